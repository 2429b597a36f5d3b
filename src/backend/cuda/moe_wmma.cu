// The MoE experts' grouped GEMM on tensor cores, for prompts (more than kGemvMaxTokens tokens).
// A block computes a 64×64 tile of out for one expert's rows: 4 warps of 2×2 WMMA 16×16×16
// fragments, K staged 32 at a time through shared memory, the next stage's global loads issued
// before the current stage's MMAs. f32 activations are split into three terms of the weights'
// type (bf16 or f16) as they are staged (hi + mid + lo = x exactly for bf16), each multiplied
// with the weights into the same f32 accumulators, smallest first: f32-class results, as the
// GEMV core gives for few tokens. The fused gate/up variant applies SwiGLU to the two
// accumulators element by element (same fragment layout) before storing.
#include <mma.h>

#include "backend/cuda/fp8.cuh"
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

// Eight e4m3 bytes (one 64-bit half of a 16-byte load) to bf16, exactly (e4m3 ⊂ bf16).
__device__ __forceinline__ uint4 fp8x8_to_bf16(uint32_t lo, uint32_t hi) {
  float f[8];
  widen_fp8x4(lo, f);
  widen_fp8x4(hi, f + 4);
  uint4 r;
  uint32_t* o = reinterpret_cast<uint32_t*>(&r);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_bfloat162 b = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
    o[i] = *reinterpret_cast<const uint32_t*>(&b);
  }
  return r;
}

// grid (⌈m/64⌉, max_tiles); blocks past the device's tile count exit at once.
// kFp8 (T bf16): the weights are F8_E4M3 (fp8.cuh), staged widened to bf16; each k block's
// products go to their own accumulators, added to the totals times the block's scale (one
// scale for the whole tile: fp8_wmma_blocks).
template <typename T, bool kDual, bool kFp8 = false>
__global__ void __launch_bounds__(kThreads) moe_wmma_kernel(MoeGemmArgs a, bool vec_a, bool vec_b) {
  static_assert(!kFp8 || std::is_same_v<T, __nv_bfloat16>, "fp8 weights are widened to bf16");
  using WT = std::conditional_t<kFp8, uint8_t, T>;  // the weights' stored type
  grid_dependency_sync();
  const int tile = blockIdx.y;
  int e = 0, row0, rows;
  if (a.dense_w) {
    row0 = tile * kTM;
    rows = int(min64(kTM, a.dense_rows - row0));
    if (rows <= 0) return;
  } else {
    if (tile >= *a.n_tiles) return;
    e = a.tile_expert[tile], row0 = a.tile_row0[tile], rows = a.tile_rows[tile];
  }
  const int64_t n0 = int64_t(blockIdx.x) * kTN, K = a.k;
  const void* w_data = a.dense_w ? a.dense_w : a.w[e];
  const WT* W = static_cast<const WT*>(w_data);
  const WT* W2 = kDual ? static_cast<const WT*>(a.w2[e]) : nullptr;
  // kFp8: the tile's row of block scales, of each weight.
  const float* srow = nullptr;
  const float* srow2 = nullptr;
  if constexpr (kFp8) {
    const Fp8Matrix f = fp8_matrix(w_data, a.m, K, a.fp8_block_rows, a.fp8_block_cols);
    srow = f.scales + (n0 / f.br) * f.kb;
    if constexpr (kDual) {
      const Fp8Matrix f2 = fp8_matrix(W2, a.m, K, a.fp8_block_rows, a.fp8_block_cols);
      srow2 = f2.scales + (n0 / f2.br) * f2.kb;
    }
  }
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
  const WT* brow = b_ok ? W + (n0 + lr) * K : nullptr;
  const WT* brow2 = (kDual && b_ok) ? W2 + (n0 + lr) * K : nullptr;

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
    if constexpr (kFp8) {
      static_assert(kCols == 16, "a staged row's fp8 weights are one 16-byte load");
      if (brow && vec_b && full) {
        const uint4 r = *reinterpret_cast<const uint4*>(brow + k0 + lc);
        bq[0] = fp8x8_to_bf16(r.x, r.y), bq[1] = fp8x8_to_bf16(r.z, r.w);
        if constexpr (kDual) {
          const uint4 r2 = *reinterpret_cast<const uint4*>(brow2 + k0 + lc);
          bq2[0] = fp8x8_to_bf16(r2.x, r2.y), bq2[1] = fp8x8_to_bf16(r2.z, r2.w);
        }
      } else {
#pragma unroll
        for (int q = 0; q < kCols; ++q) {
          const int64_t c = k0 + lc + q;
          bv[q] = from_f32<T>((brow && c < K) ? fp8_to_f32(brow[c]) : 0.0f);
          if constexpr (kDual) bv2[q] = from_f32<T>((brow2 && c < K) ? fp8_to_f32(brow2[c]) : 0.0f);
        }
      }
    } else if (brow && vec_b && full) {
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
  // kFp8: the current k block's products, before its scale.
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> blk[kFp8 ? 2 : 1][2],
      blk2[kFp8 && kDual ? 2 : 1][2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      wmma::fill_fragment(acc[i][j], 0.0f);
      if constexpr (kDual) wmma::fill_fragment(acc2[i][j], 0.0f);
      if constexpr (kFp8) {
        wmma::fill_fragment(blk[i][j], 0.0f);
        if constexpr (kDual) wmma::fill_fragment(blk2[i][j], 0.0f);
      }
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
            if constexpr (kFp8) {
              wmma::mma_sync(blk[i][j], fa[i], fb[j], blk[i][j]);
              if constexpr (kDual) wmma::mma_sync(blk2[i][j], fa[i], fb2[j], blk2[i][j]);
            } else {
              wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
              if constexpr (kDual) wmma::mma_sync(acc2[i][j], fa[i], fb2[j], acc2[i][j]);
            }
          }
        }
      }
    }
    if constexpr (kFp8) {
      // The k block ends with this stage (bc is a multiple of kTK): its products, scaled, join
      // the totals (one scale for every element, so the fragments' layout does not matter).
      if ((k0 + kTK) % a.fp8_block_cols == 0 || k0 + kTK >= K) {
        const int64_t b = k0 / a.fp8_block_cols;
        const float sc = __ldg(srow + b), sc2 = kDual ? __ldg(srow2 + b) : 0.0f;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
#pragma unroll
          for (int j = 0; j < 2; ++j) {
#pragma unroll
            for (int q = 0; q < acc[i][j].num_elements; ++q) {
              acc[i][j].x[q] = fmaf(sc, blk[i][j].x[q], acc[i][j].x[q]);
              if constexpr (kDual) acc2[i][j].x[q] = fmaf(sc2, blk2[i][j].x[q], acc2[i][j].x[q]);
            }
            wmma::fill_fragment(blk[i][j], 0.0f);
            if constexpr (kDual) wmma::fill_fragment(blk2[i][j], 0.0f);
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
    if (r < rows && n0 + c < a.m) {
      float* o = a.out + int64_t(row0 + r) * a.ldo + n0 + c;
      *o = a.accumulate ? *o + Cs[r * kLdc + c] : Cs[r * kLdc + c];
    }
  }
}

}  // namespace

void launch_moe_wmma(const MoeGemmArgs& a, DType wdtype, bool dual, unsigned max_tiles,
                     cudaStream_t stream) {
  const bool vec_a = a.k % 4 == 0 && a.ldx % 4 == 0 && (reinterpret_cast<uintptr_t>(a.x) & 15) == 0;
  const dim3 grid(unsigned((a.m + kTN - 1) / kTN), max_tiles);
  if (wdtype == DType::F8_E4M3) {
    RECUR_CHECK(fp8_wmma_blocks(a.fp8_block_rows, a.fp8_block_cols));
    const bool vec_b = a.k % 16 == 0 && a.w_aligned;
    if (dual) {
      launch_kernel(moe_wmma_kernel<__nv_bfloat16, true, true>, grid, kThreads, 0, stream, a, vec_a,
                    vec_b);
    } else {
      launch_kernel(moe_wmma_kernel<__nv_bfloat16, false, true>, grid, kThreads, 0, stream, a,
                    vec_a, vec_b);
    }
    return;
  }
  const bool vec_b = a.k % 8 == 0 && a.w_aligned;
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
