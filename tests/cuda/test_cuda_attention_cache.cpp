// Attention over caches of each element type (F32, BF16, F16, F8_E4M3) on the GPU: cache writes
// equal the CPU reference's bytes (the same rounding), and attention equals the scalar
// reference reading the same rounded cache, through every kernel: decode (group sizes 1 to 16,
// head dims 64 to 256, dv ≠ hd, splits and their merge; the tensor-core decode kernel for
// BF16, F16 and F8_E4M3 caches, groups of up to 16 and head dims multiples of 64), the warp
// kernel (head dims not multiples of 32), the tiled kernel (groups too large for the warp
// kernel), the tensor-core prompt kernels (TF32 halves for F32, bf16 terms for BF16, f16 terms
// for F16 and F8_E4M3; fresh prompts and prompts continuing a cached prefix, head sizes up to
// 256), and the latent (strided-value) view up to the published Kimi-Linear's 32 heads of 576/512
// in one call (the tiled kernel, the tensor-core latent kernel, the decode kernel's latent form
// and, for F16 and F8_E4M3 prompts on a Hopper, the warpgroup latent kernel); the fused attention
// input stage writes each type as the default does.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "backend/cpu/reference.h"
#include "cuda/cuda_test_util.h"

namespace recur {
namespace {

using namespace testing;

class CudaAttentionCache : public CudaTest, public ::testing::WithParamInterface<DType> {};

INSTANTIATE_TEST_SUITE_P(Types, CudaAttentionCache,
                         ::testing::Values(DType::F32, DType::BF16, DType::F16, DType::F8_E4M3),
                         [](const ::testing::TestParamInfo<DType>& i) {
                           return std::string(dtype_name(i.param));
                         });

struct Case {
  int64_t group, hd, dv;
  int block_size;
  std::vector<int> lens, first;
};

TEST_P(CudaAttentionCache, EveryKernelMatchesReferenceOverTheSameCache) {
  const DType dt = GetParam();
  const Case cases[] = {
      // Decode kernel: group sizes, head dims, dv ≠ hd both ways, long histories (splits).
      {1, 64, 64, 16, {1, 1, 1}, {5000, 31, 0}},
      {2, 64, 64, 32, {1, 1, 1}, {3000, 31, 0}},
      {4, 128, 128, 16, {1, 2, 1}, {1000, 3, 63}},
      {8, 128, 128, 16, {5, 1}, {100, 40}},
      {8, 256, 256, 16, {1}, {6000}},
      {8, 192, 128, 16, {1, 1}, {4000, 70}},
      {2, 64, 128, 16, {1, 1, 1}, {3000, 31, 0}},
      {16, 256, 256, 16, {1}, {6000}},  // Qwen3.5-122B-A10B's heads
      {12, 128, 64, 16, {1, 1}, {900, 40}},
      // Warp kernel (hd 20, 40), odd groups, a prompt continuing a cached prefix.
      {3, 20, 20, 16, {1, 33, 17}, {70, 0, 16}},
      {5, 40, 24, 16, {1, 33, 17}, {70, 0, 21}},
      // Tiled kernel: a group too large for the warp kernel.
      {24, 64, 160, 16, {1, 3}, {300, 40}},
      // Tensor-core prompt kernel: fresh prompts, continuations, groups not dividing 64.
      {1, 64, 64, 16, {300, 5, 80}, {0, 700, 40}},
      {3, 128, 128, 32, {100, 1}, {37, 2000}},
      {8, 192, 128, 16, {100, 33}, {0, 50}},
      {2, 128, 64, 16, {130}, {0}},
      // Qwen3-Next's heads continuing a prefix; a value head not a multiple of 16.
      {8, 256, 256, 16, {200}, {1000}},
      {4, 32, 24, 16, {100, 70}, {0, 9}},
      // A value head of 20 four-element chunks: a thread's value copies wrap to later rows.
      {2, 64, 80, 16, {90, 40}, {0, 30}},
      // Blocks of 12 positions: 16-bit caches copied 4 elements at a time, not 8.
      {8, 256, 256, 12, {150}, {100}},
  };
  for (const Case& c : cases) {
    const int64_t kv = 2, heads = kv * c.group, hd = c.hd, dv = c.dv;
    Layout lay(c.lens, c.first, c.block_size, rng);
    const int64_t n = lay.l.n_tokens;
    HostTensor kc(dt, {lay.n_blocks(), kv, hd, c.block_size}),
        vc(dt, {lay.n_blocks(), kv, c.block_size, dv});
    fill_random(kc, rng);  // the history written by earlier forwards
    fill_random(vc, rng);
    poison_past_ends(lay, c.lens, c.first, kc, &vc);
    HostTensor k(DType::F32, {n, kv, hd}), v(DType::F32, {n, kv, dv}),
        q(DType::F32, {n, heads, hd});
    fill_random(k, rng);
    fill_random(v, rng, 3.0f);
    fill_random(q, rng);
    DeviceTensor dkc = dev(kc), dvc = dev(vc), dk = dev(k), dv_ = dev(v), dq = dev(q);
    HostTensor kc_ref = kc, vc_ref = vc;
    ops().begin_forward(lay.l, {}, {});
    ops().kv_cache_write(dk.t, dv_.t, dkc.t, dvc.t, lay.l);
    ref::kv_cache_write(k.t, v.t, kc_ref.t, vc_ref.t, lay.l);
    const std::string what = std::string(dtype_name(dt)) + " group=" + std::to_string(c.group) +
                             " hd=" + std::to_string(hd) + " dv=" + std::to_string(dv) +
                             " n=" + std::to_string(n) + " first=" + std::to_string(c.first[0]);
    ASSERT_TRUE(same_bits(host(dkc, kc), kc_ref)) << what;
    ASSERT_TRUE(same_bits(host(dvc, vc), vc_ref)) << what;
    HostTensor out(DType::F32, {n, heads, dv}), ref = out;
    DeviceTensor dout = poisoned(out);
    const float scale = 1.0f / std::sqrt(float(hd));
    ops().paged_attention(dq.t, dkc.t, dvc.t, lay.l, scale, dout.t);
    ref::paged_attention(q.t, kc_ref.t, vc_ref.t, lay.l, scale, ref.t);
    const double err = max_abs_diff(host(dout, out).f(), ref.f(), out.numel());
    record_error(std::string("paged_attention cache ") + dtype_name(dt), err);
    // 2e-5 as the other kernels at head sizes up to 128; the tensor-core path's TF32 halves
    // leave about 2^-20 per product, whose sum grows with √hd (2.19e-5 measured at hd 192).
    EXPECT_LE(err, 2e-5 * std::max(1.0, std::sqrt(double(hd) / 128.0))) << what;
  }
}

// Softmax weights far below the largest keep their precision: one key scores 24.5 (log2
// units) above 12,000 others, whose weights 2^-24.5 lie under f16's subnormals unless scaled
// first (kWeightScaleOf); their values are 1 and the top key's 0, so the output is their share
// of the weight (12,000 · 2^-24.5, about 5.1e-4), which weights rounded to f16's subnormal
// step move by about 2e-4 in the prompt kernel (2.11e-4 measured with the scaling removed; a
// decode's context splits each take their own maximum). Decode (one token) and prompt (100
// tokens) kernels.
TEST_P(CudaAttentionCache, TinySoftmaxWeightsKeepTheirPrecision) {
  const DType dt = GetParam();
  const int64_t kv = 2, group = 8, hd = 64, dv = 64;
  const uint32_t one = dt == DType::F32    ? 0x3f800000u
                       : dt == DType::BF16 ? 0x3f80u
                       : dt == DType::F16  ? 0x3c00u
                                           : 0x38u;  // 1.0's bits in the cache type
  auto set_one = [&](HostTensor& h, int64_t i) {
    std::memcpy(static_cast<uint8_t*>(h.t.data) + i * dtype_size(dt), &one, dtype_size(dt));
  };
  for (const int len : {1, 100}) {
    Layout lay({len}, {12000}, 16, rng);
    HostTensor kc(dt, {lay.n_blocks(), kv, hd, 16}), vc(dt, {lay.n_blocks(), kv, 16, dv});
    for (int64_t i = 0; i < vc.numel(); ++i) set_one(vc, i);
    const int64_t block0 = lay.block_ids[0];  // position 0: key channel 0 is 1, values 0
    for (int64_t h = 0; h < kv; ++h) {
      set_one(kc, block0 * kc.t.stride[0] + h * kc.t.stride[1]);
      std::memset(static_cast<uint8_t*>(vc.t.data) +
                      (block0 * vc.t.stride[0] + h * vc.t.stride[1]) * dtype_size(dt),
                  0, dv * dtype_size(dt));
    }
    const float scale = 1.0f / std::sqrt(float(hd));
    HostTensor q(DType::F32, {len, kv * group, hd});
    for (int64_t t = 0; t < len * kv * group; ++t)
      q.f()[t * hd] = 24.5f / (scale * 1.4426950408889634f);
    DeviceTensor dkc = dev(kc), dvc = dev(vc), dq = dev(q);
    HostTensor out(DType::F32, {len, kv * group, dv}), ref = out;
    DeviceTensor dout = poisoned(out);
    ops().begin_forward(lay.l, {}, {});
    ops().paged_attention(dq.t, dkc.t, dvc.t, lay.l, scale, dout.t);
    ref::paged_attention(q.t, kc.t, vc.t, lay.l, scale, ref.t);
    ASSERT_GT(ref.f()[0], 2e-4);
    const double err = max_abs_diff(host(dout, out).f(), ref.f(), out.numel());
    EXPECT_LE(err, 2e-5) << dtype_name(dt) << " tokens " << len;
  }
}

// The latent cache in each type: values are the keys' first dv channels (v_cache a view of
// k_cache, channels block_size apart), written through the view; attention equals the
// reference, up to the published Kimi-Linear's 32 heads of 576 (values 512) in one call, at
// decode (long histories: splits) and for prompts, through the tiled kernel, the tensor-core
// latent kernel and (few tokens, 16-bit and FP8 caches) the decode kernel's latent form, with
// NaN in the cache past each sequence's end.
TEST_P(CudaAttentionCache, LatentViewMatchesReferenceUpToKimiGroup) {
  const DType dt = GetParam();
  const Case cases[] = {// The tiled kernel (head sizes not multiples of 32, blocks of 5).
                        {4, 24, 16, 16, {1, 33, 17}, {70, 0, 16}},
                        {5, 24, 16, 5, {1, 2, 9}, {100, 3, 0}},
                        // The tensor-core kernel: two tokens' rows a block (prompts), half its
                        // rows idle (decode), a group not dividing 32, blocks of 8.
                        {16, 64, 32, 16, {37, 5}, {0, 90}},
                        {16, 64, 32, 16, {1, 1}, {500, 3}},
                        {20, 128, 64, 8, {7, 1}, {30, 200}},
                        {32, 576, 512, 16, {1, 1}, {3000, 70}},
                        {32, 576, 512, 16, {40, 1}, {0, 600}},
                        {32, 576, 512, 16, {1, 3, 1}, {9000, 20, 1}},
                        // Past the decode kernel's 64 tokens (the tensor-core latent kernel for
                        // every type), contexts ending inside a copied chunk.
                        {16, 64, 32, 16, {60, 9}, {0, 90}},
                        {32, 576, 512, 16, {66}, {13}},
                        // Kimi-Linear's heads past 64 tokens (on a Hopper the warpgroup latent
                        // kernel for F16 and F8_E4M3): ragged prompts, one continuing a cached
                        // prefix, contexts ending inside a tile and a copied chunk; a group not
                        // dividing the block's 64 rows (three tokens of 20 heads).
                        {32, 576, 512, 16, {97, 70}, {0, 301}},
                        {20, 576, 512, 8, {71}, {5}},
                        // The decode kernel's latent form with head tiles partly or half idle.
                        {8, 128, 64, 16, {1, 1}, {77, 300}},
                        {24, 320, 256, 32, {1, 2}, {1000, 45}}};
  ASSERT_LE(32 * 576, Ops::kMaxAttentionGroupDims);
  for (const Case& c : cases) {
    const int64_t heads = c.group, hd = c.hd, dv = c.dv;
    const int bs = c.block_size;
    Layout lay(c.lens, c.first, bs, rng);
    const int64_t n = lay.l.n_tokens;
    HostTensor kc(dt, {lay.n_blocks(), 1, hd, bs});
    fill_random(kc, rng);
    // Those keys are values too: a kernel must drop them before the weighted sum.
    poison_past_ends(lay, c.lens, c.first, kc, nullptr);
    auto values_of = [&](Tensor keys) {
      keys.shape[2] = bs, keys.shape[3] = dv;
      keys.stride[2] = 1, keys.stride[3] = bs;
      return keys;
    };
    HostTensor k(DType::F32, {n, hd}), q(DType::F32, {n, heads, hd});
    fill_random(k, rng);
    fill_random(q, rng, 0.3f);
    DeviceTensor dkc = dev(kc), dk = dev(k), dq = dev(q);
    HostTensor kc_ref = kc;
    ops().begin_forward(lay.l, {}, {});
    ops().kv_cache_write(dk.t.col_heads(0, 1, hd), dk.t.col_heads(0, 1, dv), dkc.t,
                         values_of(dkc.t), lay.l);
    ref::kv_cache_write(k.t.col_heads(0, 1, hd), k.t.col_heads(0, 1, dv), kc_ref.t,
                        values_of(kc_ref.t), lay.l);
    const std::string what = std::string(dtype_name(dt)) + " group=" + std::to_string(c.group) +
                             " hd=" + std::to_string(hd) + " first=" + std::to_string(c.first[0]);
    ASSERT_TRUE(same_bits(host(dkc, kc), kc_ref)) << what;
    HostTensor out(DType::F32, {n, heads, dv}), ref = out;
    DeviceTensor dout = poisoned(out);
    const float scale = 1.0f / std::sqrt(float(hd));
    ops().paged_attention(dq.t, dkc.t, values_of(dkc.t), lay.l, scale, dout.t);
    ref::paged_attention(q.t, kc_ref.t, values_of(kc_ref.t), lay.l, scale, ref.t);
    const double err = max_abs_diff(host(dout, out).f(), ref.f(), out.numel());
    record_error(std::string("paged_attention latent cache ") + dtype_name(dt), err);
    EXPECT_LE(err, 2e-5) << what;
  }
}

// The fused attention input stage writes a narrow cache as the ops.cpp default (rms_norm, rope,
// kv_cache_write) does, bit for bit: the Qwen3-Next shape at decode, a ragged prompt batch, and
// value heads of other sizes than the key heads.
TEST_P(CudaAttentionCache, FusedAttentionInputsEqualTheDefault) {
  const DType dt = GetParam();
  struct Dims {
    int64_t heads, kv, hd, dv;
    int rot;
    std::vector<int> lens, first;
  };
  const Dims cases[] = {{16, 2, 256, 256, 64, {1, 1, 1}, {2050, 0, 31}},
                        {4, 2, 40, 40, 20, {3, 1, 5}, {0, 17, 40}},
                        {8, 2, 192, 128, 64, {5, 1}, {0, 77}},
                        {4, 1, 64, 320, 64, {1, 3}, {9, 20}}};
  for (const Dims& d : cases) {
    Layout lay(d.lens, d.first, 16, rng);
    AttentionInputCase c(lay.l, lay.n_blocks(), d.heads, d.kv, d.hd, d.dv, d.rot, DType::BF16, rng,
                         dt);
    const auto runs = fused_and_default_attention_inputs(c, lay.l);
    const std::string what =
        std::string(dtype_name(dt)) + " hd=" + std::to_string(d.hd) + " dv=" + std::to_string(d.dv);
    EXPECT_TRUE(same_bits(host(runs[0].kc, c.kc), host(runs[1].kc, c.kc))) << "k cache " << what;
    EXPECT_TRUE(same_bits(host(runs[0].vc, c.vc), host(runs[1].vc, c.vc))) << "v cache " << what;
    EXPECT_TRUE(same_bits(host(runs[0].k, c.k), host(runs[1].k, c.k))) << "k " << what;
  }
}

// An F16 cache saturates as the CPU's does: past ±65504 (infinities too) to ±65504, NaN kept,
// subnormals and ties rounded to nearest even; the bytes equal the reference's.
TEST_F(CudaTest, F16CacheWritesSaturateAsTheReference) {
  const float tiny = std::ldexp(1.0f, -24);  // f16's smallest subnormal
  const float extremes[] = {1e6f,     -1e6f,       65519.0f,  70000.0f, NAN,
                            1e-6f,    INFINITY,    -INFINITY, 65520.0f, -65536.0f,
                            tiny / 2, tiny * 1.5f, 6.1e-5f,   -0.0f};
  const int64_t hd = 64, dv = 64;
  Layout lay({2}, {0}, 16, rng);
  HostTensor k(DType::F32, {2, 1, hd}), v(DType::F32, {2, 1, dv});
  fill_random(k, rng, 100.0f);
  fill_random(v, rng, 100.0f);
  for (size_t i = 0; i < std::size(extremes); ++i) {
    k.f()[i] = extremes[i];
    v.f()[2 * dv - 1 - i] = extremes[i];
  }
  HostTensor kc(DType::F16, {lay.n_blocks(), 1, hd, 16}),
      vc(DType::F16, {lay.n_blocks(), 1, 16, dv});
  fill_random(kc, rng);
  fill_random(vc, rng);
  DeviceTensor dkc = dev(kc), dvc = dev(vc), dk = dev(k), dv_ = dev(v);
  HostTensor kc_ref = kc, vc_ref = vc;
  ops().begin_forward(lay.l, {}, {});
  ops().kv_cache_write(dk.t, dv_.t, dkc.t, dvc.t, lay.l);
  ref::kv_cache_write(k.t, v.t, kc_ref.t, vc_ref.t, lay.l);
  EXPECT_TRUE(same_bits(host(dkc, kc), kc_ref));
  EXPECT_TRUE(same_bits(host(dvc, vc), vc_ref));
}

// One token's attention over a long context of Qwen3-Next's heads (8 query heads of 256 a kv
// head) and of Qwen3.5-122B-A10B's (16) runs on the tensor-core decode kernel over a BF16, F16
// or F8_E4M3 cache, split across blocks and merged; the F32 cache keeps the CUDA-core one. (The
// results of both are checked against the reference above.)
TEST(CudaAttentionDecode, NarrowCachesTakeTheTensorCoreKernel) {
  std::mt19937 rng(21);
  for (const DType dt : {DType::BF16, DType::F16, DType::F8_E4M3, DType::F32}) {
    for (const int64_t group : {8, 16}) {
      bool ok = false;
      const std::string table = profile_table(
          [&](CudaOps& ops) {
            const int64_t kv = 2, hd = 256;
            Layout lay(std::vector<int>{1}, std::vector<int>{3000}, 16, rng);
            HostTensor kc(dt, {lay.n_blocks(), kv, hd, 16}), vc(dt, {lay.n_blocks(), kv, 16, hd});
            HostTensor q(DType::F32, {1, kv * group, hd}), out(DType::F32, {1, kv * group, hd});
            fill_random(kc, rng);
            fill_random(vc, rng);
            fill_random(q, rng);
            DeviceTensor dkc(ops, kc), dvc(ops, vc), dq(ops, q), dout(ops, out);
            ops.begin_forward(lay.l, {}, {});  // the profile labels the launches from here
            ops.paged_attention(dq.t, dkc.t, dvc.t, lay.l, 0.0625f, dout.t);
            ops.synchronize();
          },
          &ok);
      if (!ok) GTEST_SKIP() << "no usable CUDA device";
      const bool narrow = dt != DType::F32;
      const std::string what = std::string(dtype_name(dt)) + " group " + std::to_string(group);
      EXPECT_EQ(profile_count(table, "decode b=1 paged_attention (decode, tensor cores)"),
                narrow ? 1 : -1)
          << what << table;
      EXPECT_EQ(profile_count(table, "decode b=1 paged_attention (decode) "), narrow ? -1 : 1)
          << what << table;
      EXPECT_EQ(profile_count(table, "decode b=1 paged_attention (combine)"), 1) << what << table;
    }
  }
}

// A latent prompt of Kimi-Linear's heads over an F16 or F8_E4M3 cache takes the warpgroup latent
// kernel on a Hopper, and the TF32 latent kernel over BF16 and F32 caches (and without sm_90a).
TEST(CudaAttentionLatent, PromptsTakeTheWarpgroupKernelOverF16AndFp8) {
  std::mt19937 rng(47);
  for (const DType dt : {DType::BF16, DType::F16, DType::F8_E4M3, DType::F32}) {
    bool ok = false;
    const std::string table = profile_table(
        [&](CudaOps& ops) {
          const int64_t heads = 32, hd = 576, dv = 512, bs = 16;
          Layout lay(std::vector<int>{80}, std::vector<int>{0}, bs, rng);
          HostTensor kc(dt, {lay.n_blocks(), 1, hd, bs});
          HostTensor q(DType::F32, {80, heads, hd}), out(DType::F32, {80, heads, dv});
          fill_random(kc, rng);
          fill_random(q, rng, 0.3f);
          DeviceTensor dkc(ops, kc), dq(ops, q), dout(ops, out);
          Tensor values = dkc.t;
          values.shape[2] = bs, values.shape[3] = dv, values.stride[2] = 1, values.stride[3] = bs;
          ops.begin_forward(lay.l, {}, {});  // the profile labels the launches from here
          ops.paged_attention(dq.t, dkc.t, values, lay.l, 1.0f / 24.0f, dout.t);
          ops.synchronize();
        },
        &ok);
    if (!ok) GTEST_SKIP() << "no usable CUDA device";
    const bool wgmma = device_is_sm90a() && (dt == DType::F16 || dt == DType::F8_E4M3);
    EXPECT_EQ(profile_count(table, "prompt n=80 paged_attention (latent prompt, wgmma)"),
              wgmma ? 1 : -1)
        << dtype_name(dt) << table;
    EXPECT_EQ(profile_count(table, "prompt n=80 paged_attention (latent, tensor cores)"),
              wgmma ? -1 : 1)
        << dtype_name(dt) << table;
  }
}

}  // namespace
}  // namespace recur
