// Prompt attention on tensor cores over a BF16, F16 or F8_E4M3 cache: the online softmax of
// flash attention 2 over tiles of the paged cache, with mma.sync m16n8k16 on 16-bit operands
// (f32 accumulation). The F32 cache takes kernels_attention_mma.cu's TF32 kernel.
//
// A block takes kPromptRows query rows of one sequence and one kv head, a row being (token,
// query head of the group), so every key and value tile loaded serves the whole group, and
// walks the key positions in tiles of kKeys, causal per row. Its eight warps are four row
// groups of 16 rows by two channel halves: a warp sums its half of the query-key products,
// the pair adds the two partial scores through shared memory (both get the same sums, so the
// same weights), and each multiplies the weights into its half of the value channels. Halving
// a warp's accumulators lets a multiprocessor hold twice the warps of one that keeps them all,
// for the same shared-memory traffic per product.
//
// The results must stay within f32's error (2e-5 of the scalar reference, as the other
// kernels). The cache's elements are exactly 16-bit values (bf16 or f16; e4m3 widens exactly to
// f16), so keys and values are single operands; queries and weights are f32, split into terms of
// that type (mma_16bit.cuh): three bf16 terms (two bf16 terms would leave 2^-16, measured up to
// 2.7e-5 in the tests) or two f16 terms, so a product is three or two MMAs, the small terms first.
// The queries are split once per block into planes that ldmatrix reads as fragments. A BF16 or F16
// tile is copied (cp.async, 16 bytes a copy where the cache's layout allows, else 8) into the
// layout ldmatrix reads; an F8_E4M3 one lands raw and is widened into an f16 plane; the next tile
// is copied while the current one is multiplied.
#include <algorithm>
#include <cmath>

#include "backend/cuda/attention_mma.cuh"
#include "backend/cuda/cuda_internal.cuh"
#include "backend/cuda/mma_16bit.cuh"

namespace recur {
namespace cuda {

namespace {

constexpr int kRowGroups = 4;  // of 16 rows
constexpr int kWarps = 2 * kRowGroups;
constexpr int kThreads = 32 * kWarps;
constexpr int kRows = kPromptRows;
static_assert(kRows == 16 * kRowGroups, "a row group owns 16 rows");
constexpr int kKeys = 32;  // key positions per tile
// Row strides (elements): 16-byte rows an odd number of 16 bytes apart, so the 8 rows of an
// ldmatrix matrix lie in 8 distinct bank groups (for an e4m3 stage they only need alignment).
constexpr int kKeyStride = kKeys + 8;
__host__ __device__ constexpr int query_stride(int hd) {
  return hd + 8;  // hd a multiple of 16
}
__host__ __device__ constexpr int value_stride(int dv) {
  return (dv + 15) / 16 * 16 + 8;
}

// The first channel and the channel count of a channel half (c_half 0 or 1) of n channels, in
// whole 16-channel MMA steps: the first half takes the odd step.
__device__ __forceinline__ void channel_half(int n, int c_half, int& first, int& count) {
  const int steps = (n + 15) / 16, first_steps = (steps + 1) / 2;
  first = 16 * first_steps * c_half;
  count = max(0, min(n, c_half == 0 ? 16 * first_steps : n) - first);
}

// The products' operand type of a cache element type T (the bits of BF16: uint16_t, F16:
// __half, F8_E4M3: uint8_t, widened to f16); the queries and weights split into its terms.
template <typename T>
using OperandOf = std::conditional_t<std::is_same_v<T, uint16_t>, __nv_bfloat16, __half>;

// Shared memory: the query planes Qp [terms][kRows][query_stride]; two stages of the tile as
// copied, keys [hd][kKeyStride] (channels by positions, as the cache holds them) and values
// [kKeys][value_stride], of T; for F8_E4M3 the tile widened into one f16 plane of that layout;
// the warps' partial scores [kWarps][kKeys / 8][32 lanes][4] (f32).
struct Smem {
  size_t q, k_stage, v_stage, k_plane, v_plane, partial, total;
  __host__ __device__ Smem(int hd, int dv, int elem_bytes, int terms) {
    q = size_t(kRows) * query_stride(hd) * 2;
    k_stage = size_t(hd) * kKeyStride * elem_bytes;
    v_stage = size_t(kKeys) * value_stride(dv) * elem_bytes;
    const bool widened = elem_bytes != 2;
    k_plane = widened ? size_t(hd) * kKeyStride * 2 : 0;
    v_plane = widened ? size_t(kKeys) * value_stride(dv) * 2 : 0;
    partial = size_t(kWarps) * kKeys * 16 * sizeof(float);
    total = terms * q + 2 * (k_stage + v_stage) + k_plane + v_plane + partial;
  }
};
template <typename T>
__host__ __device__ Smem smem_of(int hd, int dv) {
  return Smem(hd, dv, sizeof(T), kTermsOf<OperandOf<T>>);
}

// Async copy of kVec cache elements (kVec-element aligned; zeros when !valid, nothing read then).
template <int kVec, typename T>
__device__ __forceinline__ void copy_async(T* dst, const T* src, bool valid) {
  constexpr int kBytes = kVec * int(sizeof(T));
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(d), "l"(src), "n"(kBytes),
               "r"(valid ? kBytes : 0));
}

// Starts the copies of keys and values k0 .. k0 + kKeys − 1 (zeros past last) into a stage, in
// chunks of kVec elements.
template <typename T, int kVec>
__device__ __forceinline__ void start_tile(const TileCopier<kKeys, kThreads, kVec>& copier,
                                           const AttnArgs& a, const int32_t* table, int kvh, int k0,
                                           int last, T* Ks, T* Vs) {
  const int vs = value_stride(a.dv);
  copier.template copy<T>(
      a, table, kvh, k0, last, true,
      [&](int d, int p, const T* src, bool valid) {
        copy_async<kVec>(Ks + d * kKeyStride + p, src, valid);
      },
      [&](int p, int d, const T* src, bool valid) {
        copy_async<kVec>(Vs + p * vs + d, src, valid);
      });
}

// An e4m3 stage, landed, widened into the f16 planes (same layout).
__device__ __forceinline__ void widen_tile(const uint8_t* Ks, const uint8_t* Vs, __half* Kp,
                                           __half* Vp, int hd, int dv) {
  const int vs = value_stride(dv);
  for (int e = threadIdx.x; e < hd * (kKeys / 4); e += kThreads) {
    const int d = e / (kKeys / 4), p = 4 * (e % (kKeys / 4));
    widen4(Ks + d * kKeyStride + p, Kp + d * kKeyStride + p);
  }
  for (int e = threadIdx.x; e < kKeys * (dv / 4); e += kThreads) {
    const int p = e / (dv / 4), d = 4 * (e % (dv / 4));
    widen4(Vs + p * vs + d, Vp + p * vs + d);
  }
}

// c0 += a · b (b[0..1]) and c1 += a · b' (b[2..3]), a as its terms, the smallest first.
template <typename M>
__device__ __forceinline__ void mma_terms(float (&c0)[4], float (&c1)[4],
                                          const uint32_t (&a)[kTermsOf<M>][4],
                                          const uint32_t (&b)[4]) {
#pragma unroll
  for (int i = kTermsOf<M> - 1; i >= 0; --i) {
    mma16<M>(c0, a[i], b[0], b[1]);
    mma16<M>(c1, a[i], b[2], b[3]);
  }
}

// Waits for the other warp of a row group's pair (named barrier 1 + row group, 64 threads).
__device__ __forceinline__ void pair_sync(int row_group) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(1 + row_group), "n"(64) : "memory");
}

// grid (query tiles, kv_heads), kThreads. DV_MAX ≥ dv (a multiple of 16) bounds the
// accumulator's registers: acc[j] holds value channels [v0 + 8j, v0 + 8j + 8) of the thread's
// rows g and g + 8 (g = lane / 4), v0 the first channel of the warp's half. T: the cache's
// element (uint16_t for BF16, __half for F16, uint8_t for F8_E4M3). kVec: the elements of one
// copy, 8 (16 bytes) for 16-bit caches laid out for it, else 4.
template <int DV_MAX, typename T, int kVec>
__global__ void __launch_bounds__(kThreads) attention_16bit_kernel(AttnArgs a) {
  using M = OperandOf<T>;
  constexpr bool kWiden = sizeof(T) == 1;
  constexpr int kTerms = kTermsOf<M>;  // of the queries and the weights
  extern __shared__ __align__(16) unsigned char smem[];
  const int hd = a.hd, dv = a.dv, group = a.group, qs = query_stride(hd), vs = value_stride(dv);
  const Smem sm = smem_of<T>(hd, dv);
  M* Qp = reinterpret_cast<M*>(smem);
  unsigned char* stages = smem + kTerms * sm.q;
  auto stage_k = [&](int i) {
    return reinterpret_cast<T*>(stages + i * (sm.k_stage + sm.v_stage));
  };
  auto stage_v = [&](int i) {
    return reinterpret_cast<T*>(stages + i * (sm.k_stage + sm.v_stage) + sm.k_stage);
  };
  M* Kp = reinterpret_cast<M*>(stages + 2 * (sm.k_stage + sm.v_stage));  // kWiden only
  M* Vp = Kp + sm.k_plane / sizeof(M);
  float* partial = reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(Vp) + sm.v_plane);
  const size_t q_plane = sm.q / sizeof(M);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int row_group = warp % kRowGroups, c_half = warp / kRowGroups;
  const int g = lane / 4, c = lane % 4;  // fragment row and column
  int q0, q_count, v0, v_count;          // the warp's query-key channels and value channels
  channel_half(hd, c_half, q0, q_count);
  channel_half(dv, c_half, v0, v_count);
  // ldmatrix: the row and column of this lane's row address within a 16 × 16 block.
  const int lm_row = lane % 8 + 8 * (lane / 8 % 2), lm_col = 8 * (lane / 16);

  // The tiles of sequence s follow those of sequence s − 1.
  const int tokens_per_tile = kRows / group;
  int tile, kvh;
  prompt_tile_and_head(tile, kvh);
  const RowTile rt = find_row_tile(a, tokens_per_tile, tile);
  if (rt.s == a.n_seqs) return;
  const int t0 = rt.t0, t_end = rt.t_end;
  const int n_rows = rt.n_rows;
  const int32_t* table = rt.table;
  const int m0 = row_group * 16;
  int max_pos, warp_max_pos;  // the last key any row of the block, or of the warp, attends to
  last_keys(a, t0, t_end, m0, max_pos, warp_max_pos);
  // A first tile of positions written by earlier forwards (a prompt continuing a cached
  // prefix: the sequence's positions in this forward start at first_new) is copied before
  // waiting for the kernel before, which writes the new ones; the batch mirror read so far was
  // uploaded before the forward's kernels. Only when the tile ends on a cache block's end and
  // a block's head slices fill whole 128-byte lines: the copies go through L1, which must not
  // keep a line that the kernel before still writes.
  const bool early = kKeys % a.bs == 0 && a.kc_s1 * sizeof(T) % 128 == 0 &&
                     a.vc_s1 * sizeof(T) % 128 == 0 &&
                     min(max_pos, kKeys - 1) < a.positions[a.seq_start[rt.s]];
  const TileCopier<kKeys, kThreads, kVec> copier(a);
  if (early) start_tile<T>(copier, a, table, kvh, 0, max_pos, stage_k(0), stage_v(0));
  grid_dependency_sync();
  if (!early) start_tile<T>(copier, a, table, kvh, 0, max_pos, stage_k(0), stage_v(0));
  copy_commit();

  // Queries, scaled so that scores come out in log2 units (exp2 below), as their terms' planes
  // (within f16's range for f16 terms).
  const float q_scale = a.scale * 1.4426950408889634f;
  for (int e = tid; e < kRows * hd / 2; e += kThreads) {
    const int r = 2 * e / hd, d = 2 * e % hd;
    float x[2] = {0.0f, 0.0f};
    if (r < n_rows) {
      const float* q =
          a.q + int64_t(t0 + r / group) * a.q_s0 + int64_t(kvh * group + r % group) * a.q_s1 + d;
      x[0] = q[0] * q_scale, x[1] = q[1] * q_scale;
      if constexpr (std::is_same_v<M, __half>) {
        x[0] = clamp_f16_range(x[0]), x[1] = clamp_f16_range(x[1]);
      }
    }
    uint32_t t[kTerms];
    split_x2<M>(x[0], x[1], t);
#pragma unroll
    for (int i = 0; i < kTerms; ++i) {
      *reinterpret_cast<uint32_t*>(Qp + i * q_plane + r * qs + d) = t[i];
    }
  }
  int row_pos[2];
  fragment_row_positions(a, rt, m0 + g, row_pos);

  constexpr int kAccTiles = DV_MAX / 16;  // a half's n-tiles of 8 channels
  static_assert(kAccTiles % 4 == 0, "n-tiles go in fours");
  float acc[kAccTiles][4];
#pragma unroll
  for (int j = 0; j < kAccTiles; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

  for (int k0 = 0, it = 0; k0 <= max_pos; k0 += kKeys, ++it) {
    const int cur = it % 2;
    copy_wait<0>();   // this thread's copies of the current tile have landed
    __syncthreads();  // and everyone's (and the queries); every warp is done with the last tile
    // The next tile goes into the other stage, which no warp reads any more, while this one is
    // multiplied: one block barrier a tile.
    if (k0 + kKeys <= max_pos) {
      start_tile<T>(copier, a, table, kvh, k0 + kKeys, max_pos, stage_k(1 - cur), stage_v(1 - cur));
    }
    copy_commit();
    const M* Kt = reinterpret_cast<const M*>(stage_k(cur));
    const M* Vt = reinterpret_cast<const M*>(stage_v(cur));
    if constexpr (kWiden) {
      widen_tile(reinterpret_cast<const uint8_t*>(stage_k(cur)),
                 reinterpret_cast<const uint8_t*>(stage_v(cur)), Kp, Vp, hd, dv);
      __syncthreads();
      Kt = Kp, Vt = Vp;
    }
    if (k0 <= warp_max_pos) {  // else every key of the tile is past the warp's rows
      // Scores S [16 rows × kKeys] of the warp: n-tile j holds keys [8j, 8j + 8).
      float sc[kKeys / 8][4];
#pragma unroll
      for (int j = 0; j < kKeys / 8; ++j) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.0f;
      const M* qrow = Qp + (m0 + lm_row) * qs + lm_col + q0;
      const M* krow = Kt + (lm_row + q0) * kKeyStride + lm_col;
#pragma unroll 2
      for (int kk = 0; kk < q_count; kk += 16) {
        uint32_t aq[kTerms][4];
#pragma unroll
        for (int i = 0; i < kTerms; ++i) ldmatrix_x4<false>(aq[i], qrow + i * q_plane + kk);
#pragma unroll
        for (int j = 0; j < kKeys / 8; j += 2) {
          uint32_t bk[4];
          ldmatrix_x4<true>(bk, krow + kk * kKeyStride + 8 * j);
          mma_terms<M>(sc[j], sc[j + 1], aq, bk);
        }
      }
      // The pair's partial scores summed (mine + theirs: the same in both warps).
      float4* mine = reinterpret_cast<float4*>(partial) + warp * (kKeys / 8) * 32 + lane;
      const float4* theirs =
          reinterpret_cast<const float4*>(partial) + (warp ^ kRowGroups) * (kKeys / 8) * 32 + lane;
#pragma unroll
      for (int j = 0; j < kKeys / 8; ++j) {
        mine[32 * j] = make_float4(sc[j][0], sc[j][1], sc[j][2], sc[j][3]);
      }
      pair_sync(row_group);
#pragma unroll
      for (int j = 0; j < kKeys / 8; ++j) {
        const float4 o = theirs[32 * j];
        sc[j][0] += o.x, sc[j][1] += o.y, sc[j][2] += o.z, sc[j][3] += o.w;
      }
      // Causal mask and the online softmax of the thread's rows g and g + 8.
      float corr[2];
      online_softmax_tile<kKeys / 8, false>(sc, k0, c, row_pos, 0, m, l, corr);
      rescale_rows(acc, corr);
      // acc += P · V over each 16 keys: the score fragments of n-tiles 2kk and 2kk + 1 are the
      // a operand as they lie (rows g, g + 8; keys 2c, 2c + 1 and 8 + 2c, 9 + 2c), the weights
      // times kWeightScaleOf<M> (the denominators too, below).
      constexpr float kWs = kWeightScaleOf<M>;
#pragma unroll
      for (int kk = 0; kk < kKeys / 16; ++kk) {
        uint32_t ap[kTerms][4], t[kTerms];
#pragma unroll
        for (int f = 0; f < 4; ++f) {
          const float(&s)[4] = sc[2 * kk + f / 2];
          split_x2<M>(s[2 * (f % 2)] * kWs, s[2 * (f % 2) + 1] * kWs, t);
#pragma unroll
          for (int i = 0; i < kTerms; ++i) ap[i][f] = t[i];
        }
        const M* vrow = Vt + (16 * kk + lm_row) * vs + lm_col + v0;
        // Four n-tiles at a time, each term over all four: a product waits on the one before
        // into the same accumulator three products back instead of one.
#pragma unroll
        for (int n = 0; n < kAccTiles; n += 4) {
          if (8 * n >= v_count) break;  // warp-uniform; v_count is whole 16-channel steps
          const bool second = 8 * (n + 2) < v_count;
          uint32_t bv[2][4];
          ldmatrix_x4<true>(bv[0], vrow + 8 * n);
          if (second) ldmatrix_x4<true>(bv[1], vrow + 8 * (n + 2));
#pragma unroll
          for (int i = kTerms - 1; i >= 0; --i) {
            mma16<M>(acc[n], ap[i], bv[0][0], bv[0][1]);
            mma16<M>(acc[n + 1], ap[i], bv[0][2], bv[0][3]);
            if (second) {
              mma16<M>(acc[n + 2], ap[i], bv[1][0], bv[1][1]);
              mma16<M>(acc[n + 3], ap[i], bv[1][2], bv[1][3]);
            }
          }
        }
      }
    }
  }
  quad_sums(l);
  l[0] *= kWeightScaleOf<M>, l[1] *= kWeightScaleOf<M>;
  store_rows(a, acc, l, m0, g, c, n_rows, t0, kvh, v0, v0 + v_count);
}

template <int DV_MAX, typename T>
void launch_dv(const AttnArgs& a, bool wide_copies, dim3 grid, size_t smem, cudaStream_t stream) {
  if constexpr (sizeof(T) == 2) {
    if (wide_copies) {
      launch_opted_in<attention_16bit_kernel<DV_MAX, T, 8>>(grid, kThreads, smem, stream, a);
      return;
    }
  }
  launch_opted_in<attention_16bit_kernel<DV_MAX, T, 4>>(grid, kThreads, smem, stream, a);
}

template <typename T>
void launch_type(const AttnArgs& a, bool wide_copies, dim3 grid, cudaStream_t stream) {
  const size_t smem = smem_of<T>(a.hd, a.dv).total;
  if (a.dv <= 64) {
    launch_dv<64, T>(a, wide_copies, grid, smem, stream);
  } else if (a.dv <= 128) {
    launch_dv<128, T>(a, wide_copies, grid, smem, stream);
  } else {
    launch_dv<256, T>(a, wide_copies, grid, smem, stream);
  }
}

}  // namespace

size_t attention_16bit_smem_bytes(int hd, int dv) {
  return std::max({smem_of<uint16_t>(hd, dv).total, smem_of<__half>(hd, dv).total,
                   smem_of<uint8_t>(hd, dv).total});
}

void launch_attention_16bit(const AttnArgs& a, DType cache, bool wide_copies, dim3 grid,
                            cudaStream_t stream) {
  if (cache == DType::BF16) {
    launch_type<uint16_t>(a, wide_copies, grid, stream);
  } else if (cache == DType::F16) {
    launch_type<__half>(a, wide_copies, grid, stream);
  } else {
    RECUR_CHECK(cache == DType::F8_E4M3);
    launch_type<uint8_t>(a, false, grid, stream);
  }
}

}  // namespace cuda
}  // namespace recur
