#include "fake_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <new>

namespace recur::testing {

const RecordedSeq* RecordedBatch::find_slot(int32_t slot) const {
  for (const RecordedSeq& s : seqs) {
    if (s.slot == slot) return &s;
  }
  return nullptr;
}

FakeModel::FakeModel(Ops& ops, const LoadOptions& opt, int max_position,
                     double delay_ns_per_position)
    : ops_(ops), delay_ns_per_position_(delay_ns_per_position) {
  info_.vocab_size = kVocab;
  info_.max_position = opt.max_context > 0 ? std::min(opt.max_context, max_position) : max_position;
  info_.attention_layers = 1;
  info_.attention_dim = 1;
  state_ = opt.state;
  if (state_.n_blocks <= 0) state_.n_blocks = 1024;
  max_batch_tokens_ = opt.max_batch_tokens;
  max_logit_rows_ = opt.max_logit_rows > 0 ? opt.max_logit_rows : opt.max_batch_tokens;
  slot_pos_.assign(size_t(state_.n_slots), -1);
  seen_slot_.assign(size_t(state_.n_slots), 0);
  snapshot_pos_.assign(size_t(state_.n_snapshots), -1);
}

void FakeModel::save_snapshot(int slot, int snapshot) {
  if (slot < 0 || slot >= state_.n_slots || snapshot < 0 || snapshot >= state_.n_snapshots) {
    violate(fmt::format("save of slot {} into snapshot {}", slot, snapshot));
    return;
  }
  snapshot_pos_[size_t(snapshot)] = slot_pos_[size_t(slot)];
}

void FakeModel::restore_snapshot(int snapshot, int slot) {
  if (slot < 0 || slot >= state_.n_slots || snapshot < 0 || snapshot >= state_.n_snapshots ||
      snapshot_pos_[size_t(snapshot)] < 0) {
    violate(fmt::format("restore of snapshot {} into slot {}", snapshot, slot));
    return;
  }
  slot_pos_[size_t(slot)] = snapshot_pos_[size_t(snapshot)];
}

void FakeModel::reset_slot(int slot) {
  if (slot < 0 || slot >= state_.n_slots) {
    violate(fmt::format("reset of slot {} outside [0, {})", slot, state_.n_slots));
    return;
  }
  slot_pos_[size_t(slot)] = 0;
  ++resets;
}

void FakeModel::violate(std::string what) {
  if (violations.size() < 20) violations.push_back(std::move(what));
}

Status FakeModel::forward(const Batch& b, Tensor logits) {
  if (++forwards == throw_at_forward) throw std::bad_alloc();
  const int n_seqs = b.n_seqs(), n_tokens = b.n_tokens();
  if (n_tokens < 1 || n_tokens > max_batch_tokens_) {
    violate(fmt::format("batch of {} tokens; the model holds {}", n_tokens, max_batch_tokens_));
  }
  if (int(b.logit_rows.size()) > max_logit_rows_) {
    violate(fmt::format("{} logit rows; the model holds {}", b.logit_rows.size(), max_logit_rows_));
  }
  if (b.device_tokens) violate("device tokens on a host model");
  if (int(b.seq_start.size()) != n_seqs + 1 || int(b.block_start.size()) != n_seqs + 1 ||
      b.positions.size() != b.tokens.size() || b.seq_start.front() != 0 ||
      b.seq_start.back() != n_tokens) {
    violate("ragged layout does not add up");
    return Status();
  }
  RecordedBatch rec;
  rec.n_tokens = n_tokens;
  rec.logit_rows = int(b.logit_rows.size());
  std::fill(seen_slot_.begin(), seen_slot_.end(), uint8_t(0));
  int64_t attended = 0;
  for (int i = 0; i < n_seqs; ++i) {
    const int32_t slot = b.slot[size_t(i)];
    const int begin = b.seq_start[size_t(i)], end = b.seq_start[size_t(i) + 1];
    if (slot < 0 || slot >= state_.n_slots) {
      violate(fmt::format("slot {} outside [0, {})", slot, state_.n_slots));
      continue;
    }
    if (end <= begin) violate(fmt::format("sequence {} of the batch brings no token", i));
    if (seen_slot_[size_t(slot)]++) violate(fmt::format("slot {} twice in one batch", slot));
    const int32_t first = b.positions[size_t(begin)];
    if (first != slot_pos_[size_t(slot)]) {
      violate(fmt::format("slot {} fed at position {}; its state holds {} positions", slot, first,
                          slot_pos_[size_t(slot)]));
    }
    for (int t = begin; t < end; ++t) {
      if (b.positions[size_t(t)] != first + (t - begin)) {
        violate(fmt::format("slot {}: positions not consecutive", slot));
      }
      if (b.tokens[size_t(t)] < 0 || b.tokens[size_t(t)] >= kVocab) {
        violate(fmt::format("token id {} outside the vocabulary", b.tokens[size_t(t)]));
      }
      attended += b.positions[size_t(t)] + 1;
    }
    const int32_t last = first + (end - begin) - 1;
    const int n_blocks = b.block_start[size_t(i) + 1] - b.block_start[size_t(i)];
    if (n_blocks < last / state_.block_size + 1) {
      violate(fmt::format("slot {}: {} blocks do not cover position {}", slot, n_blocks, last));
    }
    for (int k = b.block_start[size_t(i)]; k < b.block_start[size_t(i) + 1]; ++k) {
      if (b.block_ids[size_t(k)] < 0 || b.block_ids[size_t(k)] >= state_.n_blocks) {
        violate(
            fmt::format("block id {} outside [0, {})", b.block_ids[size_t(k)], state_.n_blocks));
      }
    }
    slot_pos_[size_t(slot)] = last + 1;
    if (record) {
      RecordedSeq s;
      s.slot = slot;
      s.first_pos = first;
      s.tokens.assign(b.tokens.begin() + begin, b.tokens.begin() + end);
      s.blocks = n_blocks;
      s.logits = std::find(b.logit_rows.begin(), b.logit_rows.end(), end - 1) != b.logit_rows.end();
      rec.seqs.push_back(std::move(s));
    }
  }
  rec.attended_positions = attended;
  float* out = logits.ptr<float>();
  for (size_t r = 0; r < b.logit_rows.size(); ++r) {
    const int32_t row = b.logit_rows[r];
    if (row < 0 || row >= n_tokens) {
      violate(fmt::format("logit row {} outside the batch", row));
      continue;
    }
    float* o = out + r * size_t(kVocab);
    std::fill(o, o + kVocab, 0.0f);
    o[next_token(b.tokens[size_t(row)])] = 10.0f;
  }
  if (delay_ns_per_position_ > 0) {
    const auto until = std::chrono::steady_clock::now() +
                       std::chrono::nanoseconds(int64_t(delay_ns_per_position_ * double(attended)));
    while (std::chrono::steady_clock::now() < until) {
    }
  }
  if (record) batches.push_back(std::move(rec));
  return Status();
}

}  // namespace recur::testing
