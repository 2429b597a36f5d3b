// Row-wise, elementwise and matmul kernels against the scalar references at awkward sizes.
#include <cstring>
#include <deque>

#include <sys/mman.h>
#include <unistd.h>

#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/kernels_quant.h"
#include "backend/cpu/reference.h"
#include "ops/op_test_util.h"

namespace recur {
namespace {

using testing::fill_random;
using testing::HostTensor;
using testing::max_abs_diff;

class BasicOps : public ::testing::Test {
 protected:
  CpuOps ops{2};
  std::mt19937 rng{1234};
};

// copy (the prefix cache's snapshots): rows of a state pool into another pool's row and back,
// byte for byte, leaving the neighbouring rows alone.
TEST_F(BasicOps, CopyMovesOneRowOfAPoolExactly) {
  HostTensor pool(DType::F32, {3, 5, 33}), snapshots(DType::F32, {2, 5, 33});
  fill_random(pool, rng);
  fill_random(snapshots, rng);
  const HostTensor before = snapshots;
  ops.copy(pool.t.slice_rows(1, 2), snapshots.t.slice_rows(0, 1));
  EXPECT_EQ(std::memcmp(snapshots.f(), pool.f() + 5 * 33, 5 * 33 * 4), 0);
  EXPECT_EQ(std::memcmp(snapshots.f() + 5 * 33, before.f() + 5 * 33, 5 * 33 * 4), 0);
  ops.copy(snapshots.t.slice_rows(1, 2), pool.t.slice_rows(2, 3));
  EXPECT_EQ(std::memcmp(pool.f() + 2 * 5 * 33, before.f() + 5 * 33, 5 * 33 * 4), 0);
}

// The tests' host tensors: a view taken of one stays valid while the vector holding it grows
// (a move keeps the bytes' buffer; a copy would leave the view pointing at freed memory).
TEST_F(BasicOps, HostTensorViewsSurviveAGrowingVector) {
  std::vector<HostTensor> held;
  held.emplace_back(DType::F32, std::initializer_list<int64_t>{4, 8});
  fill_random(held[0], rng);
  const Tensor view = held[0].t.slice_rows(1, 3);
  const float first = view.ptr<float>()[0];
  for (int i = 0; i < 64; ++i) held.emplace_back(DType::F32, std::initializer_list<int64_t>{4, 8});
  EXPECT_EQ(view.data, static_cast<const void*>(held[0].f() + 8));
  EXPECT_EQ(held[0].t.data, static_cast<const void*>(held[0].bytes.data()));
  EXPECT_EQ(view.ptr<float>()[0], first);
}

TEST_F(BasicOps, MatmulMatchesReferenceForEveryWeightDtypeAndOddSizes) {
  for (DType wt : {DType::F32, DType::BF16, DType::F16}) {
    for (int64_t n : {1, 3, 4, 5, 33, 70}) {
      for (int64_t k : {31, 32, 33}) {
        for (int64_t m : {1, 17, 33}) {
          HostTensor x(DType::F32, {n, k}), w(wt, {m, k}), out(DType::F32, {n, m}),
              ref(DType::F32, {n, m});
          fill_random(x, rng);
          fill_random(w, rng, 0.2f);
          ops.matmul(x.t, w.t, out.t, false);
          ref::matmul(x.t, w.t, ref.t);
          ASSERT_LE(max_abs_diff(out.f(), ref.f(), n * m), 1e-4)
              << dtype_name(wt) << " n=" << n << " k=" << k << " m=" << m;
        }
      }
    }
  }
}

// matmul_group runs every weight in one parallel pass over their panels: each output equals,
// bit for bit, what matmul gives for that weight alone (the Ops default), for packed weights of
// every dtype, quantized ones, and groups mixing both; and it matches the reference.
TEST_F(BasicOps, MatmulGroupEqualsOneMatmulPerWeight) {
  std::vector<Buffer> owned;
  const DType kinds[] = {DType::F32, DType::BF16, DType::F16, DType::Q8_32, DType::Q4_32};
  for (int mix = 0; mix < 6; ++mix) {
    for (int64_t n : {1, 3, 8, 17}) {
      const int64_t k = 96;
      const std::vector<int64_t> ms = {1, 70, 33, 130};
      HostTensor x(DType::F32, {n, k});
      fill_random(x, rng);
      std::vector<HostTensor> w, got, alone;
      std::vector<Tensor> packed, outs;
      for (size_t i = 0; i < ms.size(); ++i) {
        // mix 0..4: every weight of one kind; mix 5: one of each in turn.
        const DType kind = kinds[mix < 5 ? mix : i % 5];
        const bool quantized = kind == DType::Q8_32 || kind == DType::Q4_32;
        w.push_back(HostTensor(quantized ? DType::BF16 : kind, {ms[i], k}));
        fill_random(w.back(), rng, 0.2f);
        auto p = quantized ? ops.quantize_matmul_weight(w.back().t, kind, &owned)
                           : ops.adopt_matmul_weight(w.back().t, &owned);
        ASSERT_TRUE(p.ok()) << p.error().to_string();
        packed.push_back(*p);
        got.push_back(HostTensor(DType::F32, {n, ms[i]}));
        alone.push_back(got.back());
      }
      for (auto& o : got) outs.push_back(o.t);
      ops.matmul_group(x.t, packed, outs);
      for (size_t i = 0; i < ms.size(); ++i) {
        ops.matmul(x.t, packed[i], alone[i].t, false);
        const size_t bytes = size_t(n * ms[i]) * sizeof(float);
        EXPECT_EQ(std::memcmp(got[i].f(), alone[i].f(), bytes), 0)
            << "mix " << mix << " n=" << n << " weight " << i;
        if (!cpu::is_quantized(packed[i].dtype)) {
          HostTensor want = got[i];
          ref::matmul(x.t, w[i].t, want.t);
          EXPECT_LE(max_abs_diff(got[i].f(), want.f(), n * ms[i]), 1e-4) << "weight " << i;
        }
      }
    }
  }
}

// The k-major layout of adopt_matmul_weight: every tile shape (columns 1..4 vectors with a
// partial last one, token counts around the 6/8/12/16-token tiles), every weight dtype; each
// token's row must be bit-identical to that token computed alone.
TEST_F(BasicOps, KMajorMatmulMatchesReferenceAndIsBatchInvariant) {
  std::vector<Buffer> owned;
  for (DType wt : {DType::F32, DType::BF16, DType::F16}) {
    for (int64_t n : {1, 2, 5, 6, 7, 13, 17, 26, 32, 40}) {
      for (int64_t k : {1, 31, 64, 65}) {
        for (int64_t m : {1, 4, 16, 17, 33, 64, 96, 130}) {
          HostTensor x(DType::F32, {n, k}), w(wt, {m, k}), out(DType::F32, {n, m}),
              ref(DType::F32, {n, m}), one(DType::F32, {1, m});
          fill_random(x, rng);
          fill_random(w, rng, 0.2f);
          auto packed = ops.adopt_matmul_weight(w.t, &owned);
          ASSERT_TRUE(packed.ok());
          ASSERT_EQ(packed->stride[0], 1) << "not k-major";
          ASSERT_EQ(packed->shape[0], m);
          ASSERT_EQ(packed->shape[1], k);
          ops.matmul(x.t, *packed, out.t, false);
          ref::matmul(x.t, w.t, ref.t);
          ASSERT_LE(max_abs_diff(out.f(), ref.f(), n * m), 1e-4)
              << dtype_name(wt) << " n=" << n << " k=" << k << " m=" << m;
          for (int64_t t : {int64_t(0), n / 2, n - 1}) {
            ops.matmul(x.t.slice_rows(t, t + 1), *packed, one.t, false);
            ASSERT_EQ(std::memcmp(one.f(), out.f() + t * m, size_t(m) * 4), 0)
                << "token " << t << " of " << n << " differs alone; m=" << m << " k=" << k;
          }
        }
      }
    }
  }
  // Accumulation into a strided output view.
  const int64_t n = 7, k = 33, m = 20;
  HostTensor x(DType::F32, {n, k}), w(DType::BF16, {m, k}), outbig(DType::F32, {n, m + 3}),
      ref(DType::F32, {n, m});
  fill_random(x, rng);
  fill_random(w, rng);
  fill_random(outbig, rng);
  HostTensor before = outbig;
  auto packed = ops.adopt_matmul_weight(w.t, &owned);
  ASSERT_TRUE(packed.ok());
  ops.matmul(x.t, *packed, outbig.t.slice_cols(2, 2 + m), /*accumulate=*/true);
  ref::matmul(x.t, w.t, ref.t);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t j = 0; j < m + 3; ++j) {
      const float got = outbig.f()[t * (m + 3) + j], old = before.f()[t * (m + 3) + j];
      if (j >= 2 && j < 2 + m) {
        EXPECT_NEAR(got, old + ref.f()[t * m + j - 2], 1e-4);
      } else {
        EXPECT_EQ(got, old) << "column outside the view was written";
      }
    }
  }
}

// matmul_pass: jobs of every matmul weight layout (k-major F32/BF16/F16, Q8_32, Q4_32), some
// sharing an input, some accumulating, some empty, in passes big enough to split across the
// threads mid-job; each job's result must be bit-identical to its own matmul.
TEST_F(BasicOps, MatmulPassEqualsOneMatmulPerJob) {
  struct Shape {
    int64_t m, k, n;
    bool accumulate;
  };
  const Shape shapes[] = {{300, 256, 3, false}, {1, 256, 3, true},   {17, 64, 1, false},
                          {200, 96, 7, true},   {64, 256, 3, false}, {130, 32, 0, false}};
  for (DType wt : {DType::F32, DType::BF16, DType::F16, DType::Q8_32, DType::Q4_32}) {
    std::vector<Buffer> owned;
    std::deque<HostTensor> store;
    std::vector<CpuOps::MatmulJob> jobs;
    std::vector<HostTensor*> expected;
    HostTensor* last_x = nullptr;
    for (size_t j = 0; j < std::size(shapes); ++j) {
      const Shape& s = shapes[j];
      HostTensor& w = store.emplace_back(DType::BF16, std::initializer_list<int64_t>{s.m, s.k});
      fill_random(w, rng, 0.2f);
      HostTensor& wf = store.emplace_back(wt == DType::F32 || wt == DType::F16 ? wt : DType::BF16,
                                          std::initializer_list<int64_t>{s.m, s.k});
      for (int64_t i = 0; i < s.m * s.k; ++i) {
        const float v = bf16_to_f32(w.t.ptr<uint16_t>()[i]);
        if (wt == DType::F32) wf.f()[i] = v;
        if (wt == DType::F16) wf.t.ptr<uint16_t>()[i] = f32_to_f16(v);
        if (wf.t.dtype == DType::BF16) wf.t.ptr<uint16_t>()[i] = w.t.ptr<uint16_t>()[i];
      }
      auto packed = wt == DType::Q8_32 || wt == DType::Q4_32
                        ? ops.quantize_matmul_weight(wf.t, wt, &owned)
                        : ops.adopt_matmul_weight(wf.t, &owned);
      ASSERT_TRUE(packed.ok());
      // Jobs 0 and 1 share their input (one quantization for both).
      if (j != 1) {
        last_x = &store.emplace_back(
            DType::F32, std::initializer_list<int64_t>{std::max<int64_t>(s.n, 1), s.k});
        fill_random(*last_x, rng);
      }
      HostTensor& x = *last_x;
      HostTensor& out = store.emplace_back(
          DType::F32, std::initializer_list<int64_t>{std::max<int64_t>(s.n, 1), s.m});
      fill_random(out, rng);
      HostTensor& want = store.emplace_back(out);
      ops.matmul(x.t.slice_rows(0, s.n), *packed, want.t.slice_rows(0, s.n), s.accumulate);
      jobs.push_back({x.t.slice_rows(0, s.n), *packed, out.t.slice_rows(0, s.n), s.accumulate});
      expected.push_back(&want);
    }
    ops.matmul_pass(jobs);
    for (size_t j = 0; j < jobs.size(); ++j) {
      const int64_t count = std::max<int64_t>(shapes[j].n, 1) * shapes[j].m;
      ASSERT_EQ(std::memcmp(jobs[j].out.data, expected[j]->f(), size_t(count) * 4), 0)
          << dtype_name(wt) << " job " << j;
    }
  }
}

TEST_F(BasicOps, MatmulAccumulatesAndHonoursRowStrides) {
  const int64_t n = 7, k = 33, m = 9;
  HostTensor xbig(DType::F32, {n, k + 5}), w(DType::BF16, {m, k}), outbig(DType::F32, {n, m + 3}),
      ref(DType::F32, {n, m});
  fill_random(xbig, rng);
  fill_random(w, rng);
  fill_random(outbig, rng);
  HostTensor before = outbig;
  Tensor x = xbig.t.slice_cols(2, 2 + k), out = outbig.t.slice_cols(1, 1 + m);
  ops.matmul(x, w.t, out, /*accumulate=*/true);
  ref::matmul(x, w.t, ref.t);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t j = 0; j < m + 3; ++j) {
      const float got = outbig.f()[t * (m + 3) + j];
      const float old = before.f()[t * (m + 3) + j];
      if (j >= 1 && j < 1 + m) {
        EXPECT_NEAR(got, old + ref.f()[t * m + j - 1], 1e-4);
      } else {
        EXPECT_EQ(got, old) << "column outside the view was written";
      }
    }
  }
}

// matmul_heads on odd shapes, every weight dtype, inputs with gaps between heads or one input
// shared by all heads (head stride 0), outputs with gaps: the scalar reference per head, the
// gaps untouched.
TEST_F(BasicOps, MatmulHeadsMatchesReferenceOnStridedHeads) {
  struct Shape {
    int64_t n, H, m, k, x_gap, out_gap;  // x_gap -1: one input for every head
  };
  const Shape shapes[] = {{1, 3, 17, 33, 0, 0},  {5, 2, 9, 40, 5, 3},   {33, 5, 4, 31, -1, 1},
                          {1, 7, 64, 24, -1, 8}, {8, 4, 33, 128, 0, 0}, {70, 3, 20, 16, 4, 2}};
  for (DType wt : {DType::F32, DType::BF16, DType::F16}) {
    for (const Shape& sh : shapes) {
      const int64_t n = sh.n, H = sh.H, m = sh.m, k = sh.k;
      const int64_t xs = sh.x_gap < 0 ? 0 : k + sh.x_gap, os = m + sh.out_gap;
      HostTensor xbuf(DType::F32, {n, 2 + (H - 1) * xs + k}), w(wt, {H, m, k});
      HostTensor obuf(DType::F32, {n, 1 + H * os}), ref(DType::F32, {n, H, m});
      fill_random(xbuf, rng);
      fill_random(w, rng, 0.2f);
      fill_random(obuf, rng);
      const HostTensor before = obuf;
      const Tensor x = xbuf.t.col_heads(2, H, k, xs);
      ops.matmul_heads(x, w.t, obuf.t.col_heads(1, H, m, os));
      ref::matmul_heads(x, w.t, ref.t);
      const int64_t cols = 1 + H * os;
      for (int64_t t = 0; t < n; ++t) {
        for (int64_t c = 0; c < cols; ++c) {
          const float got = obuf.f()[t * cols + c];
          const int64_t h = (c - 1) / os, j = (c - 1) % os;
          if (c >= 1 && j < m) {
            ASSERT_NEAR(got, ref.f()[(t * H + h) * m + j], 1e-4)
                << dtype_name(wt) << " n=" << n << " H=" << H << " m=" << m << " k=" << k;
          } else {
            ASSERT_EQ(got, before.f()[t * cols + c]) << "column outside the heads was written";
          }
        }
      }
    }
  }
}

TEST_F(BasicOps, RmsNormVariantsAndL2NormMatchReference) {
  for (DType wt : {DType::BF16, DType::F32})
    for (int64_t d : {15, 16, 33}) {
      const int64_t n = 5, heads = 3;
      HostTensor x(DType::F32, {n, heads, d}), w(wt, {d}), gate(DType::F32, {n, heads, d});
      fill_random(x, rng);
      fill_random(w, rng, 0.3f);
      fill_random(gate, rng);
      HostTensor out(DType::F32, {n, heads, d}), ref(DType::F32, {n, heads, d});
      ops.rms_norm(x.t, w.t, 1.0f, 1e-6f, out.t);
      ref::rms_norm(x.t, w.t, 1.0f, 1e-6f, ref.t);
      EXPECT_LE(max_abs_diff(out.f(), ref.f(), out.numel()), 1e-5);
      for (GateActivation act : {GateActivation::kSilu, GateActivation::kSigmoid}) {
        ops.rms_norm_gated(x.t, gate.t, w.t, 1e-6f, act, out.t);
        ref::rms_norm_gated(x.t, gate.t, w.t, 1e-6f, act, ref.t);
        EXPECT_LE(max_abs_diff(out.f(), ref.f(), out.numel()), 1e-5)
            << "act=" << int(act) << " d=" << d;
      }
      HostTensor a = x, b = x;
      ops.l2_norm(a.t, 1e-6f, 0.25f);
      ref::l2_norm(b.t, 1e-6f, 0.25f);
      EXPECT_LE(max_abs_diff(a.f(), b.f(), a.numel()), 1e-6);
    }
}

TEST_F(BasicOps, RopeRotatesOnlyTheRotaryChannels) {
  const int64_t n = 6, heads = 3, hd = 24;
  for (int rot : {6, 12, 24}) {
    HostTensor x(DType::F32, {n, heads, hd});
    fill_random(x, rng);
    HostTensor a = x, b = x;
    const int32_t pos[] = {0, 1, 7, 100, 4095, 1000000};
    ops.rope(a.t, pos, rot, 10000.0);
    ref::rope(b.t, pos, rot, 10000.0);
    EXPECT_LE(max_abs_diff(a.f(), b.f(), a.numel()), 2e-5) << "rot=" << rot;
    for (int64_t t = 0; t < n; ++t)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t j = rot; j < hd; ++j)
          ASSERT_EQ(a.f()[(t * heads + h) * hd + j], x.f()[(t * heads + h) * hd + j]);
    // Position 0 is the identity.
    for (int64_t j = 0; j < heads * hd; ++j) ASSERT_FLOAT_EQ(a.f()[j], x.f()[j]);
    // Angles are cached between calls: the same call again, then other positions and another
    // theta, must still follow the reference.
    HostTensor a2 = x, b2 = x;
    ops.rope(a2.t, pos, rot, 10000.0);
    EXPECT_EQ(std::memcmp(a2.f(), a.f(), size_t(a.numel()) * 4), 0) << "rot=" << rot;
    int32_t moved[] = {0, 1, 7, 100, 4095, 1000000};
    moved[2] = 9;
    a2 = x;
    ops.rope(a2.t, moved, rot, 10000.0);
    ref::rope(b2.t, moved, rot, 10000.0);
    EXPECT_LE(max_abs_diff(a2.f(), b2.f(), a2.numel()), 2e-5) << "rot=" << rot;
    a2 = x;
    b2 = x;
    ops.rope(a2.t, moved, rot, 500000.0);
    ref::rope(b2.t, moved, rot, 500000.0);
    EXPECT_LE(max_abs_diff(a2.f(), b2.f(), a2.numel()), 2e-5) << "theta, rot=" << rot;
  }
}

TEST_F(BasicOps, ElementwiseOpsMatchReference) {
  const int64_t n = 4, d = 33;
  HostTensor g(DType::F32, {n, d}), u(DType::F32, {n, d}), out(DType::F32, {n, d}),
      s(DType::F32, {n, 1});
  fill_random(g, rng);
  fill_random(u, rng);
  fill_random(s, rng);
  HostTensor want = out;
  ops.swiglu(g.t, u.t, out.t);
  ref::swiglu(g.t, u.t, want.t);
  ASSERT_LE(max_abs_diff(out.f(), want.f(), n * d), 1e-6);
  HostTensor x = u, xr = u;
  ops.mul_sigmoid(x.t, g.t);
  ref::mul_sigmoid(xr.t, g.t);
  ASSERT_LE(max_abs_diff(x.f(), xr.f(), n * d), 1e-6);
  ops.add(x.t, g.t);
  ref::add(xr.t, g.t);
  ASSERT_LE(max_abs_diff(x.f(), xr.f(), n * d), 1e-6);
  ops.add_scaled_sigmoid(x.t, g.t, s.t);
  ref::add_scaled_sigmoid(xr.t, g.t, s.t);
  ASSERT_LE(max_abs_diff(x.f(), xr.f(), n * d), 1e-6);
}

// Gated DeltaNet gates over the whole range softplus meets: tiny e^x, the x > 20 cut, and
// head counts around the 16-lane vectors; relative error against the double definition.
TEST_F(BasicOps, GdnGatesMatchReference) {
  for (int64_t hv : {1, 2, 17, 32}) {
    const int64_t n = 9;
    HostTensor a(DType::F32, {n, hv}), b(DType::F32, {n, hv}), a_log(DType::F32, {hv}),
        dt_bias(DType::BF16, {hv});
    fill_random(a, rng, 12.0f);  // |x| up to ~40: both sides of the cut, e^x down to 1e-16
    fill_random(b, rng, 6.0f);
    fill_random(a_log, rng, 1.0f);
    fill_random(dt_bias, rng, 1.0f);
    HostTensor g(DType::F32, {n, hv}), beta = g, g_ref = g, beta_ref = g;
    ops.gdn_gates(a.t, b.t, a_log.t, dt_bias.t, g.t, beta.t);
    ref::gdn_gates(a.t, b.t, a_log.t, dt_bias.t, g_ref.t, beta_ref.t);
    for (int64_t i = 0; i < n * hv; ++i) {
      // x = a + dt_bias is formed in f32 (half an ulp of x, i.e. |x|·6e-8, relative in e^x);
      // the vector exp and log add a few ulps.
      const double x = double(a.f()[i]) + bf16_to_f32(dt_bias.t.ptr<uint16_t>()[i % hv]);
      const double tol = (4e-7 + 1.2e-7 * std::fabs(x)) * std::fabs(g_ref.f()[i]);
      ASSERT_LE(std::fabs(g.f()[i] - g_ref.f()[i]), tol) << "hv=" << hv << " x=" << x;
      ASSERT_NEAR(beta.f()[i], beta_ref.f()[i], 1e-7);
    }
    // Rows that are not packed take the per-row path: the same bits as the packed path.
    HostTensor wide_a(DType::F32, {n, hv + 3}), wide_b = wide_a, wide_g = wide_a,
                                                wide_beta = wide_a;
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t h = 0; h < hv; ++h) {
        wide_a.f()[t * (hv + 3) + h] = a.f()[t * hv + h];
        wide_b.f()[t * (hv + 3) + h] = b.f()[t * hv + h];
      }
    }
    ops.gdn_gates(wide_a.t.slice_cols(0, hv), wide_b.t.slice_cols(0, hv), a_log.t, dt_bias.t,
                  wide_g.t.slice_cols(0, hv), wide_beta.t.slice_cols(0, hv));
    for (int64_t t = 0; t < n; ++t) {
      ASSERT_EQ(std::memcmp(wide_g.f() + t * (hv + 3), g.f() + t * hv, size_t(hv) * 4), 0)
          << "hv=" << hv;
      ASSERT_EQ(std::memcmp(wide_beta.f() + t * (hv + 3), beta.f() + t * hv, size_t(hv) * 4), 0)
          << "hv=" << hv;
    }
  }
}

// Kimi Delta Attention's gates: one decay per key channel (a, g [n, Hv·dk], dt_bias [Hv·dk],
// a_log [Hv] per head), beta per head; odd head counts and channel counts around the vectors.
TEST_F(BasicOps, GdnGatesPerKeyChannelMatchReference) {
  for (int64_t hv : {1, 3}) {
    for (int64_t dk : {5, 16, 33}) {
      const int64_t n = 7, c = hv * dk;
      HostTensor a(DType::F32, {n, c}), b(DType::F32, {n, hv}), a_log(DType::F32, {hv}),
          dt_bias(DType::BF16, {c});
      fill_random(a, rng, 12.0f);
      fill_random(b, rng, 6.0f);
      fill_random(a_log, rng, 1.0f);
      fill_random(dt_bias, rng, 1.0f);
      HostTensor g(DType::F32, {n, c}), beta(DType::F32, {n, hv}), g_ref = g, beta_ref = beta;
      ops.gdn_gates(a.t, b.t, a_log.t, dt_bias.t, g.t, beta.t);
      ref::gdn_gates(a.t, b.t, a_log.t, dt_bias.t, g_ref.t, beta_ref.t);
      for (int64_t i = 0; i < n * c; ++i) {
        const int64_t t = i / c, j = i % c;
        const double x = double(a.f()[i]) + bf16_to_f32(dt_bias.t.ptr<uint16_t>()[j]);
        const double tol = (4e-7 + 1.2e-7 * std::fabs(x)) * std::fabs(g_ref.f()[i]);
        ASSERT_LE(std::fabs(g.f()[i] - g_ref.f()[i]), tol) << "hv=" << hv << " dk=" << dk;
        // Channel j of head j / dk decays by that head's a_log: the double definition.
        const double sp = x > 20 ? x : std::log1p(std::exp(x));
        ASSERT_NEAR(g_ref.f()[i], -std::exp(double(a_log.f()[j / dk])) * sp,
                    1e-6 * std::fabs(g_ref.f()[i]) + 1e-30)
            << "t=" << t;
      }
      for (int64_t i = 0; i < n * hv; ++i) {
        ASSERT_NEAR(beta.f()[i], beta_ref.f()[i], 1e-7);
        ASSERT_NEAR(beta_ref.f()[i], 1 / (1 + std::exp(-double(b.f()[i]))), 1e-7);
      }
      // g written in place of a: the same values.
      HostTensor in_place = a;
      ops.gdn_gates(in_place.t, b.t, a_log.t, dt_bias.t, in_place.t, beta.t);
      ASSERT_EQ(std::memcmp(in_place.f(), g.f(), size_t(n * c) * 4), 0);
    }
  }
}

TEST_F(BasicOps, EmbeddingAndGatherRowsMatchReference) {
  HostTensor table(DType::BF16, {11, 7}), out(DType::F32, {3, 7});
  fill_random(table, rng);
  const int32_t ids[] = {10, 0, 4};
  HostTensor want = out;
  ops.embedding(ids, 3, table.t, out.t);
  ref::embedding(ids, 3, table.t, want.t);
  ASSERT_EQ(std::memcmp(out.f(), want.f(), sizeof(float) * 3 * 7), 0);
  HostTensor g(DType::F32, {2, 7}), gw = g;
  const int32_t rows[] = {2, 0};
  ops.gather_rows(out.t, rows, 2, g.t);
  ref::gather_rows(out.t, rows, 2, gw.t);
  ASSERT_EQ(std::memcmp(g.f(), gw.f(), sizeof(float) * 2 * 7), 0);
}

// The backend's allocator: buffers of 2 MiB or more start on a 2 MiB boundary (so that they
// can sit on huge pages), smaller ones on a cache line; both are counted and freed.
TEST_F(BasicOps, AllocatorAlignsLargeBuffersToHugePagesAndCountsThem) {
  Allocator& a = ops.allocator();
  const AllocStats before = a.stats();
  {
    const size_t big_bytes = (size_t(5) << 20) + 3;
    auto big = a.allocate(big_bytes, "big test buffer");
    auto small = a.allocate(100, "small test buffer");
    ASSERT_TRUE(big.ok() && small.ok());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(big->data()) % (size_t(2) << 20), 0u);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(small->data()) % 64, 0u);
    std::memset(big->data(), 1, big_bytes);
    EXPECT_EQ(static_cast<const uint8_t*>(big->data())[big_bytes - 1], 1);
    EXPECT_EQ(a.stats().live_buffers, before.live_buffers + 2);
    EXPECT_EQ(a.stats().allocs_total, before.allocs_total + 2);
  }
  EXPECT_EQ(a.stats().live_buffers, before.live_buffers);
  EXPECT_EQ(a.stats().live_bytes, before.live_bytes);
}

// Opt-in pre-faulting: a large buffer's pages are resident as soon as it is allocated.
TEST_F(BasicOps, PrefaultedLargeBuffersAreResidentAtAllocation) {
  ASSERT_FALSE(CpuOps::prefault_large_buffers()) << "off by default";
  CpuOps::set_prefault_large_buffers(true);
  const size_t bytes = size_t(6) << 20;
  auto big = ops.allocator().allocate(bytes, "prefaulted test buffer");
  CpuOps::set_prefault_large_buffers(false);
  ASSERT_TRUE(big.ok());
  const size_t page = size_t(sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> resident((bytes + page - 1) / page);
  ASSERT_EQ(mincore(big->data(), bytes, resident.data()), 0);
  size_t missing = 0;
  for (unsigned char r : resident) missing += (r & 1) ? 0 : 1;
  EXPECT_EQ(missing, 0u) << "of " << resident.size() << " pages";
}

}  // namespace
}  // namespace recur
