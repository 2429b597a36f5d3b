// Mixture of experts against the scalar references: routing (every MoeRouting option, ties, a
// selection bias), the routed experts, and the shared-expert defaults, gated and ungated.
#include <algorithm>
#include <cstring>
#include <deque>

#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/reference.h"
#include "ops/op_test_util.h"

namespace recur {
namespace {

using testing::fill_random;
using testing::HostTensor;
using testing::max_abs_diff;

class MoeOps : public ::testing::Test {
 protected:
  CpuOps ops{2};
  std::mt19937 rng{7};
};

struct RouteResult {
  HostTensor ids, weights;
};

RouteResult route(Ops* ops, const HostTensor& logits, const MoeRouting& r) {
  const int64_t n = logits.t.shape[0];
  RouteResult out{HostTensor(DType::I32, {n, r.k}), HostTensor(DType::F32, {n, r.k})};
  if (ops) {
    ops->moe_route(logits.t, r, out.ids.t, out.weights.t);
  } else {
    ref::moe_route(logits.t, r, out.ids.t, out.weights.t);
  }
  return out;
}

// Kernel and reference choose the same experts in the same order, with weights within 1e-6
// relative to the scale.
void expect_same_routes(const RouteResult& got, const RouteResult& want, float scale,
                        const std::string& what) {
  const int64_t m = want.ids.numel();
  EXPECT_EQ(std::memcmp(got.ids.t.data, want.ids.t.data, size_t(m) * 4), 0) << what;
  EXPECT_LE(max_abs_diff(got.weights.f(), want.weights.f(), m), 1e-6 * scale) << what;
}

std::string describe(const MoeRouting& r) {
  return std::string(r.score == MoeRouting::Score::kSoftmax ? "softmax" : "sigmoid") +
         (r.selection_bias.empty() ? "" : " biased") + (r.renormalize ? " renormalised" : "") +
         " scale=" + std::to_string(r.scale) + " k=" + std::to_string(r.k);
}

TEST_F(MoeOps, RouteMatchesReferenceForEveryOption) {
  for (int64_t E : {7, 33}) {
    const int64_t n = 9;
    HostTensor logits(DType::F32, {n, E}), bias(DType::F32, {E});
    fill_random(logits, rng, 2.0f);
    fill_random(bias, rng, 0.3f);
    for (auto score : {MoeRouting::Score::kSoftmax, MoeRouting::Score::kSigmoid}) {
      for (bool biased : {false, true}) {
        for (bool renormalize : {false, true}) {
          for (float scale : {1.0f, 2.5f}) {
            for (int k : {1, 3, int(E)}) {
              MoeRouting r;
              r.score = score, r.k = k, r.renormalize = renormalize, r.scale = scale;
              if (biased) r.selection_bias = bias.t;
              const RouteResult got = route(&ops, logits, r), want = route(nullptr, logits, r);
              expect_same_routes(got, want, scale, describe(r) + " E=" + std::to_string(E));
              if (renormalize) {  // the weights of a token sum to the scale
                for (int64_t t = 0; t < n; ++t) {
                  double sum = 0;
                  for (int j = 0; j < k; ++j) sum += got.weights.f()[t * k + j];
                  EXPECT_NEAR(sum, scale, 1e-6 * scale) << describe(r);
                }
              }
            }
          }
        }
      }
    }
  }
}

// Equal scores go to the lower expert index: equal logits, equal biased scores, and sigmoid
// scores that round to the same f32 (σ(29), σ(30), σ(31) are all 1.0f).
TEST_F(MoeOps, RouteTiesGoToTheLowerIndex) {
  const int64_t E = 6;
  const float rows[][E] = {
      {0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f},  // all tie
      {1.0f, 3.0f, 3.0f, 0.0f, 3.0f, 2.0f},  // three tie at the top
      {0.0f, 30.0f, 0.0f, 31.0f, 29.0f, 1.0f},
  };
  const int64_t n = 3;
  HostTensor logits(DType::F32, {n, E});
  std::memcpy(logits.f(), rows, sizeof(rows));
  for (auto score : {MoeRouting::Score::kSoftmax, MoeRouting::Score::kSigmoid}) {
    MoeRouting r;
    r.score = score, r.k = 2;
    const RouteResult got = route(&ops, logits, r), want = route(nullptr, logits, r);
    expect_same_routes(got, want, 1.0f, describe(r));
    EXPECT_EQ(got.ids.t.ptr<int32_t>()[0], 0);
    EXPECT_EQ(got.ids.t.ptr<int32_t>()[1], 1);
    EXPECT_EQ(got.ids.t.ptr<int32_t>()[2], 1);
    EXPECT_EQ(got.ids.t.ptr<int32_t>()[3], 2);
  }
  MoeRouting sig;
  sig.score = MoeRouting::Score::kSigmoid, sig.k = 2;
  const RouteResult saturated = route(&ops, logits, sig);
  EXPECT_EQ(saturated.ids.t.ptr<int32_t>()[4], 1) << "σ(30) ties σ(31) in f32";
  EXPECT_EQ(saturated.ids.t.ptr<int32_t>()[5], 3);
  // A bias that makes unequal scores tie: all logits equal, bias on experts 4 and 1 alike.
  HostTensor flat(DType::F32, {1, E}), bias(DType::F32, {E});
  for (int64_t e = 0; e < E; ++e) flat.f()[e] = 0.25f, bias.f()[e] = e == 1 || e == 4 ? 0.5f : 0;
  sig.selection_bias = bias.t;
  const RouteResult b = route(&ops, flat, sig);
  expect_same_routes(b, route(nullptr, flat, sig), 1.0f, describe(sig));
  EXPECT_EQ(b.ids.t.ptr<int32_t>()[0], 1);
  EXPECT_EQ(b.ids.t.ptr<int32_t>()[1], 4);
}

// The selection bias changes which experts are chosen, never their weights: those are the
// unbiased scores of the chosen experts (then renormalised and scaled as asked).
TEST_F(MoeOps, RouteBiasChoosesButDoesNotWeigh) {
  const int64_t n = 16, E = 12;
  const int k = 4;
  HostTensor logits(DType::F32, {n, E});
  fill_random(logits, rng, 1.0f);
  for (auto score : {MoeRouting::Score::kSoftmax, MoeRouting::Score::kSigmoid}) {
    // Of the order of the gaps between the scores (softmax scores of 12 experts are smaller).
    HostTensor bias(DType::F32, {E});
    fill_random(bias, rng, score == MoeRouting::Score::kSoftmax ? 0.02f : 0.2f);
    MoeRouting plain;
    plain.score = score, plain.k = k, plain.renormalize = false;
    MoeRouting biased = plain;
    biased.selection_bias = bias.t;
    const RouteResult a = route(&ops, logits, plain), b = route(&ops, logits, biased);
    expect_same_routes(b, route(nullptr, logits, biased), 1.0f, describe(biased));
    int changed = 0;
    for (int64_t t = 0; t < n; ++t) {
      changed += std::memcmp(a.ids.t.ptr<int32_t>() + t * k, b.ids.t.ptr<int32_t>() + t * k,
                             size_t(k) * 4) != 0;
    }
    EXPECT_GT(changed, 0) << "the bias must change some choices for this test to mean much";
    // Unbiased scores: the weight of every expert that the plain routing with k = E gives.
    MoeRouting all = plain;
    all.k = int(E);
    const RouteResult every = route(&ops, logits, all);
    for (int64_t t = 0; t < n; ++t) {
      for (int j = 0; j < k; ++j) {
        const int32_t id = b.ids.t.ptr<int32_t>()[t * k + j];
        float unbiased = -1;
        for (int64_t e = 0; e < E; ++e) {
          if (every.ids.t.ptr<int32_t>()[t * E + e] == id) unbiased = every.weights.f()[t * E + e];
        }
        ASSERT_EQ(b.weights.f()[t * k + j], unbiased) << describe(biased) << " t=" << t;
      }
    }
  }
}

// Group-limited routing (DeepSeek-V3 / Kimi): the kernel equals the reference, and every chosen
// expert lies in one of the topk_group groups whose two best values (score + bias) sum highest,
// computed here from the reference's own ungrouped scores.
TEST_F(MoeOps, GroupedRouteChoosesOnlyInTheBestGroups) {
  struct Case {
    int64_t E;
    int n_group, topk_group, k;
  };
  for (const Case c : {Case{12, 4, 2, 3}, Case{64, 8, 3, 8}, Case{15, 5, 1, 2}, Case{8, 1, 1, 2},
                       Case{16, 4, 4, 4}}) {
    const int64_t n = 11;
    HostTensor logits(DType::F32, {n, c.E}), bias(DType::F32, {c.E});
    fill_random(logits, rng, 2.0f);
    fill_random(bias, rng, 0.3f);
    for (int64_t e = 0; e < c.E; ++e) logits.f()[(n - 1) * c.E + e] = 0.25f;  // all tie
    for (bool biased : {false, true}) {
      MoeRouting r;
      r.score = MoeRouting::Score::kSigmoid, r.k = c.k, r.scale = 2.446f;
      r.n_group = c.n_group, r.topk_group = c.topk_group;
      if (biased) r.selection_bias = bias.t;
      const std::string what = describe(r) + " groups " + std::to_string(c.n_group) + "/" +
                               std::to_string(c.topk_group) + " E=" + std::to_string(c.E);
      const RouteResult got = route(&ops, logits, r), want = route(nullptr, logits, r);
      expect_same_routes(got, want, r.scale, what);
      // Every expert's score, from the reference routing all E without groups or renormalising.
      MoeRouting all = r;
      all.k = int(c.E), all.n_group = 1, all.renormalize = false, all.scale = 1.0f;
      const RouteResult every = route(nullptr, logits, all);
      const int64_t size = c.E / c.n_group;
      for (int64_t t = 0; t < n; ++t) {
        std::vector<double> value(size_t(c.E));
        for (int64_t j = 0; j < c.E; ++j) {
          const int32_t e = every.ids.t.ptr<int32_t>()[t * c.E + j];
          value[size_t(e)] = every.weights.f()[t * c.E + j] + (biased ? bias.f()[e] : 0.0f);
        }
        std::vector<double> group(size_t(c.n_group));
        for (int g = 0; g < c.n_group; ++g) {
          std::vector<double> v(value.begin() + g * size, value.begin() + (g + 1) * size);
          std::sort(v.rbegin(), v.rend());
          group[size_t(g)] = v[0] + (size > 1 ? v[1] : 0.0);
        }
        for (int j = 0; j < c.k; ++j) {
          const int32_t e = got.ids.t.ptr<int32_t>()[t * c.k + j];
          // Groups strictly better than e's group: fewer than topk_group of them.
          int better = 0;
          for (int g = 0; g < c.n_group; ++g) better += group[size_t(g)] > group[size_t(e / size)];
          ASSERT_LT(better, c.topk_group) << what << " t=" << t << " expert " << e;
        }
      }
    }
  }
  // A case where grouping changes the choice: group 0 holds the single best expert, group 1
  // the better pair; with one group kept, only group 1's experts are chosen.
  HostTensor logits(DType::F32, {1, 4});
  const float row[] = {5.0f, -5.0f, 2.0f, 2.0f};
  std::memcpy(logits.f(), row, sizeof(row));
  MoeRouting r;
  r.score = MoeRouting::Score::kSigmoid, r.k = 2, r.n_group = 2, r.topk_group = 1;
  const RouteResult got = route(&ops, logits, r);
  EXPECT_EQ(got.ids.t.ptr<int32_t>()[0], 2);
  EXPECT_EQ(got.ids.t.ptr<int32_t>()[1], 3);
  expect_same_routes(got, route(nullptr, logits, r), 1.0f, "grouped pair");
}

// E experts of [ff, d] gate and up and [d, ff] down, in BF16; storage kept in `store`.
std::vector<ExpertWeights> make_experts(int64_t E, int64_t d, int64_t ff,
                                        std::deque<HostTensor>& store, std::mt19937& rng) {
  std::vector<ExpertWeights> experts;
  for (int64_t e = 0; e < E; ++e) {
    HostTensor& g = store.emplace_back(DType::BF16, std::initializer_list<int64_t>{ff, d});
    HostTensor& u = store.emplace_back(DType::BF16, std::initializer_list<int64_t>{ff, d});
    HostTensor& dn = store.emplace_back(DType::BF16, std::initializer_list<int64_t>{d, ff});
    for (HostTensor* t : {&g, &u, &dn}) fill_random(*t, rng, 0.3f);
    experts.push_back({g.t, u.t, dn.t});
  }
  return experts;
}

// The routed experts, then the shared-expert default gated by σ(score) and ungated (no score),
// against the references.
TEST_F(MoeOps, ExpertsAndSharedExpertMatchReference) {
  const int64_t n = 9, d = 24, E = 7, k = 3, ff = 13;
  HostTensor logits(DType::F32, {n, E});
  fill_random(logits, rng, 2.0f);
  MoeRouting r;
  r.k = int(k);
  const RouteResult routes = route(&ops, logits, r);
  std::deque<HostTensor> store;
  const std::vector<ExpertWeights> experts = make_experts(E, d, ff, store, rng);
  HostTensor x(DType::F32, {n, d}), out(DType::F32, {n, d}), ref_out = out;
  fill_random(x, rng);
  fill_random(out, rng);  // must be overwritten
  HostTensor scratch(DType::U8,
                     {int64_t(ops.moe_experts_scratch_bytes(int(n), int(k), int(E), int(d), int(ff),
                                                            experts.front().gate.dtype))});
  ops.moe_experts(x.t, experts, routes.ids.t, routes.weights.t, out.t, scratch.t);
  ref::moe_experts(x.t, experts, routes.ids.t, routes.weights.t, ref_out.t);
  EXPECT_LE(max_abs_diff(out.f(), ref_out.f(), n * d), 1e-5);

  const std::vector<ExpertWeights> shared_w = make_experts(1, d, ff, store, rng);
  HostTensor score(DType::F32, {n, 1}), g(DType::F32, {n, ff}), u = g, h = g, y = x;
  fill_random(score, rng, 2.0f);
  HostTensor scratch2(
      DType::U8, {int64_t(ops.moe_experts_scratch_bytes(int(n), int(k) + 1, int(E) + 1, int(d),
                                                        int(ff), experts.front().gate.dtype))});
  HostTensor gated_out = out;
  for (bool gated : {true, false}) {
    SharedExpertArgs shared;
    shared.w = shared_w[0];
    if (gated) shared.score = score.t;
    shared.gate = g.t, shared.up = u.t, shared.hidden = h.t, shared.out = y.t;
    fill_random(out, rng);
    ops.moe_experts_shared(x.t, experts, routes.ids.t, routes.weights.t, shared, out.t, scratch2.t);
    testing::reference_moe_shared(x.t, experts, routes.ids.t, routes.weights.t, shared.w,
                                  shared.score, ref_out.t);
    EXPECT_LE(max_abs_diff(out.f(), ref_out.f(), n * d), 1e-5) << "gated=" << gated;
    if (gated) gated_out = out;
  }
  EXPECT_GT(max_abs_diff(out.f(), gated_out.f(), n * d), 1e-3) << "the gate must matter";
}

// Experts and the shared expert in the backend's matmul layout (as a model loads them), big
// enough that each pass splits across the threads: against the references on the weights as
// stored, for one token (decode) and several.
TEST_F(MoeOps, ExpertsInMatmulLayoutMatchReference) {
  const int64_t d = 256, E = 7, k = 3, ff = 160;
  std::deque<HostTensor> store;
  std::vector<ExpertWeights> experts = make_experts(E, d, ff, store, rng);
  std::vector<ExpertWeights> shared_w = make_experts(1, d, ff, store, rng);
  std::vector<Buffer> owned;
  auto adopt = [&](std::vector<ExpertWeights> ws) {
    for (ExpertWeights& w : ws) {
      for (Tensor* t : {&w.gate, &w.up, &w.down}) {
        auto packed = ops.adopt_matmul_weight(*t, &owned);
        EXPECT_TRUE(packed.ok());
        *t = *packed;
      }
    }
    return ws;
  };
  const std::vector<ExpertWeights> packed = adopt(experts), packed_shared = adopt(shared_w);
  // Outputs reach ~100 here: float rounding is relative to that.
  auto largest = [](const HostTensor& t) {
    float m = 0;
    for (int64_t i = 0; i < t.numel(); ++i) m = std::max(m, std::fabs(t.f()[i]));
    return double(m);
  };
  for (int64_t n : {1, 9}) {
    HostTensor logits(DType::F32, {n, E});
    fill_random(logits, rng, 2.0f);
    MoeRouting r;
    r.k = int(k);
    const RouteResult routes = route(&ops, logits, r);
    HostTensor x(DType::F32, {n, d}), out(DType::F32, {n, d}), ref_out = out;
    HostTensor score(DType::F32, {n, 1}), g(DType::F32, {n, ff}), u = g, h = g, y = x;
    fill_random(x, rng);
    fill_random(score, rng, 2.0f);
    HostTensor scratch(
        DType::U8, {int64_t(ops.moe_experts_scratch_bytes(int(n), int(k) + 1, int(E) + 1, int(d),
                                                          int(ff), packed.front().gate.dtype))});
    ops.moe_experts(x.t, packed, routes.ids.t, routes.weights.t, out.t, scratch.t);
    ref::moe_experts(x.t, experts, routes.ids.t, routes.weights.t, ref_out.t);
    EXPECT_LE(max_abs_diff(out.f(), ref_out.f(), n * d), 1e-6 * largest(ref_out)) << "n=" << n;
    SharedExpertArgs shared;
    shared.w = packed_shared[0];
    shared.score = score.t;
    shared.gate = g.t, shared.up = u.t, shared.hidden = h.t, shared.out = y.t;
    ops.moe_experts_shared(x.t, packed, routes.ids.t, routes.weights.t, shared, out.t, scratch.t);
    testing::reference_moe_shared(x.t, experts, routes.ids.t, routes.weights.t, shared_w[0],
                                  score.t, ref_out.t);
    EXPECT_LE(max_abs_diff(out.f(), ref_out.f(), n * d), 1e-6 * largest(ref_out))
        << "shared, n=" << n;
  }
}

// The fused default moe_route_experts_shared: moe_route with the routing given, the shared
// default, then the residual add; ids, weights and out written either way.
TEST_F(MoeOps, RouteExpertsSharedDefaultComposesItsParts) {
  const int64_t n = 5, d = 16, E = 9, ff = 11;
  HostTensor logits(DType::F32, {n, E}), bias(DType::F32, {E});
  fill_random(logits, rng, 2.0f);
  fill_random(bias, rng, 0.3f);
  MoeRouting r;
  r.score = MoeRouting::Score::kSigmoid, r.k = 2, r.selection_bias = bias.t, r.scale = 2.5f;
  std::deque<HostTensor> store;
  const std::vector<ExpertWeights> experts = make_experts(E, d, ff, store, rng);
  const std::vector<ExpertWeights> shared_w = make_experts(1, d, ff, store, rng);
  HostTensor x(DType::F32, {n, d}), g(DType::F32, {n, ff}), u = g, h = g, y = x;
  fill_random(x, rng);
  SharedExpertArgs shared;
  shared.w = shared_w[0];
  shared.gate = g.t, shared.up = u.t, shared.hidden = h.t, shared.out = y.t;
  HostTensor scratch(DType::U8,
                     {int64_t(ops.moe_experts_scratch_bytes(int(n), r.k + 1, int(E) + 1, int(d),
                                                            int(ff), experts.front().gate.dtype))});
  HostTensor ids(DType::I32, {n, r.k}), w(DType::F32, {n, r.k}), out(DType::F32, {n, d}),
      residual(DType::F32, {n, d});
  fill_random(residual, rng);
  const HostTensor residual0 = residual;
  ops.moe_route_experts_shared(logits.t, r, x.t, experts, ids.t, w.t, shared, out.t, scratch.t,
                               residual.t);
  const RouteResult want = route(nullptr, logits, r);
  expect_same_routes({ids, w}, want, r.scale, describe(r));
  HostTensor ref_out(DType::F32, {n, d});
  testing::reference_moe_shared(x.t, experts, want.ids.t, want.weights.t, shared.w, Tensor(),
                                ref_out.t);
  EXPECT_LE(max_abs_diff(out.f(), ref_out.f(), n * d), 1e-5);
  for (int64_t i = 0; i < n * d; ++i)
    ASSERT_NEAR(residual.f()[i], residual0.f()[i] + ref_out.f()[i], 1e-5);
}

}  // namespace
}  // namespace recur
