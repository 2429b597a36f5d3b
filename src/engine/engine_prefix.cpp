// The engine's use of the prefix cache: where an admitted prompt starts, where its chunks stop,
// and what each prefill step leaves in the cache.
#include <algorithm>

#include "engine/engine.h"
#include "engine/pools.h"
#include "engine/prefix_cache.h"
#include "engine/sequence.h"

namespace recur {

int32_t Engine::match_prefix(const Sequence& seq, int* pinned) {
  // At least the last prompt token is fed again: its logits give the first token.
  const int32_t snapshot =
      cache_->match(seq.block_hashes, seq.req.prompt, int(seq.req.prompt.size()) - 1, &chain_);
  *pinned = cache_->unreferenced_in(chain_);
  return snapshot;
}

void Engine::start_sequence(Sequence& seq, int32_t snapshot) {
  if (!cache_) {
    model_->reset_slot(seq.slot);
    return;
  }
  seq.entries.reserve(seq.req.prompt.size() / size_t(config_.block_size));
  for (int32_t id : chain_) {
    cache_->acquire(id);
    seq.entries.push_back(id);
    seq.blocks.push_back(cache_->block(id));
  }
  int restored = 0;
  if (snapshot >= 0) {
    model_->restore_snapshot(snapshot, seq.slot);
    cache_->touch_snapshot(chain_.back());
    restored = int(chain_.size()) * config_.block_size;
    seq.n_past = seq.prompt_done = restored;
  } else {
    model_->reset_slot(seq.slot);
  }
  // The request reports what its own prompt found; a resumption's hit saves recomputation.
  if (seq.preemptions == 0) seq.cached_tokens = restored;
  std::lock_guard<std::mutex> lk(mu_);
  stats_.prefix_queries += 1;
  stats_.prefix_query_tokens += int64_t(seq.req.prompt.size());
  stats_.prefix_hit_tokens += restored;
}

bool Engine::wait_for_shared_prefix(const Sequence& seq) {
  const int bs = config_.block_size;
  const int hit = int(chain_.size()) * bs;
  // Where the request could start from (its last token is always fed).
  const int usable = (int(seq.req.prompt.size()) - 1) / bs * bs;
  for (auto& rp : running_) {
    Sequence& r = *rp;
    if (r.finished || !r.prefilling()) continue;
    // The blocks both prompts start with (equal hash chains: a collision only delays).
    const size_t n = std::min(seq.block_hashes.size(), r.block_hashes.size());
    size_t common = 0;
    while (common < n && seq.block_hashes[common] == r.block_hashes[common]) ++common;
    const int point = std::min(int(common) * bs, usable);
    if (point <= hit || r.prompt_done >= point) continue;
    // The nearest point any waiting request asked for comes first; the others ask again
    // once it is passed.
    if (r.share_stop <= r.n_past || point < r.share_stop) r.share_stop = point;
    return true;
  }
  return false;
}

int Engine::next_cache_stop(const Sequence& seq) const {
  const int length = int(seq.req.prompt.size());
  const int interval = config_.snapshot_interval;
  int stop = (seq.n_past / interval + 1) * interval;
  if (seq.share_stop > seq.n_past) stop = std::min(stop, seq.share_stop);
  const int last_boundary = length / config_.block_size * config_.block_size;
  if (last_boundary > seq.n_past) stop = std::min(stop, last_boundary);
  return std::min(stop, length);
}

void Engine::cache_prompt_progress(Sequence& seq) {
  const int bs = config_.block_size;
  const int length = int(seq.req.prompt.size());
  const std::span<const int32_t> prompt(seq.req.prompt);
  // Every full block of prompt tokens becomes an entry, or reads the entry another sequence
  // made of the same tokens (its own copy goes back to the pool).
  const size_t full = size_t(std::min(seq.n_past, length) / bs);
  while (seq.entries.size() < full) {
    const size_t j = seq.entries.size();
    const int32_t parent = j > 0 ? seq.entries[j - 1] : -1;
    const int32_t id = cache_->publish(parent, seq.block_hashes[j],
                                       prompt.subspan(j * size_t(bs), size_t(bs)), seq.blocks[j]);
    if (cache_->block(id) != seq.blocks[j]) {
      blocks_->release(seq.blocks[j]);
      seq.blocks[j] = cache_->block(id);
    }
    seq.entries.push_back(id);
  }
  // A snapshot where the chunk stopped for one: every interval, the prompt's last block
  // boundary, and where a waiting request asked for one.
  const bool stop = seq.n_past % config_.snapshot_interval == 0 || seq.n_past == length / bs * bs ||
                    seq.n_past == seq.share_stop;
  if (seq.n_past % bs != 0 || !stop || seq.entries.empty()) return;
  const int32_t snapshot = cache_->add_snapshot(seq.entries.back());
  if (snapshot >= 0) model_->save_snapshot(seq.slot, snapshot);
}

}  // namespace recur
