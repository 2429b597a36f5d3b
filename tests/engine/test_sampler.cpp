// The per-request sampler: each transform's exact effect on crafted logits, the sampled
// distribution against softmax, reproducibility per seed, logprobs, validation, no allocation.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <new>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "alloc_counter.h"
#include "backend/cpu/cpu_ops.h"
#include "engine/sampler.h"

namespace recur {
namespace {

constexpr int kQwenVocab = 151936;

// Samples `n` tokens from the same logits (copied fresh each time), returning counts per id.
std::vector<int> histogram(const SamplingParams& p, const std::vector<float>& logits, int n,
                           uint64_t seed = 1234) {
  Sampler s(p, int(logits.size()), seed);
  std::vector<int> counts(logits.size(), 0);
  std::vector<float> work;
  SampledToken out;
  for (int i = 0; i < n; ++i) {
    work = logits;
    s.sample(work.data(), &out);
    EXPECT_GE(out.id, 0);
    EXPECT_LT(out.id, int(logits.size()));
    ++counts[out.id];
  }
  return counts;
}

std::vector<double> softmax(const std::vector<float>& logits, double t = 1.0) {
  double m = *std::max_element(logits.begin(), logits.end());
  std::vector<double> p(logits.size());
  double s = 0;
  for (size_t i = 0; i < p.size(); ++i) s += p[i] = std::exp((logits[i] - m) / t);
  for (double& x : p) x /= s;
  return p;
}

// Pearson chi-square of observed counts against probabilities (cells with p = 0 must be 0).
double chi_square(const std::vector<int>& counts, const std::vector<double>& p) {
  int64_t n = std::accumulate(counts.begin(), counts.end(), int64_t(0));
  double chi = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    if (p[i] == 0) {
      EXPECT_EQ(counts[i], 0) << "token " << i << " has probability 0";
      continue;
    }
    const double e = p[i] * double(n);
    chi += (counts[i] - e) * (counts[i] - e) / e;
  }
  return chi;
}

std::vector<float> log_of(const std::vector<double>& probs) {
  std::vector<float> l;
  for (double p : probs) l.push_back(float(std::log(p)));
  return l;
}

std::vector<float> random_logits(int n, uint64_t seed, float scale = 3.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> l(n);
  for (float& x : l) x = d(rng);
  return l;
}

int32_t sample_once(const SamplingParams& p, std::vector<float> logits, uint64_t seed = 7) {
  Sampler s(p, int(logits.size()), seed);
  SampledToken out;
  s.sample(logits.data(), &out);
  return out.id;
}

TEST(Sampler, GreedyPicksArgmaxAndLowestIdOnTies) {
  SamplingParams p;
  p.temperature = 0;
  EXPECT_EQ(sample_once(p, {0.1f, 2.0f, -1.0f, 1.9f}), 1);
  EXPECT_EQ(sample_once(p, {0.5f, 3.0f, 1.0f, 3.0f, 3.0f}), 1);
  EXPECT_EQ(sample_once(p, {-5.0f, -5.0f, -5.0f}), 0);
  // Across many chunks of a real vocabulary, with the maximum tied far apart.
  std::vector<float> big = random_logits(kQwenVocab, 3);
  big[100000] = 50;
  big[140000] = 50;
  EXPECT_EQ(sample_once(p, big), 100000);
  big[77] = 50;
  EXPECT_EQ(sample_once(p, big), 77);
  // Greedy ignores top-k/p and min-p; logprobs on or off must not change the choice.
  p.top_k = 2;
  p.top_p = 0.1f;
  p.min_p = 0.9f;
  p.logprobs = 3;
  EXPECT_EQ(sample_once(p, big), 77);
}

// A device backend's greedy path: the engine takes Ops::argmax_rows's id instead of sampling
// when the sampler is plain greedy. The two must choose alike on ties, NaN and rows with
// nothing above -inf; and plain_greedy must not hold once anything changes the logits or
// logprobs are asked for.
TEST(Sampler, ArgmaxRowsChoosesAsGreedySampling) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<std::vector<float>> rows = {{0.1f, 2.0f, -1.0f, 1.9f}, {0.5f, 3.0f, 1.0f, 3.0f, 3.0f},
                                          {-5.0f, -5.0f, -5.0f},     {nan, 1.0f, 1.0f},
                                          {1.0f, nan, 2.0f},         {nan, -inf, -inf},
                                          {-inf, -inf, -inf},        {nan, nan},
                                          {-inf, nan, -inf}};
  std::vector<float> big = random_logits(kQwenVocab, 5);
  big[140000] = 40, big[100000] = 40, big[3] = nan;
  rows.push_back(big);
  recur::CpuOps ops(1);
  SamplingParams p;
  p.temperature = 0;
  for (const std::vector<float>& row : rows) {
    std::vector<float> x = row;
    int32_t id = -1;
    ops.argmax_rows(Tensor::contiguous(x.data(), DType::F32, {1, int64_t(x.size())}),
                    Tensor::contiguous(&id, DType::I32, {1}));
    EXPECT_EQ(id, sample_once(p, row)) << "row of " << row.size();
  }
  EXPECT_TRUE(Sampler(p, 8, 1).plain_greedy());
  SamplingParams q = p;
  q.logprobs = 0;
  EXPECT_FALSE(Sampler(q, 8, 1).plain_greedy());
  q = p, q.repetition_penalty = 1.1f;
  EXPECT_FALSE(Sampler(q, 8, 1).plain_greedy());
  q = p, q.logit_bias = {{3, 1.0f}};
  EXPECT_FALSE(Sampler(q, 8, 1).plain_greedy());
  q = p, q.temperature = 0.7f;
  EXPECT_FALSE(Sampler(q, 8, 1).plain_greedy());
}

TEST(Sampler, TemperatureToZeroApproachesGreedy) {
  const std::vector<float> logits = {1.0f, 3.0f, 2.5f, 0.0f};
  SamplingParams p;
  double prev = 0;
  for (float t : {2.0f, 1.0f, 0.5f, 0.2f}) {
    p.temperature = t;
    std::vector<int> c = histogram(p, logits, 20000);
    const double top = c[1] / 20000.0;
    EXPECT_GT(top, prev) << "T=" << t;
    EXPECT_NEAR(top, softmax(logits, t)[1], 0.02) << "T=" << t;
    prev = top;
  }
  for (float t : {1e-2f, 1e-3f, 1e-4f, 1e-6f, 1e-30f}) {  // the last two are greedy outright
    p.temperature = t;
    EXPECT_EQ(histogram(p, logits, 2000)[1], 2000) << "T=" << t;
  }
  // Exactly tied maxima stay tied for tiny T > 1e-5: both are drawn, nothing else is.
  p.temperature = 1e-3f;
  std::vector<int> c = histogram(p, {2.0f, 5.0f, 5.0f, 4.9f}, 4000);
  EXPECT_EQ(c[0] + c[3], 0);
  EXPECT_NEAR(c[1] / 4000.0, 0.5, 0.05);
}

TEST(Sampler, SameSeedSameSequenceDifferentSeedsDiffer) {
  auto run = [](const SamplingParams& p, uint64_t fallback, bool interleave) {
    Sampler s(p, 5000, fallback);
    SamplingParams q;
    q.temperature = 1.3f;
    Sampler other(q, 5000, 99);  // a neighbour in the batch drawing from its own RNG
    std::vector<int32_t> ids;
    SampledToken out, other_out;
    for (int step = 0; step < 64; ++step) {
      std::vector<float> l = random_logits(5000, step, 2.0f);
      if (interleave) {
        std::vector<float> l2 = l;
        other.sample(l2.data(), &other_out);
        other.sample(l2.data(), &other_out);
      }
      s.sample(l.data(), &out);
      s.accept(out.id);
      ids.push_back(out.id);
    }
    return ids;
  };
  for (int variant = 0; variant < 4; ++variant) {
    SamplingParams p;
    p.temperature = 1.5f;
    if (variant == 1) p.top_k = 50;
    if (variant == 2) p.top_p = 0.9f;
    if (variant == 3) p.min_p = 0.01f, p.frequency_penalty = 0.5f;
    const auto a = run(p, 42, false);
    EXPECT_EQ(a, run(p, 42, true)) << "variant " << variant;
    EXPECT_NE(a, run(p, 43, false)) << "variant " << variant;
    p.seed = 42;  // an explicit seed wins over the engine's fallback
    EXPECT_EQ(a, run(p, 777, false)) << "variant " << variant;
  }
  SamplingParams p;
  p.seed = 5;
  EXPECT_EQ(Sampler(p, 10, 6).seed(), 5u);
  EXPECT_EQ(Sampler(SamplingParams{}, 10, 6).seed(), 6u);
}

TEST(Sampler, ConsumesExactlyOneDrawPerSampledToken) {
  // Two tokens at equal odds: the id is u < 0.5 for the token's own draw u. Forced steps in
  // between (a -inf rival) must consume a draw too.
  SamplingParams p;
  Sampler s(p, 2, 2024);
  std::mt19937_64 ref(2024);
  SampledToken out;
  for (int step = 0; step < 200; ++step) {
    const double u = double(ref() >> 11) * 0x1.0p-53;
    std::vector<float> l = {0.0f, 0.0f};
    if (step % 3 == 2) l[1] = -INFINITY;
    s.sample(l.data(), &out);
    EXPECT_EQ(out.id, step % 3 == 2 ? 0 : (u < 0.5 ? 0 : 1)) << "step " << step;
  }
}

TEST(Sampler, EmpiricalDistributionMatchesSoftmax) {
  const std::vector<float> logits = {1.0f, 0.2f, -0.5f, 2.0f, 1.5f, -2.0f, 0.0f, 0.7f};
  constexpr int kDraws = 200000;
  // 7 degrees of freedom: P(chi2 > 30) ~ 1e-4; the seed is fixed, so this is deterministic.
  for (float t : {1.0f, 0.7f, 1.8f}) {
    SamplingParams p;
    p.temperature = t;
    EXPECT_LT(chi_square(histogram(p, logits, kDraws), softmax(logits, t)), 30.0) << "T=" << t;
  }
  // The filtered paths renormalise over what they keep: top-k, and min-p (tokens >= 0.2·max).
  SamplingParams p;
  p.temperature = 0.9f;
  p.top_k = 3;
  std::vector<double> want = softmax({logits[3], logits[4], logits[0]}, 0.9);
  std::vector<double> full(8, 0.0);
  full[3] = want[0], full[4] = want[1], full[0] = want[2];
  EXPECT_LT(chi_square(histogram(p, logits, kDraws), full), 30.0);
  p = SamplingParams{};
  p.min_p = 0.2f;  // drops 0.2, -0.5, -2.0, 0.0 (ratios e^-1.8, e^-2.5, e^-4, e^-2)
  std::vector<double> sm = softmax(logits);
  for (int i : {1, 2, 5, 6}) sm[i] = 0;
  const double kept = std::accumulate(sm.begin(), sm.end(), 0.0);
  for (double& x : sm) x /= kept;
  EXPECT_LT(chi_square(histogram(p, logits, kDraws), sm), 30.0);
}

TEST(Sampler, TopKNeverLeavesTheTopK) {
  for (int vocab : {1000, kQwenVocab}) {
    std::vector<float> logits = random_logits(vocab, 11, 1.0f);
    std::vector<int32_t> order(vocab);
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int a, int b) { return logits[a] > logits[b]; });
    for (int k : {1, 5, 20}) {
      SamplingParams p;
      p.temperature = 5.0f;  // flat, so every kept token shows up
      p.top_k = k;
      std::set<int32_t> top(order.begin(), order.begin() + k);
      std::vector<int> c = histogram(p, logits, vocab > 10000 ? 1000 : 4000);
      int distinct = 0;
      for (int id = 0; id < vocab; ++id) {
        if (c[id] == 0) continue;
        ++distinct;
        EXPECT_TRUE(top.count(id)) << "k=" << k << " sampled " << id;
      }
      EXPECT_EQ(distinct, k);
    }
  }
  // Ties at the k-th place go to the lower id.
  SamplingParams p;
  p.top_k = 2;
  std::vector<int> c = histogram(p, {1.0f, 3.0f, 1.0f, 1.0f}, 2000);
  EXPECT_GT(c[0], 0);
  EXPECT_EQ(c[2] + c[3], 0);
}

TEST(Sampler, TopPKeepsTheSmallestSetReachingP) {
  // Probabilities 0.5, 0.25, 0.15, 0.1 on shuffled ids.
  const std::vector<double> probs = {0.15, 0.5, 0.1, 0.25};
  const std::vector<float> logits = log_of(probs);
  auto kept = [&](float top_p) {
    SamplingParams p;
    p.top_p = top_p;
    std::vector<int> c = histogram(p, logits, 4000);
    std::set<int> s;
    for (int i = 0; i < 4; ++i)
      if (c[i]) s.insert(i);
    return s;
  };
  EXPECT_EQ(kept(0.3f), (std::set<int>{1}));
  EXPECT_EQ(kept(0.49f), (std::set<int>{1}));
  EXPECT_EQ(kept(0.6f), (std::set<int>{1, 3}));
  EXPECT_EQ(kept(0.8f), (std::set<int>{0, 1, 3}));
  EXPECT_EQ(kept(0.95f), (std::set<int>{0, 1, 2, 3}));
  EXPECT_EQ(kept(1e-6f), (std::set<int>{1}));  // at least one

  // Many candidates (histogram, then halving inside the boundary bucket): 600 equal tokens at
  // scattered ids hold ~all mass; p = 0.40083 needs 241 of them, taken in id order.
  constexpr int kVocab = 5000;
  std::vector<float> l(kVocab, -30.0f);
  std::vector<int32_t> ids(kVocab);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), std::mt19937_64(5));
  ids.resize(600);
  for (int32_t id : ids) l[id] = 0.0f;
  std::sort(ids.begin(), ids.end());
  std::set<int32_t> want(ids.begin(), ids.begin() + 241);
  SamplingParams p;
  p.top_p = 0.40083f;
  std::vector<int> c = histogram(p, l, 30000);
  std::set<int32_t> got;
  for (int i = 0; i < kVocab; ++i)
    if (c[i]) got.insert(i);
  EXPECT_EQ(got, want);

  // A real vocabulary against a full-sort reference, with top-k in front of it as well.
  std::vector<float> big = random_logits(kQwenVocab, 21, 1.0f);
  for (int i = 0; i < 40; ++i) big[(i * 3779) % kQwenVocab] = 11.0f + 0.1f * i;
  for (int top_k : {0, 30}) {
    for (float top_p : {0.5f, 0.8f, 0.95f}) {
      std::vector<float> ref = big;
      std::vector<int32_t> order(kQwenVocab);
      std::iota(order.begin(), order.end(), 0);
      std::sort(order.begin(), order.end(), [&](int a, int b) { return ref[a] > ref[b]; });
      if (top_k) order.resize(top_k);
      std::vector<float> sub;
      for (int32_t id : order) sub.push_back(ref[id]);
      std::vector<double> pr = softmax(sub);
      double acc = 0;
      size_t n = 0;
      while (acc < top_p) acc += pr[n++];
      std::set<int32_t> nucleus(order.begin(), order.begin() + n);
      SamplingParams q;
      q.top_k = top_k;
      q.top_p = top_p;
      std::vector<int> counts = histogram(q, big, 3000);
      std::set<int32_t> sampled;
      for (int i = 0; i < kQwenVocab; ++i)
        if (counts[i]) sampled.insert(i);
      EXPECT_EQ(sampled, nucleus) << "top_k " << top_k << " top_p " << top_p;
    }
  }
}

TEST(Sampler, MinPDropsTokensBelowMinPTimesMax) {
  const std::vector<float> logits = log_of({0.04, 0.3, 0.5, 0.06, 0.1});
  auto kept = [&](float min_p, float top_p) {
    SamplingParams p;
    p.min_p = min_p;
    p.top_p = top_p;
    std::vector<int> c = histogram(p, logits, 4000);
    std::set<int> s;
    for (int i = 0; i < 5; ++i)
      if (c[i]) s.insert(i);
    return s;
  };
  EXPECT_EQ(kept(0.15f, 1.0f), (std::set<int>{1, 2, 4}));     // cut 0.075
  EXPECT_EQ(kept(0.11f, 1.0f), (std::set<int>{1, 2, 3, 4}));  // cut 0.055
  EXPECT_EQ(kept(0.7f, 1.0f), (std::set<int>{2}));
  EXPECT_EQ(kept(1.0f, 1.0f), (std::set<int>{2}));
  // After top-p: 0.75 keeps {0.5, 0.3}; min-p 0.15 would keep 0.1 too but comes second.
  EXPECT_EQ(kept(0.15f, 0.75f), (std::set<int>{1, 2}));
  // Min-p is relative to the tempered max: T=2 flattens, so 0.06 (ratio sqrt(0.12)) stays.
  SamplingParams p;
  p.min_p = 0.3f;
  p.temperature = 2.0f;
  std::vector<int> c = histogram(p, logits, 4000);
  EXPECT_EQ(c[0], 0);  // sqrt(0.08) = 0.28 < 0.3
  EXPECT_GT(c[3], 0);  // sqrt(0.12) = 0.35
}

TEST(Sampler, RepetitionPenaltyOnPromptAndOutputTokens) {
  SamplingParams p;
  p.temperature = 0;
  p.repetition_penalty = 2.0f;
  Sampler s(p, 6, 1);
  const std::vector<int32_t> prompt = {1, 2, 2};
  s.set_prompt(prompt);
  s.accept(3);
  s.accept(3);
  std::vector<float> l = {2.0f, 2.0f, -2.0f, 4.0f, 1.0f, -1.0f};
  SampledToken out;
  s.sample(l.data(), &out);
  // Applied once per token however often it was seen: divides positives, multiplies negatives.
  EXPECT_EQ(l, (std::vector<float>{2.0f, 1.0f, -4.0f, 2.0f, 1.0f, -1.0f}));
  EXPECT_EQ(out.id, 0);
  s.accept(5);  // a generated token counts too
  l = {2.0f, 2.0f, -2.0f, 4.0f, 1.0f, -1.0f};
  s.sample(l.data(), &out);
  EXPECT_EQ(l, (std::vector<float>{2.0f, 1.0f, -4.0f, 2.0f, 1.0f, -2.0f}));
  // Below 1 it rewards repetition.
  p.repetition_penalty = 0.5f;
  Sampler r(p, 3, 1);
  r.set_prompt(std::vector<int32_t>{1});
  l = {3.0f, 2.0f, -2.0f};
  r.sample(l.data(), &out);
  EXPECT_EQ(l, (std::vector<float>{3.0f, 4.0f, -2.0f}));
  EXPECT_EQ(out.id, 1);
}

TEST(Sampler, PresenceAndFrequencyPenaltiesCountOutputTokensOnly) {
  SamplingParams p;
  p.temperature = 0;
  p.presence_penalty = 0.5f;
  p.frequency_penalty = 0.25f;
  Sampler s(p, 5, 1);
  s.set_prompt(std::vector<int32_t>{0, 0, 4});  // the prompt does not count
  s.accept(1);
  s.accept(1);
  s.accept(1);
  s.accept(2);
  std::vector<float> l = {1.0f, 1.0f, -1.0f, 0.5f, 2.0f};
  SampledToken out;
  s.sample(l.data(), &out);
  EXPECT_EQ(l, (std::vector<float>{1.0f, 1.0f - 0.5f - 0.75f, -1.0f - 0.5f - 0.25f, 0.5f, 2.0f}));
  EXPECT_EQ(out.id, 4);
  // Negative values encourage; order with repetition: repetition first, then subtraction.
  p.presence_penalty = -1.0f;
  p.frequency_penalty = 0;
  p.repetition_penalty = 2.0f;
  Sampler t(p, 3, 1);
  t.set_prompt(std::vector<int32_t>{0});
  t.accept(1);
  l = {4.0f, 4.0f, 4.0f};
  t.sample(l.data(), &out);
  EXPECT_EQ(l, (std::vector<float>{2.0f, 3.0f, 4.0f}));
}

TEST(Sampler, LogitBiasIsAddedFirstAndCanBanOrForce) {
  SamplingParams p;
  p.logit_bias = {{2, -100.0f}};
  std::vector<int> c = histogram(p, {1.0f, 1.0f, 1.5f, 1.0f}, 20000);
  EXPECT_EQ(c[2], 0);
  EXPECT_GT(std::min({c[0], c[1], c[3]}), 5000);
  p.logit_bias = {{3, 100.0f}};
  for (float t : {0.0f, 1.0f, 2.0f}) {
    p.temperature = t;
    EXPECT_EQ(histogram(p, {9.0f, 5.0f, 12.0f, -8.0f}, 2000)[3], 2000) << "T=" << t;
  }
  p.top_k = 2;
  p.top_p = 0.5f;
  EXPECT_EQ(histogram(p, random_logits(kQwenVocab, 8), 200)[3], 200);

  // Added to raw logits before penalties (duplicates add up); other logits untouched.
  p = SamplingParams{};
  p.temperature = 0;
  p.logit_bias = {{0, 3.0f}, {2, -1.0f}, {0, 1.0f}};
  p.repetition_penalty = 2.0f;
  Sampler s(p, 3, 1);
  s.set_prompt(std::vector<int32_t>{0, 2});
  std::vector<float> l = {1.0f, 2.5f, 0.5f};
  SampledToken out;
  s.sample(l.data(), &out);
  EXPECT_EQ(l, (std::vector<float>{2.5f, 2.5f, -1.0f}));  // (1+4)/2, -, (0.5-1)*2
  EXPECT_EQ(out.id, 0);
}

TEST(Sampler, LogprobsAreLogSoftmaxOfTheRawLogits) {
  for (int vocab : {1000, kQwenVocab}) {
    std::vector<float> raw = random_logits(vocab, 17, 4.0f);
    double m = *std::max_element(raw.begin(), raw.end()), s = 0;
    for (float x : raw) s += std::exp(double(x) - m);
    const double lse = m + std::log(s);
    std::vector<int32_t> order(vocab);
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int a, int b) { return raw[a] > raw[b]; });

    SamplingParams p;
    p.logprobs = 5;
    p.temperature = 0.8f;
    p.top_p = 0.9f;
    p.logit_bias = {{order[500], 30.0f}};  // changes what is sampled, not the reported logprobs
    p.presence_penalty = 1.0f;
    Sampler smp(p, vocab, 3);
    SampledToken out;
    for (int step = 0; step < 5; ++step) {
      std::vector<float> l = raw;
      smp.sample(l.data(), &out);
      smp.accept(out.id);
      EXPECT_NEAR(out.logprob, double(raw[out.id]) - lse, 1e-4) << "vocab " << vocab;
      ASSERT_EQ(out.top.size(), 5u);
      for (int i = 0; i < 5; ++i) {
        EXPECT_EQ(out.top[i].id, order[i]);
        EXPECT_NEAR(out.top[i].logprob, double(raw[order[i]]) - lse, 1e-4);
        if (i > 0) {
          EXPECT_GE(out.top[i - 1].logprob, out.top[i].logprob);
        }
      }
    }
    EXPECT_EQ(out.id, order[500]);  // the bias forced it
  }
  // logprobs = 0: only the chosen token; -1: nothing.
  const std::vector<float> l = {0.0f, 1.0f, 2.0f};
  const double lse = std::log(1 + std::exp(1.0) + std::exp(2.0));
  SamplingParams p;
  p.temperature = 0;
  p.logprobs = 0;
  Sampler s(p, 3, 1);
  SampledToken out;
  std::vector<float> w = l;
  s.sample(w.data(), &out);
  EXPECT_EQ(out.id, 2);
  EXPECT_NEAR(out.logprob, 2.0 - lse, 1e-6);
  EXPECT_TRUE(out.top.empty());
  p.logprobs = 20;  // more than the vocabulary: all of it
  Sampler all(p, 3, 1);
  w = l;
  all.sample(w.data(), &out);
  ASSERT_EQ(out.top.size(), 3u);
  EXPECT_EQ(out.top[2].id, 0);
  EXPECT_NEAR(out.top[2].logprob, 0.0 - lse, 1e-6);
  // A penalised prompt token that still wins reports its unpenalised logprob.
  p.logprobs = 0;
  p.repetition_penalty = 1.2f;
  Sampler pen(p, 3, 1);
  pen.set_prompt(std::vector<int32_t>{2});
  w = l;
  pen.sample(w.data(), &out);
  EXPECT_EQ(out.id, 2);
  EXPECT_FLOAT_EQ(w[2], 2.0f / 1.2f);
  EXPECT_NEAR(out.logprob, 2.0 - lse, 1e-6);
}

TEST(Sampler, NanAndInfiniteLogitsNeverWinAndNeverCrash) {
  const float nan = std::nanf(""), inf = INFINITY;
  std::vector<SamplingParams> configs(6);
  configs[0].temperature = 0;
  configs[1].top_k = 3;
  configs[2].top_p = 0.9f;
  configs[3].min_p = 0.1f;
  configs[5].top_k = 2;
  configs[5].top_p = 0.5f;
  configs[5].logprobs = 2;
  for (const SamplingParams& p : configs) {
    std::vector<int> c = histogram(p, {nan, 1.0f, nan, 2.0f, -inf}, 500);
    EXPECT_EQ(c[0] + c[2] + c[4], 0) << "top_k " << p.top_k << " top_p " << p.top_p;
    c = histogram(p, {-inf, -inf, -inf}, 10);  // nothing sensible, but a valid id
    EXPECT_EQ(c[0] + c[1] + c[2], 10);
  }
}

TEST(Sampler, ValidateRejectsBadValuesNamingTheField) {
  EXPECT_TRUE(SamplingParams{}.validate(100).ok());
  auto expect_bad = [](auto mutate, const std::string& field) {
    SamplingParams p;
    mutate(p);
    Status st = p.validate(100);
    ASSERT_FALSE(st.ok()) << field;
    EXPECT_EQ(st.error().code, ErrorCode::kInvalidArgument);
    EXPECT_NE(st.error().message.find(field), std::string::npos) << st.error().message;
  };
  const float nan = std::nanf("");
  expect_bad([](SamplingParams& p) { p.temperature = -0.1f; }, "temperature");
  expect_bad([&](SamplingParams& p) { p.temperature = nan; }, "temperature");
  expect_bad([](SamplingParams& p) { p.temperature = INFINITY; }, "temperature");
  expect_bad([](SamplingParams& p) { p.top_p = 0; }, "top_p must be in (0, 1]");
  expect_bad([](SamplingParams& p) { p.top_p = 1.01f; }, "top_p");
  expect_bad([&](SamplingParams& p) { p.top_p = nan; }, "top_p");
  expect_bad([](SamplingParams& p) { p.min_p = -0.01f; }, "min_p");
  expect_bad([&](SamplingParams& p) { p.min_p = nan; }, "min_p");
  expect_bad([](SamplingParams& p) { p.repetition_penalty = 0; }, "repetition_penalty");
  expect_bad([&](SamplingParams& p) { p.repetition_penalty = nan; }, "repetition_penalty");
  expect_bad([](SamplingParams& p) { p.presence_penalty = 2.5f; }, "presence_penalty");
  expect_bad([&](SamplingParams& p) { p.presence_penalty = nan; }, "presence_penalty");
  expect_bad([&](SamplingParams& p) { p.frequency_penalty = nan; }, "frequency_penalty");
  expect_bad([](SamplingParams& p) { p.logit_bias = {{100, 1.0f}}; }, "logit_bias token id 100");
  expect_bad([](SamplingParams& p) { p.logit_bias = {{-1, 1.0f}}; }, "logit_bias");
  expect_bad([&](SamplingParams& p) { p.logit_bias = {{3, nan}}; }, "logit_bias");
  expect_bad([](SamplingParams& p) { p.logit_bias = {{3, 101.0f}}; }, "logit_bias");
  expect_bad([](SamplingParams& p) { p.logprobs = 21; }, "logprobs");
  expect_bad([](SamplingParams& p) { p.logprobs = -2; }, "logprobs");
  SamplingParams ok;
  ok.top_k = -1;
  ok.temperature = 0;
  ok.min_p = 1;
  ok.logprobs = 20;
  ok.logit_bias = {{99, -100.0f}};
  EXPECT_TRUE(ok.validate(100).ok());
}

TEST(Sampler, NoAllocationPerSampleCall) {
  std::vector<SamplingParams> configs(6);
  configs[0].temperature = 0;
  configs[0].logprobs = 5;
  configs[0].repetition_penalty = 1.2f;
  configs[0].logit_bias = {{5, 2.0f}};
  configs[1].top_k = 20;
  configs[1].top_p = 0.8f;
  configs[1].logprobs = 20;
  configs[2].top_p = 0.8f;
  configs[2].presence_penalty = 0.5f;
  configs[2].frequency_penalty = 0.5f;
  configs[3].min_p = 0.05f;
  configs[3].logprobs = 0;
  configs[4].temperature = 0.7f;  // plain temperature sampling
  configs[5].temperature = 1.0f;
  configs[5].top_p = 0.95f;
  configs[5].min_p = 0.01f;
  configs[5].repetition_penalty = 1.1f;
  const std::vector<float> base = random_logits(kQwenVocab, 1, 2.0f);
  std::vector<int32_t> prompt(3000);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = int32_t(i * 37 % kQwenVocab);
  std::vector<float> l(kQwenVocab);
  for (const SamplingParams& p : configs) {
    Sampler s(p, kQwenVocab, 9);
    s.set_prompt(prompt);
    SampledToken out;
    out.top.reserve(kMaxTopLogprobs);  // what the engine's first step does once
    int64_t allocs = 0;
    for (int step = 0; step < 30; ++step) {
      std::copy(base.begin(), base.end(), l.begin());
      l[step * 1000] = 12.0f;  // a new token every step, so penalty bookkeeping grows
      testing::start_counting_allocs();
      s.sample(l.data(), &out);
      s.accept(out.id);
      s.accept(step * 1000 + 1);
      allocs += testing::stop_counting_allocs();
    }
    EXPECT_EQ(allocs, 0) << "top_k " << p.top_k << " top_p " << p.top_p;
  }
  // The counter itself works.
  testing::start_counting_allocs();
  auto* probe = new std::vector<int>(10);
  const int64_t probe_allocs = testing::stop_counting_allocs();
  delete probe;
  EXPECT_EQ(probe_allocs, 2);
}

}  // namespace
}  // namespace recur
