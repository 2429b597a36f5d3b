// MoE routing and experts on the GPU against the scalar references. Routing (every MoeRouting
// option) must match the ids exactly and the weights to 1e-6. Experts: every path (GEMV core,
// f32 experts, tensor cores on activations split into 16-bit terms) is f32-class: ≤ 1e-5
// relative.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "backend/cpu/reference.h"
#include "cuda/cuda_reference.h"
#include "cuda/cuda_test_util.h"

namespace recur {
namespace {

using namespace testing;

class CudaMoe : public CudaTest {};

// The profile's name of the experts' f16 tiles for `which` (gate/up or down): warpgroup products
// where sm_90a code runs, mma.sync elsewhere.
std::string f16_tiles(const std::string& which) {
  return "(" + which + (device_is_sm90a() ? ", f16 wgmma)" : ", f16 tensor cores)");
}

// A routing description with its selection bias (when it has one) on the host and the device.
struct Routing {
  MoeRouting host, device;
  HostTensor bias{DType::F32, {1}};
  DeviceTensor dbias;
  std::string name;
};
// The options the tests cover: Qwen's (softmax, renormalised), raw softmax, sigmoid with and
// without a selection bias (DeepSeek / Kimi style, scaled), softmax with a bias.
std::vector<std::unique_ptr<Routing>> routings(CudaOps& ops, int64_t E, int k, std::mt19937& rng) {
  struct Option {
    MoeRouting::Score score;
    bool bias, renormalize;
    float scale;
    const char* name;
  };
  const Option options[] = {
      {MoeRouting::Score::kSoftmax, false, true, 1.0f, "softmax"},
      {MoeRouting::Score::kSoftmax, false, false, 1.0f, "softmax raw"},
      {MoeRouting::Score::kSigmoid, false, true, 2.5f, "sigmoid scaled"},
      {MoeRouting::Score::kSigmoid, true, true, 2.446f, "sigmoid bias scaled"},
      {MoeRouting::Score::kSigmoid, true, false, 1.0f, "sigmoid bias raw"},
      {MoeRouting::Score::kSoftmax, true, true, 1.0f, "softmax bias"}};
  std::vector<std::unique_ptr<Routing>> out;
  for (const Option& o : options) {
    auto r = std::make_unique<Routing>();
    r->host.score = o.score, r->host.k = k, r->host.renormalize = o.renormalize;
    r->host.scale = o.scale;
    r->device = r->host;
    if (o.bias) {
      r->bias = HostTensor(DType::F32, {E});
      fill_random(r->bias, rng, 0.3f);
      r->dbias = DeviceTensor(ops, r->bias);
      r->host.selection_bias = r->bias.t, r->device.selection_bias = r->dbias.t;
    }
    r->name = o.name;
    out.push_back(std::move(r));
  }
  return out;
}

// Every option on every routing kernel: E of 128, 256 or 512 with k ≤ 32 takes the threshold
// filter kernel (with a selection bias or without); other E ≤ 512 with k ≤ 32 and no bias the
// block-per-token kernel (1, 2 or 4 logits per thread); more experts, larger k or a bias the
// warp-per-token kernel (logits in registers, or from memory for E > 1024).
TEST_F(CudaMoe, RoutingMatchesReferenceForEveryOption) {
  struct Case {
    int64_t n, E, k;
  };
  for (const Case c : {Case{9, 7, 3}, Case{33, 64, 8}, Case{5, 512, 10}, Case{4, 200, 32},
                       Case{3, 4096, 64}, Case{6, 256, 8}, Case{6, 128, 32}, Case{6, 512, 32},
                       Case{6, 512, 1}, Case{5, 2000, 8}, Case{5, 1024, 40}}) {
    for (const auto& r : routings(ops(), c.E, int(c.k), rng)) {
      HostTensor logits(DType::F32, {c.n, c.E});
      fill_random(logits, rng, 2.0f);
      // Exact ties, which must go to the lower expert index.
      logits.f()[1] = logits.f()[3];
      // A token whose largest logits all sit with one thread of a block (experts e + 128·i),
      // and one with a tie across the threshold (more candidates than picks).
      if (c.n > 3 && c.E >= 512) {
        for (int64_t i = 0; i < 4; ++i) logits.f()[1 * c.E + 5 + 128 * i] = 9.0f - float(i);
        for (int64_t e = 0; e < c.E; e += 37) logits.f()[2 * c.E + e] = 7.5f;
      }
      // The largest logits -0 (lower index) and +0: equal, so the lower index first.
      if (c.n > 4 && c.E > 8) {
        for (int64_t e = 0; e < c.E; ++e) {
          logits.f()[3 * c.E + e] = -0.1f - std::fabs(logits.f()[3 * c.E + e]);
        }
        logits.f()[3 * c.E + 5] = -0.0f, logits.f()[3 * c.E + 7] = 0.0f;
      }
      // A token whose logits are all equal: the k lowest indices (or the bias's), equal scores.
      for (int64_t e = 0; e < c.E; ++e) logits.f()[(c.n - 1) * c.E + e] = 0.25f;
      HostTensor ids(DType::I32, {c.n, c.k}), w(DType::F32, {c.n, c.k}), ids_ref = ids, w_ref = w;
      DeviceTensor dl = dev(logits), dids = poisoned(ids), dw = poisoned(w);
      ops().moe_route(dl.t, r->device, dids.t, dw.t);
      host_ref::moe_route(logits.t, r->host, ids_ref.t, w_ref.t);
      HostTensor gi = host(dids, ids), gw = host(dw, w);
      for (int64_t i = 0; i < c.n * c.k; ++i) {
        ASSERT_EQ(gi.t.ptr<int32_t>()[i], ids_ref.t.ptr<int32_t>()[i])
            << r->name << " E=" << c.E << " k=" << c.k << " i=" << i;
      }
      const double err = max_abs_diff(gw.f(), w_ref.f(), c.n * c.k);
      record_error("moe_route weights " + r->name, err);
      EXPECT_LE(err, 1e-6) << r->name << " E=" << c.E << " k=" << c.k;
    }
  }
}

// A selection bias on the threshold filter kernels (E 128, 256 or 512, k ≤ 32; Kimi's routing:
// sigmoid scores, the f32 score plus the bias chooses, the unbiased scores weigh, scaled by
// 2.446; and softmax with a bias), for several token counts, against the scalar reference. Rows:
// 0 random; 1 a tie of biased keys (equal logits, equal biases; with sigmoid scores on top,
// across the threshold for k = 8); 2 NaN logits (ranked lowest; one where the bias is largest)
// and a -inf one (sigmoid only: NaN makes the softmax sum NaN); 3 the top keys on one thread
// (experts e + 128·i); the last (n > 4) all logits equal, the bias alone choosing, its largest
// value held by two or three experts. Without the bias the reference picks other experts in
// every case (so a kernel ignoring it fails), and weighing by the biased keys would fail the
// weights.
TEST_F(CudaMoe, BiasedRoutingMatchesReference) {
  struct Case {
    int64_t n, E;
    int k;
  };
  for (const Case c : {Case{1, 128, 8}, Case{2, 256, 8}, Case{5, 512, 8}, Case{17, 128, 8},
                       Case{33, 256, 8}, Case{64, 512, 8}, Case{6, 512, 32}, Case{6, 128, 32}}) {
    for (const bool sigmoid : {true, false}) {
      HostTensor bias(DType::F32, {c.E});
      fill_random(bias, rng, 0.3f);
      float* b = bias.f();
      for (int64_t e = 0; e < c.E; e += 11) b[e] = 0.125f;  // row 1's tied group
      b[2] = b[7] = *std::max_element(b, b + c.E);          // the last row's tie, row 2's NaN
      DeviceTensor dbias = dev(bias);
      MoeRouting unbiased;
      unbiased.score = sigmoid ? MoeRouting::Score::kSigmoid : MoeRouting::Score::kSoftmax;
      unbiased.k = c.k, unbiased.scale = sigmoid ? 2.446f : 1.0f;
      MoeRouting host_r = unbiased, dev_r = unbiased;
      host_r.selection_bias = bias.t, dev_r.selection_bias = dbias.t;

      HostTensor logits(DType::F32, {c.n, c.E});
      fill_random(logits, rng, 2.0f);
      // Row t's logits [E], or null past the rows.
      auto row = [&](int64_t t) { return t < c.n ? logits.f() + t * c.E : nullptr; };
      // Everything far below a sigmoid key of 1 (σ(-4) < 0.02), the bias aside.
      auto lower = [&](float* l) {
        for (int64_t e = 0; e < c.E; ++e) l[e] = -4.0f - std::fabs(l[e]);
      };
      if (float* l = row(1)) {
        lower(l);
        for (int64_t e = 0; e < c.E; e += 11) l[e] = 6.0f;  // ⌈E/11⌉ ≥ 12 equal keys
      }
      if (float* l = row(2); l && sigmoid) {
        l[7] = l[c.E / 2 + 1] = l[c.E - 1] = NAN;
        l[4] = -INFINITY;  // score 0: the bias alone
      }
      if (float* l = row(3)) {
        lower(l);
        for (int64_t e = 5; e < c.E; e += 128) l[e] = 6.0f - 0.25f * float(e / 128);
      }
      if (c.n > 4) {
        float* l = row(c.n - 1);
        for (int64_t e = 0; e < c.E; ++e) l[e] = 0.25f;
      }

      HostTensor ids(DType::I32, {c.n, c.k}), w(DType::F32, {c.n, c.k}), ids_ref = ids, w_ref = w;
      HostTensor ids_unbiased = ids, w_unbiased = w;
      DeviceTensor dl = dev(logits), dids = poisoned(ids), dw = poisoned(w);
      ops().moe_route(dl.t, dev_r, dids.t, dw.t);
      host_ref::moe_route(logits.t, host_r, ids_ref.t, w_ref.t);
      host_ref::moe_route(logits.t, unbiased, ids_unbiased.t, w_unbiased.t);
      const std::string what = std::string(sigmoid ? "sigmoid" : "softmax") +
                               " n=" + std::to_string(c.n) + " E=" + std::to_string(c.E) +
                               " k=" + std::to_string(c.k);
      ASSERT_NE(std::memcmp(ids_ref.t.data, ids_unbiased.t.data, size_t(c.n * c.k) * 4), 0)
          << what << ": the bias changes no pick";
      HostTensor gi = host(dids, ids), gw = host(dw, w);
      for (int64_t i = 0; i < c.n * c.k; ++i) {
        ASSERT_EQ(gi.t.ptr<int32_t>()[i], ids_ref.t.ptr<int32_t>()[i]) << what << " i=" << i;
      }
      const double err = max_abs_diff(gw.f(), w_ref.f(), c.n * c.k);
      record_error(
          std::string("moe_route weights biased filter ") + (sigmoid ? "sigmoid" : "softmax"), err);
      EXPECT_LE(err, 1e-6) << what;
    }
  }
}

// Group-limited routing (MoeRouting::grouped): the same picks and weights as the scalar
// reference of the op (ref::moe_route, which limits the choice to the best groups; host_ref
// knows no groups), with and without a selection bias, ties included.
TEST_F(CudaMoe, GroupedRoutingMatchesReference) {
  struct Case {
    int64_t n, E;
    int n_group, topk_group, k;
  };
  for (const Case c : {Case{9, 12, 4, 2, 3}, Case{7, 256, 8, 4, 8}, Case{5, 15, 5, 1, 2},
                       Case{3, 4096, 64, 8, 16}}) {
    for (const auto& r : routings(ops(), c.E, c.k, rng)) {
      r->host.n_group = r->device.n_group = c.n_group;
      r->host.topk_group = r->device.topk_group = c.topk_group;
      HostTensor logits(DType::F32, {c.n, c.E});
      fill_random(logits, rng, 2.0f);
      logits.f()[1] = logits.f()[3];
      for (int64_t e = 0; e < c.E; ++e) logits.f()[(c.n - 1) * c.E + e] = 0.25f;
      HostTensor ids(DType::I32, {c.n, c.k}), w(DType::F32, {c.n, c.k}), ids_ref = ids, w_ref = w;
      DeviceTensor dl = dev(logits), dids = poisoned(ids), dw = poisoned(w);
      ops().moe_route(dl.t, r->device, dids.t, dw.t);
      ref::moe_route(logits.t, r->host, ids_ref.t, w_ref.t);
      HostTensor gi = host(dids, ids), gw = host(dw, w);
      for (int64_t i = 0; i < c.n * c.k; ++i) {
        ASSERT_EQ(gi.t.ptr<int32_t>()[i], ids_ref.t.ptr<int32_t>()[i])
            << r->name << " E=" << c.E << " groups " << c.n_group << " i=" << i;
      }
      const double err = max_abs_diff(gw.f(), w_ref.f(), c.n * c.k);
      record_error("moe_route grouped weights " + r->name, err);
      EXPECT_LE(err, 1e-6) << r->name << " E=" << c.E;
    }
  }
}

// Routed by the GPU's own router (so ids cover repeated and unused experts), then experts.
TEST_F(CudaMoe, ExpertsMatchReferenceOnEveryPath) {
  struct Case {
    int64_t n, E, k, d, ff;
  };
  const Case cases[] = {{1, 7, 3, 24, 13},
                        {3, 7, 3, 24, 13},
                        {8, 7, 3, 24, 13},
                        {9, 7, 3, 24, 13},
                        {70, 7, 3, 24, 13},
                        {1, 32, 8, 64, 32},
                        {5, 32, 8, 64, 32},
                        {100, 32, 8, 64, 32},
                        {200, 16, 4, 64, 40},
                        {1, 64, 10, 512, 256},
                        {2, 64, 10, 512, 256},
                        {100, 64, 10, 512, 256},
                        // prompts on tensor cores: one expert per token (x's split terms outgrow
                        // the expert outputs' scratch they share); full 64-row tiles, k and the
                        // output columns not multiples of a stage or a tile
                        {100, 8, 1, 64, 32},
                        {300, 16, 4, 136, 200},
                        // the f16 tiles' gate/up in clusters of 16 blocks; SwiGLU rows wider
                        // than a cluster (17 blocks: f32 rows, then a row split)
                        {300, 16, 4, 64, 2048},
                        {150, 8, 2, 64, 2176},
                        // clusters of 10, the last block 8 columns wide
                        {200, 16, 4, 64, 1160},
                        // more than 2,048 pairs: the sort in three slices
                        {700, 32, 8, 64, 32},
                        // decode batches, few rows per expert (tiles of 2 and 4 rows), with 16-byte
                        // rows whose count is not a multiple of a block's
                        {12, 64, 4, 512, 256},
                        {16, 64, 8, 512, 256},
                        {16, 64, 8, 264, 136}};
  for (DType dt : {DType::BF16, DType::F32, DType::F16}) {
    for (const Case& c : cases) {
      Experts ex = make_experts(ops(), c.E, c.d, c.ff, dt, rng);
      HostTensor logits(DType::F32, {c.n, c.E});
      fill_random(logits, rng, 2.0f);
      HostTensor ids(DType::I32, {c.n, c.k}), w(DType::F32, {c.n, c.k});
      DeviceTensor dl = dev(logits), dids = poisoned(ids), dw = poisoned(w);
      MoeRouting routing;
      routing.k = int(c.k);
      ops().moe_route(dl.t, routing, dids.t, dw.t);
      HostTensor hids = host(dids, ids), hw = host(dw, w);
      // x as a column slice of a wider buffer (row stride ≠ d).
      HostTensor xbig(DType::F32, {c.n, c.d + 4}), out(DType::F32, {c.n, c.d}), ref = out;
      fill_random(xbig, rng);
      DeviceTensor dx = dev(xbig), dout = poisoned(out);
      HostTensor scratch_h(
          DType::U8,
          {int64_t(ops().moe_experts_scratch_bytes(int(c.n), int(c.k), int(c.E), int(c.d),
                                                   int(c.ff), ex.d.front().gate.dtype))});
      DeviceTensor scratch = poisoned(scratch_h);
      ops().moe_experts(dx.t.slice_cols(4, 4 + c.d), ex.d, dids.t, dw.t, dout.t, scratch.t);
      ref::moe_experts(xbig.t.slice_cols(4, 4 + c.d), ex.h, hids.t, hw.t, ref.t);
      HostTensor got = host(dout, out);
      ASSERT_EQ(count_nonfinite(got.f(), out.numel()), 0);
      const bool lowp = c.n > CudaOps::kGemvMaxTokens && dt != DType::F32;
      const double err = rel_err(got.f(), ref.f(), out.numel());
      const std::string path = c.n <= CudaOps::kGemvMaxTokens ? "gemv"
                               : lowp                         ? "tensor cores"
                                                              : "gemv tiles";
      record_error(std::string("moe_experts ") + path + " " + dtype_name(dt), err);
      EXPECT_LE(err, 1e-5) << dtype_name(dt) << " n=" << c.n << " E=" << c.E << " d=" << c.d
                           << " ff=" << c.ff;
    }
  }
}

// x [n, d] through the experts ex (k of them a token, routed by the GPU from random logits) on
// the device and by the reference: the device's output, the reference's and the ids.
struct ExpertsRun {
  HostTensor got, ref, ids;
};
ExpertsRun run_experts(CudaOps& ops, const Experts& ex, const HostTensor& x, int64_t k, int64_t ff,
                       std::mt19937& rng) {
  const int64_t n = x.t.shape[0], d = x.t.shape[1], E = int64_t(ex.d.size());
  HostTensor logits(DType::F32, {n, E});
  fill_random(logits, rng, 2.0f);
  HostTensor ids(DType::I32, {n, k}), w(DType::F32, {n, k}), out(DType::F32, {n, d});
  DeviceTensor dl(ops, logits), dx(ops, x), dids(ops, ids), dw(ops, w);
  dids.poison(), dw.poison();
  MoeRouting routing;
  routing.k = int(k);
  ops.moe_route(dl.t, routing, dids.t, dw.t);
  HostTensor scratch_h(
      DType::U8, {int64_t(ops.moe_experts_scratch_bytes(int(n), int(k), int(E), int(d), int(ff),
                                                        ex.d.front().gate.dtype))});
  DeviceTensor dout(ops, out), scratch(ops, scratch_h);
  dout.poison(), scratch.poison();
  ops.moe_experts(dx.t, ex.d, dids.t, dw.t, dout.t, scratch.t);
  ExpertsRun r{dout.download(ops, out), out, dids.download(ops, ids)};
  ref::moe_experts(x.t, ex.h, r.ids.t, dw.download(ops, w).t, r.ref.t);
  return r;
}

// A prompt of n random rows through ex (k experts a token), the launches labelled in the
// profile as one forward's: its relative error against the reference.
double prompt_experts_error(CudaOps& ops, const Experts& ex, int64_t n, int64_t k, int64_t ff,
                            std::mt19937& rng) {
  const int64_t d = ex.h.front().gate.shape[1];
  HostTensor x(DType::F32, {n, d});
  fill_random(x, rng);
  Layout lay(std::vector<int>{int(n)}, std::vector<int>{0}, 16, rng);
  ops.begin_forward(lay.l, {}, {});  // the profile labels the launches from here
  const ExpertsRun r = run_experts(ops, ex, x, k, ff, rng);
  return rel_err(r.got.f(), r.ref.f(), n * d);
}

// With one-hot 16-bit weights every product on the tensor cores is one activation, so the
// experts' outputs carry no rounding but the activations' split, the SwiGLU's and the
// combine's. Each activation row goes in as two f16 terms of the row scaled by a power of two:
// both terms must arrive (one alone leaves 2^-12 of a value, ~2e-4), for every row of a tile,
// and the scaling must follow each row (and, for down, each SwiGLU row across the blocks of
// its cluster). Rows: random; scaled by 2^40, 2^-40 and 10^6 (beyond f16's range, where
// unscaled terms overflow); one value 10^4 times the rest. Each row's error is taken against
// its own largest value. ff 40: one block a tile; 2,048: clusters of sixteen.
TEST_F(CudaMoe, TensorCoreExpertsCarryEveryBitOfTheActivations) {
  const int64_t n = 300, E = 16, k = 4, d = 64;  // ~75 rows an expert: tiles 64 + rest
  for (int64_t ff : {40, 2048}) {
    for (DType dt : {DType::BF16, DType::F16}) {
      Experts ex = make_experts(ops(), E, d, ff, dt, rng, /*one_hot=*/true);
      HostTensor x(DType::F32, {n, d});
      fill_random(x, rng);
      for (int64_t t = 0; t < n; ++t) {
        const float scale[] = {1.0f, 0x1p40f, 0x1p-40f, 1e6f, 1.0f};
        for (int64_t c = 0; c < d; ++c) x.f()[t * d + c] *= scale[t % 5];
        if (t % 5 == 4) x.f()[t * d + t % d] *= 1e4f;
      }
      const ExpertsRun r = run_experts(ops(), ex, x, k, ff, rng);
      ASSERT_EQ(count_nonfinite(r.got.f(), n * d), 0);
      double err = 0.0;
      for (int64_t t = 0; t < n; ++t) {
        err = std::max(err, rel_err(r.got.f() + t * d, r.ref.f() + t * d, d, 0.0));
      }
      record_error(std::string("moe_experts tensor cores one-hot ") + dtype_name(dt), err);
      EXPECT_LE(err, 1e-6) << dtype_name(dt) << " ff=" << ff;
    }
  }
}

// A bf16 expert weight beyond f16's range (1e5) would saturate on the f16 tiles: the backend
// found it when the weight was adopted and the experts take the tiles that keep bf16 weights.
TEST_F(CudaMoe, ExpertWeightsBeyondF16KeepTheirValue) {
  const int64_t n = 200, E = 8, k = 2, d = 64, ff = 64;
  Experts ex = make_experts(ops(), E, d, ff, DType::BF16, rng);
  HostTensor big = ex.host[3 * 5];  // expert 5's gate
  big.t.ptr<uint16_t>()[7 * d + 3] = f32_to_bf16(1e5f);
  ex.h[5].gate = big.t;
  ex.d[5].gate = ops().adopt_matmul_weight(big.t, nullptr).value();
  HostTensor x(DType::F32, {n, d});
  fill_random(x, rng);
  const ExpertsRun r = run_experts(ops(), ex, x, k, ff, rng);
  int64_t picked = 0;
  for (int64_t i = 0; i < n * k; ++i) picked += r.ids.t.ptr<int32_t>()[i] == 5;
  ASSERT_GT(picked, 0);
  ASSERT_EQ(count_nonfinite(r.got.f(), n * d), 0);
  const double err = rel_err(r.got.f(), r.ref.f(), n * d);
  record_error("moe_experts bf16 beyond f16", err);
  EXPECT_LE(err, 1e-5);
}

// A prompt's shared expert rides along the routed experts' f16 tiles (one gate/up launch, no
// matmul of its own), by the profile's launch names.
TEST(CudaMoePaths, PromptSharedExpertRidesTheExpertTiles) {
  std::mt19937 rng(29);
  bool ok = false;
  const std::string table = profile_table(
      [&](CudaOps& ops) {
        const int64_t n = 200, E = 16, k = 4, d = 64, ff = 64;
        Experts ex = make_experts(ops, E, d, ff, DType::BF16, rng);
        Experts sh = make_experts(ops, 1, d, ff, DType::BF16, rng);
        HostTensor x(DType::F32, {n, d}), g(DType::F32, {n, ff}), y = x, score(DType::F32, {n, 1});
        HostTensor logits(DType::F32, {n, E}), ids(DType::I32, {n, k}), w(DType::F32, {n, k});
        for (HostTensor* t : {&x, &score, &logits}) fill_random(*t, rng);
        DeviceTensor dx(ops, x), dscore(ops, score), dl(ops, logits), dids(ops, ids), dw(ops, w);
        DeviceTensor dg(ops, g), du(ops, g), dh(ops, g), dy(ops, y), dout(ops, y);
        HostTensor scratch_h(
            DType::U8,
            {int64_t(ops.moe_experts_scratch_bytes(int(n), int(k) + 1, int(E) + 1, int(d), int(ff),
                                                   ex.d.front().gate.dtype))});
        DeviceTensor scratch(ops, scratch_h);
        MoeRouting routing;
        routing.k = int(k);
        Layout lay(std::vector<int>{int(n)}, std::vector<int>{0}, 16, rng);
        ops.begin_forward(lay.l, {}, {});  // the profile labels the launches from here
        ops.moe_route(dl.t, routing, dids.t, dw.t);
        SharedExpertArgs shared;
        shared.w = sh.d[0], shared.score = dscore.t, shared.gate = dg.t, shared.up = du.t;
        shared.hidden = dh.t, shared.out = dy.t;
        ops.moe_experts_shared(dx.t, ex.d, dids.t, dw.t, shared, dout.t, scratch.t);
        HostTensor got = dout.download(ops, y), ref = y;
        reference_moe_shared(x.t, ex.h, dids.download(ops, ids).t, dw.download(ops, w).t, sh.h[0],
                             score.t, ref.t);
        EXPECT_LE(rel_err(got.f(), ref.f(), n * d), 1e-5);
      },
      &ok);
  if (!ok) GTEST_SKIP() << "no usable CUDA device";
  EXPECT_EQ(profile_count(table, "prompt n=200 moe_experts " + f16_tiles("gate/up")), 1) << table;
  EXPECT_EQ(table.find("matmul"), std::string::npos) << table;
}

// Which tiles ran, by the profile's launch names: bf16 experts take the f16 tiles, also after
// another weight was found beyond f16's range; experts holding such a weight take the tiles
// that split f32 activations into three bf16 terms.
TEST(CudaMoePaths, ExpertsLeaveTheF16TilesOnlyForAWeightBeyondF16) {
  std::mt19937 rng(26);
  for (const bool beyond : {false, true}) {
    bool ok = false;
    const std::string table = profile_table(
        [&](CudaOps& ops) {
          const int64_t n = 200, E = 8, k = 2, d = 64, ff = 64;
          HostTensor wide(DType::BF16, {ff, d});
          fill_random(wide, rng, 0.3f);
          wide.t.ptr<uint16_t>()[0] = f32_to_bf16(1e5f);
          const Tensor dwide = ops.adopt_matmul_weight(wide.t, nullptr).value();
          Experts ex = make_experts(ops, E, d, ff, DType::BF16, rng);
          if (beyond) ex.h[5].gate = wide.t, ex.d[5].gate = dwide;
          EXPECT_LE(prompt_experts_error(ops, ex, n, k, ff, rng), 1e-5);
        },
        &ok);
    if (!ok) GTEST_SKIP() << "no usable CUDA device";
    EXPECT_EQ(profile_count(table, "prompt n=200 moe_experts " + f16_tiles("gate/up")),
              beyond ? -1 : 1)
        << table;
    EXPECT_EQ(profile_count(table, "prompt n=200 moe_experts (gate/up, tensor cores)"),
              beyond ? 1 : -1)
        << table;
  }
}

// The experts' 16-bit tiles on warpgroup products (where sm_90a code runs) give
// the reference's results as the mma.sync tiles do (the same products, summed in another order),
// on tiles of one block and of clusters, SwiGLU rows wider than a cluster, k and output columns
// that are not multiples of a stage or a tile; the profile shows which tiles ran.
TEST(CudaMoePaths, WarpgroupTilesMatchTheReference) {
  if (!device_is_sm90a()) GTEST_SKIP() << "no device running sm_90a code (wgmma)";
  struct Case {
    int64_t n, E, k, d, ff;
  };
  const Case cases[] = {{100, 8, 1, 64, 32},   {300, 16, 4, 136, 200}, {300, 16, 4, 64, 2048},
                        {150, 8, 2, 64, 2176}, {200, 16, 4, 64, 1160}, {700, 32, 8, 64, 32}};
  std::mt19937 rng(38);
  for (DType dt : {DType::BF16, DType::F16}) {
    bool ok = false;
    const std::string table = profile_table(
        [&](CudaOps& ops) {
          for (const Case& c : cases) {
            Experts ex = make_experts(ops, c.E, c.d, c.ff, dt, rng);
            EXPECT_LE(prompt_experts_error(ops, ex, c.n, c.k, c.ff, rng), 1e-5)
                << dtype_name(dt) << " n " << c.n << " d " << c.d << " ff " << c.ff;
          }
        },
        &ok);
    ASSERT_TRUE(ok);
    EXPECT_NE(table.find("moe_experts (gate/up, f16 wgmma)"), std::string::npos) << table;
    EXPECT_NE(table.find("moe_experts (down, f16 wgmma)"), std::string::npos) << table;
    EXPECT_EQ(table.find("f16 tensor cores"), std::string::npos) << table;
  }
}

// RECUR_CUDA_PORTABLE=1 puts a Hopper on the paths of later GPUs (whose compute_90 PTX has no
// warpgroup products or e4m3 tiles): the experts' mma.sync tiles, with the reference's results,
// and block-FP8 prompts on f16 terms even where e4m3 was asked for.
TEST(CudaMoePaths, PortableBackendTakesTheMmaSyncTiles) {
  const ScopedEnv portable("RECUR_CUDA_PORTABLE", "1");
  std::mt19937 rng(41);
  bool ok = false;
  const std::string table = profile_table(
      [&](CudaOps& ops) {
        EXPECT_EQ(ops.fp8_activations(), std::optional(Fp8Activations::kF16));
        const int64_t n = 300, E = 16, k = 4, d = 136, ff = 200;
        Experts ex = make_experts(ops, E, d, ff, DType::BF16, rng);
        EXPECT_LE(prompt_experts_error(ops, ex, n, k, ff, rng), 1e-5);
      },
      &ok, Fp8Activations::kE4m3);
  if (!ok) GTEST_SKIP() << "no usable CUDA device";
  EXPECT_NE(table.find("moe_experts (gate/up, f16 tensor cores)"), std::string::npos) << table;
  EXPECT_EQ(table.find("wgmma"), std::string::npos) << table;
}

// One token takes the direct path (no sort; the down launch reads its experts and loads their
// weights before its PDL wait): its output equals the same token's row in a two-token call bit
// for bit.
TEST_F(CudaMoe, OneTokenExpertsEqualTheirRowInABatch) {
  const int64_t E = 64, k = 10, d = 2048, ff = 512;
  for (DType dt : {DType::BF16, DType::F32}) {
    Experts ex = make_experts(ops(), E, d, ff, dt, rng);
    HostTensor logits(DType::F32, {2, E}), x(DType::F32, {2, d});
    fill_random(logits, rng, 2.0f);
    fill_random(x, rng);
    HostTensor ids(DType::I32, {2, k}), w(DType::F32, {2, k}), out(DType::F32, {2, d});
    DeviceTensor dl = dev(logits), dx = dev(x), dids = poisoned(ids), dw = poisoned(w);
    MoeRouting routing;
    routing.k = int(k);
    ops().moe_route(dl.t, routing, dids.t, dw.t);
    HostTensor got[2] = {out, out};
    for (int64_t n : {1, 2}) {
      HostTensor scratch_h(
          DType::U8, {int64_t(ops().moe_experts_scratch_bytes(int(n), int(k), int(E), int(d),
                                                              int(ff), ex.d.front().gate.dtype))});
      DeviceTensor dout = poisoned(out), scratch = poisoned(scratch_h);
      ops().moe_experts(dx.t.slice_rows(0, n), ex.d, dids.t.slice_rows(0, n), dw.t.slice_rows(0, n),
                        dout.t.slice_rows(0, n), scratch.t);
      got[n - 1] = host(dout, out);
    }
    ASSERT_EQ(count_nonfinite(got[0].f(), d), 0);
    EXPECT_EQ(std::memcmp(got[0].f(), got[1].f(), size_t(d) * 4), 0) << dtype_name(dt);
  }
}

// The shared expert, gated by σ(score) (Qwen) or not (Kimi): one token rides along the routed
// experts' launches, as do prompts on the tensor-core tiles (sorted as one more expert; 16-bit
// experts of 200 and 300 tokens), other token counts take the default's ops; all against the
// references, and against the default's ops on the GPU.
TEST_F(CudaMoe, SharedExpertMatchesReference) {
  struct Case {
    int64_t n, E, k, d, ff;
  };
  const Case cases[] = {{1, 64, 10, 512, 256},
                        {1, 7, 3, 24, 13},
                        {3, 32, 8, 64, 32},
                        {200, 16, 4, 64, 40},
                        {300, 64, 8, 256, 128}};
  for (DType dt : {DType::BF16, DType::F32}) {
    for (bool gated : {true, false}) {
      for (const Case& c : cases) {
        Experts ex = make_experts(ops(), c.E, c.d, c.ff, dt, rng);
        Experts sh = make_experts(ops(), 1, c.d, c.ff, dt, rng);
        HostTensor logits(DType::F32, {c.n, c.E});
        fill_random(logits, rng, 2.0f);
        HostTensor ids(DType::I32, {c.n, c.k}), w(DType::F32, {c.n, c.k});
        DeviceTensor dl = dev(logits), dids = poisoned(ids), dw = poisoned(w);
        MoeRouting routing;
        routing.k = int(c.k);
        ops().moe_route(dl.t, routing, dids.t, dw.t);
        HostTensor hids = host(dids, ids), hw = host(dw, w);
        HostTensor x(DType::F32, {c.n, c.d}), score(DType::F32, {c.n, 1}), out = x, ref = x;
        HostTensor g(DType::F32, {c.n, c.ff}), y = x;
        fill_random(x, rng);
        fill_random(score, rng);
        DeviceTensor dx = dev(x), dscore = dev(score);
        HostTensor scratch_h(
            DType::U8,
            {int64_t(ops().moe_experts_scratch_bytes(int(c.n), int(c.k) + 1, int(c.E) + 1, int(c.d),
                                                     int(c.ff), ex.d.front().gate.dtype))});
        HostTensor got[2] = {out, out};
        for (int path = 0; path < 2; ++path) {  // the backend's op, then the default's ops
          DeviceTensor dg = poisoned(g), du = poisoned(g), dh = poisoned(g), dy = poisoned(y);
          DeviceTensor dout = poisoned(out), scratch = poisoned(scratch_h);
          SharedExpertArgs shared;
          shared.w = sh.d[0];
          shared.score = gated ? dscore.t : Tensor{}, shared.gate = dg.t, shared.up = du.t;
          shared.hidden = dh.t, shared.out = dy.t;
          if (path == 0) {
            ops().moe_experts_shared(dx.t, ex.d, dids.t, dw.t, shared, dout.t, scratch.t);
          } else {
            ops().Ops::moe_experts_shared(dx.t, ex.d, dids.t, dw.t, shared, dout.t, scratch.t);
          }
          got[path] = host(dout, out);
          ASSERT_EQ(count_nonfinite(got[path].f(), out.numel()), 0);
        }
        reference_moe_shared(x.t, ex.h, hids.t, hw.t, sh.h[0], gated ? score.t : Tensor{}, ref.t);
        const std::string what = std::string(dtype_name(dt)) + (gated ? " gated" : " ungated") +
                                 " n=" + std::to_string(c.n) + " E=" + std::to_string(c.E);
        const double err = rel_err(got[0].f(), ref.f(), out.numel());
        record_error(
            std::string("moe_experts_shared ") + dtype_name(dt) + (gated ? " gated" : " ungated"),
            err);
        EXPECT_LE(err, 1e-5) << what;
        EXPECT_LE(rel_err(got[1].f(), ref.f(), out.numel()), 1e-5) << "default, " << what;
        EXPECT_LE(rel_err(got[0].f(), got[1].f(), out.numel()), 1e-5) << what;
      }
    }
  }
}

// Routing inside the expert kernels (one token; 128, 256 or 512 experts, k ≤ 32, with a
// selection bias or without) against moe_route, moe_experts_shared and add to the residual: the
// same ids, and bit for bit the same weights, output and residual (the same formulas and sums);
// ids and weights also against the CPU's reference (ref::moe_route), the output against the
// references' experts. 64 experts route by the routing kernel; a second token takes the
// default's ops. Routing options as routings() lists them (0 Qwen's; 1 raw softmax; 2 scaled
// sigmoid; 3 sigmoid with a bias, scaled: Kimi's; 4 sigmoid with a bias, raw; 5 softmax with a
// bias); the shared expert gated (Qwen) or not (Kimi). With a bias, the reference without it
// picks other experts: a path ignoring the bias fails.
TEST_F(CudaMoe, RoutingInsideExpertsMatchesRouteThenExperts) {
  struct Case {
    int64_t n, E, k;
    int pattern;       // 0 random, 1 top logits on one thread, 2 ties across the threshold, 3 ±0
    int64_t ff = 128;  // 16 gate/up blocks a tile: clusters of 4; 144: of 2; 136: none
    int routing = 0;
    bool gated = true;
  };
  const Case cases[] = {{1, 512, 10, 0},
                        {1, 512, 10, 1},
                        {1, 512, 32, 2},
                        {1, 256, 8, 3},
                        {1, 128, 1, 0},
                        {1, 128, 32, 2},
                        {1, 512, 10, 0, 144},
                        {1, 256, 8, 2, 136},
                        {1, 512, 10, 0, 128, 1},
                        {1, 256, 8, 0, 128, 2},
                        {1, 256, 8, 0, 128, 2, false},
                        {1, 256, 8, 0, 128, 3, false},
                        {1, 512, 10, 1, 128, 3},
                        {1, 128, 8, 0, 128, 3, false},
                        {1, 512, 8, 0, 128, 3, false},
                        {1, 256, 8, 2, 136, 3, false},
                        {1, 512, 32, 2, 144, 4, false},
                        {1, 128, 32, 0, 128, 4},
                        {1, 256, 8, 0, 128, 5},
                        {1, 512, 8, 3, 136, 5, false},
                        {1, 64, 10, 0, 128, 3, false},
                        {1, 64, 10, 0},
                        {2, 512, 10, 0},
                        {2, 256, 8, 0, 128, 3, false}};
  const int64_t d = 256;
  for (DType dt : {DType::BF16, DType::F32}) {
    for (const Case& c : cases) {
      const int64_t ff = c.ff;
      const auto all_routings = routings(ops(), c.E, int(c.k), rng);
      const Routing& rt = *all_routings[size_t(c.routing)];
      Experts ex = make_experts(ops(), c.E, d, ff, dt, rng);
      Experts sh = make_experts(ops(), 1, d, ff, dt, rng);
      HostTensor logits(DType::F32, {c.n, c.E});
      fill_random(logits, rng, 2.0f);
      float* l = logits.f();
      if (c.pattern == 1) {
        for (int64_t i = 0; i < 4; ++i) l[5 + 128 * i] = 9.0f - float(i);
      } else if (c.pattern == 2) {
        for (int64_t e = 0; e < c.E; e += 5) l[e] = 7.5f;
      } else if (c.pattern == 3) {
        for (int64_t e = 0; e < c.E; ++e) l[e] = -0.1f - std::fabs(l[e]);
        l[5] = -0.0f, l[7] = 0.0f;
      }
      HostTensor x(DType::F32, {c.n, d}), score(DType::F32, {c.n, 1}), out = x, res = x;
      HostTensor ids(DType::I32, {c.n, c.k}), w(DType::F32, {c.n, c.k});
      HostTensor g(DType::F32, {c.n, ff}), y = x;
      fill_random(x, rng);
      fill_random(score, rng);
      fill_random(res, rng);
      DeviceTensor dl = dev(logits), dx = dev(x), dscore = dev(score);
      HostTensor scratch_h(
          DType::U8,
          {int64_t(ops().moe_experts_scratch_bytes(int(c.n), int(c.k) + 1, int(c.E) + 1, int(d),
                                                   int(ff), ex.d.front().gate.dtype))});
      HostTensor got_ids[2] = {ids, ids}, got_w[2] = {w, w}, got[2] = {out, out};
      HostTensor got_res[2] = {res, res};
      for (int path = 0; path < 2; ++path) {  // the fused op, then route and experts
        DeviceTensor dg = poisoned(g), du = poisoned(g), dh = poisoned(g), dy = poisoned(y);
        DeviceTensor dout = poisoned(out), scratch = poisoned(scratch_h);
        // The fused path starts from valid ids of another routing (what the previous layer
        // leaves): down must not keep them, however early it read them.
        HostTensor stale = ids;
        for (int64_t j = 0; j < c.n * c.k; ++j)
          stale.t.ptr<int32_t>()[j] = int32_t((j * 7 + 3) % c.E);
        DeviceTensor dids = path == 0 ? dev(stale) : poisoned(ids), dw = poisoned(w),
                     dres = dev(res);
        SharedExpertArgs shared;
        shared.w = sh.d[0];
        shared.score = c.gated ? dscore.t : Tensor{}, shared.gate = dg.t, shared.up = du.t;
        shared.hidden = dh.t, shared.out = dy.t;
        if (path == 0) {
          ops().moe_route_experts_shared(dl.t, rt.device, dx.t, ex.d, dids.t, dw.t, shared, dout.t,
                                         scratch.t, dres.t);
        } else {
          ops().moe_route(dl.t, rt.device, dids.t, dw.t);
          ops().moe_experts_shared(dx.t, ex.d, dids.t, dw.t, shared, dout.t, scratch.t);
          ops().add(dres.t, dout.t);
        }
        got_ids[path] = host(dids, ids), got_w[path] = host(dw, w), got[path] = host(dout, out);
        got_res[path] = host(dres, res);
      }
      const std::string what =
          std::string(dtype_name(dt)) + " n=" + std::to_string(c.n) + " E=" + std::to_string(c.E) +
          " k=" + std::to_string(c.k) + " pattern " + std::to_string(c.pattern) +
          " ff=" + std::to_string(ff) + " " + rt.name + (c.gated ? "" : " ungated");
      HostTensor ids_ref = ids, w_ref = w, ref = out, ids_cpu = ids, w_cpu = w;
      host_ref::moe_route(logits.t, rt.host, ids_ref.t, w_ref.t);
      EXPECT_EQ(std::memcmp(got_ids[0].t.data, ids_ref.t.data, size_t(c.n * c.k) * 4), 0) << what;
      // With a bias both references choose by the f32 score plus the bias (without one the CPU's
      // chooses by f32 score, which distinct logits may tie).
      if (!rt.host.selection_bias.empty()) {
        MoeRouting unbiased = rt.host;
        unbiased.selection_bias = Tensor{};
        HostTensor ids_unbiased = ids, w_unbiased = w;
        host_ref::moe_route(logits.t, unbiased, ids_unbiased.t, w_unbiased.t);
        ASSERT_NE(std::memcmp(ids_unbiased.t.data, ids_ref.t.data, size_t(c.n * c.k) * 4), 0)
            << what << ": the bias changes no pick";
        ref::moe_route(logits.t, rt.host, ids_cpu.t, w_cpu.t);
        EXPECT_EQ(std::memcmp(got_ids[0].t.data, ids_cpu.t.data, size_t(c.n * c.k) * 4), 0) << what;
        EXPECT_LE(max_abs_diff(got_w[0].f(), w_cpu.f(), c.n * c.k), 1e-6) << what;
      }
      EXPECT_EQ(std::memcmp(got_ids[0].t.data, got_ids[1].t.data, size_t(c.n * c.k) * 4), 0)
          << what;
      EXPECT_EQ(std::memcmp(got_w[0].t.data, got_w[1].t.data, size_t(c.n * c.k) * 4), 0) << what;
      EXPECT_EQ(std::memcmp(got[0].t.data, got[1].t.data, size_t(c.n * d) * 4), 0) << what;
      EXPECT_EQ(std::memcmp(got_res[0].t.data, got_res[1].t.data, size_t(c.n * d) * 4), 0) << what;
      for (int64_t e = 0; e < c.n * d; ++e) {  // the residual took the output
        ASSERT_EQ(got_res[0].f()[e], res.f()[e] + got[0].f()[e]) << what << " at " << e;
      }
      reference_moe_shared(x.t, ex.h, ids_ref.t, w_ref.t, sh.h[0], c.gated ? score.t : Tensor{},
                           ref.t);
      EXPECT_LE(rel_err(got[0].f(), ref.f(), out.numel()), 1e-5) << what;
    }
  }
}

}  // namespace
}  // namespace recur
