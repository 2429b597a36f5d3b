// Latent attention's prompts on Hopper's warpgroup products (wgmma, sm_90a), over an F16 or
// F8_E4M3 latent cache (e4m3 tiles widened exactly to f16 in shared memory first).
//
// Why: the TF32 kernel (kernels_attention_latent.cu) ran an 8,192-token chunk of Kimi-Linear's
// prompt at ~17 TFLOP/s (548 ms a layer at a 16k-32k context, H200, session 47): its products
// are mma.sync on TF32 halves, 32 rows a block, with the key channels split between warps that
// trade partial scores through shared memory. A latent prompt is multi-query attention with wide
// heads (Kimi-Linear: 32 query heads of 576 / 512 over one latent): every row of a block reads
// the same keys, and the keys' first dv channels are the values.
//
// A block: 64 rows of (token, query head) (two tokens of Kimi-Linear's 32 heads), one kv head,
// two warpgroups over the same rows. Each tile of kKeys positions of the latent is copied
// (cp.async) into the next of two stages while the current one is multiplied; both warpgroups
// compute the tile's scores [64 × kKeys] from the queries' two f16 terms in shared memory (the
// same products in the same order, so the same weights: no partial scores traded, at the price of
// issuing them twice), run the online softmax, and warpgroup w adds P · V for value channels
// [w dv/2, (w + 1) dv/2): V is read out of the same tile, K-major (positions contiguous). The
// weights are split into two f16 terms as the queries are (mma_16bit.cuh): f32's accuracy.
//   Shared memory, in wgmma_desc's layout without swizzling, as byte offsets:
//   - query term i, K-major: row r, channel d at (r/8)·16hd + (d/8)·128 + (r%8)·16 + (d%8)·2;
//   - the tile: channel d, position p at (p/8)·(16hd + 16) + (d/8)·128 + (d%8)·16 + (p%8)·2:
//     MN-major for the scores (B = keysᵀ, positions its columns), K-major for the values (B = V,
//     positions its k), the same 8 × 8 core matrices either way.
// Positions past the block's last one in its last tile are zeroed after they land: they are
// values too, and a weight of 0 times a stale NaN is NaN.
//   Measured against the TF32 kernel (H100, session 52, bench/results/h100-session52-call1.txt:
// Kimi-Linear cut to 8 layers, batch 1, 8,192-token chunks): prefill of 2,048 tokens 44k -> 54k
// tok/s, of 32,768 tokens 8.4k -> 32.4k (F16 cache) and 9.3k -> 30.7k (FP8), so it is the path
// wherever it applies.
#include <algorithm>
#include <type_traits>

#include "backend/cuda/attention_mma.cuh"
#include "backend/cuda/attention_wgmma.cuh"
#include "backend/cuda/cuda_internal.cuh"
#include "backend/cuda/mma_16bit.cuh"
#include "backend/cuda/wgmma.cuh"

namespace recur {
namespace cuda {

namespace {

constexpr int kKeys = kWgmmaTileKeys;  // positions per tile
constexpr int kRows = 64;  // (token, query head) rows per block: one warpgroup's products
constexpr int kThreads = 256;
using M = __half;  // the products' operand type
constexpr int kTerms = kTermsOf<M>;

__host__ __device__ constexpr int group_bytes(int hd) {
  return 16 * hd + 16;  // between a tile's 8-position groups
}

// Byte sizes of the shared-memory regions: the query terms, the f16 tile, and the stages as
// copied (the f16 tiles themselves, or e4m3 [hd][kKeys] beside one f16 tile they widen into).
struct LatentSmem {
  int q_plane, tile, stage, total;
  __host__ __device__ LatentSmem(int hd, bool widen)
      : q_plane(kRows * hd * 2),
        tile(kKeys / 8 * group_bytes(hd)),
        stage(widen ? hd * kKeys : tile) {
    total = kTerms * q_plane + 2 * stage + (widen ? tile : 0);
  }
};

// Zeros positions [from, kKeys) of every channel of a landed f16 tile.
[[maybe_unused]] __device__ __forceinline__ void zero_past(unsigned char* tile, int hd, int from) {
  const int n = kKeys - from;
  for (int e = threadIdx.x; e < hd * n; e += kThreads) {
    const int d = e / n, p = from + e % n;
    *reinterpret_cast<__half*>(tile + (p / 8) * group_bytes(hd) + (d / 8) * 128 + (d % 8) * 16 +
                               (p % 8) * 2) = __half(0.0f);
  }
}

// A landed e4m3 stage [hd][kKeys] widened into the f16 tile, positions from `from` on as zeros.
[[maybe_unused]] __device__ __forceinline__ void widen_keys(const uint8_t* raw, unsigned char* tile,
                                                            int hd, int from) {
  for (int e = threadIdx.x; e < hd * (kKeys / 8); e += kThreads) {
    const int d = e / (kKeys / 8), p = 8 * (e % (kKeys / 8));
    uint2 v = *reinterpret_cast<const uint2*>(raw + d * kKeys + p);
    // Byte j of the pair is position p + j: those from `from` on become +0.
    const int keep = min(max(from - p, 0), 8);
    if (keep < 4) v.x &= keep == 0 ? 0u : (1u << (8 * keep)) - 1u;
    if (keep < 8) v.y &= keep <= 4 ? 0u : (1u << (8 * (keep - 4))) - 1u;
    *reinterpret_cast<uint4*>(tile + (p / 8) * group_bytes(hd) + (d / 8) * 128 + (d % 8) * 16) =
        widen8(v);
  }
}

// grid (row tiles of kRows rows, kv heads), kThreads. T: __half (F16) or the bits of e4m3
// (uint8_t, F8_E4M3); HD, DV: the key and value sizes (compile-time, so that no branch lies among
// a tile's products). acc[j] holds value channels DV/2 · wg + [8j, 8j + 8) of the thread's rows.
template <typename T, int HD, int DV>
__global__ void __launch_bounds__(kThreads, 1) latent_prompt_wgmma_kernel(AttnArgs a) {
#if !defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __trap();  // the PTX for later GPUs: never launched there (Impl::sm90a)
#else
  constexpr bool kWiden = std::is_same_v<T, uint8_t>;
  constexpr int kVec = kWiden ? 4 : 8;  // elements a copy: 4 e4m3, or 16 bytes
  constexpr int kHalf = DV / 2;         // value channels a warpgroup
  constexpr int kg = group_bytes(HD);
  extern __shared__ __align__(128) unsigned char smem[];
  const LatentSmem sm(HD, kWiden);
  auto q_plane = [&](int term) { return smem + term * sm.q_plane; };
  unsigned char* stages = smem + kTerms * sm.q_plane;
  unsigned char* widened = stages + 2 * sm.stage;  // kWiden: the f16 tile
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, wg = warp / 4;
  const int g = lane / 4, c = lane % 4;  // fragment row and column
  const int group = a.group;

  int tile, kvh;
  prompt_tile_and_head(tile, kvh);
  const RowTile rt = find_row_tile(a, kRows / group, tile);
  if (rt.s == a.n_seqs) return;
  const int t0 = rt.t0, n_rows = rt.n_rows;
  const int m0 = 16 * (warp % 4);  // the warp's first row (both warpgroups hold all 64)
  int max_pos, warp_max_pos;
  last_keys(a, t0, rt.t_end, m0, max_pos, warp_max_pos);
  const TileCopier<kKeys, kThreads, kVec> copier(a);
  auto start_tile = [&](int k0, unsigned char* dst) {
    copier.template copy<T>(
        a, rt.table, kvh, k0, max_pos, false,
        [&](int d, int p, const T* src, bool valid) {
          if constexpr (kWiden) {
            copy4_async(dst + d * kKeys + p, src, valid);
          } else {
            copy16_async(dst + (p / 8) * kg + (d / 8) * 128 + (d % 8) * 16, src, valid);
          }
        },
        [](int, int, const T*, bool) {});
  };
  grid_dependency_sync();  // the cache's new positions and the queries come from kernels before
  start_tile(0, stages);
  copy_commit();

  // Queries scaled so that scores come out in log2 units, as their f16 terms, 8 channels a step;
  // neighbouring threads take neighbouring rows, 16 bytes apart.
  const float q_scale = a.scale * 1.4426950408889634f;
  for (int e = tid; e < kRows * (HD / 8); e += kThreads) {
    const int r = e % kRows, d = 8 * (e / kRows);
    float x[8] = {};
    if (r < n_rows) {
      const float* q =
          a.q + int64_t(t0 + r / group) * a.q_s0 + int64_t(kvh * group + r % group) * a.q_s1 + d;
#pragma unroll
      for (int u = 0; u < 8; ++u) x[u] = clamp_f16_range(q[u] * q_scale);
    }
    uint32_t t[4][kTerms];
#pragma unroll
    for (int u = 0; u < 4; ++u) split_x2<M>(x[2 * u], x[2 * u + 1], t[u]);
    const int off = (r / 8) * 16 * HD + (d / 8) * 128 + (r % 8) * 16;
#pragma unroll
    for (int i = 0; i < kTerms; ++i) {
      *reinterpret_cast<uint4*>(q_plane(i) + off) = make_uint4(t[0][i], t[1][i], t[2][i], t[3][i]);
    }
  }
  int row_pos[2];
  fragment_row_positions(a, rt, m0 + g, row_pos);

  float acc[kHalf / 8][4];
#pragma unroll
  for (int j = 0; j < kHalf / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  constexpr float kWs = kWeightScaleOf<M>;

  for (int k0 = 0, it = 0; k0 <= max_pos; k0 += kKeys, ++it) {
    unsigned char* cur = stages + (it % 2) * sm.stage;
    copy_wait<0>();        // this thread's copies of the current tile have landed
    fence_async_shared();  // its stores and copies are visible to the products
    __syncthreads();       // and everyone's; both warpgroups are done with the last tile
    if (k0 + kKeys <= max_pos) start_tile(k0 + kKeys, stages + (1 - it % 2) * sm.stage);
    copy_commit();
    const unsigned char* tile_k = cur;
    const int from = max_pos + 1 - k0;  // the tile's first position past the block's last
    if (kWiden || from < kKeys) {
      if constexpr (kWiden) {
        widen_keys(cur, widened, HD, min(from, kKeys));
        tile_k = widened;
      } else {
        zero_past(cur, HD, from);
      }
      fence_async_shared();
      __syncthreads();
    }
    // Both warpgroups' scores and softmax weights of the tile, the same (the weights times kWs:
    // the denominators too, below).
    uint32_t ap[kKeys / 16][kTerms][4];
    wgmma_tile_weights<M>(
        HD / 16, [&](int i, int kk) { return wgmma_desc(q_plane(i) + kk * 256, 128, 16 * HD); },
        [&](int kk) { return wgmma_desc(tile_k + kk * 256, 128, kg); }, k0, c, row_pos, m, l, acc,
        ap);
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
      // V [16 positions × kHalf channels] K-major: positions 8 apart are a group (kg) apart,
      // channels 8 apart 128 bytes.
      const uint64_t vd = wgmma_desc(tile_k + 2 * kk * kg + wg * (kHalf / 8) * 128, kg, 128);
#pragma unroll
      for (int i = kTerms - 1; i >= 0; --i) wgmma_rs_kmajor_f16<kHalf>(acc, ap[kk][i], vd, true);
    }
    wgmma_commit();
    wgmma_wait<0>();
    pin_registers(acc);
  }
  quad_sums(l);
  l[0] *= kWs, l[1] *= kWs;
  store_rows(a, acc, l, m0, g, c, n_rows, t0, kvh, wg * kHalf);
#endif
}

template <typename T, int HD, int DV>
void launch_shape(const AttnArgs& a, dim3 grid, cudaStream_t stream) {
  constexpr auto kKernel = latent_prompt_wgmma_kernel<T, HD, DV>;
  const size_t smem = size_t(LatentSmem(HD, std::is_same_v<T, uint8_t>).total);
  opt_in_smem<kKernel>(smem);
  launch_kernel(kKernel, grid, kThreads, smem, stream, a);
}

}  // namespace

bool latent_prompt_wgmma(CudaOps::Impl& s, const AttnArgs& a, const Tensor& k_cache,
                         const SeqLayout& layout, int kv_heads) {
  const DType dt = k_cache.dtype;
  // Kimi-Linear's heads (576 / 512), at most a block's rows a group; 16-byte copies of an F16
  // cache (8-element aligned, strides and blocks multiples of 8), 4-byte ones of an e4m3 cache
  // (the caller has checked 4-element alignment and blocks of a multiple of 4).
  const bool f16_copies = dt == DType::F16 && reinterpret_cast<uintptr_t>(k_cache.data) % 16 == 0 &&
                          k_cache.stride[0] % 8 == 0 && k_cache.stride[1] % 8 == 0 &&
                          k_cache.stride[2] % 8 == 0 && a.bs % 8 == 0;
  if (!s.sm90a || !(f16_copies || dt == DType::F8_E4M3) || a.hd != 576 || a.dv != 512 ||
      a.group > kRows || size_t(LatentSmem(a.hd, dt == DType::F8_E4M3).total) > s.max_smem_optin) {
    return false;
  }
  double positions = 0;  // for the profile: a block reads the latent up to its last position
  const int64_t row_tiles =
      prompt_row_tiles(layout, kRows / a.group, s.options.profile ? &positions : nullptr);
  if (row_tiles == 0) return true;
  if (s.options.profile) {
    s.work(attention_flops(layout, a.heads, a.hd, a.dv),
           positions * double(kv_heads) * double(a.hd) * double(dtype_size(dt)));
  }
  const dim3 grid{unsigned(row_tiles), unsigned(kv_heads)};
  if (dt == DType::F16) {
    launch_shape<__half, 576, 512>(a, grid, s.stream);
  } else {
    launch_shape<uint8_t, 576, 512>(a, grid, s.stream);
  }
  s.launched("paged_attention (latent prompt, wgmma)");
  return true;
}

}  // namespace cuda
}  // namespace recur
