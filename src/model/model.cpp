#include "model/model.h"

namespace recur {

void Batch::clear() {
  tokens.clear();
  positions.clear();
  seq_start.clear();
  slot.clear();
  block_start.clear();
  block_ids.clear();
  logit_rows.clear();
  device_tokens = nullptr;
}

void Batch::add_sequence(int32_t slot_id, int32_t first_pos, std::span<const int32_t> new_tokens,
                         std::span<const int32_t> blocks, Logits want) {
  if (seq_start.empty()) seq_start.push_back(0);
  if (block_start.empty()) block_start.push_back(0);
  const int32_t first_row = int32_t(tokens.size());
  for (size_t i = 0; i < new_tokens.size(); ++i) {
    tokens.push_back(new_tokens[i]);
    positions.push_back(first_pos + int32_t(i));
  }
  seq_start.push_back(int32_t(tokens.size()));
  slot.push_back(slot_id);
  block_ids.insert(block_ids.end(), blocks.begin(), blocks.end());
  block_start.push_back(int32_t(block_ids.size()));
  if (want == Logits::kAll) {
    for (int32_t r = first_row; r < int32_t(tokens.size()); ++r) logit_rows.push_back(r);
  } else if (want == Logits::kLast && !new_tokens.empty()) {
    logit_rows.push_back(int32_t(tokens.size()) - 1);
  }
}

SeqLayout Batch::layout(int block_size) const {
  SeqLayout l;
  l.n_seqs = n_seqs();
  l.n_tokens = n_tokens();
  l.seq_start = seq_start.data();
  l.slot = slot.data();
  l.positions = positions.data();
  l.block_start = block_start.data();
  l.block_ids = block_ids.data();
  l.block_size = block_size;
  return l;
}

namespace {
Status no_state_io() {
  return make_error(ErrorCode::kUnsupported, "this model cannot copy its cache to the host");
}
}  // namespace

Status Model::read_block(int, std::span<uint8_t>) {
  return no_state_io();
}
Status Model::write_block(int, std::span<const uint8_t>) {
  return no_state_io();
}
Status Model::read_snapshot(int, std::span<uint8_t>) {
  return no_state_io();
}
Status Model::write_snapshot(int, std::span<const uint8_t>) {
  return no_state_io();
}

}  // namespace recur
