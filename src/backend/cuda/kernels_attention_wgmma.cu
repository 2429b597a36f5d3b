// Prompt attention over a BF16, F16 or F8_E4M3 cache on Hopper's warpgroup products (wgmma; e4m3
// tiles widened exactly to f16 in shared memory first): the online softmax of flash attention
// over tiles of the paged cache, as kernels_attention_16bit.cu's kernel computes it (the same
// terms of the queries and weights, the same masks, the same softmax code), with the products
// issued a warpgroup at a time from shared memory.
//   Why: that kernel runs mma.sync on 16 rows a warp, and with the queries and weights split into
// two f16 (three bf16) terms a warp cannot hold its queries and a whole head's value
// accumulators in registers, so it splits the channels between warp pairs that trade partial
// scores through shared memory; at 65,536 tokens it issued a product every ~26 cycles a
// scheduler (about 100 TFLOP/s counted once, bench/results/h200-session30-run1-prof-65k.txt).
// Here the queries stay in shared memory and a warpgroup's one instruction multiplies 64 rows by
// a tile, so a warp keeps all its channels and no scores are traded.
//   A block: warpgroups of 64 query rows each (a row is a token and a query head of the group;
// two warpgroups for f16 terms, one for bf16's three, whose query planes fill shared memory),
// one kv head, sharing each tile of kKeys positions of keys and values, copied (cp.async) into
// the next of two stages while the current one is multiplied. Per tile a warpgroup computes
// scores [64 × kKeys] = Σ over channels of Q · K (a product a term, the small term first), runs
// the online softmax of its rows, and adds P · V [64 × dv] (a product a term of P).
//   Shared memory, in wgmma_desc's layout without swizzling, as byte offsets:
//   - Q term i of warpgroup w, K-major: row r, channel d at
//     (r/8)·16hd + (d/8)·128 + (r%8)·16 + (d%8)·2;
//   - keys, MN-major (positions contiguous, as the cache holds them): channel d, position p at
//     (p/8)·(16hd + 16) + (d/8)·128 + (d%8)·16 + (p%8)·2;
//   - values, MN-major (channels contiguous): position p, channel d at
//     (d/8)·(16·kKeys + 16) + (p/8)·128 + (p%8)·16 + (d%8)·2.
//   The 16 bytes past each group of 8 positions (keys) or channels (values) put the 16-byte
// copies of neighbouring threads, which step those groups, in distinct banks.
#include <algorithm>
#include <cmath>
#include <type_traits>

#include <cuda_fp8.h>

#include "backend/cuda/attention_mma.cuh"
#include "backend/cuda/attention_wgmma.cuh"
#include "backend/cuda/cuda_internal.cuh"
#include "backend/cuda/mma_16bit.cuh"
#include "backend/cuda/wgmma.cuh"

namespace recur {
namespace cuda {

namespace {

constexpr int kKeys = kWgmmaTileKeys;  // positions per tile

// A block's shape for a cache of elements T: __half (F16), the bits of bf16 (uint16_t, BF16) or
// of e4m3 (uint8_t, F8_E4M3, widened exactly to f16 in shared memory before the products). M,
// the products' operand type: f16 splits the queries and weights into two terms and runs two
// warpgroups of 64 rows; bf16 needs three terms, whose queries leave room for one warpgroup.
template <typename T>
struct Shape {
  static constexpr bool kWiden = std::is_same_v<T, uint8_t>;
  using M = std::conditional_t<std::is_same_v<T, uint16_t>, __nv_bfloat16, __half>;
  static constexpr bool kF16 = std::is_same_v<M, __half>;
  static constexpr int kTerms = kTermsOf<M>;
  static constexpr int kGroups = kF16 ? 2 : 1;  // warpgroups of 64 rows
  static constexpr int kThreads = 128 * kGroups;
  static constexpr int kRows = 64 * kGroups;
  static constexpr int kVec = kWiden ? 4 : 8;  // elements a copy: 16 bytes, or 4 e4m3
};
static_assert(Shape<__half>::kVec * 2 == 16 && Shape<uint16_t>::kVec * 2 == 16 &&
                  Shape<uint8_t>::kVec == 4,
              "16-byte copies of 16-bit elements, 4-byte ones of e4m3");

// Bytes between core-matrix groups of the key and value tiles (see the layout above).
__host__ __device__ constexpr int key_group_bytes(int hd) {
  return 16 * hd + 16;
}
constexpr int kValueGroupBytes = 16 * kKeys + 16;

// Byte sizes of the shared-memory regions for head sizes hd, dv, with `planes` query planes
// (terms × warpgroups): the f16/bf16 tiles in the products' layout, two stages of them or, when
// widened, one, beside two stages of the raw e4m3 tiles (keys [hd][kKeys], values [kKeys][dv]).
struct Smem {
  int q_plane, k_stage, v_stage, raw_k, raw_v, total;
  __host__ __device__ Smem(int hd, int dv, int planes, bool widen)
      : q_plane(64 * hd * 2),
        k_stage(kKeys / 8 * key_group_bytes(hd)),
        v_stage(dv / 8 * kValueGroupBytes),
        raw_k(widen ? hd * kKeys : 0),
        raw_v(widen ? kKeys * dv : 0) {
    total = planes * q_plane +
            (widen ? 2 * (raw_k + raw_v) + k_stage + v_stage : 2 * (k_stage + v_stage));
  }
};
template <typename T>
__host__ __device__ Smem smem_of(int hd, int dv) {
  using S = Shape<T>;
  return Smem(hd, dv, S::kTerms * S::kGroups, S::kWiden);
}

// Starts the copies of positions k0 .. k0 + kKeys − 1 (zeros past last) into a stage: 16-bit
// tiles straight into the products' layout, e4m3 ones as they lie (4 bytes a copy).
template <typename T, int kThreads>
__device__ __forceinline__ void start_tile(
    const TileCopier<kKeys, kThreads, Shape<T>::kVec>& copier, const AttnArgs& a,
    const int32_t* table, int kvh, int k0, int last, unsigned char* Ks, unsigned char* Vs) {
  const int kg = key_group_bytes(a.hd), dv = a.dv;
  copier.template copy<T>(
      a, table, kvh, k0, last, true,
      [&](int d, int p, const T* src, bool valid) {
        if constexpr (Shape<T>::kWiden) {
          copy4_async(Ks + d * kKeys + p, src, valid);
        } else {
          copy16_async(Ks + (p / 8) * kg + (d / 8) * 128 + (d % 8) * 16, src, valid);
        }
      },
      [&](int p, int d, const T* src, bool valid) {
        if constexpr (Shape<T>::kWiden) {
          copy4_async(Vs + p * dv + d, src, valid);
        } else {
          copy16_async(Vs + (d / 8) * kValueGroupBytes + (p / 8) * 128 + (p % 8) * 16, src, valid);
        }
      });
}

// A landed e4m3 stage (keys [hd][kKeys], values [kKeys][dv]) widened into the products' f16
// tiles, 8 elements (one 8-byte read, one 16-byte store) a step.
template <int kThreads>
__device__ __forceinline__ void widen_tile(const uint8_t* rk, const uint8_t* rv, unsigned char* Kf,
                                           unsigned char* Vf, int hd, int dv) {
  const int kg = key_group_bytes(hd);
  for (int e = threadIdx.x; e < hd * (kKeys / 8); e += kThreads) {
    const int d = e / (kKeys / 8), p = 8 * (e % (kKeys / 8));
    *reinterpret_cast<uint4*>(Kf + (p / 8) * kg + (d / 8) * 128 + (d % 8) * 16) =
        widen8(*reinterpret_cast<const uint2*>(rk + d * kKeys + p));
  }
  for (int e = threadIdx.x; e < kKeys * (dv / 8); e += kThreads) {
    const int p = e / (dv / 8), d = 8 * (e % (dv / 8));
    *reinterpret_cast<uint4*>(Vf + (d / 8) * kValueGroupBytes + (p / 8) * 128 + (p % 8) * 16) =
        widen8(*reinterpret_cast<const uint2*>(rv + p * dv + d));
  }
}

// grid (row tiles of kRows rows, kv heads), kThreads (Shape<T>). HD = DV: the head size (64, 128
// or 256: the products' width; compile-time, so that no branch lies among a tile's products,
// which ptxas would otherwise serialize). acc[j] holds value channels [8j, 8j + 8) of the
// thread's rows.
template <typename T, int HD, int DV>
__global__ void __launch_bounds__(Shape<T>::kThreads, 1) attention_wgmma_kernel(AttnArgs a) {
#if !defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __trap();  // the PTX for later GPUs: never launched there (Impl::sm90a)
#else
  using S = Shape<T>;
  using M = typename S::M;
  constexpr int kTerms = S::kTerms, kGroups = S::kGroups, kThreads = S::kThreads, kRows = S::kRows;
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int hd = HD;
  const int group = a.group;
  const Smem sm = smem_of<T>(hd, DV);
  auto q_plane = [&](int term, int wg) { return smem + (term * kGroups + wg) * sm.q_plane; };
  unsigned char* stages = smem + kTerms * kGroups * sm.q_plane;
  // The copies' stages: the products' tiles themselves, or the raw e4m3 tiles, widened each
  // tile into the one f16 tile after them.
  const int stage_bytes = S::kWiden ? sm.raw_k + sm.raw_v : sm.k_stage + sm.v_stage;
  auto stage_k = [&](int i) { return stages + i * stage_bytes; };
  auto stage_v = [&](int i) {
    return stages + i * stage_bytes + (S::kWiden ? sm.raw_k : sm.k_stage);
  };
  unsigned char* Kf = stages + 2 * stage_bytes;  // widened tiles (kWiden)
  unsigned char* Vf = Kf + sm.k_stage;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, wg = warp / 4;
  const int g = lane / 4, c = lane % 4;  // fragment row and column

  const int tokens_per_tile = kRows / group;
  int tile, kvh;
  prompt_tile_and_head(tile, kvh);
  const RowTile rt = find_row_tile(a, tokens_per_tile, tile);
  if (rt.s == a.n_seqs) return;
  const int t0 = rt.t0, t_end = rt.t_end, n_rows = rt.n_rows;
  const int32_t* table = rt.table;
  const int m0 = 64 * wg + 16 * (warp % 4);  // the warp's first row
  // The last key any row of the block attends to: every warpgroup walks every tile (a tile
  // past a warpgroup's rows leaves its sums unchanged), so that no branch separates products.
  int max_pos, warp_max_pos;
  last_keys(a, t0, t_end, m0, max_pos, warp_max_pos);
  // As in the 16-bit kernel: a first tile written by earlier forwards is copied before the
  // wait for the kernel before (which writes this forward's positions).
  constexpr int kElem = int(sizeof(T));
  const bool early = kKeys % a.bs == 0 && a.kc_s1 * kElem % 128 == 0 &&
                     a.vc_s1 * kElem % 128 == 0 &&
                     min(max_pos, kKeys - 1) < a.positions[a.seq_start[rt.s]];
  const TileCopier<kKeys, kThreads, S::kVec> copier(a);
  if (early) start_tile<T>(copier, a, table, kvh, 0, max_pos, stage_k(0), stage_v(0));
  grid_dependency_sync();
  if (!early) start_tile<T>(copier, a, table, kvh, 0, max_pos, stage_k(0), stage_v(0));
  copy_commit();

  // Queries scaled so that scores come out in log2 units, as their terms (within f16's range
  // for f16 terms), 8 channels (16 bytes of each term) a step; neighbouring threads take
  // neighbouring rows, 16 bytes apart.
  const float q_scale = a.scale * 1.4426950408889634f;
  const int q_row_bytes = 16 * hd;  // between 8-row groups
  for (int e = tid; e < kRows * (hd / 8); e += kThreads) {
    const int r = e % kRows, d = 8 * (e / kRows);
    float x[8] = {};
    if (r < n_rows) {
      const float* q =
          a.q + int64_t(t0 + r / group) * a.q_s0 + int64_t(kvh * group + r % group) * a.q_s1 + d;
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        x[u] = q[u] * q_scale;
        if constexpr (S::kF16) x[u] = clamp_f16_range(x[u]);
      }
    }
    uint32_t t[4][kTerms];
#pragma unroll
    for (int u = 0; u < 4; ++u) split_x2<M>(x[2 * u], x[2 * u + 1], t[u]);
    const int off = (r % 64 / 8) * q_row_bytes + (d / 8) * 128 + (r % 8) * 16;
#pragma unroll
    for (int i = 0; i < kTerms; ++i) {
      *reinterpret_cast<uint4*>(q_plane(i, r / 64) + off) =
          make_uint4(t[0][i], t[1][i], t[2][i], t[3][i]);
    }
  }
  int row_pos[2];
  fragment_row_positions(a, rt, m0 + g, row_pos);

  float acc[DV / 8][4];
#pragma unroll
  for (int j = 0; j < DV / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  constexpr float kWs = kWeightScaleOf<M>;

  for (int k0 = 0, it = 0; k0 <= max_pos; k0 += kKeys, ++it) {
    const int cur = it % 2;
    copy_wait<0>();        // this thread's copies of the current tile have landed
    fence_async_shared();  // its stores and copies are visible to the products
    __syncthreads();       // and everyone's; every warpgroup is done with the last tile
    if (k0 + kKeys <= max_pos) {
      start_tile<T>(copier, a, table, kvh, k0 + kKeys, max_pos, stage_k(1 - cur), stage_v(1 - cur));
    }
    copy_commit();
    const unsigned char* Ks = stage_k(cur);
    const unsigned char* Vs = stage_v(cur);
    if constexpr (S::kWiden) {
      widen_tile<kThreads>(stage_k(cur), stage_v(cur), Kf, Vf, hd, DV);
      fence_async_shared();
      __syncthreads();
      Ks = Kf, Vs = Vf;
    }
    // The warpgroup's scores and softmax weights of the tile (the weights times kWs: the
    // denominators too, below).
    uint32_t ap[kKeys / 16][kTerms][4];
    wgmma_tile_weights<M>(
        hd / 16, [&](int i, int kk) { return wgmma_desc(q_plane(i, wg) + kk * 256, 128, 16 * hd); },
        [&](int kk) { return wgmma_desc(Ks + kk * 256, 128, key_group_bytes(hd)); }, k0, c, row_pos,
        m, l, acc, ap);
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
      const uint64_t vd = wgmma_desc(Vs + kk * 256, 128, kValueGroupBytes);
#pragma unroll
      for (int i = kTerms - 1; i >= 0; --i) wgmma_rs<M, DV>(acc, ap[kk][i], vd, true);
    }
    wgmma_commit();
    wgmma_wait<0>();
    pin_registers(acc);
  }
  quad_sums(l);
  l[0] *= kWs, l[1] *= kWs;
  store_rows(a, acc, l, m0, g, c, n_rows, t0, kvh);
#endif
}

// Launches kKernel (an attention_wgmma_kernel) with smem bytes of dynamic shared memory.
template <auto kKernel>
void launch_wgmma(dim3 grid, int threads, size_t smem, cudaStream_t stream, const AttnArgs& a) {
  opt_in_smem<kKernel>(smem);
  launch_kernel(kKernel, grid, threads, smem, stream, a);
}

// fn(T{}) for the cache type's element (F16: __half, BF16: its bits, F8_E4M3: its bits).
template <typename Fn>
void dispatch_element(DType cache, Fn&& fn) {
  if (cache == DType::F16) {
    fn(__half{});
  } else if (cache == DType::BF16) {
    fn(uint16_t{});
  } else {
    RECUR_CHECK(cache == DType::F8_E4M3);
    fn(uint8_t{});
  }
}

}  // namespace

int attention_wgmma_rows(DType cache) {
  int rows = 0;
  dispatch_element(cache, [&](auto t) { rows = Shape<decltype(t)>::kRows; });
  return rows;
}

size_t attention_wgmma_smem_bytes(DType cache, int hd, int dv) {
  size_t bytes = 0;
  dispatch_element(cache, [&](auto t) { bytes = size_t(smem_of<decltype(t)>(hd, dv).total); });
  return bytes;
}

// An e4m3 cache needs no wide copies: its 4-element copies ask what paged_attention_mma has
// already checked (4-element alignment, blocks of a multiple of 4 positions).
bool attention_wgmma_takes(DType cache, bool wide_copies, int group, int hd, int dv,
                           size_t max_smem) {
  const bool copies = cache == DType::F8_E4M3 || (cache == DType::F16 && wide_copies) ||
                      (cache == DType::BF16 && wide_copies);
  return copies && hd == dv && (dv == 64 || dv == 128 || dv == 256) && group >= 1 &&
         group <= attention_wgmma_rows(cache) &&
         attention_wgmma_smem_bytes(cache, hd, dv) <= max_smem;
}

void launch_attention_wgmma(const AttnArgs& a, DType cache, dim3 grid, cudaStream_t stream) {
  RECUR_CHECK(a.hd == a.dv);
  dispatch_element(cache, [&](auto t) {
    using T = decltype(t);
    const size_t smem = size_t(smem_of<T>(a.hd, a.dv).total);
    constexpr int kThreads = Shape<T>::kThreads;
    if (a.dv == 64) {
      launch_wgmma<attention_wgmma_kernel<T, 64, 64>>(grid, kThreads, smem, stream, a);
    } else if (a.dv == 128) {
      launch_wgmma<attention_wgmma_kernel<T, 128, 128>>(grid, kThreads, smem, stream, a);
    } else {
      RECUR_CHECK(a.dv == 256);
      launch_wgmma<attention_wgmma_kernel<T, 256, 256>>(grid, kThreads, smem, stream, a);
    }
  });
}

}  // namespace cuda
}  // namespace recur
