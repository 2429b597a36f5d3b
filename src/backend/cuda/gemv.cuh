// The bandwidth-bound core shared by matmul (few tokens) and the MoE experts (few tokens per
// expert): a block of kGemvThreads computes R consecutive output rows of a weight matrix
// w [m, k] (stored dtype) for up to NT f32 activation rows. Each weight row is streamed once
// with 16-byte loads that bypass L1 (they are used once); the activation rows are small and
// re-read from L1 for every weight row. Arithmetic is f32; results match the CPU's f32 kernels
// to rounding. Block-FP8 weights (Fp8E4M3) take the same core: each widened 16-byte chunk is
// multiplied by its block's scale before its products.
#pragma once

#include <cuda_fp8.h>

#include <type_traits>

#include "backend/cuda/cuda_internal.cuh"

namespace recur::cuda {

constexpr int kGemvThreads = 128;

// A block-FP8 weight element as the GEMV core's weight type: one e4m3 byte. Layout of such a
// weight (F8_E4M3, as released or made by --quantize fp8): one piece of device memory holds the
// bytes row-major [m, k], then, from fp8_scales_offset(m, k), the f32 block scales
// [ceil(m / br), ceil(k / bc)]: w[r][c] = fp8[r][c] · scales[r / br][c / bc] (edge blocks
// partial). The backend keeps each weight's block sizes (Impl::fp8_blocks).
struct Fp8E4M3 {
  uint8_t bits;
};
template <typename W>
constexpr bool kBlockFp8 = std::is_same_v<W, Fp8E4M3>;

// Bytes from a block-FP8 weight's data to its scales.
__host__ __device__ __forceinline__ int64_t fp8_scales_offset(int64_t m, int64_t k) {
  return (m * k + 15) / 16 * 16;
}

// One e4m3 byte to f32, exactly (the NaN codes give NaN).
__device__ __forceinline__ float fp8_to_f32(uint8_t b) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t(b), __NV_E4M3)));
}
// Four e4m3 bytes (the low byte first) to f32, exactly.
__device__ __forceinline__ void widen_fp8x4(uint32_t bits, float* out) {
  const float2 lo = __half22float2(
      __half2(__nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(bits & 0xffffu), __NV_E4M3)));
  const float2 hi = __half22float2(
      __half2(__nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(bits >> 16), __NV_E4M3)));
  out[0] = lo.x, out[1] = lo.y, out[2] = hi.x, out[3] = hi.y;
}

// The block scales of a GEMV's R weight rows: none but for block-FP8, where row r's scales
// start at row[r] and each spans bc columns.
template <typename W, int R>
struct RowScales {
  __device__ __forceinline__ float of(int, int64_t) const { return 1.0f; }
};
template <int R>
struct RowScales<Fp8E4M3, R> {
  const float* row[R];
  int bc;
  __device__ __forceinline__ float of(int r, int64_t col) const {
    return __ldg(row[r] + uint32_t(col) / uint32_t(bc));
  }
};
// The scales of rows row0 .. row0 + R - 1 (rows ≥ `rows` clamped to row0, as the GEMV's weight
// rows are) of the weight at w [m, k] in br × bc blocks; nothing for other weight types.
template <typename W, int R>
__device__ __forceinline__ RowScales<W, R> row_scales(const void* w, int64_t m, int64_t k, int br,
                                                      int bc, int64_t row0, int rows) {
  RowScales<W, R> s;
  if constexpr (kBlockFp8<W>) {
    const float* scales =
        reinterpret_cast<const float*>(static_cast<const uint8_t*>(w) + fp8_scales_offset(m, k));
    // 32-bit arithmetic (rows and column blocks fit): a 64-bit division per row costs a
    // subroutine and, in kernels holding preloaded weights, registers.
    const uint32_t kb = (uint32_t(k) + uint32_t(bc) - 1) / uint32_t(bc);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      s.row[r] = scales + ((uint32_t(row0) + uint32_t(r < rows ? r : 0)) / uint32_t(br)) * kb;
    }
    s.bc = bc;
  }
  return s;
}

// Elements of a weight type in a 16-byte chunk: 4 f32, 8 bf16/f16, 16 block-FP8.
template <typename W>
constexpr int kChunkElems = 16 / int(sizeof(W));

// Weights are read once a step and never again before the step's other weights: they go to L2
// marked first to evict, so they displace each other rather than the activations, state and
// cache lines the step reuses (measured about 2 µs a batch-1 step of the 80B configuration).
__device__ __forceinline__ uint4 load_streaming(const void* p) {
  uint4 r;
  uint64_t policy;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p), "l"(policy));
  return r;
}

__device__ __forceinline__ void widen(uint32_t bits, float* out, float) {
  out[0] = __uint_as_float(bits);
}
__device__ __forceinline__ void widen(uint32_t bits, float* out, __nv_bfloat16) {
  out[0] = __uint_as_float(bits << 16);
  out[1] = __uint_as_float(bits & 0xffff0000u);
}
__device__ __forceinline__ void widen(uint32_t bits, float* out, __half) {
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&bits));
  out[0] = f.x;
  out[1] = f.y;
}

// dispatch_weight with block-FP8 (Fp8E4M3): the GEMV core's weight types.
template <typename Fn>
void dispatch_gemv_weight(DType dt, Fn&& fn) {
  if (dt == DType::F8_E4M3) {
    fn(Fp8E4M3{});
  } else {
    dispatch_weight(dt, fn);
  }
}

__device__ __forceinline__ void widen(uint32_t bits, float* out, Fp8E4M3) {
  widen_fp8x4(bits, out);
}

// 16 bytes of weights widened to f32 (kChunkElems<W> values).
template <typename W>
struct Chunk {
  static constexpr int kElems = kChunkElems<W>;
  float v[kElems];
};

template <typename W>
__device__ __forceinline__ Chunk<W> widen_chunk(uint4 raw) {
  Chunk<W> c;
  constexpr int kPer = kChunkElems<W> / 4;  // elements per 32-bit word
  widen(raw.x, c.v + 0 * kPer, W{});
  widen(raw.y, c.v + 1 * kPer, W{});
  widen(raw.z, c.v + 2 * kPer, W{});
  widen(raw.w, c.v + 3 * kPer, W{});
  return c;
}

template <typename W>
__device__ __forceinline__ Chunk<W> load_chunk(const W* p) {
  return widen_chunk<W>(load_streaming(p));
}

// Chunk c (E floats) of an activation row x.
template <int E>
__device__ __forceinline__ void load_x_chunk(const float* x, int64_t c, float (&xv)[E]) {
#pragma unroll
  for (int q = 0; q < E; q += 4) {
    const float4 f = __ldg(reinterpret_cast<const float4*>(x + c * E + q));
    xv[q] = f.x, xv[q + 1] = f.y, xv[q + 2] = f.z, xv[q + 3] = f.w;
  }
}

// acc[r][t] += the widened chunk c of weight row r (wc[r], and wc2[r] into acc2 when kDual)
// times the same chunk of activation row t.
template <typename W, int R, int NT, bool kDual>
__device__ __forceinline__ void fma_widened(const Chunk<W> (&wc)[R],
                                            const Chunk<W> (&wc2)[kDual ? R : 1],
                                            const float* const (&xr)[NT], int64_t c,
                                            float (&acc)[R][NT], float (&acc2)[R][NT]) {
  constexpr int E = kChunkElems<W>;
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    float xv[E];
    load_x_chunk(xr[t], c, xv);
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int q = 0; q < E; ++q) {
        acc[r][t] = fmaf(wc[r].v[q], xv[q], acc[r][t]);
        if constexpr (kDual) acc2[r][t] = fmaf(wc2[r].v[q], xv[q], acc2[r][t]);
      }
    }
  }
}

// Word j of a raw 16-byte chunk.
__device__ __forceinline__ uint32_t chunk_word(const uint4& raw, int j) {
  return j == 0 ? raw.x : j == 1 ? raw.y : j == 2 ? raw.z : raw.w;
}

// fma_widened for block-FP8 chunks kept raw (wc[r], wc2[r]) with their blocks' scales s[r],
// s2[r]: each is widened a 32-bit word at a time next to its products (sixteen values widened
// at once per row hold four times their bytes in registers: the down projection took 255),
// and, lying within one column block, sums its 16 products first and takes the scale once.
template <int R, int NT, bool kDual>
__device__ __forceinline__ void fma_fp8(const uint4 (&wc)[R], const uint4 (&wc2)[kDual ? R : 1],
                                        const float (&s)[R], const float (&s2)[R],
                                        const float* const (&xr)[NT], int64_t c,
                                        float (&acc)[R][NT], float (&acc2)[R][NT]) {
  constexpr int E = kChunkElems<Fp8E4M3>;
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    float xv[E];
    load_x_chunk(xr[t], c, xv);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float p = 0.0f, p2 = 0.0f;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float w[4], w2[4];
        widen_fp8x4(chunk_word(wc[r], j), w);
        if constexpr (kDual) widen_fp8x4(chunk_word(wc2[r], j), w2);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          p = fmaf(w[q], xv[j * 4 + q], p);
          if constexpr (kDual) p2 = fmaf(w2[q], xv[j * 4 + q], p2);
        }
      }
      acc[r][t] = fmaf(p, s[r], acc[r][t]);
      if constexpr (kDual) acc2[r][t] = fmaf(p2, s2[r], acc2[r][t]);
    }
  }
}

// The block scales of chunk c of block-FP8 rows.
template <int R>
__device__ __forceinline__ void chunk_scales(const RowScales<Fp8E4M3, R>& sc, int64_t c,
                                             float (&s)[R]) {
#pragma unroll
  for (int r = 0; r < R; ++r) s[r] = sc.of(r, c * kChunkElems<Fp8E4M3>);
}

// The product of chunk c loaded from the rows wr (and wr2 when kDual; sc, sc2 their block
// scales): the inner step of every GEMV over 16-byte rows.
template <typename W, int R, int NT, bool kDual>
__device__ __forceinline__ void fma_chunk(const W* const (&wr)[R], const W* const (&wr2)[R],
                                          const RowScales<W, R>& sc, const RowScales<W, R>& sc2,
                                          const float* const (&xr)[NT], int64_t c,
                                          float (&acc)[R][NT], float (&acc2)[R][NT]) {
  constexpr int E = kChunkElems<W>;
  if constexpr (kBlockFp8<W>) {
    uint4 wc[R], wc2[kDual ? R : 1];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      wc[r] = load_streaming(wr[r] + c * E);
      if constexpr (kDual) wc2[r] = load_streaming(wr2[r] + c * E);
    }
    float s[R], s2[R];
    chunk_scales(sc, c, s);
    if constexpr (kDual) chunk_scales(sc2, c, s2);
    fma_fp8<R, NT, kDual>(wc, wc2, s, s2, xr, c, acc, acc2);
  } else {
    Chunk<W> wc[R], wc2[kDual ? R : 1];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      wc[r] = load_chunk(wr[r] + c * E);
      if constexpr (kDual) wc2[r] = load_chunk(wr2[r] + c * E);
    }
    fma_widened<W, R, NT, kDual>(wc, wc2, xr, c, acc, acc2);
  }
}

// fma_chunk of chunk c of R rows already loaded (raw[r]), no second weight.
template <typename W, int R, int NT>
__device__ __forceinline__ void fma_chunk_raw(const uint4 (&raw)[R], const RowScales<W, R>& sc,
                                              const float* const (&xr)[NT], int64_t c,
                                              float (&acc)[R][NT]) {
  if constexpr (kBlockFp8<W>) {
    const uint4 unused[1] = {};
    float s[R];
    chunk_scales(sc, c, s);
    fma_fp8<R, NT, false>(raw, unused, s, s, xr, c, acc, acc);
  } else {
    Chunk<W> wc[R], unused[1];
#pragma unroll
    for (int r = 0; r < R; ++r) wc[r] = widen_chunk<W>(raw[r]);
    fma_widened<W, R, NT, false>(wc, unused, xr, c, acc, acc);
  }
}

// The first kPre chunks this thread streams of each of a block's R rows (w: the block's first
// row, rows ≥ `rows` clamped as in gemv_partial; 16-byte rows). A kernel may issue these loads
// before its wait for the kernel before it (weights never depend on it), so they overlap that
// kernel's tail instead of starting after it.
template <typename W, int R, int kPre>
__device__ __forceinline__ void gemv_preload(const W* w, int64_t k, int rows,
                                             uint4 (&pre)[kPre][R]) {
  constexpr int E = kChunkElems<W>;
  const int64_t n_chunks = k / E;
#pragma unroll
  for (int p = 0; p < kPre; ++p) {
    const int64_t c = threadIdx.x + int64_t(p) * kGemvThreads;
    if (c < n_chunks) {
#pragma unroll
      for (int r = 0; r < R; ++r) pre[p][r] = load_streaming(w + (r < rows ? r : 0) * k + c * E);
    }
  }
}

// Per-thread partial dot products: acc[r][t] += Σ w[r][i]·x[t][i] over this thread's share of
// k (and acc2 with w2 when kDual). w, w2 point at the block's first row; rows ≥ `rows` and
// activation rows ≥ the caller's count were clamped to valid memory and are discarded.
// kVec: k is a multiple of the chunk, weights and x rows are 16-byte aligned (and for block-FP8
// a chunk lies within one column block: bc a multiple of 16).
// kPre > 0 with pre set (kVec, no w2): the first kPre chunks per row come from gemv_preload,
// used in the loop's order (the same sums).
// sc, sc2: the block scales of w's and w2's rows (row_scales).
template <typename W, int NT, int R, bool kDual, bool kVec, int kPre = 0>
__device__ __forceinline__ void gemv_partial(const W* w, const W* w2, int64_t k, int rows,
                                             const RowScales<W, R>& sc, const RowScales<W, R>& sc2,
                                             const float* const (&xr)[NT], float (&acc)[R][NT],
                                             float (&acc2)[R][NT],
                                             const uint4 (*pre)[R] = nullptr) {
  const W* wr[R];
  const W* wr2[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    wr[r] = w + (r < rows ? r : 0) * k;
    wr2[r] = kDual ? w2 + (r < rows ? r : 0) * k : nullptr;
  }
  if constexpr (kVec) {
    constexpr int E = kChunkElems<W>;
    const int64_t n_chunks = k / E;
    // Four chunks of each row in flight per thread for one token on a few rows (long rows
    // otherwise take several dependent round trips), two where registers allow; with many
    // activation rows the FMAs, not the loads, are the limit.
    constexpr int kUnroll = (R * NT <= 4 && !kDual) ? 4 : NT <= 2 ? 2 : 1;
    int64_t c0 = threadIdx.x;
    if constexpr (kPre > 0 && !kDual) {
      if (pre) {
#pragma unroll
        for (int p = 0; p < kPre; ++p) {
          const int64_t c = threadIdx.x + int64_t(p) * kGemvThreads;
          if (c < n_chunks) fma_chunk_raw<W, R, NT>(pre[p], sc, xr, c, acc);
        }
        c0 = threadIdx.x + int64_t(kPre) * kGemvThreads;
      }
    }
#pragma unroll(kUnroll)
    for (int64_t c = c0; c < n_chunks; c += kGemvThreads) {
      fma_chunk<W, R, NT, kDual>(wr, wr2, sc, sc2, xr, c, acc, acc2);
    }
  } else {
    for (int64_t i = threadIdx.x; i < k; i += kGemvThreads) {
      float wv[R], wv2[R];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if constexpr (kBlockFp8<W>) {
          wv[r] = fp8_to_f32(wr[r][i].bits) * sc.of(r, i);
          wv2[r] = kDual ? fp8_to_f32(wr2[r][i].bits) * sc2.of(r, i) : 0.0f;
        } else {
          wv[r] = to_f32(wr[r][i]);
          wv2[r] = kDual ? to_f32(wr2[r][i]) : 0.0f;
        }
      }
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        const float xv = xr[t][i];
#pragma unroll
        for (int r = 0; r < R; ++r) {
          acc[r][t] = fmaf(wv[r], xv, acc[r][t]);
          if constexpr (kDual) acc2[r][t] = fmaf(wv2[r], xv, acc2[r][t]);
        }
      }
    }
  }
}

// Sums acc (and acc2) over the block; afterwards red[r * NT + t] (and red[R*NT + ...]) hold the
// totals. red: shared memory of (kDual ? 2 : 1) · R · NT · (kGemvThreads / 32) floats.
template <int NT, int R, bool kDual>
__device__ __forceinline__ void gemv_reduce(float (&acc)[R][NT], float (&acc2)[R][NT], float* red) {
  constexpr int V = R * NT;
  constexpr int kWarps = kGemvThreads / 32;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const float v = warp_sum(acc[r][t]);
      if (lane == 0) red[(r * NT + t) * kWarps + warp] = v;
      if constexpr (kDual) {
        const float v2 = warp_sum(acc2[r][t]);
        if (lane == 0) red[(V + r * NT + t) * kWarps + warp] = v2;
      }
    }
  }
  __syncthreads();
  constexpr int kTotal = (kDual ? 2 : 1) * V;
  float sum = 0.0f;
  if (threadIdx.x < kTotal) {
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += red[threadIdx.x * kWarps + w];
  }
  __syncthreads();
  if (threadIdx.x < kTotal) red[threadIdx.x] = sum;
  __syncthreads();
}

}  // namespace recur::cuda
