// Paged attention over caches of each element type (F32, BF16, F16, F8_E4M3): cache writes
// equal the scalar reference's bytes, and attention equals the reference reading the same
// rounded cache, on ragged batches (decode tokens with history, fresh prompts, prompts
// continuing a cached prefix), grouped-query heads of odd sizes, the latent (strided-value)
// view, and the published Kimi-Linear's latent group (32 heads of 576/512) in one call. An F16
// cache saturates at ±65504, keeps NaN and rounds into its subnormals, and reads back exactly.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <utility>

#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/reference.h"
#include "ops/op_test_util.h"

namespace recur {
namespace {

using testing::fill_random;
using testing::HostTensor;
using testing::Layout;
using testing::max_abs_diff;
using testing::poison_past_ends;

constexpr DType kCacheTypes[] = {DType::F32, DType::BF16, DType::F16, DType::F8_E4M3};

class AttentionCache : public ::testing::TestWithParam<DType> {
 protected:
  CpuOps ops{3};
  std::mt19937 rng{7};
};

INSTANTIATE_TEST_SUITE_P(Types, AttentionCache, ::testing::ValuesIn(kCacheTypes),
                         [](const ::testing::TestParamInfo<DType>& i) {
                           return std::string(dtype_name(i.param));
                         });

bool same_bytes(const HostTensor& a, const HostTensor& b) {
  return a.bytes.size() == b.bytes.size() &&
         std::memcmp(a.bytes.data(), b.bytes.data(), a.bytes.size()) == 0;
}

// Separate key and value caches: the batch's new tokens written by the op and by the
// reference (same bytes), then attention against the reference over the same cache.
TEST_P(AttentionCache, RaggedBatchesWithHistoryMatchReference) {
  const DType dt = GetParam();
  struct Dims {
    int64_t kv, group, hd, dv;
    int bs;
  };
  for (const Dims& d : {Dims{2, 1, 32, 32, 16}, Dims{2, 3, 20, 33, 16}, Dims{1, 5, 64, 64, 12},
                        Dims{3, 7, 40, 24, 8}}) {
    const int64_t heads = d.kv * d.group;
    // A decode token deep in its context, a fresh prompt, a prompt continuing a cached prefix
    // (mid-block), a long decode token split into parts.
    const std::vector<int> lens = {1, 33, 17, 1}, first = {70, 0, 21, 2500};
    Layout lay(lens, first, d.bs, rng);
    const int64_t n = lay.l.n_tokens;
    HostTensor kc(dt, {lay.n_blocks(), d.kv, d.hd, d.bs}),
        vc(dt, {lay.n_blocks(), d.kv, d.bs, d.dv});
    fill_random(kc, rng);  // the history written by earlier calls
    fill_random(vc, rng);
    poison_past_ends(lay, lens, first, kc, &vc);
    HostTensor k(DType::F32, {n, d.kv, d.hd}), v(DType::F32, {n, d.kv, d.dv}),
        q(DType::F32, {n, heads, d.hd});
    fill_random(k, rng);
    fill_random(v, rng, 3.0f);
    fill_random(q, rng);
    HostTensor kc_ref = kc, vc_ref = vc;
    ops.kv_cache_write(k.t, v.t, kc.t, vc.t, lay.l);
    ref::kv_cache_write(k.t, v.t, kc_ref.t, vc_ref.t, lay.l);
    ASSERT_TRUE(same_bytes(kc, kc_ref)) << "hd=" << d.hd;
    ASSERT_TRUE(same_bytes(vc, vc_ref)) << "dv=" << d.dv;
    HostTensor out(DType::F32, {n, heads, d.dv}), ref_out = out;
    fill_random(out, rng);  // must be overwritten
    const float scale = 1.0f / std::sqrt(float(d.hd));
    ops.paged_attention(q.t, kc.t, vc.t, lay.l, scale, out.t);
    ref::paged_attention(q.t, kc.t, vc.t, lay.l, scale, ref_out.t);
    EXPECT_LE(max_abs_diff(out.f(), ref_out.f(), out.numel()), 2e-5)
        << "group=" << d.group << " hd=" << d.hd << " dv=" << d.dv;
  }
}

// The rounded cache's attention stays near the f32 cache's over the same keys and values (a
// cache read as the wrong type would not), and differs from it unless the type is F32.
TEST_P(AttentionCache, RoundingErrorAgainstTheF32Cache) {
  const DType dt = GetParam();
  const int64_t kv = 2, group = 4, heads = kv * group, hd = 64, dv = 64;
  const int bs = 16;
  const std::vector<int> lens = {1, 40}, first = {300, 0};
  Layout lay(lens, first, bs, rng);
  const int64_t n = lay.l.n_tokens;
  // Every position written this call: a second layout covering each sequence's whole context.
  const std::vector<int> all_lens = {301, 40}, zeros = {0, 0};
  Layout fill(all_lens, zeros, bs, rng);
  fill.block_ids = lay.block_ids;
  fill.l.block_ids = fill.block_ids.data();
  HostTensor k(DType::F32, {fill.l.n_tokens, kv, hd}), v(DType::F32, {fill.l.n_tokens, kv, dv}),
      q(DType::F32, {n, heads, hd});
  fill_random(k, rng);
  fill_random(v, rng);
  fill_random(q, rng);
  HostTensor kc(dt, {lay.n_blocks(), kv, hd, bs}), vc(dt, {lay.n_blocks(), kv, bs, dv});
  HostTensor kc32(DType::F32, {lay.n_blocks(), kv, hd, bs}),
      vc32(DType::F32, {lay.n_blocks(), kv, bs, dv});
  ops.kv_cache_write(k.t, v.t, kc.t, vc.t, fill.l);
  ops.kv_cache_write(k.t, v.t, kc32.t, vc32.t, fill.l);
  HostTensor out(DType::F32, {n, heads, dv}), out32 = out;
  const float scale = 1.0f / std::sqrt(float(hd));
  ops.paged_attention(q.t, kc.t, vc.t, lay.l, scale, out.t);
  ops.paged_attention(q.t, kc32.t, vc32.t, lay.l, scale, out32.t);
  // bf16 keeps 8 significant bits (relative error ≤ 2^-9), f16 11 (≤ 2^-12, 8 times less),
  // e4m3 4 (≤ 2^-4): outputs of unit-scale random heads move by about that much.
  const double err = max_abs_diff(out.f(), out32.f(), out.numel());
  const double bound = dt == DType::F32    ? 0.0
                       : dt == DType::BF16 ? 3e-2
                       : dt == DType::F16  ? 4e-3
                                           : 4e-1;
  EXPECT_LE(err, bound) << dtype_name(dt);
  if (dt != DType::F32) {
    EXPECT_GT(err, 0.0) << "the cache did not round";
  }
  std::printf("%s cache: max |attention − f32 cache's| = %.3g\n", dtype_name(dt), err);
}

// k_cache [blocks, 1, hd, bs] whose first dv channels, viewed [blocks, 1, bs, dv] with channels
// bs apart, are the values (a latent cache).
Tensor values_of(const HostTensor& keys, int bs, int64_t dv) {
  Tensor v = keys.t;
  v.shape[2] = bs, v.shape[3] = dv;
  v.stride[2] = 1, v.stride[3] = bs;
  return v;
}

// A latent cache in each type: writes through the view land in the keys, and attention over
// the view equals the reference, for small groups and for the published Kimi-Linear's 32 heads
// of 576 (values 512) in one call (Ops::kMaxAttentionGroupDims).
TEST_P(AttentionCache, LatentViewMatchesReferenceUpToKimiGroup) {
  const DType dt = GetParam();
  struct Dims {
    int64_t group, hd, dv;
    int bs;
    std::vector<int> lens, first;
  };
  const std::vector<Dims> cases = {
      {4, 24, 16, 16, {1, 33, 17, 2}, {70, 0, 16, 1500}},
      {5, 24, 16, 5, {1, 9}, {40, 11}},
      {32, 576, 512, 16, {1, 1, 5}, {1300, 7, 60}},
  };
  ASSERT_LE(32 * 576, Ops::kMaxAttentionGroupDims);
  for (const Dims& d : cases) {
    const int64_t heads = d.group;
    Layout lay(d.lens, d.first, d.bs, rng);
    const int64_t n = lay.l.n_tokens;
    HostTensor kc(dt, {lay.n_blocks(), 1, d.hd, d.bs});
    fill_random(kc, rng);
    poison_past_ends(lay, d.lens, d.first, kc, nullptr);  // values too, in a latent cache
    HostTensor k(DType::F32, {n, d.hd}), q(DType::F32, {n, heads, d.hd});
    fill_random(k, rng);
    fill_random(q, rng, 0.3f);
    HostTensor kc_ref = kc;
    ops.kv_cache_write(k.t.col_heads(0, 1, d.hd), k.t.col_heads(0, 1, d.dv), kc.t,
                       values_of(kc, d.bs, d.dv), lay.l);
    ref::kv_cache_write(k.t.col_heads(0, 1, d.hd), k.t.col_heads(0, 1, d.dv), kc_ref.t,
                        values_of(kc_ref, d.bs, d.dv), lay.l);
    ASSERT_TRUE(same_bytes(kc, kc_ref));
    HostTensor out(DType::F32, {n, heads, d.dv}), ref_out = out;
    fill_random(out, rng);
    const float scale = 1.0f / std::sqrt(float(d.hd));
    ops.paged_attention(q.t, kc.t, values_of(kc, d.bs, d.dv), lay.l, scale, out.t);
    ref::paged_attention(q.t, kc.t, values_of(kc, d.bs, d.dv), lay.l, scale, ref_out.t);
    EXPECT_LE(max_abs_diff(out.f(), ref_out.f(), out.numel()), 2e-5)
        << "group=" << d.group << " hd=" << d.hd;
  }
}

// x rounded to the nearest binary16 (ties to even), magnitudes over 65504 to ±65504, NaN kept,
// computed apart from f32_to_f16: the multiple of the spacing at x's binade (2^-24 under 2^-14).
double f16_expected(float x) {
  if (std::isnan(x)) return NAN;
  if (std::fabs(x) > 65504.0f) return std::copysign(65504.0, x);
  int e;
  std::frexp(double(x), &e);  // |x| = m·2^e, m in [0.5, 1)
  const double spacing = std::ldexp(1.0, std::max(e - 1, -14) - 10);
  return std::nearbyint(double(x) / spacing) * spacing;
}

// An F16 cache's writes saturate (±65504, infinities too), keep NaN, round to nearest even into
// the subnormals, as the reference's bytes; attention reads the stored values back exactly
// (one position: the output is the values), through the vector conversion and its tail.
TEST(AttentionCacheF16, WritesSaturateKeepNaNRoundSubnormalsAndReadBackExactly) {
  CpuOps ops{3};
  std::mt19937 rng{11};
  const float tiny = std::ldexp(1.0f, -24);  // the smallest subnormal
  const std::vector<std::pair<float, double>> cases = {
      {1e6f, 65504.0},
      {-1e6f, -65504.0},
      {65519.0f, 65504.0},
      {70000.0f, 65504.0},
      {NAN, NAN},
      {1e-6f, 17 * double(tiny)},  // 16.78 subnormal steps
      {INFINITY, 65504.0},
      {-INFINITY, -65504.0},
      {65520.0f, 65504.0},  // unsaturated: inf
      {-65536.0f, -65504.0},
      {65504.0f, 65504.0},
      {3e-8f, double(tiny)},
      {tiny / 2, 0.0},                  // a tie: to even (0)
      {tiny * 1.5f, 2 * double(tiny)},  // a tie: to even (2)
      {-2.5e-5f, -419 * double(tiny)},
      {6.1e-5f, 1023 * double(tiny)},  // the largest subnormal
      {1.0f + std::ldexp(1.0f, -11), 1.0},
      {1.0f + 3 * std::ldexp(1.0f, -11), 1.0 + std::ldexp(1.0, -9)},
      {0.1f, 0.0999755859375},
      {-0.0f, 0.0},
  };
  const int64_t hd = 35, dv = 35;  // AVX-512: two vectors of 16, then a tail of 3
  const int bs = 16;
  Layout lay({1}, {0}, bs, rng);
  HostTensor k(DType::F32, {1, 1, hd}), v(DType::F32, {1, 1, dv});
  fill_random(k, rng, 100.0f);
  fill_random(v, rng, 100.0f);
  for (size_t i = 0; i < cases.size(); ++i) k.f()[i] = cases[i].first;
  for (size_t i = 0; i < cases.size(); ++i) v.f()[dv - 1 - i] = cases[i].first;  // tail first
  HostTensor kc(DType::F16, {lay.n_blocks(), 1, hd, bs}),
      vc(DType::F16, {lay.n_blocks(), 1, bs, dv});
  fill_random(kc, rng);
  fill_random(vc, rng);
  HostTensor kc_ref = kc, vc_ref = vc;
  ops.kv_cache_write(k.t, v.t, kc.t, vc.t, lay.l);
  ref::kv_cache_write(k.t, v.t, kc_ref.t, vc_ref.t, lay.l);
  ASSERT_TRUE(same_bytes(kc, kc_ref));
  ASSERT_TRUE(same_bytes(vc, vc_ref));
  const int32_t block = lay.block_ids[0];
  auto expect_stored = [](float got, float x, double want, const char* what, int64_t i) {
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << what << " " << i << ": " << x << " -> " << got;
    } else {
      EXPECT_EQ(double(got), want) << what << " " << i << ": " << x;
    }
  };
  for (int64_t i = 0; i < hd; ++i) {
    const float x = k.f()[i];
    const double want = size_t(i) < cases.size() ? cases[size_t(i)].second : f16_expected(x);
    expect_stored(float(f16_expected(x)), x, want, "the listed rounding of key", i);
    const uint16_t bits = kc.t.ptr<uint16_t>()[block * kc.t.stride[0] + i * kc.t.stride[2]];
    expect_stored(f16_to_f32(bits), x, want, "key", i);
  }
  // The values back through attention: keys zeroed, so one position's weight is exactly 1.
  std::memset(kc.bytes.data(), 0, kc.bytes.size());
  HostTensor q(DType::F32, {1, 1, hd}), out(DType::F32, {1, 1, dv});
  fill_random(q, rng);
  fill_random(out, rng);
  ops.paged_attention(q.t, kc.t, vc.t, lay.l, 1.0f, out.t);
  for (int64_t d = 0; d < dv; ++d) {
    const float x = v.f()[d];
    const size_t c = size_t(dv - 1 - d);
    const double want = c < cases.size() ? cases[c].second : f16_expected(x);
    const uint16_t bits = vc.t.ptr<uint16_t>()[block * vc.t.stride[0] + d];
    expect_stored(f16_to_f32(bits), x, want, "value", d);
    expect_stored(out.f()[d], x, want, "attention over value", d);
  }
}

}  // namespace
}  // namespace recur
