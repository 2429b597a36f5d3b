// Paged attention over caches of each element type (F32, BF16, F8_E4M3): cache writes equal
// the scalar reference's bytes, and attention equals the reference reading the same rounded
// cache, on ragged batches (decode tokens with history, fresh prompts, prompts continuing a
// cached prefix), grouped-query heads of odd sizes, the latent (strided-value) view, and the
// published Kimi-Linear's latent group (32 heads of 576/512) in one call.
#include <cstdio>
#include <cstring>

#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/reference.h"
#include "ops/op_test_util.h"

namespace recur {
namespace {

using testing::fill_random;
using testing::HostTensor;
using testing::Layout;
using testing::max_abs_diff;

constexpr DType kCacheTypes[] = {DType::F32, DType::BF16, DType::F8_E4M3};

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
  // bf16 keeps 8 significant bits (relative error ≤ 2^-9), e4m3 4 (≤ 2^-4): outputs of
  // unit-scale random heads move by about that much.
  const double err = max_abs_diff(out.f(), out32.f(), out.numel());
  const double bound = dt == DType::F32 ? 0.0 : dt == DType::BF16 ? 3e-2 : 4e-1;
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

}  // namespace
}  // namespace recur
