// Prompt products over 16-bit weights on one f16 term of each activation row
// (BackendOptions::prompt_activations kF16, sm_90a): the dense matmuls and the experts multiply
// the hi term of every row (the f16 rounding of the row scaled by its power of two) and nothing
// else, and a forward's decode rows keep the products they have in a forward of their own.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "backend/cpu/reference.h"
#include "cuda/cuda_test_util.h"

namespace recur {
namespace {

using namespace testing;

BackendOptions one_term() {
  BackendOptions o;
  o.prompt_activations = PromptActivations::kF16;
  return o;
}

// The split's power of two for a row whose largest |value| is mx (moe_tile_io.cuh's
// f16_row_exponent; unit_rows: rows with mx in [2^-2, 2^15) stay unscaled, as the dense
// matmuls split them).
int row_exponent(float mx, bool unit_rows) {
  if (unit_rows && mx >= 0.25f && mx < 32768.0f) return 0;
  if (!(mx > 0.0f) || std::isinf(mx)) return 0;
  int p = 0;
  std::frexp(mx, &p);
  return std::clamp(15 - p, -126, 126);
}

// Each row of x [n, k] as its hi term: f16 of the row times 2^e, times 2^-e.
HostTensor hi_rows(const HostTensor& x, bool unit_rows) {
  HostTensor h = x;
  const int64_t n = x.t.shape[0], k = x.t.shape[1];
  for (int64_t r = 0; r < n; ++r) {
    float* row = h.f() + r * k;
    float mx = 0.0f;
    for (int64_t c = 0; c < k; ++c) mx = std::max(mx, std::fabs(row[c]));
    const int e = row_exponent(mx, unit_rows);
    for (int64_t c = 0; c < k; ++c) {
      row[c] = std::ldexp(f16_to_f32(f32_to_f16(std::ldexp(row[c], e))), -e);
    }
  }
  return h;
}

// Rows 1, 10^6 and 2^-40 times random (scaled, and left as they are where the dense split does).
HostTensor rows_of_three_ranges(int64_t n, int64_t k, std::mt19937& rng) {
  HostTensor x(DType::F32, {n, k});
  fill_random(x, rng);
  const float scale[] = {1.0f, 1e6f, 0x1p-40f};
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t c = 0; c < k; ++c) x.f()[r * k + c] *= scale[r % 3];
  }
  return x;
}

// The largest row error: against the row's largest reference value, or (rms) its RMS one.
double row_rel_err(const HostTensor& got, const HostTensor& want, bool rms = false) {
  const int64_t n = got.t.shape[0], m = got.t.shape[1];
  double err = 0;
  for (int64_t r = 0; r < n; ++r) {
    const float *g = got.f() + r * m, *w = want.f() + r * m;
    err = std::max(err, rms ? rms_rel_err(g, w, m) : rel_err(g, w, m, 0.0));
  }
  return err;
}

// A prompt's dense matmuls (one weight, and a group of two on one split of x) multiply each
// row's hi term: within f32 summation of that product, and far from the product of the f32
// rows (which two terms keep within 1e-5); a weight small enough for the GEMV kernel's token
// groups keeps its f32 products. The profile names the one-term GEMMs.
TEST(CudaPromptActivations, OneTermMatmulsMultiplyTheHiTerm) {
  if (!device_is_sm90a()) GTEST_SKIP() << "no device running sm_90a code (wgmma)";
  std::mt19937 rng(44);
  bool ok = false;
  const std::string table = profile_table(
      [&](CudaOps& ops) {
        EXPECT_EQ(ops.prompt_activations(), std::optional(PromptActivations::kF16));
        const int64_t n = 300, k = 520, m = 2056;
        HostTensor w(DType::F16, {m, k}), w2(DType::F16, {1024, k}), w3(DType::F16, {64, k});
        for (HostTensor* t : {&w, &w2, &w3}) fill_random(*t, rng, 0.2f);
        const Tensor dw = ops.adopt_weight(w.t).value(), dw2 = ops.adopt_weight(w2.t).value();
        const Tensor dw3 = ops.adopt_weight(w3.t).value();
        ASSERT_FALSE(ops.matmul_takes_gemv(n, dw));
        ASSERT_FALSE(ops.matmul_takes_gemv(n, dw2));
        ASSERT_TRUE(ops.matmul_takes_gemv(n, dw3));
        const HostTensor x = rows_of_three_ranges(n, k, rng), xh = hi_rows(x, true);
        Layout lay(std::vector<int>{int(n)}, std::vector<int>{0}, 16, rng);
        ops.begin_forward(lay.l, {}, {});
        HostTensor out(DType::F32, {n, m}), out2(DType::F32, {n, 1024}), out3(DType::F32, {n, 64});
        DeviceTensor dx(ops, x), dout(ops, out), gout(ops, out), gout2(ops, out2), gout3(ops, out3);
        ops.matmul(dx.t, dw, dout.t);
        const Tensor ws[] = {dw, dw2, dw3}, outs[] = {gout.t, gout2.t, gout3.t};
        ops.matmul_group(dx.t, ws, outs);
        HostTensor ref_hi = out, ref_f32 = out, ref2_hi = out2, ref3_f32 = out3;
        ref::matmul(xh.t, w.t, ref_hi.t);
        ref::matmul(x.t, w.t, ref_f32.t);
        ref::matmul(xh.t, w2.t, ref2_hi.t);
        ref::matmul(x.t, w3.t, ref3_f32.t);
        const HostTensor got = dout.download(ops, out), ggot = gout.download(ops, out);
        const double err = row_rel_err(got, ref_hi);
        record_error("matmul 1-term f16 vs its hi-term product", err);
        EXPECT_LE(err, 1e-5);
        EXPECT_LE(row_rel_err(ggot, ref_hi), 1e-5) << "matmul_group, first weight";
        EXPECT_LE(row_rel_err(gout2.download(ops, out2), ref2_hi), 1e-5) << "second weight";
        EXPECT_LE(row_rel_err(gout3.download(ops, out3), ref3_f32), 1e-5) << "GEMV weight";
        EXPECT_GT(row_rel_err(got, ref_f32), 2e-5) << "one term only?";
      },
      &ok, one_term());
  ASSERT_TRUE(ok);
  EXPECT_EQ(profile_count(table, "prompt n=300 matmul 1-term f16 2056x520"), 2) << table;
  EXPECT_EQ(profile_count(table, "prompt n=300 matmul 1-term f16 1024x520"), 1) << table;
  EXPECT_EQ(table.find("2-term"), std::string::npos) << table;
}

// A prompt's experts (bf16 and f16 weights, on the warpgroup tiles) multiply the hi terms of
// x's rows and of the SwiGLU rows down takes: nearer the one-term reference than the f32 one,
// and far from the f32 one (two terms keep 1e-5). Not within f32 summation of the reference: a
// SwiGLU value the device sums in f32 may round to the other f16 neighbour of the host's (a few
// a token here), which moves every output of the row by up to ~1e-4 of it (RMS).
TEST(CudaPromptActivations, OneTermExpertsMultiplyTheHiTerms) {
  if (!device_is_sm90a()) GTEST_SKIP() << "no device running sm_90a code (wgmma)";
  std::mt19937 rng(45);
  for (DType dt : {DType::BF16, DType::F16}) {
    bool ok = false;
    const std::string table = profile_table(
        [&](CudaOps& ops) {
          const int64_t n = 300, E = 16, k = 4, d = 136, ff = 200;
          Experts ex = make_experts(ops, E, d, ff, dt, rng);
          const HostTensor x = rows_of_three_ranges(n, d, rng);
          HostTensor logits(DType::F32, {n, E});
          fill_random(logits, rng, 2.0f);
          HostTensor ids(DType::I32, {n, k}), w(DType::F32, {n, k}), out(DType::F32, {n, d});
          DeviceTensor dl(ops, logits), dx(ops, x), dids(ops, ids), dw(ops, w), dout(ops, out);
          HostTensor scratch_h(DType::U8, {int64_t(ops.moe_experts_scratch_bytes(
                                              int(n), int(k), int(E), int(d), int(ff), dt))});
          DeviceTensor scratch(ops, scratch_h);
          Layout lay(std::vector<int>{int(n)}, std::vector<int>{0}, 16, rng);
          ops.begin_forward(lay.l, {}, {});
          MoeRouting routing;
          routing.k = int(k);
          ops.moe_route(dl.t, routing, dids.t, dw.t);
          ops.moe_experts(dx.t, ex.d, dids.t, dw.t, dout.t, scratch.t);
          const HostTensor got = dout.download(ops, out), hids = dids.download(ops, ids);
          const HostTensor hw = dw.download(ops, w);
          HostTensor ref_f32 = out;
          ref::moe_experts(x.t, ex.h, hids.t, hw.t, ref_f32.t);
          // The experts on the hi terms of x's rows and of each SwiGLU row.
          const HostTensor one_term = experts_with_rounded_rows(
              x, ex.h, hids, hw, [](const HostTensor& r) { return hi_rows(r, false); });
          const double err = row_rel_err(got, one_term, true);
          const double err_f32 = row_rel_err(got, ref_f32, true);
          const std::string name = std::string("moe_experts 1-term f16 (rms), ") + dtype_name(dt);
          record_error(name + " vs its hi-term products", err);
          record_error(name + " vs f32", err_f32);
          EXPECT_LE(err, 2e-4) << dtype_name(dt);
          EXPECT_LT(err, 0.5 * err_f32) << dtype_name(dt);
          EXPECT_GT(err_f32, 5e-5) << dtype_name(dt) << ": one term only?";
        },
        &ok, one_term());
    ASSERT_TRUE(ok);
    EXPECT_EQ(profile_count(table, "prompt n=300 moe_experts (gate/up, 1-term f16 wgmma)"), 1)
        << table;
    EXPECT_EQ(profile_count(table, "prompt n=300 moe_experts (down, 1-term f16 wgmma)"), 1)
        << table;
  }
}

// In a forward of decode tokens (one-token sequences, first) and a prompt, the decode rows come
// out bit for bit as in a forward of their own (the GEMV kernel for 3 of them, two f16 terms for
// 70), the prompt rows on one term; dense matmuls and the experts alike.
TEST(CudaPromptActivations, DecodeRowsBesideAPromptKeepTheirProducts) {
  if (!device_is_sm90a()) GTEST_SKIP() << "no device running sm_90a code (wgmma)";
  std::mt19937 rng(46);
  bool ok = false;
  profile_table(
      [&](CudaOps& ops) {
        const int64_t d = 264, m = 2048, ff = 192, E = 8, k = 4, prompt = 150;
        HostTensor wh(DType::F16, {m, d});
        fill_random(wh, rng, 0.2f);
        const Tensor w = ops.adopt_weight(wh.t).value();
        Experts ex = make_experts(ops, E, d, ff, DType::BF16, rng);
        for (const int decode : {3, 70}) {
          const auto [x, whole_mm] =
              decode_rows_beside_a_prompt(ops, w, ex.d, ff, k, decode, prompt, rng);
          // The prompt rows did take one term: their hi-term product, not the f32 one.
          HostTensor px(DType::F32, {prompt, d}), pm(DType::F32, {prompt, m});
          std::copy_n(x.f() + decode * d, prompt * d, px.f());
          std::copy_n(whole_mm.f() + decode * m, prompt * m, pm.f());
          HostTensor ref_hi = pm, ref_f32 = pm;
          ref::matmul(hi_rows(px, true).t, wh.t, ref_hi.t);
          ref::matmul(px.t, wh.t, ref_f32.t);
          EXPECT_LE(row_rel_err(pm, ref_hi), 1e-5) << decode << " decode rows";
          EXPECT_GT(row_rel_err(pm, ref_f32), 2e-5) << decode << " decode rows";
        }
      },
      &ok, one_term());
  ASSERT_TRUE(ok);
}

}  // namespace
}  // namespace recur
