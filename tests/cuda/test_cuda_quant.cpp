// Quantized weights on the CUDA backend. Block-FP8 (F8_E4M3 with f32 block scales, any block
// sizes, edge blocks partial): matmul on every path (the fp8 GEMV for few tokens, its token
// groups, the tensor-core tiles for prompts), matmul_group, the MoE experts (GEMV core, tiles of
// a few rows, tensor cores, with a shared expert riding along), against the definition (the fp8
// bytes × their block scale, in double or through the scalar references on the dequantized
// weights): f32-class, ≤ 2e-5 relative. --quantize fp8 on the device gives the CPU's bytes and
// scales. Int8 / q4 weights are refused with an error that says so.
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "backend/cpu/reference.h"
#include "cuda/cuda_test_util.h"

namespace recur {
namespace {

using namespace testing;

class CudaQuant : public CudaTest {};

// Random fp8 bytes (every finite code) with block scales, and the weight they stand for.
struct Fp8Weight {
  int64_t m = 0, k = 0;
  int br = 0, bc = 0;
  HostTensor bytes{DType::F8_E4M3, {1}};  // [m, k]
  HostTensor scales{DType::F32, {1}};     // [ceil(m / br), ceil(k / bc)]
  HostTensor dequant{DType::F32, {1}};    // [m, k]: bytes × block scale
  Tensor d;                               // adopted by the CUDA backend
};

Fp8Weight random_fp8(CudaOps& ops, std::mt19937& rng, int64_t m, int64_t k, int br, int bc,
                     std::vector<Buffer>* owned) {
  Fp8Weight w;
  w.m = m, w.k = k, w.br = br, w.bc = bc;
  const int64_t mb = (m + br - 1) / br, kb = (k + bc - 1) / bc;
  w.bytes = HostTensor(DType::F8_E4M3, {m, k});
  w.scales = HostTensor(DType::F32, {mb, kb});
  w.dequant = HostTensor(DType::F32, {m, k});
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> scale(1e-4f, 3e-3f);
  auto* b = w.bytes.t.ptr<uint8_t>();
  for (int64_t i = 0; i < m * k; ++i) {
    do b[i] = uint8_t(byte(rng));
    while ((b[i] & 0x7f) == 0x7f);  // not the NaN codes
  }
  for (int64_t i = 0; i < mb * kb; ++i) w.scales.f()[i] = scale(rng);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t c = 0; c < k; ++c) {
      w.dequant.f()[r * k + c] =
          f8_e4m3_to_f32(b[r * k + c]) * w.scales.f()[(r / br) * kb + c / bc];
    }
  }
  auto adopted = ops.adopt_block_fp8_weight(w.bytes.t, w.scales.t, br, bc, owned);
  EXPECT_TRUE(adopted.ok()) << adopted.error().message;
  if (adopted.ok()) w.d = adopted.value();
  return w;
}

// out [n, m] = x · w^T in double (reference ref::matmul's sums, in f64).
HostTensor reference_matmul(const HostTensor& x, const Fp8Weight& w) {
  const int64_t n = x.t.shape[0];
  HostTensor out(DType::F32, {n, w.m});
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t r = 0; r < w.m; ++r) {
      double acc = 0;
      for (int64_t c = 0; c < w.k; ++c)
        acc += double(x.f()[t * w.k + c]) * double(w.dequant.f()[r * w.k + c]);
      out.f()[t * w.m + r] = float(acc);
    }
  }
  return out;
}

// Every path on awkward shapes: k not a multiple of 16 (the element-by-element GEMV), block
// sizes that the tensor-core tiles refuse (br 32: the GEMV over token groups for prompts; br
// 15: a GEMV block's rows straddle two scale rows), m and k not multiples of 128 (partial edge
// blocks), token counts 1 to 200, and out += .
TEST_F(CudaQuant, BlockFp8MatmulMatchesDefinitionOnEveryPath) {
  struct Case {
    int64_t m, k;
    int br, bc;
  };
  const Case cases[] = {{200, 300, 128, 128},   {130, 272, 128, 128}, {96, 160, 32, 16},
                        {257, 512, 64, 32},     {640, 560, 128, 128}, {700, 900, 64, 32},
                        {1000, 1200, 128, 128}, {200, 272, 15, 16}};
  std::vector<Buffer> owned;
  bool saw_gemv = false, saw_tiles = false;
  for (const Case& c : cases) {
    Fp8Weight w = random_fp8(ops(), rng, c.m, c.k, c.br, c.bc, &owned);
    ASSERT_FALSE(w.d.empty());
    for (int64_t n : {1, 3, 8, 33, 200}) {
      HostTensor x(DType::F32, {n, c.k}), out(DType::F32, {n, c.m});
      fill_random(x, rng);
      HostTensor ref = reference_matmul(x, w);
      DeviceTensor dx = dev(x), dout = poisoned(out);
      ops().matmul(dx.t, w.d, dout.t);
      HostTensor got = host(dout, out);
      ASSERT_EQ(count_nonfinite(got.f(), out.numel()), 0) << c.m << "x" << c.k << " n=" << n;
      const bool gemv = CudaOps::matmul_takes_gemv(n, w.d);
      saw_gemv |= gemv, saw_tiles |= !gemv && c.br % 64 == 0;
      const double err = rel_err(got.f(), ref.f(), out.numel());
      record_error(std::string("fp8 matmul ") + (gemv ? "gemv" : "prompt"), err);
      EXPECT_LE(err, 2e-5) << c.m << "x" << c.k << " blocks " << c.br << "x" << c.bc << " n=" << n;
      // out += x · w^T onto the result: twice the product.
      ops().matmul(dx.t, w.d, dout.t, /*accumulate=*/true);
      got = host(dout, out);
      for (int64_t i = 0; i < out.numel(); ++i) ref.f()[i] *= 2.0f;
      EXPECT_LE(rel_err(got.f(), ref.f(), out.numel()), 2e-5) << "accumulate n=" << n;
    }
  }
  EXPECT_TRUE(saw_gemv && saw_tiles);
}

// matmul_group over fp8 weights gives each weight's matmul bit for bit; and with bf16 weights
// among them (a block-FP8 layer's gates, which ride in the fp8 launch).
TEST_F(CudaQuant, BlockFp8MatmulGroupEqualsMatmuls) {
  std::vector<Buffer> owned;
  const int64_t k = 272;
  std::vector<Fp8Weight> ws;
  for (int64_t m : {96, 200, 64}) ws.push_back(random_fp8(ops(), rng, m, k, 128, 128, &owned));
  std::vector<Tensor> gates;
  for (int64_t m : {32, 6}) {
    HostTensor g(DType::BF16, {m, k});
    fill_random(g, rng);
    gates.push_back(weight(g));
  }
  for (bool with_gates : {false, true}) {
    for (int64_t n : {1, 3, 8, 12}) {
      HostTensor x(DType::F32, {n, k});
      fill_random(x, rng);
      DeviceTensor dx = dev(x);
      std::vector<HostTensor> outs;
      std::vector<DeviceTensor> grouped, single;
      std::vector<Tensor> wt, ot;
      std::vector<int> fp8_of;  // the index in ws of an fp8 weight, or -1
      auto add = [&](const Tensor& w, int fp8) {
        fp8_of.push_back(fp8);
        outs.emplace_back(DType::F32, std::initializer_list<int64_t>{n, w.shape[0]});
        grouped.push_back(poisoned(outs.back()));
        single.push_back(poisoned(outs.back()));
        wt.push_back(w);
        ot.push_back(grouped.back().t);
      };
      add(ws[0].d, 0);
      if (with_gates) add(gates[0], -1);
      add(ws[1].d, 1);
      if (with_gates) {
        add(gates[1], -1);
      } else {
        add(ws[2].d, 2);
      }
      ops().matmul_group(dx.t, wt, ot);
      for (size_t i = 0; i < wt.size(); ++i) {
        ops().matmul(dx.t, wt[i], single[i].t);
        const HostTensor a = host(grouped[i], outs[i]), b = host(single[i], outs[i]);
        EXPECT_TRUE(same_bits(a, b)) << "weight " << i << " n=" << n << " gates " << with_gates;
        if (fp8_of[i] < 0) continue;
        const HostTensor ref = reference_matmul(x, ws[size_t(fp8_of[i])]);
        EXPECT_LE(rel_err(a.f(), ref.f(), a.numel()), 2e-5) << "weight " << i << " n=" << n;
      }
    }
  }
}

// One token's fp8 group with bf16 gates is one launch.
TEST_F(CudaQuant, BlockFp8MatmulGroupTakesBf16GatesInOneLaunch) {
  const int64_t k = 256;
  bool ok = false;
  const std::string table = profile_table(
      [&](CudaOps& ops) {
        std::vector<Buffer> owned;
        const Fp8Weight w = random_fp8(ops, rng, 128, k, 128, 128, &owned);
        HostTensor g(DType::BF16, {16, k}), x(DType::F32, {1, k});
        fill_random(g, rng);
        fill_random(x, rng);
        const Tensor gate = ops.adopt_weight(g.t).value();
        HostTensor o1(DType::F32, {1, 128}), o2(DType::F32, {1, 16});
        DeviceTensor dx(ops, x), d1(ops, o1), d2(ops, o2);
        const Tensor wt[] = {w.d, gate}, ot[] = {d1.t, d2.t};
        Layout one_token(std::vector<int>{1}, std::vector<int>{0}, 16, rng);
        ops.begin_forward(one_token.l, {}, {});  // the profile labels the launches from here
        ops.matmul_group(dx.t, wt, ot);
        ops.synchronize();
      },
      &ok);
  if (!ok) GTEST_SKIP() << "no usable CUDA device";
  EXPECT_EQ(profile_count(table, "decode b=1 matmul group fp8 gemv 128 16 x256"), 1) << table;
  EXPECT_EQ(table.find("matmul gemv"), std::string::npos) << table;
  EXPECT_EQ(table.find("matmul group gemv"), std::string::npos) << table;
}

// The experts with fp8 weights on every path, routed by the GPU's router, against the scalar
// reference on the dequantized weights; and with a gated shared expert (riding along for one
// token, the default's ops for more).
TEST_F(CudaQuant, BlockFp8MoeExpertsMatchReference) {
  struct Case {
    int64_t n, E, k, d, ff;
    int br, bc;
  };
  const Case cases[] = {{1, 8, 2, 272, 192, 128, 128},
                        {3, 8, 2, 272, 192, 128, 128},
                        {8, 8, 2, 272, 192, 128, 128},
                        {12, 8, 2, 272, 192, 128, 128},
                        {33, 8, 2, 272, 192, 128, 128},
                        {200, 8, 2, 272, 192, 128, 128},
                        {1, 6, 3, 100, 72, 32, 16},
                        {33, 6, 3, 100, 72, 32, 16},
                        {200, 6, 3, 96, 80, 64, 16},
                        {1, 6, 3, 96, 80, 15, 16},  // rows of a block in two scale rows
                        {70, 16, 4, 256, 128, 128, 128},
                        // tensor cores with full 64-row tiles: pipelined, and (d_ff not a
                        // multiple of 16) the fallback tiles
                        {300, 8, 4, 272, 192, 128, 128},
                        {300, 8, 4, 272, 200, 128, 128}};
  for (const Case& c : cases) {
    std::vector<Buffer> owned;
    std::vector<Fp8Weight> ws;
    std::vector<ExpertWeights> hx, dx_experts;
    for (int64_t e = 0; e <= c.E; ++e) {  // the last one is the shared expert
      ws.push_back(random_fp8(ops(), rng, c.ff, c.d, c.br, c.bc, &owned));
      ws.push_back(random_fp8(ops(), rng, c.ff, c.d, c.br, c.bc, &owned));
      ws.push_back(random_fp8(ops(), rng, c.d, c.ff, c.br, c.bc, &owned));
    }
    for (int64_t e = 0; e <= c.E; ++e) {
      const size_t b = size_t(3 * e);
      hx.push_back({ws[b].dequant.t, ws[b + 1].dequant.t, ws[b + 2].dequant.t});
      dx_experts.push_back({ws[b].d, ws[b + 1].d, ws[b + 2].d});
    }
    const std::span<const ExpertWeights> routed_h(hx.data(), size_t(c.E)),
        routed_d(dx_experts.data(), size_t(c.E));
    HostTensor logits(DType::F32, {c.n, c.E});
    fill_random(logits, rng, 2.0f);
    HostTensor ids(DType::I32, {c.n, c.k}), w(DType::F32, {c.n, c.k});
    DeviceTensor dl = dev(logits), dids = poisoned(ids), dw = poisoned(w);
    MoeRouting routing;
    routing.k = int(c.k);
    ops().moe_route(dl.t, routing, dids.t, dw.t);
    const HostTensor hids = host(dids, ids), hw = host(dw, w);
    HostTensor x(DType::F32, {c.n, c.d}), out(DType::F32, {c.n, c.d}), ref = out;
    fill_random(x, rng, 0.5f);
    DeviceTensor dx = dev(x), dout = poisoned(out);
    HostTensor scratch_h(
        DType::U8,
        {int64_t(ops().moe_experts_scratch_bytes(int(c.n), int(c.k + 1), int(c.E), int(c.d),
                                                 int(c.ff), routed_d.front().gate.dtype))});
    DeviceTensor scratch = poisoned(scratch_h);
    ops().moe_experts(dx.t, routed_d, dids.t, dw.t, dout.t, scratch.t);
    ref::moe_experts(x.t, routed_h, hids.t, hw.t, ref.t);
    HostTensor got = host(dout, out);
    ASSERT_EQ(count_nonfinite(got.f(), out.numel()), 0) << "n=" << c.n;
    double err = rel_err(got.f(), ref.f(), out.numel());
    record_error("fp8 moe_experts", err);
    EXPECT_LE(err, 2e-5) << "n=" << c.n << " E=" << c.E << " d=" << c.d << " ff=" << c.ff
                         << " blocks " << c.br << "x" << c.bc;

    // With the shared expert, gated by σ(score): reference = routed + σ(s) · shared(x).
    HostTensor score(DType::F32, {c.n, 1}), gate(DType::F32, {c.n, c.ff}), hid = gate, up = gate;
    HostTensor sh_out(DType::F32, {c.n, c.d});
    fill_random(score, rng);
    DeviceTensor dscore = dev(score), dgate = poisoned(gate), dup = poisoned(up),
                 dhid = poisoned(hid), dsh = poisoned(sh_out);
    SharedExpertArgs shared;
    shared.w = dx_experts.back();
    shared.score = dscore.t, shared.gate = dgate.t, shared.up = dup.t, shared.hidden = dhid.t;
    shared.out = dsh.t;
    dout.poison();
    ops().moe_experts_shared(dx.t, routed_d, dids.t, dw.t, shared, dout.t, scratch.t);
    got = host(dout, out);
    reference_moe_shared(x.t, routed_h, hids.t, hw.t, hx.back(), score.t, ref.t);
    err = rel_err(got.f(), ref.f(), out.numel());
    record_error("fp8 moe_experts_shared", err);
    EXPECT_LE(err, 2e-5) << "shared n=" << c.n << " E=" << c.E;
  }
}

// One token routed inside the fp8 expert kernels (moe_route_experts_shared: 256 or 512 experts)
// gives moe_route then moe_experts_shared bit for bit, and the reference on the dequantized
// weights (routed experts plus σ(score) times the shared one).
TEST_F(CudaQuant, BlockFp8RoutingInsideExpertsMatchesRouteThenExperts) {
  const int64_t d = 256, ff = 128;
  for (const auto& [E, k] : {std::pair<int64_t, int64_t>{512, 10}, {256, 8}}) {
    std::vector<Buffer> owned;
    std::vector<Fp8Weight> ws;
    std::vector<ExpertWeights> hx, dx_experts;
    for (int64_t e = 0; e <= E; ++e) {  // the last one is the shared expert
      ws.push_back(random_fp8(ops(), rng, ff, d, 128, 128, &owned));
      ws.push_back(random_fp8(ops(), rng, ff, d, 128, 128, &owned));
      ws.push_back(random_fp8(ops(), rng, d, ff, 128, 128, &owned));
    }
    for (int64_t e = 0; e <= E; ++e) {  // views once ws stops moving
      const size_t b = size_t(3 * e);
      hx.push_back({ws[b].dequant.t, ws[b + 1].dequant.t, ws[b + 2].dequant.t});
      dx_experts.push_back({ws[b].d, ws[b + 1].d, ws[b + 2].d});
    }
    const std::span<const ExpertWeights> routed_d(dx_experts.data(), size_t(E));
    HostTensor logits(DType::F32, {1, E}), x(DType::F32, {1, d}), score(DType::F32, {1, 1});
    fill_random(logits, rng, 2.0f);
    fill_random(x, rng, 0.5f);
    fill_random(score, rng);
    HostTensor ids(DType::I32, {1, k}), w(DType::F32, {1, k}), out(DType::F32, {1, d});
    HostTensor g(DType::F32, {1, ff}), y = out;
    DeviceTensor dl = dev(logits), dx = dev(x), dscore = dev(score);
    HostTensor scratch_h(
        DType::U8, {int64_t(ops().moe_experts_scratch_bytes(
                       1, int(k) + 1, int(E) + 1, int(d), int(ff), routed_d.front().gate.dtype))});
    MoeRouting routing;
    routing.k = int(k);
    HostTensor got[2] = {out, out}, got_ids[2] = {ids, ids};
    for (int path = 0; path < 2; ++path) {  // the fused op, then route and experts
      DeviceTensor dg = poisoned(g), du = poisoned(g), dh = poisoned(g), dy = poisoned(y);
      DeviceTensor dout = poisoned(out), scratch = poisoned(scratch_h), dids = poisoned(ids),
                   dw = poisoned(w);
      SharedExpertArgs shared;
      shared.w = dx_experts.back();
      shared.score = dscore.t, shared.gate = dg.t, shared.up = du.t, shared.hidden = dh.t;
      shared.out = dy.t;
      if (path == 0) {
        ops().moe_route_experts_shared(dl.t, routing, dx.t, routed_d, dids.t, dw.t, shared, dout.t,
                                       scratch.t, Tensor{});
      } else {
        ops().moe_route(dl.t, routing, dids.t, dw.t);
        ops().moe_experts_shared(dx.t, routed_d, dids.t, dw.t, shared, dout.t, scratch.t);
      }
      got[path] = host(dout, out), got_ids[path] = host(dids, ids);
      if (path == 1) w = host(dw, w);
    }
    const std::string what = "E=" + std::to_string(E) + " k=" + std::to_string(k);
    EXPECT_EQ(std::memcmp(got_ids[0].t.data, got_ids[1].t.data, size_t(k) * 4), 0) << what;
    EXPECT_EQ(std::memcmp(got[0].t.data, got[1].t.data, size_t(d) * 4), 0) << what;
    HostTensor ref = out;
    reference_moe_shared(x.t, std::span<const ExpertWeights>(hx.data(), size_t(E)), got_ids[1].t,
                         w.t, hx.back(), score.t, ref.t);
    ASSERT_EQ(count_nonfinite(got[0].f(), d), 0) << what;
    const double err = rel_err(got[0].f(), ref.f(), d);
    record_error("fp8 moe_route_experts_shared", err);
    EXPECT_LE(err, 2e-5) << what;
  }
}

// Fp8Activations::kE4m3: x quantized to e4m3 per row and 128 channels (scale = the
// group's largest |value| / 448, rounded to nearest even, saturating), as the kernel does.
struct E4m3Rows {
  std::vector<float> q;      // [n, k]: the e4m3 values
  std::vector<float> scale;  // [n, ⌈k/128⌉]
};
E4m3Rows quantize_rows(const HostTensor& x) {
  const int64_t n = x.t.shape[0], k = x.t.shape[1], kbs = (k + 127) / 128;
  E4m3Rows r{std::vector<float>(size_t(n * k)), std::vector<float>(size_t(n * kbs))};
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t g = 0; g < kbs; ++g) {
      const int64_t c0 = g * 128, c1 = std::min(k, c0 + 128);
      float mx = 0;
      for (int64_t c = c0; c < c1; ++c) mx = std::max(mx, std::fabs(x.f()[t * k + c]));
      const float inv = mx > 0 ? 448.0f / mx : 0.0f;
      for (int64_t c = c0; c < c1; ++c) {
        r.q[size_t(t * k + c)] = f8_e4m3_to_f32(f32_to_f8_e4m3(x.f()[t * k + c] * inv));
      }
      r.scale[size_t(t * kbs + g)] = mx / 448.0f;
    }
  }
  return r;
}

// x's rows as the e4m3 path sees them: each value its e4m3 code times its group's scale.
HostTensor dequantized_rows(const HostTensor& x) {
  const int64_t n = x.t.shape[0], k = x.t.shape[1], kbs = (k + 127) / 128;
  const E4m3Rows q = quantize_rows(x);
  HostTensor out(DType::F32, {n, k});
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t c = 0; c < k; ++c) {
      out.f()[t * k + c] = q.q[size_t(t * k + c)] * q.scale[size_t(t * kbs + c / 128)];
    }
  }
  return out;
}

// The e4m3 path's dense matmul is its definition to the tensor cores' summing: Σ over k blocks
// of the weight block's scale × the token's group scale × Σ e4m3 · e4m3 (each block's sum on the
// FP8 products, whose accumulation keeps fewer bits than f32); out += too. Against the f32
// product its error is the quantization's, far larger: the path did quantize. The backend is made
// with the default options: e4m3 is the default.
TEST(CudaQuantPaths, E4m3ActivationMatmulIsItsDefinition) {
  if (!device_is_sm90a()) GTEST_SKIP() << "no device running sm_90a code (wgmma)";
  std::mt19937 rng(81);
  bool ok = false;
  const std::string table = profile_table(
      [&](CudaOps& ops) {
        std::vector<Buffer> owned;
        for (const auto& [m, k] :
             {std::pair<int64_t, int64_t>{200, 272}, {640, 560}, {1000, 1200}}) {
          Fp8Weight w = random_fp8(ops, rng, m, k, 128, 128, &owned);
          for (int64_t n : {77, 200}) {
            HostTensor x(DType::F32, {n, k}), out(DType::F32, {n, m});
            fill_random(x, rng);
            const E4m3Rows xq = quantize_rows(x);
            const int64_t kbs = (k + 127) / 128;
            HostTensor def(DType::F32, {n, m});
            for (int64_t t = 0; t < n; ++t) {
              for (int64_t r = 0; r < m; ++r) {
                double acc = 0;
                for (int64_t g = 0; g < kbs; ++g) {
                  double block = 0;
                  for (int64_t c = g * 128; c < std::min(k, g * 128 + 128); ++c) {
                    block += double(xq.q[size_t(t * k + c)]) *
                             double(f8_e4m3_to_f32(w.bytes.t.ptr<uint8_t>()[r * k + c]));
                  }
                  acc += block * double(w.scales.f()[(r / 128) * kbs + g]) *
                         double(xq.scale[size_t(t * kbs + g)]);
                }
                def.f()[t * m + r] = float(acc);
              }
            }
            DeviceTensor dx(ops, x), dout(ops, out);
            dout.poison();
            Layout lay(std::vector<int>{int(n)}, std::vector<int>{0}, 16, rng);
            ops.begin_forward(lay.l, {}, {});  // the profile labels the launches from here
            ops.matmul(dx.t, w.d, dout.t);
            HostTensor got = dout.download(ops, out);
            ASSERT_EQ(count_nonfinite(got.f(), out.numel()), 0) << m << "x" << k << " n=" << n;
            const double err = rel_err(got.f(), def.f(), out.numel());
            record_error("fp8 matmul e4m3 activations", err);
            EXPECT_LE(err, 1e-3) << m << "x" << k << " n=" << n;
            const HostTensor f32 = reference_matmul(x, w);
            EXPECT_GT(rel_err(got.f(), f32.f(), out.numel()), 10 * err) << "quantized?";
            ops.matmul(dx.t, w.d, dout.t, /*accumulate=*/true);
            got = dout.download(ops, out);
            for (int64_t i = 0; i < out.numel(); ++i) def.f()[i] *= 2.0f;
            EXPECT_LE(rel_err(got.f(), def.f(), out.numel()), 1e-3) << "accumulate n=" << n;
          }
        }
      },
      &ok, BackendOptions{}.fp8_activations);  // the default
  ASSERT_TRUE(ok);
  EXPECT_NE(table.find("matmul fp8 e4m3 wgmma"), std::string::npos) << table;
}

// The e4m3 path's experts against the same experts on x and SwiGLU rows quantized as the
// kernels quantize them, and against the f32 reference. The SwiGLU values the device sums on FP8
// tensor cores (fewer bits than f32) round to the other side of an e4m3 step from the host's
// for ~0.2% of them, each moving its token's outputs by ~4e-3 of their size: the RMS error
// against the definition stays near that, the f32 reference's is the quantization's (~3%), and
// a misplaced operand or scale gives errors of the outputs' own size. The profile shows its
// tiles ran.
TEST(CudaQuantPaths, E4m3ActivationExpertsAreTheirDefinition) {
  if (!device_is_sm90a()) GTEST_SKIP() << "no device running sm_90a code (wgmma)";
  std::mt19937 rng(82);
  bool ok = false;
  const std::string table = profile_table(
      [&](CudaOps& ops) {
        const int64_t n = 300, E = 8, k = 4, d = 272, ff = 192;
        std::vector<Buffer> owned;
        std::vector<Fp8Weight> ws;
        std::vector<ExpertWeights> hx, dx_experts;
        for (int64_t e = 0; e < E; ++e) {
          ws.push_back(random_fp8(ops, rng, ff, d, 128, 128, &owned));
          ws.push_back(random_fp8(ops, rng, ff, d, 128, 128, &owned));
          ws.push_back(random_fp8(ops, rng, d, ff, 128, 128, &owned));
        }
        for (int64_t e = 0; e < E; ++e) {
          const size_t b = size_t(3 * e);
          hx.push_back({ws[b].dequant.t, ws[b + 1].dequant.t, ws[b + 2].dequant.t});
          dx_experts.push_back({ws[b].d, ws[b + 1].d, ws[b + 2].d});
        }
        HostTensor logits(DType::F32, {n, E}), x(DType::F32, {n, d}), out(DType::F32, {n, d});
        fill_random(logits, rng, 2.0f);
        fill_random(x, rng, 0.5f);
        HostTensor ids(DType::I32, {n, k}), w(DType::F32, {n, k}), ref = out;
        DeviceTensor dl(ops, logits), dx(ops, x), dids(ops, ids), dw(ops, w), dout(ops, out);
        MoeRouting routing;
        routing.k = int(k);
        Layout lay(std::vector<int>{int(n)}, std::vector<int>{0}, 16, rng);
        ops.begin_forward(lay.l, {}, {});  // the profile labels the launches from here
        ops.moe_route(dl.t, routing, dids.t, dw.t);
        HostTensor scratch_h(
            DType::U8,
            {int64_t(ops.moe_experts_scratch_bytes(int(n), int(k), int(E), int(d), int(ff),
                                                   dx_experts.front().gate.dtype))});
        DeviceTensor scratch(ops, scratch_h);
        dout.poison(), scratch.poison();
        ops.moe_experts(dx.t, dx_experts, dids.t, dw.t, dout.t, scratch.t);
        const HostTensor got = dout.download(ops, out), hids = dids.download(ops, ids),
                         hw = dw.download(ops, w);
        ASSERT_EQ(count_nonfinite(got.f(), out.numel()), 0);
        // The experts on x's rows and each SwiGLU row quantized as the e4m3 path quantizes them.
        const HostTensor def = experts_with_rounded_rows(x, hx, hids, hw, dequantized_rows);
        const double err = rms_rel_err(got.f(), def.f(), out.numel());
        record_error("fp8 moe_experts e4m3 activations (rms)", err);
        EXPECT_LE(err, 1.5e-2);
        EXPECT_LE(rel_err(got.f(), def.f(), out.numel()), 0.1);
        ref::moe_experts(x.t, hx, hids.t, hw.t, ref.t);
        const double quantization = rms_rel_err(got.f(), ref.f(), out.numel());
        record_error("fp8 moe_experts e4m3 vs f32 (rms)", quantization);
        EXPECT_GT(quantization, 3 * err) << "quantized?";
      },
      &ok, Fp8Activations::kE4m3);
  ASSERT_TRUE(ok);
  EXPECT_NE(table.find("moe_experts (gate/up, e4m3 wgmma)"), std::string::npos) << table;
  EXPECT_NE(table.find("moe_experts (down, e4m3 wgmma)"), std::string::npos) << table;
}

// Under e4m3 activations only prompt rows are quantized: in a forward of decode tokens (one-token
// sequences, first) and a prompt, the decode rows come out bit for bit as in a forward of their
// own (GEMV for 3 of them, the f16-term tiles for 70), the prompt rows as e4m3 products; dense
// matmuls and the experts alike.
TEST(CudaQuantPaths, DecodeRowsBesideAPromptKeepTheirProducts) {
  if (!device_is_sm90a()) GTEST_SKIP() << "no device running sm_90a code (wgmma)";
  std::mt19937 rng(83);
  bool ok = false;
  profile_table(
      [&](CudaOps& ops) {
        std::vector<Buffer> owned;
        const int64_t d = 272, ff = 192, E = 8, k = 4, prompt = 150;
        const Fp8Weight w = random_fp8(ops, rng, 640, d, 128, 128, &owned);
        std::vector<ExpertWeights> experts;
        std::vector<Fp8Weight> ws;
        for (int64_t e = 0; e < 3 * E; ++e) {
          ws.push_back(
              random_fp8(ops, rng, e % 3 == 2 ? d : ff, e % 3 == 2 ? ff : d, 128, 128, &owned));
        }
        for (int64_t e = 0; e < E; ++e) {
          experts.push_back(
              {ws[size_t(3 * e)].d, ws[size_t(3 * e + 1)].d, ws[size_t(3 * e + 2)].d});
        }
        for (const int decode : {3, 70}) {
          const auto [x, whole_mm] =
              decode_rows_beside_a_prompt(ops, w.d, experts, ff, k, decode, prompt, rng);
          // The prompt rows did take e4m3 activations: far from the f32 product.
          HostTensor px(DType::F32, {prompt, d}), pm(DType::F32, {prompt, 640});
          std::copy_n(x.f() + decode * d, prompt * d, px.f());
          std::copy_n(whole_mm.f() + decode * 640, prompt * 640, pm.f());
          const HostTensor f32 = reference_matmul(px, w);
          EXPECT_GT(rel_err(pm.f(), f32.f(), pm.numel()), 1e-3) << "prompt rows quantized?";
        }
      },
      &ok, Fp8Activations::kE4m3);
  ASSERT_TRUE(ok);
}

// --quantize fp8 on the device (from host or device memory) makes the CPU's blocks: the
// weights it gives multiply like the CPU-quantized bytes and scales adopted as a checkpoint's,
// bit for bit. The CPU's quantization, restated: 128×128 blocks, scale amax / 448 (1 for an
// all-zero block), e4m3 of v / scale rounded to nearest even.
TEST_F(CudaQuant, QuantizeFp8OnTheDeviceMatchesTheCpusBlocks) {
  const int64_t m = 300, k = 200, mb = 3, kb = 2;
  for (DType dt : {DType::BF16, DType::F32}) {
    HostTensor w(dt, {m, k});
    fill_random(w, rng, 0.05f);
    // One all-zero block (rows 128..255, columns 128..199).
    for (int64_t r = 128; r < 256; ++r) {
      for (int64_t c = 128; c < k; ++c) {
        if (dt == DType::F32) {
          w.f()[r * k + c] = 0.0f;
        } else {
          w.t.ptr<uint16_t>()[r * k + c] = 0;
        }
      }
    }
    auto at = [&](int64_t i) {
      return dt == DType::F32 ? w.f()[i] : bf16_to_f32(w.t.ptr<uint16_t>()[i]);
    };
    HostTensor q(DType::F8_E4M3, {m, k}), s(DType::F32, {mb, kb});
    for (int64_t bi = 0; bi < mb; ++bi) {
      for (int64_t bj = 0; bj < kb; ++bj) {
        const int64_t r1 = std::min(m, (bi + 1) * 128), c1 = std::min(k, (bj + 1) * 128);
        float amax = 0.0f;
        for (int64_t r = bi * 128; r < r1; ++r) {
          for (int64_t c = bj * 128; c < c1; ++c) amax = std::max(amax, std::fabs(at(r * k + c)));
        }
        const float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
        s.f()[bi * kb + bj] = scale;
        for (int64_t r = bi * 128; r < r1; ++r) {
          for (int64_t c = bj * 128; c < c1; ++c)
            q.t.ptr<uint8_t>()[r * k + c] = f32_to_f8_e4m3(at(r * k + c) / scale);
        }
      }
    }
    std::vector<Buffer> owned;
    const Tensor from_cpu = ops().adopt_block_fp8_weight(q.t, s.t, 128, 128, &owned).value();
    auto from_host = ops().quantize_matmul_weight(w.t, DType::F8_E4M3, &owned);
    ASSERT_TRUE(from_host.ok()) << from_host.error().message;
    DeviceTensor dw = dev(w);
    auto from_device = ops().quantize_matmul_weight(dw.t, DType::F8_E4M3, &owned);
    ASSERT_TRUE(from_device.ok()) << from_device.error().message;
    for (int64_t n : {1, 5, 100}) {
      HostTensor x(DType::F32, {n, k}), out(DType::F32, {n, m});
      fill_random(x, rng);
      DeviceTensor dx = dev(x), a = poisoned(out), b = poisoned(out), c = poisoned(out);
      ops().matmul(dx.t, from_cpu, a.t);
      ops().matmul(dx.t, from_host.value(), b.t);
      ops().matmul(dx.t, from_device.value(), c.t);
      const HostTensor ha = host(a, out), hb = host(b, out), hc = host(c, out);
      EXPECT_TRUE(same_bits(ha, hb)) << dtype_name(dt) << " n=" << n;
      EXPECT_TRUE(same_bits(ha, hc)) << dtype_name(dt) << " n=" << n;
      EXPECT_EQ(count_nonfinite(ha.f(), out.numel()), 0);
    }
  }
}

TEST_F(CudaQuant, BadFp8ScalesAndIntegerFormatsAreRefusedWithAClearError) {
  std::vector<Buffer> owned;
  HostTensor w(DType::F8_E4M3, {192, 256}), s(DType::F32, {1, 2});  // needs [2, 2]
  auto fp8 = ops().adopt_block_fp8_weight(w.t, s.t, 128, 128, &owned);
  ASSERT_FALSE(fp8.ok());
  EXPECT_NE(fp8.error().message.find("scales must be"), std::string::npos) << fp8.error().message;
  HostTensor b(DType::BF16, {64, 64});
  auto q = ops().quantize_matmul_weight(b.t, DType::Q4_32, &owned);
  ASSERT_FALSE(q.ok());
  EXPECT_NE(q.error().message.find("Q4_32"), std::string::npos) << q.error().message;
  EXPECT_TRUE(owned.empty());
}

// The experts' scratch keeps room for e4m3 SwiGLU rows only where they are made: block-FP8
// experts with e4m3 activations (a prompt's pairs × d_ff bytes; 16-bit experts never use it).
TEST(CudaQuantPaths, ExpertScratchHoldsE4m3RowsOnlyForFp8Experts) {
  if (!device_is_sm90a()) GTEST_SKIP() << "no device running sm_90a code (e4m3 tiles)";
  BackendOptions f16_terms;
  f16_terms.fp8_activations = Fp8Activations::kF16;
  auto e4m3 = CudaOps::create(0, BackendOptions{});
  auto f16 = CudaOps::create(0, f16_terms);
  if (!e4m3.ok() || !f16.ok()) GTEST_SKIP() << "no CUDA device";
  const int n = 2048, k = 11, E = 513, d = 2048, ff = 512;  // an 80B-A3B prompt with its shared
  for (DType dt : {DType::BF16, DType::F16}) {
    EXPECT_EQ(e4m3.value()->moe_experts_scratch_bytes(n, k, E, d, ff, dt),
              f16.value()->moe_experts_scratch_bytes(n, k, E, d, ff, dt))
        << dtype_name(dt);
  }
  EXPECT_EQ(e4m3.value()->fp8_activations(), std::optional(Fp8Activations::kE4m3));
  EXPECT_EQ(f16.value()->fp8_activations(), std::optional(Fp8Activations::kF16));
  const size_t with_rows = e4m3.value()->moe_experts_scratch_bytes(n, k, E, d, ff, DType::F8_E4M3);
  const size_t without = f16.value()->moe_experts_scratch_bytes(n, k, E, d, ff, DType::F8_E4M3);
  EXPECT_GE(with_rows, without + size_t(n) * k * ff);
  // One token (decode) takes no e4m3 rows either way.
  EXPECT_EQ(e4m3.value()->moe_experts_scratch_bytes(1, k, E, d, ff, DType::F8_E4M3),
            f16.value()->moe_experts_scratch_bytes(1, k, E, d, ff, DType::F8_E4M3));
}

}  // namespace
}  // namespace recur
