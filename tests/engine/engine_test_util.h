// Helpers the engine tests share: reproducible prompts, greedy requests, and what a request's
// event sink saw.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "engine/engine.h"

namespace recur {

// len ids in [0, vocab), the same for the same seed.
inline std::vector<int32_t> random_tokens(int len, int vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> p(static_cast<size_t>(len));
  for (auto& t : p) t = int32_t(rng() % uint32_t(vocab));
  return p;
}

// A greedy request for max_tokens tokens that does not stop at end-of-sequence.
inline Request greedy_request(std::vector<int32_t> prompt, int max_tokens) {
  Request r;
  r.prompt = std::move(prompt);
  r.max_tokens = max_tokens;
  r.sampling.temperature = 0;
  r.stop.ignore_eos = true;
  return r;
}

// One request's tokens (and their log-probabilities) as streamed, and how it finished.
struct Outcome {
  std::vector<int32_t> ids;
  std::vector<float> logprobs;  // of each chosen token
  int cached = -1;              // prompt tokens the prefix cache supplied
  FinishReason reason = FinishReason::kError;
  bool done = false;
};

// The event sink that fills *o.
inline EventSink collect(Outcome* o) {
  return [o](const Event& ev) {
    if (ev.kind == Event::Kind::kToken) {
      o->ids.push_back(ev.token);
      o->logprobs.push_back(ev.logprob);
    } else {
      o->cached = ev.cached_tokens;
      o->reason = ev.reason;
      o->done = true;
    }
  };
}

}  // namespace recur
