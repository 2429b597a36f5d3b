// The MoE experts' grouped GEMM on tensor cores, for prompts (more than kGemvMaxTokens tokens),
// and block-FP8 dense matmuls (dense_w). A block computes a tile of out for one expert's rows:
// 4 warps of WMMA 16×16×16 fragments, K staged 32 at a time through shared memory. f32
// activations are split into three terms of the weights' type (bf16 or f16; hi + mid + lo = x
// exactly for bf16), each multiplied with the weights into the same f32 accumulators, smallest
// first: f32-class results, as the GEMV core gives for few tokens. The fused gate/up variant
// applies SwiGLU to the two accumulators element by element (same fragment layout) before
// storing.
//   Where the weights suit the pipelined tiles (moe_wmma_pipelined), launch_moe_wmma hands them
//     to moe_mma.cu's, on two scaled f16 terms of the activations.
//   Fallback tiles (k not a multiple of the copies, unaligned weights, or 16-bit experts with a
//     bf16 weight beyond f16's range): 64×64, each block splits f32 rows into three terms of
//     the weights' type while staging, one stage of global loads held in registers.
#include <mma.h>

#include <algorithm>

#include "backend/cuda/fp8.cuh"
#include "backend/cuda/moe.cuh"
#include "backend/cuda/moe_tile_io.cuh"

namespace recur::cuda {

namespace {

using namespace nvcuda;

constexpr int kTM = kWmmaTileRows, kTN = 64, kTK = 32;
constexpr int kCols = kTK / 2;  // columns of a staged row per thread
constexpr int kLd = kTK + 8;    // staged rows padded by 16 bytes against bank conflicts
constexpr int kLdc = kTN + 4;   // f32 epilogue rows
constexpr int kThreads = 128;
constexpr int kTerms = kMoeTerms;

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

// x [rows, k] (rows ldx apart) → terms [3, rows, k] of T: lo, mid, hi (split3). G consecutive
// columns a thread: 8 with 16-byte stores (k a multiple of 8; vec: 16-byte loads too), else 1.
template <typename T, int G>
__global__ void split_terms_kernel(const float* x, int64_t ldx, int64_t rows, int64_t k, bool vec,
                                   T* terms) {
  grid_dependency_sync();
  const int64_t groups = k / G, plane = rows * k;
  for (int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; g < rows * groups;
       g += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = g / groups, c = (g % groups) * G;
    if constexpr (G == 1) {
      T t[kTerms];
      split3(x[r * ldx + c], t);
#pragma unroll
      for (int term = 0; term < kTerms; ++term) terms[term * plane + r * k + c] = t[term];
    } else {
      static_assert(G == 8, "8 columns: one 16-byte store per term");
      float v[8];
      load_f32x8(x + r * ldx + c, vec, v);
      uint4 pk[kTerms];
      T* pt = reinterpret_cast<T*>(pk);
#pragma unroll
      for (int q = 0; q < 8; ++q) {
        T t[kTerms];
        split3(v[q], t);
#pragma unroll
        for (int term = 0; term < kTerms; ++term) pt[term * 8 + q] = t[term];
      }
#pragma unroll
      for (int term = 0; term < kTerms; ++term) {
        *reinterpret_cast<uint4*>(terms + term * plane + r * k + c) = pk[term];
      }
    }
  }
}

using Acc = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;
// A warp's accumulators: acc (acc2: the up weights when kDual); blk, blk2 (kFp8): the current
// k block's products, before its scale.
template <bool kDual, bool kFp8>
struct WarpAccs {
  Acc acc[2][2], acc2[kDual ? 2 : 1][2], blk[kFp8 ? 2 : 1][2], blk2[kFp8 && kDual ? 2 : 1][2];
  __device__ __forceinline__ void zero() {
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
  }
};

// One staged k slice of kTK: A terms [3][kTM·kLd] (rows of the tile's activations), B and B2
// [kTN·kLd] (rows of the weights: B's columns), this warp's 32×32 of the products.
template <typename T, bool kDual, bool kFp8>
__device__ __forceinline__ void mma_stage(const T* As, const T* Bs, const T* B2s, int wm, int wn,
                                          WarpAccs<kDual, kFp8>& f) {
#pragma unroll
  for (int kk = 0; kk < kTK; kk += 16) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa[2];
    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> fb[2], fb2[kDual ? 2 : 1];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      // B element (k, n) is W[n][k]: the staged rows are B's columns.
      wmma::load_matrix_sync(fb[j], Bs + (wn * 32 + j * 16) * kLd + kk, kLd);
      if constexpr (kDual) wmma::load_matrix_sync(fb2[j], B2s + (wn * 32 + j * 16) * kLd + kk, kLd);
    }
#pragma unroll
    for (int term = 0; term < kTerms; ++term) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        wmma::load_matrix_sync(fa[i], As + term * kTM * kLd + (wm * 32 + i * 16) * kLd + kk, kLd);
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          if constexpr (kFp8) {
            wmma::mma_sync(f.blk[i][j], fa[i], fb[j], f.blk[i][j]);
            if constexpr (kDual) wmma::mma_sync(f.blk2[i][j], fa[i], fb2[j], f.blk2[i][j]);
          } else {
            wmma::mma_sync(f.acc[i][j], fa[i], fb[j], f.acc[i][j]);
            if constexpr (kDual) wmma::mma_sync(f.acc2[i][j], fa[i], fb2[j], f.acc2[i][j]);
          }
        }
      }
    }
  }
}

// kFp8, after the stage at k0: when the k block ends with it (bc is a multiple of kTK), its
// products, scaled, join the totals (one scale for every element, so the fragments' layout
// does not matter). srow, srow2: the tile's row of block scales of each weight.
template <bool kDual>
__device__ __forceinline__ void fold_block(const MoeGemmArgs& a, int64_t k0, const float* srow,
                                           const float* srow2, WarpAccs<kDual, true>& f) {
  if ((k0 + kTK) % a.fp8_block_cols != 0 && k0 + kTK < a.k) return;
  const int64_t b = k0 / a.fp8_block_cols;
  const float sc = __ldg(srow + b), sc2 = kDual ? __ldg(srow2 + b) : 0.0f;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int q = 0; q < f.acc[i][j].num_elements; ++q) {
        f.acc[i][j].x[q] = fmaf(sc, f.blk[i][j].x[q], f.acc[i][j].x[q]);
        if constexpr (kDual) f.acc2[i][j].x[q] = fmaf(sc2, f.blk2[i][j].x[q], f.acc2[i][j].x[q]);
      }
      wmma::fill_fragment(f.blk[i][j], 0.0f);
      if constexpr (kDual) wmma::fill_fragment(f.blk2[i][j], 0.0f);
    }
  }
}

// The tile's kTN columns through Cs [kTM · (kTN + 4)] to out (store_tile_rows); kDual: out =
// silu(acc) · acc2.
template <bool kDual, bool kFp8>
__device__ __forceinline__ void store_tile(const MoeGemmArgs& a, WarpAccs<kDual, kFp8>& f,
                                           float* Cs, int row0, int rows, int64_t n0, int wm,
                                           int wn) {
  constexpr int ldc = kTN + 4;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      float* c = Cs + (wm * 32 + i * 16) * ldc + wn * 32 + j * 16;
      if constexpr (kDual) {
        for (int q = 0; q < f.acc[i][j].num_elements; ++q) {
          f.acc[i][j].x[q] = silu(f.acc[i][j].x[q]) * f.acc2[i][j].x[q];
        }
      }
      wmma::store_matrix_sync(c, f.acc[i][j], ldc, wmma::mem_row_major);
    }
  }
  __syncthreads();
  store_tile_rows<kTN>(a, Cs, ldc, row0, rows, n0);
}

// The tile of block (blockIdx.x, blockIdx.y): false for a surplus block.
__device__ __forceinline__ bool wmma_tile(const MoeGemmArgs& a, int& e, int& row0, int& rows) {
  const int tile = blockIdx.y;
  e = 0;
  if (a.dense_w) {
    row0 = tile * kTM;
    rows = int(min64(kTM, a.dense_rows - row0));
    return rows > 0;
  }
  if (tile >= *a.n_tiles) return false;
  e = a.tile_expert[tile], row0 = a.tile_row0[tile], rows = a.tile_rows[tile];
  return true;
}

// kFp8: the tile's row of block scales of weights w (fp8.cuh's layout).
__device__ __forceinline__ const float* scale_row(const MoeGemmArgs& a, const void* w, int64_t n0) {
  const Fp8Matrix f = fp8_matrix(w, a.m, a.k, a.fp8_block_rows, a.fp8_block_cols);
  return f.scales + (n0 / f.br) * f.kb;
}

// The fallback tiles: grid (⌈m/64⌉, max_tiles); blocks past the device's tile count exit at
// once. Each block splits its activation rows while staging them, the next stage's global loads
// held in registers during the current stage's MMAs.
// kFp8 (T bf16): the weights are F8_E4M3 (fp8.cuh), staged widened to bf16; each k block's
// products go to their own accumulators, added to the totals times the block's scale (one
// scale for the whole tile: fp8_wmma_blocks).
template <typename T, bool kDual, bool kFp8 = false>
__global__ void __launch_bounds__(kThreads) moe_wmma_kernel(MoeGemmArgs a, bool vec_a, bool vec_b) {
  static_assert(!kFp8 || std::is_same_v<T, __nv_bfloat16>, "fp8 weights are widened to bf16");
  using WT = std::conditional_t<kFp8, uint8_t, T>;  // the weights' stored type
  grid_dependency_sync();
  int e, row0, rows;
  if (!wmma_tile(a, e, row0, rows)) return;
  const int64_t n0 = int64_t(blockIdx.x) * kTN, K = a.k;
  const void* w_data = a.dense_w ? a.dense_w : a.w[e];
  const WT* W = static_cast<const WT*>(w_data);
  const WT* W2 = kDual ? static_cast<const WT*>(a.w2[e]) : nullptr;
  const float* srow = nullptr;
  const float* srow2 = nullptr;
  if constexpr (kFp8) {
    srow = scale_row(a, w_data, n0);
    if constexpr (kDual) srow2 = scale_row(a, W2, n0);
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

  WarpAccs<kDual, kFp8> f;
  f.zero();
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
        T t[kTerms];
        split3(av[q], t);
#pragma unroll
        for (int term = 0; term < kTerms; ++term) pt[term * kCols + q] = t[term];
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
    mma_stage<T, kDual, kFp8>(&As[0][0], Bs, B2s, wm, wn, f);
    if constexpr (kFp8) fold_block<kDual>(a, k0, srow, srow2, f);
  }
  store_tile<kDual, kFp8>(a, f, Cs, row0, rows, n0, wm, wn);
}

}  // namespace

bool moe_wmma_pipelined(DType wdtype, int64_t k, bool w_aligned) {
  // A weight row's 16-byte copies never straddle k: 8 16-bit or 16 fp8 elements.
  return w_aligned && k % (wdtype == DType::F8_E4M3 ? 16 : 8) == 0;
}

void launch_wmma_split(const float* x, int64_t ldx, int64_t rows, int64_t k, DType type,
                       void* terms, cudaStream_t stream) {
  const bool by8 = k % 8 == 0;
  const bool vec = by8 && ldx % 4 == 0 && (reinterpret_cast<uintptr_t>(x) & 15) == 0;
  const unsigned blocks =
      unsigned(std::min<int64_t>(blocks_for(rows * (by8 ? k / 8 : k), 256), 1 << 16));
  if (blocks == 0) return;
  auto launch = [&](auto tag) {
    using T = decltype(tag);
    T* t = static_cast<T*>(terms);
    if (by8) {
      launch_kernel(split_terms_kernel<T, 8>, blocks, 256, 0, stream, x, ldx, rows, k, vec, t);
    } else {
      launch_kernel(split_terms_kernel<T, 1>, blocks, 256, 0, stream, x, ldx, rows, k, vec, t);
    }
  };
  if (type == DType::F16) {
    launch(__half{});
  } else {
    RECUR_CHECK(type == DType::BF16);
    launch(__nv_bfloat16{});
  }
}

void launch_moe_wmma(const MoeGemmArgs& a, DType wdtype, bool dual, unsigned max_tiles,
                     cudaStream_t stream) {
  if (a.x_terms) {
    RECUR_CHECK(moe_wmma_pipelined(wdtype, a.k, a.w_aligned));
    RECUR_CHECK(!a.out_terms || (dual && a.m % 8 == 0));
    launch_moe_mma(a, wdtype, dual, max_tiles, stream);  // two scaled f16 terms
    return;
  }
  RECUR_CHECK(!a.out_terms);
  const dim3 grid(unsigned((a.m + kTN - 1) / kTN), max_tiles);
  const bool vec_a = a.k % 4 == 0 && a.ldx % 4 == 0 && (reinterpret_cast<uintptr_t>(a.x) & 15) == 0;
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
