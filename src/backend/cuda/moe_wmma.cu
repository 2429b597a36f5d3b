// The MoE experts' grouped GEMM on tensor cores, for prompts (more than kGemvMaxTokens tokens).
// A block computes a 64×64 tile of out for one expert's rows: 4 warps of 2×2 WMMA 16×16×16
// fragments, K staged 32 at a time through shared memory, the next stage's global loads issued
// before the current stage's MMAs. f32 activations are split into three terms of the weights'
// type (bf16 or f16) as they are staged (hi + mid + lo = x exactly for bf16), each multiplied
// with the weights into the same f32 accumulators, smallest first: f32-class results, as the
// GEMV core gives for few tokens. The fused gate/up variant applies SwiGLU to the two
// accumulators element by element (same fragment layout) before storing.
#include <mma.h>

#include "backend/cuda/moe.cuh"

namespace recur::cuda {

namespace {

using namespace nvcuda;

constexpr int kTM = kWmmaTileRows, kTN = 64, kTK = 32;
constexpr int kCols = kTK / 2;  // columns of a staged row per thread
constexpr int kLd = kTK + 8;    // staged rows padded by 16 bytes against bank conflicts
constexpr int kLdc = kTN + 4;   // f32 epilogue rows
constexpr int kThreads = 128;
constexpr int kTerms = 3;  // activation terms: lo, mid, hi

template <typename T>
__device__ __forceinline__ T from_f32(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half from_f32<__half>(float v) {
  return __float2half_rn(v);
}

// grid (⌈m/64⌉, max_tiles); blocks past the device's tile count exit at once.
template <typename T, bool kDual>
__global__ void __launch_bounds__(kThreads) moe_wmma_kernel(MoeGemmArgs a, bool vec_a, bool vec_b) {
  grid_dependency_sync();
  const int tile = blockIdx.y;
  if (tile >= *a.n_tiles) return;
  const int e = a.tile_expert[tile], row0 = a.tile_row0[tile], rows = a.tile_rows[tile];
  const int64_t n0 = int64_t(blockIdx.x) * kTN, K = a.k;
  const T* W = static_cast<const T*>(a.w[e]);
  const T* W2 = kDual ? static_cast<const T*>(a.w2[e]) : nullptr;
  __shared__ __align__(32) T As[kTerms][kTM * kLd];  // lo, mid, hi
  __shared__ __align__(32) T Bs[kTN * kLd];
  __shared__ __align__(32) T B2s[kDual ? kTN * kLd : 16];
  __shared__ __align__(32) float Cs[kTM * kLdc];
  const int tid = threadIdx.x, warp = tid / 32, wm = warp / 2, wn = warp % 2;

  // Staging roles: thread pair (2r, 2r+1) loads row r of A and row r of B, kCols columns each.
  const int lr = tid / 2, lc = (tid % 2) * kCols;
  const float* arow = nullptr;
  if (lr < rows) {
    const int64_t xr = a.x_row ? a.x_row[row0 + lr] : row0 + lr;
    arow = a.x + xr * a.ldx;
  }
  const bool b_ok = n0 + lr < a.m;
  const T* brow = b_ok ? W + (n0 + lr) * K : nullptr;
  const T* brow2 = (kDual && b_ok) ? W2 + (n0 + lr) * K : nullptr;

  float av[kCols];
  // kCols weights per row and stage, held as 16-byte words so the vector copies are aligned.
  uint4 bq[kCols / 8], bq2[kCols / 8];
  T* bv = reinterpret_cast<T*>(bq);
  T* bv2 = reinterpret_cast<T*>(bq2);
  auto load = [&](int64_t k0) {
    const bool full = k0 + kTK <= K;
    if (arow && vec_a && full) {
#pragma unroll
      for (int q = 0; q < kCols; q += 4) {
        const float4 f = *reinterpret_cast<const float4*>(arow + k0 + lc + q);
        av[q] = f.x, av[q + 1] = f.y, av[q + 2] = f.z, av[q + 3] = f.w;
      }
    } else {
#pragma unroll
      for (int q = 0; q < kCols; ++q) {
        const int64_t c = k0 + lc + q;
        av[q] = (arow && c < K) ? arow[c] : 0.0f;
      }
    }
    if (brow && vec_b && full) {
#pragma unroll
      for (int q = 0; q < kCols / 8; ++q) {
        bq[q] = *reinterpret_cast<const uint4*>(brow + k0 + lc + 8 * q);
        if constexpr (kDual) bq2[q] = *reinterpret_cast<const uint4*>(brow2 + k0 + lc + 8 * q);
      }
    } else {
#pragma unroll
      for (int q = 0; q < kCols; ++q) {
        const int64_t c = k0 + lc + q;
        bv[q] = (brow && c < K) ? brow[c] : from_f32<T>(0.0f);
        if constexpr (kDual) bv2[q] = (brow2 && c < K) ? brow2[c] : from_f32<T>(0.0f);
      }
    }
  };

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2], acc2[kDual ? 2 : 1][2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      wmma::fill_fragment(acc[i][j], 0.0f);
      if constexpr (kDual) wmma::fill_fragment(acc2[i][j], 0.0f);
    }
  }
  load(0);
  for (int64_t k0 = 0; k0 < K; k0 += kTK) {
    __syncthreads();  // the previous stage's MMAs are done with the shared tiles
    {
      // The terms are packed in registers and staged with 16-byte stores (scalar 2-byte
      // stores of three terms and the weights outnumbered the MMAs).
      uint4 pk[kTerms][kCols / 8];
      T* pt = reinterpret_cast<T*>(pk);
#pragma unroll
      for (int q = 0; q < kCols; ++q) {
        float v = av[q];
#pragma unroll
        for (int term = kTerms - 1; term >= 0; --term) {
          const T h = from_f32<T>(v);
          pt[term * kCols + q] = h;
          v -= to_f32(h);
        }
      }
#pragma unroll
      for (int w = 0; w < kCols / 8; ++w) {
#pragma unroll
        for (int term = 0; term < kTerms; ++term) {
          *reinterpret_cast<uint4*>(&As[term][lr * kLd + lc + 8 * w]) = pk[term][w];
        }
        *reinterpret_cast<uint4*>(&Bs[lr * kLd + lc + 8 * w]) = bq[w];
        if constexpr (kDual) *reinterpret_cast<uint4*>(&B2s[lr * kLd + lc + 8 * w]) = bq2[w];
      }
    }
    __syncthreads();
    if (k0 + kTK < K) load(k0 + kTK);
#pragma unroll
    for (int kk = 0; kk < kTK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa[2];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> fb[2], fb2[kDual ? 2 : 1];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        // B element (k, n) is W[n][k]: the staged rows are B's columns.
        wmma::load_matrix_sync(fb[j], Bs + (wn * 32 + j * 16) * kLd + kk, kLd);
        if constexpr (kDual)
          wmma::load_matrix_sync(fb2[j], B2s + (wn * 32 + j * 16) * kLd + kk, kLd);
      }
#pragma unroll
      for (int term = 0; term < kTerms; ++term) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          wmma::load_matrix_sync(fa[i], As[term] + (wm * 32 + i * 16) * kLd + kk, kLd);
        }
#pragma unroll
        for (int i = 0; i < 2; ++i) {
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
            if constexpr (kDual) wmma::mma_sync(acc2[i][j], fa[i], fb2[j], acc2[i][j]);
          }
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      if constexpr (kDual) {
        for (int q = 0; q < acc[i][j].num_elements; ++q) {
          acc[i][j].x[q] = silu(acc[i][j].x[q]) * acc2[i][j].x[q];
        }
      }
      wmma::store_matrix_sync(Cs + (wm * 32 + i * 16) * kLdc + wn * 32 + j * 16, acc[i][j], kLdc,
                              wmma::mem_row_major);
    }
  }
  __syncthreads();
  for (int idx = tid; idx < kTM * kTN; idx += kThreads) {
    const int r = idx / kTN, c = idx % kTN;
    if (r < rows && n0 + c < a.m) a.out[int64_t(row0 + r) * a.ldo + n0 + c] = Cs[r * kLdc + c];
  }
}

}  // namespace

void launch_moe_wmma(const MoeGemmArgs& a, DType wdtype, bool dual, unsigned max_tiles,
                     cudaStream_t stream) {
  const bool vec_a = a.k % 4 == 0 && a.ldx % 4 == 0 && (reinterpret_cast<uintptr_t>(a.x) & 15) == 0;
  const bool vec_b = a.k % 8 == 0 && a.w_aligned;
  const dim3 grid(unsigned((a.m + kTN - 1) / kTN), max_tiles);
  if (wdtype == DType::BF16) {
    if (dual) {
      launch_kernel(moe_wmma_kernel<__nv_bfloat16, true>, grid, kThreads, 0, stream, a, vec_a,
                    vec_b);
    } else {
      launch_kernel(moe_wmma_kernel<__nv_bfloat16, false>, grid, kThreads, 0, stream, a, vec_a,
                    vec_b);
    }
  } else {
    RECUR_CHECK(wdtype == DType::F16);
    if (dual) {
      launch_kernel(moe_wmma_kernel<__half, true>, grid, kThreads, 0, stream, a, vec_a, vec_b);
    } else {
      launch_kernel(moe_wmma_kernel<__half, false>, grid, kThreads, 0, stream, a, vec_a, vec_b);
    }
  }
}

}  // namespace recur::cuda
