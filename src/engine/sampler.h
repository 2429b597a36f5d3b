// Per-request token sampling: logit bias, repetition/presence/frequency penalties, temperature,
// top-k, top-p, min-p, a per-sequence RNG, and logprobs of the raw distribution. A Sampler
// allocates everything at construction, so sample() and accept() never touch the heap.
#pragma once

#include <cstdint>
#include <optional>
#include <random>
#include <span>
#include <utility>
#include <vector>

#include "core/status.h"
#include "engine/token_constraint.h"

namespace recur {

inline constexpr int kMaxTopLogprobs = 20;

struct SamplingParams {
  float temperature = 1.0f;         // 0: greedy (argmax, ties to the lowest id)
  int top_k = 0;                    // 0 or <0: off
  float top_p = 1.0f;               // (0, 1]
  float min_p = 0.0f;               // [0, 1]
  float repetition_penalty = 1.0f;  // > 0; tokens seen in prompt or output: l>0 ? l/p : l*p
  float presence_penalty = 0.0f;    // [-2, 2], output tokens only: l -= presence * (count>0)
  float frequency_penalty = 0.0f;   // [-2, 2], output tokens only: l -= frequency * count
  std::vector<std::pair<int32_t, float>> logit_bias;  // [-100, 100], added to the raw logits first
  std::optional<uint64_t> seed;  // reproducible sampling, whatever else is in the batch
  int logprobs = -1;  // -1: none; 0: the chosen token's logprob; n>0: also the top-n (n <= 20)
  // Also the log-probabilities of the whole vocabulary (Event::vocab_logprobs): log_softmax of
  // the raw logits, as mlx-lm's responses carry them. Costs a row copy and a pass per token.
  bool vocab_logprobs = false;

  Status validate(int vocab_size) const;
};

struct TokenLogprob {
  int32_t id;
  float logprob;
};

struct SampledToken {
  int32_t id = -1;
  float logprob = 0;  // of the chosen token under log_softmax of the unmodified logits (as vLLM)
  // Top-n of the raw distribution, descending (ties: lower id first). sample() reserves
  // kMaxTopLogprobs once, so a SampledToken reused across steps never reallocates.
  std::vector<TokenLogprob> top;
};

// out[i] = logits[i] - logsumexp(logits) over n values (NaNs aside), summed as sample() sums
// for the chosen token's logprob, so that out[id] equals SampledToken::logprob.
void log_softmax(const float* logits, int n, float* out);  // logits, out: [n]

class Sampler {
 public:
  // Sizes all scratch for `vocab_size` once. Seed: params.seed if set, else fallback_seed.
  // `params` must have passed validate(vocab_size).
  Sampler(const SamplingParams& params, int vocab_size, uint64_t fallback_seed);

  // Records prompt tokens for repetition_penalty; calls accumulate (ids must be < vocab_size).
  void set_prompt(std::span<const int32_t> prompt);

  // Samples from logits [vocab_size]; bias, penalties and a constraint's mask are applied in
  // place. Then accept(id).
  // Non-greedy sampling consumes exactly one draw of the sequence's RNG (two when a constraint
  // refuses the first); greedy consumes none.
  void sample(float* logits, SampledToken* out);

  // Records a generated token (penalty counts, and the constraint's progress).
  void accept(int32_t id);

  // Structured outputs: draws only tokens `c` allows (null: none; it must outlive the
  // sampler's use). Greedy and plain temperature draws are made first from the unrestricted
  // distribution and kept when allowed, which is a draw from the restricted one too; with
  // top-k, top-p or min-p the logits are restricted first, as their cut depends on it.
  void set_constraint(TokenConstraint* c) { constraint_ = c; }

  // Greedy with nothing applied to the logits and no logprobs: the choice is the raw logits'
  // argmax (Ops::argmax_rows), so a device backend need not return the logits.
  bool plain_greedy() const {
    return greedy_ && !penalties_ && bias_.empty() && logprobs_ < 0 && !constraint_;
  }

  uint64_t seed() const { return seed_; }
  int vocab_size() const { return vocab_; }

  // A candidate token: a logit or an unnormalised probability, and its id.
  struct Cand {
    float v;
    int32_t id;
  };

 private:
  bool apply_adjustments(float* logits);  // bias then penalties; false when nothing changed
  int32_t sample_stochastic(const float* logits);
  int32_t choose(const float* logits, bool modified);  // greedy or stochastic, as configured
  size_t filter_top_p_min_p(size_t n, double total);   // on cand_[0, n) holding probabilities
  int32_t draw(size_t n);                              // one RNG draw over cand_[0, n)
  float raw_logit(const float* logits, int32_t id) const;
  double uniform() { return double(rng_() >> 11) * 0x1.0p-53; }

  int vocab_;
  uint64_t seed_;
  std::mt19937_64 rng_;

  // Parameters, normalised at construction.
  bool greedy_;
  float temperature_;
  size_t top_k_;  // 0: off (also when >= vocab)
  float top_p_;
  float min_p_;
  float rep_penalty_;
  float presence_;
  float frequency_;
  int logprobs_;
  bool penalties_;  // any penalty in use: counts_ and seen_ are live
  TokenConstraint* constraint_ = nullptr;

  std::vector<std::pair<int32_t, float>> bias_;  // sorted by id, duplicates summed
  // Per token: output count in the low 31 bits, kInPrompt when seen in the prompt.
  std::vector<uint32_t> counts_;
  std::vector<int32_t> seen_;  // distinct ids with counts_ != 0; capacity vocab, never grows
  // Logits before bias/penalties, indexed like bias_ then seen_ (only when logprobs >= 0).
  std::vector<float> saved_;

  std::vector<Cand> raw_top_;       // heap for the top-n raw logits
  std::vector<Cand> cand_;          // candidate tokens: top-k heap or thresholded tokens
  std::vector<float> probs_;        // unnormalised probabilities (plain temperature sampling)
  std::vector<double> block_sums_;  // sums of probs_ per block, for a short walk
  std::vector<double> hist_;        // top-p: probability mass per value bucket, kept zeroed
};

}  // namespace recur
