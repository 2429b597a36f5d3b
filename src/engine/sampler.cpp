#include "engine/sampler.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>

namespace recur {

namespace {

using Cand = Sampler::Cand;

constexpr uint32_t kInPrompt = 1u << 31;
constexpr uint32_t kCountMask = kInPrompt - 1;
constexpr int kChunk = 64;    // logits per early-out test in the selection scans
constexpr int kBlock = 1024;  // probabilities per partial sum in plain temperature sampling
// vLLM's _SAMPLING_EPS: below this temperature sampling is greedy, and 1/T stays finite.
constexpr float kGreedyTemperature = 1e-5f;

// Cephes expf for x <= 0 (0 below -87.3 or NaN), within ~1e-7 relative. Branch-free, and rounding
// by the 1.5·2^23 trick instead of floor/int conversion, which GCC will not vectorise under the
// default -ftrapping-math.
inline float exp_nonpos(float x) {
  constexpr float kRound = 0x1.8p23f;
  const bool under = !(x >= -87.3f);  // NaN (from -inf - -inf) counts as underflow: 0
  x = under ? -87.3f : x;
  const float t = x * 1.44269504088896341f + kRound;  // round(x·log2 e) in the low mantissa
  const float n = t - kRound;
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t ni = std::bit_cast<int32_t>(t) - std::bit_cast<int32_t>(kRound);
  const float scale = std::bit_cast<float>((ni + 127) << 23);
  return under ? 0.0f : y * scale;
}

// A ternary, not std::max: GCC 12 leaves an omp simd max-reduction over std::max scalar.
// NaNs are skipped.
inline float max_of(const float* x, int n) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int i = 0; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

// Σ exp((x[i] - m)·inv_t) over i < n <= kBlock, also stored to out[i] when out is non-null;
// x <= m everywhere. Sixteen independent float lanes, so it vectorises without reassociation.
inline float exp_block(const float* x, float* out, int n, float m, float inv_t) {
  constexpr int kLanes = 16;
  float acc[kLanes] = {};
  int i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const float e = exp_nonpos((x[i + j] - m) * inv_t);
      if (out) out[i + j] = e;
      acc[j] += e;
    }
  }
  float s = 0;
  for (; i < n; ++i) {
    const float e = exp_nonpos((x[i] - m) * inv_t);
    if (out) out[i] = e;
    s += e;
  }
  for (float a : acc) s += a;
  return s;
}

// Σ exp((x - m)·inv_t) over the vocabulary: float per block, double across blocks (a float
// sum over 152k tokens drifts by ~1e-4, visible in reported logprobs).
double sum_exp(const float* x, int n, float m, float inv_t) {
  double total = 0;
  for (int b = 0; b < n; b += kBlock)
    total += exp_block(x + b, nullptr, std::min(kBlock, n - b), m, inv_t);
  return total;
}

// The sampling order: higher value first, then lower id.
inline bool before(const Cand& a, const Cand& b) {
  return a.v > b.v || (a.v == b.v && a.id < b.id);
}

// Keeps the best k of x[0, n) in heap[0, k) (heap top: the worst kept); returns how many.
// Chunks whose max cannot beat the worst kept are skipped, so a scan is ~one vector max.
size_t select_top(const float* x, int n, size_t k, Cand* heap) {
  size_t size = 0;
  int i = 0;
  for (; i < n && size < k; ++i) {
    // NaN would break the strict ordering that heap and sort rely on; it ranks as -inf.
    heap[size++] = {std::isnan(x[i]) ? -std::numeric_limits<float>::infinity() : x[i], i};
    std::push_heap(heap, heap + size, before);
  }
  if (size < k) return size;
  float worst = heap[0].v;
  while (i < n) {
    const int end = std::min(n, i + kChunk);
    // Later ids lose ties, so only values strictly above the worst kept enter.
    if (max_of(x + i, end - i) > worst) {
      for (int j = i; j < end; ++j) {
        if (x[j] > worst) {
          std::pop_heap(heap, heap + k, before);
          heap[k - 1] = {x[j], j};
          std::push_heap(heap, heap + k, before);
          worst = heap[0].v;
        }
      }
    }
    i = end;
  }
  return k;
}

// Reorders c[0, n) (v: probabilities) so that the returned prefix is the smallest set, in
// `before` order, whose mass reaches `need`; O(n) expected by halving with nth_element.
size_t nucleus_by_halving(Cand* c, size_t n, double need) {
  size_t lo = 0, hi = n;
  double acc = 0;
  while (hi - lo > 32) {
    const size_t mid = lo + (hi - lo) / 2;
    std::nth_element(c + lo, c + mid, c + hi, before);
    double mass = 0;
    for (size_t i = lo; i < mid; ++i) mass += c[i].v;
    if (acc + mass >= need) {
      hi = mid;
    } else {
      acc += mass;
      lo = mid;
    }
  }
  std::sort(c + lo, c + hi, before);
  for (size_t i = lo; i < hi; ++i) {
    acc += c[i].v;
    if (acc >= need) return i + 1;
  }
  return hi;  // the set holds less than `need` (min-p cut it, or rounding): keep it all
}

// Probabilities in (0, 1] bucketed by their float bits (8 exponent + 6 mantissa bits): the
// order of buckets is the order of values, each spanning under 1.6%.
constexpr int kBucketShift = 17;
constexpr size_t kBuckets = (std::bit_cast<uint32_t>(1.0f) >> kBucketShift) + 1;
inline uint32_t bucket_of(float p) {
  return std::bit_cast<uint32_t>(p) >> kBucketShift;
}

// As nucleus_by_halving; large sets first find the boundary bucket from a mass histogram, so
// only that bucket's tokens are ordered. `hist` [kBuckets] is zero on entry and on return.
size_t nucleus(Cand* c, size_t n, double need, double* hist) {
  if (n <= 256) return nucleus_by_halving(c, n, need);
  uint32_t lo_b = kBuckets, hi_b = 0;
  for (size_t i = 0; i < n; ++i) {
    const uint32_t b = bucket_of(c[i].v);
    hist[b] += c[i].v;
    lo_b = std::min(lo_b, b);
    hi_b = std::max(hi_b, b);
  }
  double acc = 0;
  int64_t boundary = -1;
  for (int64_t b = hi_b; b >= int64_t(lo_b); --b) {
    if (acc + hist[b] >= need) {
      boundary = b;
      break;
    }
    acc += hist[b];
  }
  std::fill(hist + lo_b, hist + hi_b + 1, 0.0);
  if (boundary < 0) return n;  // less than `need` in all (min-p cut it, or rounding)
  Cand* above = std::partition(c, c + n, [&](const Cand& x) { return bucket_of(x.v) > boundary; });
  Cand* at =
      std::partition(above, c + n, [&](const Cand& x) { return bucket_of(x.v) == boundary; });
  return size_t(above - c) + nucleus_by_halving(above, size_t(at - above), need - acc);
}

}  // namespace

void log_softmax(const float* logits, int n, float* out) {
  const float m = max_of(logits, n);
  const double lse = m + std::log(sum_exp(logits, n, m, 1.0f));
  for (int i = 0; i < n; ++i) out[i] = float(logits[i] - lse);
}

Status SamplingParams::validate(int vocab_size) const {
  constexpr ErrorCode kBad = ErrorCode::kInvalidArgument;
  if (vocab_size <= 0) return make_error(kBad, "vocab_size must be positive, got {}", vocab_size);
  if (!std::isfinite(temperature) || temperature < 0)
    return make_error(kBad, "temperature must be a finite number >= 0, got {}", temperature);
  if (!(top_p > 0 && top_p <= 1)) return make_error(kBad, "top_p must be in (0, 1], got {}", top_p);
  if (!(min_p >= 0 && min_p <= 1))
    return make_error(kBad, "min_p must be in [0, 1], got {}", min_p);
  if (!std::isfinite(repetition_penalty) || repetition_penalty <= 0)
    return make_error(kBad, "repetition_penalty must be a finite number > 0, got {}",
                      repetition_penalty);
  if (!(presence_penalty >= -2 && presence_penalty <= 2))
    return make_error(kBad, "presence_penalty must be in [-2, 2], got {}", presence_penalty);
  if (!(frequency_penalty >= -2 && frequency_penalty <= 2))
    return make_error(kBad, "frequency_penalty must be in [-2, 2], got {}", frequency_penalty);
  for (const auto& [id, b] : logit_bias) {
    if (id < 0 || id >= vocab_size)
      return make_error(kBad, "logit_bias token id {} is out of range [0, {})", id, vocab_size);
    if (!(b >= -100 && b <= 100))
      return make_error(kBad, "logit_bias value for token {} must be in [-100, 100], got {}", id,
                        b);
  }
  if (logprobs < -1 || logprobs > kMaxTopLogprobs)
    return make_error(kBad, "logprobs must be in [-1, {}], got {}", kMaxTopLogprobs, logprobs);
  return {};
}

Sampler::Sampler(const SamplingParams& params, int vocab_size, uint64_t fallback_seed)
    : vocab_(vocab_size),
      seed_(params.seed.value_or(fallback_seed)),
      rng_(seed_),
      greedy_(params.temperature < kGreedyTemperature),
      temperature_(params.temperature),
      top_k_(params.top_k > 0 && params.top_k < vocab_size ? size_t(params.top_k) : 0),
      top_p_(params.top_p),
      min_p_(params.min_p),
      rep_penalty_(params.repetition_penalty),
      presence_(params.presence_penalty),
      frequency_(params.frequency_penalty),
      logprobs_(params.logprobs),
      penalties_(params.repetition_penalty != 1 || params.presence_penalty != 0 ||
                 params.frequency_penalty != 0) {
  RECUR_CHECK(params.validate(vocab_size).ok());
  bias_ = params.logit_bias;
  std::sort(bias_.begin(), bias_.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  size_t w = 0;
  for (size_t r = 0; r < bias_.size(); ++r) {
    if (w > 0 && bias_[w - 1].first == bias_[r].first) {
      bias_[w - 1].second += bias_[r].second;
    } else {
      bias_[w++] = bias_[r];
    }
  }
  bias_.resize(w);
  std::erase_if(bias_, [](const auto& b) { return b.second == 0; });

  if (penalties_) {
    counts_.assign(vocab_, 0);
    seen_.reserve(vocab_);
  }
  if (logprobs_ >= 0) {
    saved_.resize(bias_.size() + (penalties_ ? vocab_ : 0));
    raw_top_.resize(std::max(logprobs_, 1));
  }
  if (!greedy_) {
    if (top_k_ > 0) {
      cand_.resize(top_k_);
    } else if (top_p_ < 1 || min_p_ > 0) {
      cand_.resize(vocab_);
    } else {
      probs_.resize(vocab_);
      block_sums_.resize((vocab_ + kBlock - 1) / kBlock);
    }
    if (top_p_ < 1) hist_.assign(kBuckets, 0.0);
  }
}

void Sampler::set_prompt(std::span<const int32_t> prompt) {
  if (rep_penalty_ == 1) return;  // only repetition_penalty looks at the prompt
  for (int32_t id : prompt) {
    RECUR_CHECK(id >= 0 && id < vocab_);
    if (counts_[id] == 0) seen_.push_back(id);
    counts_[id] |= kInPrompt;
  }
}

void Sampler::accept(int32_t id) {
  RECUR_CHECK(id >= 0 && id < vocab_);
  if (constraint_) constraint_->accept(id);
  if (!penalties_) return;
  if (counts_[id] == 0) seen_.push_back(id);
  ++counts_[id];
}

bool Sampler::apply_adjustments(float* logits) {
  const bool save = logprobs_ >= 0;
  size_t s = 0;
  for (const auto& [id, b] : bias_) {
    if (save) saved_[s++] = logits[id];
    logits[id] += b;
  }
  if (penalties_) {
    for (int32_t id : seen_) {
      float l = logits[id];
      if (save) saved_[s++] = l;
      const uint32_t count = counts_[id] & kCountMask;
      if (rep_penalty_ != 1) l = l > 0 ? l / rep_penalty_ : l * rep_penalty_;
      if (count > 0) l -= presence_ + frequency_ * float(count);
      logits[id] = l;
    }
  }
  return !bias_.empty() || (penalties_ && !seen_.empty());
}

float Sampler::raw_logit(const float* logits, int32_t id) const {
  // saved_ holds the first value seen per slot; bias_ comes first, so a biased id finds its raw.
  auto it = std::lower_bound(bias_.begin(), bias_.end(), id,
                             [](const auto& b, int32_t v) { return b.first < v; });
  if (it != bias_.end() && it->first == id) return saved_[it - bias_.begin()];
  if (penalties_ && counts_[id] != 0) {
    const size_t j = std::find(seen_.begin(), seen_.end(), id) - seen_.begin();
    return saved_[bias_.size() + j];
  }
  return logits[id];
}

void Sampler::sample(float* logits, SampledToken* out) {
  double raw_lse = 0;
  size_t n_top = 0;
  if (logprobs_ >= 0) {
    n_top = select_top(logits, vocab_, raw_top_.size(), raw_top_.data());
    std::sort_heap(raw_top_.begin(), raw_top_.begin() + n_top, before);
    const float raw_max = raw_top_[0].v;
    raw_lse = raw_max + std::log(sum_exp(logits, vocab_, raw_max, 1.0f));
  }

  const bool modified = apply_adjustments(logits);
  int32_t id;
  if (constraint_ && !greedy_ && (top_k_ > 0 || top_p_ < 1 || min_p_ > 0)) {
    constraint_->mask(std::span(logits, size_t(vocab_)));
    id = choose(logits, true);
  } else {
    id = choose(logits, modified);
    if (constraint_ && !constraint_->allows(id)) {
      constraint_->mask(std::span(logits, size_t(vocab_)));
      id = choose(logits, true);
    }
  }

  out->id = id;
  out->top.clear();
  if (logprobs_ >= 0) {
    out->logprob = float(raw_logit(logits, id) - raw_lse);
    if (logprobs_ > 0) {
      if (out->top.capacity() < size_t(kMaxTopLogprobs)) out->top.reserve(kMaxTopLogprobs);
      for (size_t i = 0; i < std::min(n_top, size_t(logprobs_)); ++i)
        out->top.push_back({raw_top_[i].id, float(raw_top_[i].v - raw_lse)});
    }
  } else {
    out->logprob = 0;
  }
}

int32_t Sampler::choose(const float* logits, bool modified) {
  if (greedy_ && logprobs_ >= 0 && !modified) return raw_top_[0].id;
  const int32_t id = greedy_ ? -1 : sample_stochastic(logits);
  if (id >= 0) return id;
  // Greedy, or degenerate logits (all -inf or NaN): the argmax rule.
  Cand best{0.0f, 0};
  select_top(logits, vocab_, 1, &best);
  return best.id;
}

int32_t Sampler::sample_stochastic(const float* logits) {
  const float inv_t = 1.0f / temperature_;
  if (top_k_ > 0) {
    const size_t n = select_top(logits, vocab_, top_k_, cand_.data());
    float m = -std::numeric_limits<float>::infinity();
    for (size_t i = 0; i < n; ++i) m = std::max(m, cand_[i].v);
    double total = 0;
    for (size_t i = 0; i < n; ++i) {
      cand_[i].v = exp_nonpos((cand_[i].v - m) * inv_t);
      total += cand_[i].v;
    }
    return draw(filter_top_p_min_p(n, total));
  }

  const float m = max_of(logits, vocab_);
  if (top_p_ < 1 || min_p_ > 0) {
    // Only tokens with probability >= cut can be kept: min-p drops the rest, and tokens below
    // (1-p)·total/V together hold less than 1-p, so the nucleus lies above them.
    double total = 0;
    double cut = min_p_;
    if (top_p_ < 1) {
      total = sum_exp(logits, vocab_, m, inv_t);
      cut = std::max(cut, (1.0 - top_p_) * total / vocab_);
    }
    // The same cut on logits, loosened so rounding cannot drop a token that belongs.
    const float thr =
        m + temperature_ * (float(std::log(cut)) - 0.01f) - 1e-5f * (std::abs(m) + 1.0f);
    size_t n = 0;
    for (int i = 0; i < vocab_; i += kChunk) {
      const int end = std::min(vocab_, i + kChunk);
      if (max_of(logits + i, end - i) < thr) continue;
      // Vector exp for the chunk, then a branch-free compaction: flat distributions pass about
      // half the tokens, which would make a branch per token unpredictable.
      float e[kChunk];
      const float* x = logits + i;
      const int len = end - i;
#pragma omp simd
      for (int j = 0; j < len; ++j) e[j] = exp_nonpos((x[j] - m) * inv_t);
      for (int j = 0; j < len; ++j) {
        cand_[n] = {e[j], i + j};  // n <= i + j < vocab, so the slot exists
        n += x[j] >= thr;
      }
    }
    return draw(filter_top_p_min_p(n, total));
  }

  // Plain temperature sampling over the whole vocabulary.
  double total = 0;
  const size_t n_blocks = block_sums_.size();
  for (size_t b = 0; b < n_blocks; ++b) {
    const int begin = int(b) * kBlock, end = std::min(vocab_, begin + kBlock);
    const float s = exp_block(logits + begin, probs_.data() + begin, end - begin, m, inv_t);
    block_sums_[b] = s;
    total += s;
  }
  const double target = uniform() * total;
  double acc = 0;
  size_t b = 0;
  for (; b + 1 < n_blocks && acc + block_sums_[b] <= target; ++b) acc += block_sums_[b];
  // Walk the block; rounding can leave the target past its end, so keep the last nonzero.
  const int begin = int(b) * kBlock, end = std::min(vocab_, begin + kBlock);
  int32_t last = -1;
  for (int i = begin; i < end; ++i) {
    if (probs_[i] <= 0) continue;
    last = i;
    acc += probs_[i];
    if (target < acc) return i;
  }
  if (last >= 0) return last;
  return int32_t(std::max_element(probs_.begin(), probs_.end()) - probs_.begin());
}

size_t Sampler::filter_top_p_min_p(size_t n, double total) {
  if (top_p_ < 1) n = nucleus(cand_.data(), n, double(top_p_) * total, hist_.data());
  if (min_p_ > 0) {
    // The most likely token has probability 1 here (x - max = 0), so the cut is min_p itself.
    n = std::remove_if(cand_.begin(), cand_.begin() + n,
                       [&](const Cand& c) { return c.v < min_p_; }) -
        cand_.begin();
  }
  return n;
}

int32_t Sampler::draw(size_t n) {
  const double u = uniform();  // drawn even when degenerate, to keep one draw per token
  if (n == 0) return -1;       // only when every logit is -inf or NaN
  double total = 0;
  for (size_t i = 0; i < n; ++i) total += cand_[i].v;
  const double target = u * total;
  double acc = 0;
  int32_t last = cand_[0].id;
  for (size_t i = 0; i < n; ++i) {
    if (cand_[i].v <= 0) continue;
    last = cand_[i].id;
    acc += cand_[i].v;
    if (target < acc) return cand_[i].id;
  }
  return last;
}

}  // namespace recur
