// The engine when the attention cache runs out: a sequence's context is bounded by what the
// cache holds for it alone, and a decoding sequence that needs a block when none is free takes
// them from the most recently admitted running sequences (vLLM's policy), which go back to the
// queue and later resume by recomputation: their prompt and the tokens they had generated are
// prefilled again as one prompt (the prefix cache, when on, may restore part of it). Their
// sampler, constraint and text stream are kept, so the tokens that follow are the ones they
// would have had, and none already sent is sent again.
#include <algorithm>

#include "engine/engine.h"
#include "engine/pools.h"
#include "engine/prefix_cache.h"
#include "engine/sequence.h"

namespace recur {

int Engine::effective_context(const EngineConfig& config, const ModelInfo& info, int kv_blocks) {
  int64_t context =
      config.max_context > 0 ? std::min(config.max_context, info.max_position) : info.max_position;
  // Architectures without attention keep nothing in the cache that grows with the context.
  if (info.attention_layers > 0) {
    context = std::min(context, int64_t(kv_blocks) * config.block_size);
  }
  return int(context);
}

bool Engine::make_room(Sequence& seq, int last_position) {
  for (;;) {
    // The last sequence still running: the least urgent, latest arrival (seq itself at the
    // latest: the ones before it in running_ are more urgent or older, and those after it
    // have not been batched this step).
    Sequence* victim = nullptr;
    bool others = false;
    for (auto it = running_.rbegin(); it != running_.rend(); ++it) {
      Sequence& s = **it;
      if (s.finished || s.preempted) continue;
      if (!victim) victim = &s;
      if (&s != &seq) {
        others = true;
        break;
      }
    }
    if (victim == &seq) {
      if (others) {
        preempt(seq);
        return false;
      }
      // Alone: the context bound leaves it every block but those of sequences that finished
      // during this step, which come free at its end; it decodes at the next.
      for (const auto& s : running_) {
        if (s->finished && !s->blocks.empty()) return false;
      }
      finish(seq, FinishReason::kLength, "the attention cache is full");  // not expected
      return false;
    }
    preempt(*victim);
    if (ensure_blocks(seq, last_position)) return true;
  }
}

void Engine::preempt(Sequence& seq) {
  if (seq.preemptions == 0) {
    // Sized once for the longest prompt it can resume with: later preemptions allocate nothing.
    const size_t longest = size_t(std::min<int64_t>(int64_t(seq.prompt_tokens) + seq.req.max_tokens,
                                                    int64_t(config_.max_context)));
    const size_t bs = size_t(config_.block_size);
    seq.req.prompt.reserve(longest);
    if (cache_) {
      seq.block_hashes.reserve(longest / bs);
      seq.entries.reserve(longest / bs);
    }
  }
  // Every token it generated (the last one sampled but not yet fed) joins the prompt; the
  // resumed prompt's last logits give the next token, sampled as it would have been.
  const size_t appended = seq.req.prompt.size() - size_t(seq.prompt_tokens);
  seq.req.prompt.insert(seq.req.prompt.end(), seq.generated.begin() + std::ptrdiff_t(appended),
                        seq.generated.end());
  if (cache_) {  // the hash chain continues over the new full blocks
    const size_t bs = size_t(config_.block_size);
    const std::span<const int32_t> prompt(seq.req.prompt);
    uint64_t h = seq.block_hashes.empty() ? cache_seed_ : seq.block_hashes.back();
    for (size_t j = seq.block_hashes.size(); (j + 1) * bs <= prompt.size(); ++j) {
      h = prefix_block_hash(h, prompt.subspan(j * bs, bs));
      seq.block_hashes.push_back(h);
    }
  }
  if (seq.slot >= 0) slots_->release(seq.slot);
  seq.slot = -1;
  release_blocks(seq);  // its prompt's blocks stay in the prefix cache, unreferenced
  seq.n_past = seq.prompt_done = seq.fed = seq.grant = seq.share_stop = 0;
  seq.next_token = -1;
  seq.preempted = true;
  ++seq.preemptions;
  seq.queued_step = step_count_;
  step_preempted_ = true;
  std::lock_guard<std::mutex> lk(mu_);
  ++stats_.preemptions;
}

void Engine::requeue_preempted() {
  step_preempted_ = false;
  for (auto& s : running_) {
    if (s->preempted) waiting_.push_back(std::move(s));  // admit() puts them first
  }
  std::erase_if(running_, [](const std::unique_ptr<Sequence>& s) { return !s; });
}

}  // namespace recur
