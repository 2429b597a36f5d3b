// The bandwidth-bound core shared by matmul (few tokens) and the MoE experts (few tokens per
// expert): a block of kGemvThreads computes R consecutive output rows of a weight matrix
// w [m, k] (stored dtype) for up to NT f32 activation rows. Each weight row is streamed once
// with 16-byte loads that bypass L1 (they are used once); the activation rows are small and
// re-read from L1 for every weight row. Arithmetic is f32; results match the CPU's f32 kernels
// to rounding.
#pragma once

#include "backend/cuda/cuda_internal.cuh"

namespace recur::cuda {

constexpr int kGemvThreads = 128;

// 16 bytes of weights, widened to f32: 4 floats or 8 bf16/f16 values.
template <typename W>
struct Chunk {
  static constexpr int kElems = 16 / int(sizeof(W));
  float v[kElems];
};

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

template <typename W>
__device__ __forceinline__ Chunk<W> widen_chunk(uint4 raw) {
  Chunk<W> c;
  constexpr int kPer = Chunk<W>::kElems / 4;  // elements per 32-bit word
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

// acc[r][t] += the loaded chunk c of weight row r (wc[r], and wc2[r] into acc2 when kDual)
// times the same chunk of activation row t.
template <typename W, int R, int NT, bool kDual>
__device__ __forceinline__ void fma_loaded(const Chunk<W> (&wc)[R],
                                           const Chunk<W> (&wc2)[kDual ? R : 1],
                                           const float* const (&xr)[NT], int64_t c,
                                           float (&acc)[R][NT], float (&acc2)[R][NT]) {
  constexpr int E = Chunk<W>::kElems;
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    float xv[E];
#pragma unroll
    for (int q = 0; q < E; q += 4) {
      const float4 f = __ldg(reinterpret_cast<const float4*>(xr[t] + c * E + q));
      xv[q] = f.x, xv[q + 1] = f.y, xv[q + 2] = f.z, xv[q + 3] = f.w;
    }
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

// fma_loaded of chunk c loaded from the rows wr (and wr2 when kDual): the inner step of every
// GEMV over bf16/f16/f32 rows.
template <typename W, int R, int NT, bool kDual>
__device__ __forceinline__ void fma_chunk(const W* const (&wr)[R], const W* const (&wr2)[R],
                                          const float* const (&xr)[NT], int64_t c,
                                          float (&acc)[R][NT], float (&acc2)[R][NT]) {
  constexpr int E = Chunk<W>::kElems;
  Chunk<W> wc[R], wc2[kDual ? R : 1];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    wc[r] = load_chunk(wr[r] + c * E);
    if constexpr (kDual) wc2[r] = load_chunk(wr2[r] + c * E);
  }
  fma_loaded<W, R, NT, kDual>(wc, wc2, xr, c, acc, acc2);
}

// fma_loaded of chunk c of R rows already loaded (raw[r]), no second weight.
template <typename W, int R, int NT>
__device__ __forceinline__ void fma_chunk_raw(const uint4 (&raw)[R], const float* const (&xr)[NT],
                                              int64_t c, float (&acc)[R][NT]) {
  Chunk<W> wc[R], unused[1];
#pragma unroll
  for (int r = 0; r < R; ++r) wc[r] = widen_chunk<W>(raw[r]);
  fma_loaded<W, R, NT, false>(wc, unused, xr, c, acc, acc);
}

// The first kPre chunks this thread streams of each of a block's R rows (w: the block's first
// row, rows ≥ `rows` clamped as in gemv_partial; 16-byte rows). A kernel may issue these loads
// before its wait for the kernel before it (weights never depend on it), so they overlap that
// kernel's tail instead of starting after it.
template <typename W, int R, int kPre>
__device__ __forceinline__ void gemv_preload(const W* w, int64_t k, int rows,
                                             uint4 (&pre)[kPre][R]) {
  constexpr int E = Chunk<W>::kElems;
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
// kVec: k is a multiple of the chunk, weights and x rows are 16-byte aligned.
// kPre > 0 with pre set (kVec, no w2): the first kPre chunks per row come from gemv_preload,
// used in the loop's order (the same sums).
template <typename W, int NT, int R, bool kDual, bool kVec, int kPre = 0>
__device__ __forceinline__ void gemv_partial(const W* w, const W* w2, int64_t k, int rows,
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
    constexpr int E = Chunk<W>::kElems;
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
          if (c < n_chunks) fma_chunk_raw<W, R, NT>(pre[p], xr, c, acc);
        }
        c0 = threadIdx.x + int64_t(kPre) * kGemvThreads;
      }
    }
#pragma unroll(kUnroll)
    for (int64_t c = c0; c < n_chunks; c += kGemvThreads) {
      fma_chunk<W, R, NT, kDual>(wr, wr2, xr, c, acc, acc2);
    }
  } else {
    for (int64_t i = threadIdx.x; i < k; i += kGemvThreads) {
      float wv[R], wv2[R];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        wv[r] = to_f32(wr[r][i]);
        wv2[r] = kDual ? to_f32(wr2[r][i]) : 0.0f;
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
