// A request inside the engine: its state in the pools and its progress. Shared by the engine's
// source files only.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/text_stream.h"

namespace recur {

struct Engine::Sequence {
  uint64_t id = 0;
  // After a preemption req.prompt also holds the tokens generated before it: the sequence
  // resumes by prefilling them (engine_preempt.cpp). prompt_tokens is the request's own.
  Request req;
  int prompt_tokens = 0;
  EventSink sink;
  Sampler sampler;
  std::unique_ptr<TokenConstraint> constraint;  // the sampler's, from req.constraint
  std::unique_ptr<TextStream> text;
  int32_t slot = -1;
  std::vector<int32_t> blocks;  // attention-cache block table
  int n_past = 0;               // tokens whose effect is in the state
  int prompt_done = 0;          // prompt tokens prefilled
  int fed = 0;                  // tokens fed in the current step
  int grant = 0;                // prompt tokens granted this step
  int reserve = 0;              // cache blocks reserved at admission for prompt + first token
  int64_t queued_step = 0;      // the engine step it joined the queue at
  bool preempted = false;       // its state given up: waits to resume, ahead of new requests
  int preemptions = 0;
  // The prefix cache's: the hash chain of the prompt's full blocks (computed at submission),
  // the entries of blocks [0, entries.size()) (the rest are its own), the tokens it found.
  std::vector<uint64_t> block_hashes;
  std::vector<int32_t> entries;
  int cached_tokens = 0;
  // A prompt position where a waiting request sharing this prompt's start asked for a
  // snapshot (chunks stop there too); stale once n_past has passed it.
  int share_stop = 0;
  int32_t next_token = -1;  // sampled, not yet fed
  std::vector<int32_t> generated;
  SampledToken sampled;
  bool finished = false;
  bool told = false;         // its finish event has reached the sink
  int64_t cancel_step = -1;  // engine steps completed when cancel() queued its end
  bool stopped_by_string = false;
  FinishReason reason = FinishReason::kStop;
  std::string message;

  Sequence(Request r, EventSink s, int vocab, uint64_t seed)
      : req(std::move(r)),
        prompt_tokens(int(req.prompt.size())),
        sink(std::move(s)),
        sampler(req.sampling, vocab, seed) {
    sampler.set_prompt(req.prompt);
    if (req.constraint) {
      constraint = req.constraint->start();
      sampler.set_constraint(constraint.get());
    }
    message.reserve(64);  // the reasons finish() gives fit: no allocation at the end
  }
  bool prefilling() const { return prompt_done < int(req.prompt.size()); }
};

}  // namespace recur
