// The MoE experts' grouped GEMM for prompts with 16-bit (bf16, f16) or block-FP8 weights, on f16
// mma.sync
// m16n8k16: the weights are the products' rows (A, 16-row fragments) and a tile's tokens their
// columns (B, 8-token fragments), so a tile of fewer than 64 tokens — the common case when a
// prompt's tokens spread over hundreds of experts — computes only the 8-token groups it fills
// instead of a whole 64-row fragment grid.
//   Operands. Each activation row comes as two f16 terms (hi, and mid = the rest, rounded) of
// the row times a power of two that puts its largest |value| in [2^14, 2^15): 22 bits of every
// value within 2^17 of the row's largest, an absolute error under 2^-39 of it below that, and
// no overflow whatever the row's range (f16 stops at 65504). The scaling is exact, so a token's
// result does not depend on the rest of the batch. Both terms multiply the weights into the same
// f32 accumulators (mid first), and the epilogue multiplies the sums by the row's inverse scale;
// with BackendOptions::prompt_activations kF16 the warpgroup tiles take the hi term alone.
// bf16 weights become f16 in registers, exactly (bf16's 8-bit significand fits f16's 11) for
// |w| in f16's normal range; smaller ones round to f16's subnormals (an absolute error under
// 2^-25); the backend sends weights beyond 65504 to the f32-activation tiles (moe_wmma.cu).
// Two f16 terms keep verify's errors at the f32 kernels' level where two bf16 terms did not
// (bench/results/cpu-session25-f16-matmul-emulation.md), and cost a third fewer products and
// copies than the three bf16 terms before them (H200, 80B-A3B cut to 6 layers, one call, means
// of two rounds: 2,048 / 16,384 / 65,536-token prefill 89,600 / 92,300 / 58,700 -> 92,000 /
// 95,200 / 60,100 tok/s; bench/results/h200-session26-notes.md).
//   Gate/up's SwiGLU outputs are down's activations: the blocks of one tile (its d_ff columns,
// at most kMaxClusterBlocks blocks) run as a cluster, which agrees on each row's largest value
// through distributed shared memory and stores the row's two terms and inverse scale.
//   A block: 256 threads, 256 weight rows (gate's 128 and up's 128 of the same output columns,
// SwiGLU applied in registers; or 256 rows of one weight) × one tile's 64 tokens, k staged 32
// at a time through a four-stage cp.async ring of unpadded, swizzled rows; two blocks (16 warps)
// share an SM. Block-FP8 weights: 128 rows, five stages (TileShape). A stage reads 64 bytes of each
// weight row: the copies ask L2 for the 256 bytes around them (.L2::256B), so memory serves each
// row in longer runs and the next three stages hit L2. H200, 80B-A3B cut to 6 layers, gate/up a
// layer at 2,048 / 16,384 tokens: 128 rows, three stages and three blocks an SM 1,032 / 5,326 µs;
// 256 rows 1,029 / 4,871; four stages 1,022 / 4,739; with .L2::256B 832 / 4,720 (a bulk L2 prefetch
// of 2 KB a row every 16 stages instead: 1,125 / 5,122). bench/results/h200-session27-notes.md,
// calls 4 to 6.
//   moe_wgmma_kernel: the same tiles of 16-bit weights on Hopper's warpgroup products, taken
// wherever sm_90a code runs (kernels_moe.cu); moe_mma_kernel's 16-bit tiles serve other devices.
#include <cooperative_groups.h>

#include <algorithm>

#include <cuda_fp8.h>

#include "backend/cuda/fp8.cuh"
#include "backend/cuda/mma_16bit.cuh"
#include "backend/cuda/moe.cuh"
#include "backend/cuda/moe_tile_io.cuh"
#include "backend/cuda/wgmma.cuh"

namespace recur::cuda {

namespace {

constexpr int kThreads = 256;  // 8 warps: 4 along the weight rows × 2 along the tokens
constexpr int kTokens = kWmmaTileRows;
constexpr int kTK = 32;
constexpr int kLd = kTK;  // staged activation rows of 64 bytes, 16-byte chunks swizzled (swz)
constexpr int kXBytes = kF16Terms * kTokens * kLd * 2;  // X [2][kTokens][kLd]: mid, hi
static_assert(kThreads == kTokens * (kTK / 8), "one 16-byte copy per thread per token row");
static_assert(kThreads == 4 * kTokens, "four threads per token row in the row maxima");

// The tile's shape for weights of type T: 16-bit weights stage 256 rows (rows of kTK·2 bytes),
// block-FP8 weights 128 (rows of kTK bytes; a warp keeps each k block's products apart from
// the totals until its scale multiplies them, twice the accumulators).
template <typename T>
struct TileShape {
  static constexpr bool kFp8 = std::is_same_v<T, uint8_t>;
  static constexpr int kRowTiles = kFp8 ? 2 : 4;  // a warp's 16-row fragments, 64 rows apart
  static constexpr int kWRows = 64 * kRowTiles;   // weight rows staged per block
  static constexpr int kRowBytes = kTK * int(sizeof(T));
  static constexpr int kStages = kFp8 ? 5 : 4;
  static constexpr int kWBytes = kWRows * kRowBytes;  // W [kWRows][kRowBytes]
  static constexpr int kStageBytes = kWBytes + kXBytes;
  static constexpr int kCsLd = kWRows + 4;  // epilogue Cs [kTokens][kCsLd] f32, reusing the ring
  static constexpr int kSmemBytes = std::max(kStages * kStageBytes, kTokens* kCsLd * 4);
  static_assert(kRowTiles % 2 == 0, "gate's fragments, then up's");
  // A ring of exactly 48 KB would not be opted in, and the static arrays come on top.
  static_assert(kSmemBytes > (48 << 10), "opt_in_smem raises the limit");
};

// The position of 16-byte chunk c of a staged row: ldmatrix's 8 consecutive rows at one chunk
// land in 8 distinct bank groups.
__device__ __forceinline__ int swz(int row, int c) {
  return (c ^ ((row >> 1) & 3)) * 8;
}

// A fragment register of two bf16 weights as two f16 (satfinite: the backend keeps weights
// beyond f16's range off this path).
__device__ __forceinline__ uint32_t bf16x2_to_f16x2(uint32_t w) {
  uint32_t h;
  asm("cvt.rn.satfinite.f16x2.f32 %0, %1, %2;\n"
      : "=r"(h)
      : "f"(__uint_as_float(w & 0xffff0000u)), "f"(__uint_as_float(w << 16)));
  return h;
}

// The position of 16-byte chunk c of staged activation row `row` (elements): for the 16-bit
// weights' ldmatrix (swz), or, for block-FP8 weights, for 8-byte loads by lanes of four tokens
// g = 0 .. 3 at once: rows g and g + 2 take other chunks, so a half-warp's loads hit 32 banks.
template <bool kFp8>
__device__ __forceinline__ int swz_x(int row, int c) {
  return kFp8 ? (c ^ (row & 2)) * 8 : swz(row, c);
}

// The byte offset of 16-byte chunk c (0, 1) of a staged block-FP8 row of 32 bytes: ldmatrix's
// 8 consecutive rows at one chunk land in 8 distinct bank groups.
__device__ __forceinline__ int swz_fp8(int row, int c) {
  return row * 32 + 16 * (c ^ ((row >> 2) & 1));
}

// Two e4m3 values (the low and high bytes of v) as f16x2, exactly.
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t v) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(v & 0xffffu), __NV_E4M3);
  return uint32_t(h.x) | (uint32_t(h.y) << 16);
}

// Gate/up's epilogue: the SwiGLU outputs Cs [kTokens][kCsLd] (this block's kW columns from n0)
// stored as down's activations, two f16 terms of each row scaled by the power of two of its
// largest |value| over every block of the cluster (the tile's d_ff columns), and the row's
// inverse scale (by the cluster's first block). row_max [kTokens]: this block's maxima of its
// rows, which the other blocks read; row_scale [kTokens]: the scales they agree on. Every thread
// of every block of the cluster calls it after a block barrier.
template <int kW, int kCsLd>
__device__ __forceinline__ void store_scaled_terms(const MoeGemmArgs& a, const float* Cs, int row0,
                                                   int rows, int64_t n0, float (&row_max)[kTokens],
                                                   float (&row_scale)[kTokens]) {
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  const int tid = threadIdx.x;
  {
    const int r = tid / 4, part = tid % 4;
    float mx = 0.0f;
#pragma unroll
    for (int c = part * (kW / 4); c < (part + 1) * (kW / 4); ++c) {
      if (n0 + c < a.m) mx = fmaxf(mx, fabsf(Cs[r * kCsLd + c]));
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    if (part == 0) row_max[r] = mx;
  }
  cluster.sync();  // every block's maxima are written
  if (tid < rows) {
    float mx = 0.0f;
    for (unsigned b = 0; b < cluster.num_blocks(); ++b) {
      mx = fmaxf(mx, *cluster.map_shared_rank(&row_max[tid], b));
    }
    const int e = f16_row_exponent(mx);
    row_scale[tid] = ldexpf(1.0f, e);
    if (cluster.block_rank() == 0) a.out_scale[row0 + tid] = ldexpf(1.0f, -e);
  }
  cluster.sync();  // every block has read the others' maxima; row_scale is visible
  __half* ot = static_cast<__half*>(a.out_terms);
  for (int idx = tid; idx < kTokens * kW / 8; idx += kThreads) {
    const int r = idx / (kW / 8), c = (idx % (kW / 8)) * 8;
    if (r >= rows || n0 + c >= a.m) continue;
    uint4 pk[kF16Terms];
    __half* pt = reinterpret_cast<__half*>(pk);
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      __half t[kF16Terms];
      split_f16(Cs[r * kCsLd + c + q] * row_scale[r], t);
#pragma unroll
      for (int term = 0; term < kF16Terms; ++term) pt[term * 8 + q] = t[term];
    }
    __half* o = ot + int64_t(row0 + r) * a.m + n0 + c;
#pragma unroll
    for (int term = 0; term < kF16Terms; ++term) {
      *reinterpret_cast<uint4*>(o + term * a.out_terms_plane) = pk[term];
    }
  }
}

// Tile row r's activation terms (mid; hi one plane on) and the inverse scale of its row; past
// the tile's rows null and 0, so the zeros copied in stay zero sums.
__device__ __forceinline__ const __half* x_terms_row(const MoeGemmArgs& a, int row0, int r,
                                                     int rows, float& inv) {
  inv = 0.0f;
  if (r >= rows) return nullptr;
  const int64_t xr = a.x_row ? int64_t(a.x_row[row0 + r]) : int64_t(row0 + r);
  inv = a.x_scale[xr];
  return static_cast<const __half*>(a.x_terms) + xr * a.ldxt;
}

// A tile's outputs from Cs (every thread of the block, after the barrier that completes Cs):
// gate/up's SwiGLU rows as down's terms (a.out_terms set), else f32 rows.
template <bool kDual, int kWRows, int kCsLd>
__device__ __forceinline__ void store_tile_outputs(const MoeGemmArgs& a, const float* Cs, int row0,
                                                   int rows, int64_t n0,
                                                   float (&row_max)[kDual ? kTokens : 1],
                                                   float (&row_scale)[kDual ? kTokens : 1]) {
  if constexpr (kDual) {
    if (a.out_terms) {
      store_scaled_terms<kWRows / 2, kCsLd>(a, Cs, row0, rows, n0, row_max, row_scale);
      return;
    }
  }
  store_tile_rows<kDual ? kWRows / 2 : kWRows>(a, Cs, kCsLd, row0, rows, n0);  // f32 rows
}

// grid (⌈m/(kWRows/2)⌉ when kDual, else ⌈m/kWRows⌉, max_tiles); a.x_terms and a.x_scale set.
// Gate/up with a.out_terms (and a.out_scale) set runs in clusters of grid.x blocks and stores
// down's terms; without, it stores f32 rows (SwiGLU rows wider than a cluster), as down does.
// Weight rows staged: kDual, gate's rows [n0, n0 + kWRows/2) then up's; else rows [n0, n0 +
// kWRows) of the one weight. Warp (wm, wn) multiplies staged rows i·64 + wm·16 + [0, 16)
// (i < kRowTiles) with the tile's 8-token groups wn, wn + 2, wn + 4, wn + 6 that hold tokens.
// Copies past the tile's tokens, the weights' rows or k are zeros (k is a multiple of the
// 16-byte copies).
//   Block-FP8 weights (T uint8_t, fp8.cuh's layout): a warp's ldmatrix of 16 staged rows of 32
// bytes gives each lane four e4m3 values of a row, k = 4t .. 4t + 3 (t = lane % 4) of a 16-value
// half; as f16 they serve as the fragment's k = 2t, 2t + 1 and 2t + 8, 2t + 9. The same
// permutation of k for the activations (a lane reads their 4t .. 4t + 3 as one 8-byte load)
// leaves every sum unchanged. Each k block's products go through part, then, times the block's
// scale, into acc.
template <typename T, bool kDual>
__global__ void __launch_bounds__(kThreads, 2) moe_mma_kernel(MoeGemmArgs a) {
  using S = TileShape<T>;
  constexpr int kRowTiles = S::kRowTiles, kWRows = S::kWRows, kStages = S::kStages;
  constexpr bool kFp8 = S::kFp8;
  grid_dependency_sync();
  int e, row0, rows;
  // The same tile for every block of a cluster (clusters run along x): they return together.
  if (!block_tile(a, e, row0, rows)) return;
  const int64_t n0 = int64_t(blockIdx.x) * (kDual ? kWRows / 2 : kWRows), K = a.k;
  const T* W = static_cast<const T*>(a.dense_w ? a.dense_w : a.w[e]);
  const T* W2 = kDual ? static_cast<const T*>(a.w2[e]) : W;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ float row_inv[kTokens];  // the tile's rows' inverse activation scales
  __shared__ float row_max[kDual ? kTokens : 1], row_scale[kDual ? kTokens : 1];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, wm = warp % 4, wn = warp / 4;

  // Copy roles: token row cr of each term, 8 columns from cc. 16-bit weights: rows cr + 64h, 8
  // columns from cc; block-FP8: row tid / 2, 16 bytes from (tid % 2)·16.
  const int cr = tid / 4, cc = (tid % 4) * 8;
  const __half* xt = static_cast<const __half*>(a.x_terms);
  float inv;
  const __half* xrow = x_terms_row(a, row0, cr, rows, inv);
  if (tid % 4 == 0) row_inv[cr] = inv;
  // The weight row of staged row sr: kDual, gate's rows for sr < kWRows / 2, then up's.
  auto weight_row = [&](int sr) -> const T* {
    const bool second = kDual && sr >= kWRows / 2;
    const int64_t r = n0 + (second ? sr - kWRows / 2 : sr);
    return r < a.m ? (second ? W2 : W) + r * K : nullptr;
  };
  constexpr int kCopyRows = kFp8 ? 1 : kRowTiles;  // weight rows a thread copies
  const T* wrow[kCopyRows];
#pragma unroll
  for (int h = 0; h < kCopyRows; ++h) wrow[h] = weight_row(kFp8 ? tid / 2 : cr + 64 * h);
  auto issue = [&](int kt) {
    unsigned char* st = smem + (kt % kStages) * S::kStageBytes;
    __half* Xs = reinterpret_cast<__half*>(st + S::kWBytes);
    const int64_t k0 = int64_t(kt) * kTK + cc;
    const bool k_in = k0 < K;
    if constexpr (kFp8) {
      const int64_t kb = int64_t(kt) * kTK + (tid % 2) * 16;
      const bool ok = wrow[0] && kb < K;
      copy16_async_l2_256(st + swz_fp8(tid / 2, tid % 2), ok ? wrow[0] + kb : W, ok);
    } else {
      T* Ws = reinterpret_cast<T*>(st);
#pragma unroll
      for (int h = 0; h < kRowTiles; ++h) {
        const bool ok = wrow[h] && k_in;
        copy16_async_l2_256(Ws + (cr + 64 * h) * kLd + swz(cr, cc / 8), ok ? wrow[h] + k0 : W, ok);
      }
    }
    const bool ok = xrow && k_in;
#pragma unroll
    for (int term = 0; term < kF16Terms; ++term) {
      copy16_async(Xs + (term * kTokens + cr) * kLd + swz_x<kFp8>(cr, cc / 8),
                   ok ? xrow + term * a.x_terms_plane + k0 : xt, ok);
    }
  };
  // Block-FP8: each row tile's row of block scales (rows past m: any valid row's; their
  // products are zeros).
  const float* srow[kFp8 ? kRowTiles : 1] = {};
  if constexpr (kFp8) {
#pragma unroll
    for (int i = 0; i < kRowTiles; ++i) {
      const bool second = kDual && i >= kRowTiles / 2;
      const int64_t r = n0 + 64 * (second ? i - kRowTiles / 2 : i);
      const Fp8Matrix f = fp8_matrix(second ? W2 : W, a.m, a.k, a.fp8_block_rows, a.fp8_block_cols);
      srow[i] = f.scales + (r < a.m ? r / f.br : 0) * f.kb;
    }
  }

  // acc[i][j]: staged rows i·64 + wm·16 + [0, 16) × tokens of group wn + 2j; part (block-FP8):
  // the current k block's products.
  float acc[kRowTiles][4][4] = {}, part[kRowTiles][4][4] = {};  // part: unused but for block-FP8
  float(&sums)[kRowTiles][4][4] = kFp8 ? part : acc;
  const int groups = (rows + 7) / 8, active = (groups - wn + 1) / 2;  // this warp's groups
  const int nk = int((K + kTK - 1) / kTK);
  const int stages_per_block = kFp8 ? a.fp8_block_cols / kTK : 1;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < nk) issue(s);
    copy_commit();  // empty groups too: the waits below count kStages - 1 groups ahead
  }
  // ldmatrix lanes: A rows lane % 16 at column (lane / 16)·8 (block-FP8: rows lane % 8 +
  // 8·((lane / 8) % 2), 16-byte chunk lane / 16); B matrix lane / 8 is group 2p + (lane / 16)
  // of the pair p, columns ((lane / 8) % 2)·8, its token lane % 8.
  const int a_row = wm * 16 + lane % 16, b_tok = (wn + 2 * (lane / 16)) * 8 + lane % 8;
  const int a_row8 = wm * 16 + lane % 8 + 8 * ((lane / 8) % 2);
  const int g = lane / 4, t = lane % 4;
  for (int kt = 0; kt < nk; ++kt) {
    copy_wait<kStages - 2>();
    // Stage kt has landed for every thread, and every warp is done with stage kt - 1, whose
    // slot the copies below refill.
    __syncthreads();
    if (kt + kStages - 1 < nk) issue(kt + kStages - 1);
    copy_commit();
    const unsigned char* st = smem + (kt % kStages) * S::kStageBytes;
    const __half* Xs = reinterpret_cast<const __half*>(st + S::kWBytes);
    uint32_t fp8_raw[kFp8 ? kRowTiles : 1][4];  // the stage's e4m3 fragments, both halves of k
    if constexpr (kFp8) {
#pragma unroll
      for (int i = 0; i < kRowTiles; ++i) {
        ldmatrix_x4<false>(fp8_raw[i], st + swz_fp8(i * 64 + a_row8, lane / 16));
      }
    }
#pragma unroll
    for (int kk = 0; kk < kTK; kk += 16) {
      uint32_t af[kRowTiles][4];
#pragma unroll
      for (int i = 0; i < kRowTiles; ++i) {
        if constexpr (kFp8) {
          const uint32_t r0 = fp8_raw[i][kk / 8], r1 = fp8_raw[i][kk / 8 + 1];  // rows g, g + 8
          af[i][0] = e4m3x2_to_f16x2(r0), af[i][1] = e4m3x2_to_f16x2(r1);
          af[i][2] = e4m3x2_to_f16x2(r0 >> 16), af[i][3] = e4m3x2_to_f16x2(r1 >> 16);
        } else {
          const T* Ws = reinterpret_cast<const T*>(st);
          ldmatrix_x4<false>(af[i], Ws + (i * 64 + a_row) * kLd + swz(a_row, lane / 16 + kk / 8));
          if constexpr (std::is_same_v<T, __nv_bfloat16>) {
#pragma unroll
            for (int r = 0; r < 4; ++r) af[i][r] = bf16x2_to_f16x2(af[i][r]);
          }
        }
      }
#pragma unroll
      for (int p = 0; p < 2; ++p) {
        if (2 * p >= active) break;  // warp-uniform
        uint32_t bf[kF16Terms][4];   // [term]: groups 2p (regs 0, 1) and 2p + 1 (regs 2, 3)
#pragma unroll
        for (int term = 0; term < kF16Terms; ++term) {
          if constexpr (kFp8) {
            // Activations k = kk + 4t .. 4t + 3 of token g of each group, as the weights' k.
#pragma unroll
            for (int q = 0; q < 2; ++q) {
              const int tok = (wn + 2 * (2 * p + q)) * 8 + g, el = kk + 4 * t;
              const uint2 v = *reinterpret_cast<const uint2*>(Xs + (term * kTokens + tok) * kLd +
                                                              swz_x<kFp8>(tok, el / 8) + el % 8);
              bf[term][2 * q] = v.x, bf[term][2 * q + 1] = v.y;
            }
          } else {
            ldmatrix_x4<false>(bf[term], Xs + (term * kTokens + b_tok + 32 * p) * kLd +
                                             swz(b_tok, (lane / 8) % 2 + kk / 8));
          }
        }
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          if (2 * p + q >= active) break;
#pragma unroll
          for (int i = 0; i < kRowTiles; ++i) {
#pragma unroll
            for (int term = 0; term < kF16Terms; ++term) {
              mma16<__half>(sums[i][2 * p + q], af[i], bf[term][2 * q], bf[term][2 * q + 1]);
            }
          }
        }
      }
    }
    if constexpr (kFp8) {
      // The k block ends with this stage (its columns a multiple of kTK), or k does.
      if ((kt + 1) % stages_per_block == 0 || kt == nk - 1) {
        const int b = kt / stages_per_block;
#pragma unroll
        for (int i = 0; i < kRowTiles; ++i) {
          const float sc = __ldg(srow[i] + b);
#pragma unroll
          for (int j = 0; j < 4; ++j) {
#pragma unroll
            for (int u = 0; u < 4; ++u) {
              acc[i][j][u] = fmaf(sc, part[i][j][u], acc[i][j][u]);
              part[i][j][u] = 0.0f;
            }
          }
        }
      }
    }
  }
  copy_wait<0>();
  __syncthreads();  // Cs reuses the ring
  // Accumulator (row g or g + 8, columns 2t, 2t + 1) is weight row (output column) × token;
  // each sum times its token's inverse scale (exact) before the SwiGLU.
  float* Cs = reinterpret_cast<float*>(smem);
  constexpr int kCsLd = S::kCsLd;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if (j >= active) break;
    const int tok = (wn + 2 * j) * 8 + 2 * t;
#pragma unroll
    for (int i = 0; i < (kDual ? kRowTiles / 2 : kRowTiles); ++i) {
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int col = i * 64 + wm * 16 + g + (u / 2) * 8;
        const float inv = row_inv[tok + u % 2];
        const float v = kDual ? silu(acc[i][j][u] * inv) * (acc[i + kRowTiles / 2][j][u] * inv)
                              : acc[i][j][u] * inv;
        Cs[(tok + u % 2) * kCsLd + col] = v;
      }
    }
  }
  __syncthreads();
  store_tile_outputs<kDual, kWRows, kCsLd>(a, Cs, row0, rows, n0, row_max, row_scale);
}

// The staged activations of the warpgroup products (moe_wgmma_kernel), K-major in wgmma_desc's
// layout without swizzling: 16-byte chunk c (k 8c .. 8c + 7) of token tok at byte
// (tok / 8)·kXGroupBytes + c·128 + (tok % 8)·16, term planes kXPlaneBytes apart. A quarter-warp's
// copies (8 tokens of one chunk) fill one 128-byte core matrix: no bank conflicts.
constexpr int kXGroupBytes = kTK / 8 * 128;
constexpr int kXPlaneBytes = kTokens / 8 * kXGroupBytes;
static_assert(kF16Terms * kXPlaneBytes == kXBytes, "the same stage as moe_mma_kernel's");

// moe_mma_kernel's tiles of 16-bit weights on Hopper's warpgroup products (sm_90a): the same
// grid, stages, weight staging and epilogue; the products differ. mma.sync kept each warp
// issuing a product every ~9 cycles for 8 tokens at a time (ncu, H200: issue-bound at 2.6 TB/s
// of weights); here warpgroup wg (warps 4wg .. 4wg + 3) multiplies its row tiles wg and wg + 2
// (kDual: gate's and up's rows of the same 64 output columns) by all 64 of the tile's tokens in
// one instruction a term and 16 k. The weights come to registers through ldmatrix as before (bf16
// made f16 there, exactly as moe_mma_kernel does), the activations' terms straight from shared
// memory (kmajor_offset's layout). acc[ti][j]: rows (wg + 2ti)·64 + wm·16 + [0, 16) × tokens
// [8j, 8j + 8), in wgmma.cuh's fragment order. kOneTerm: the hi term alone is copied and
// multiplied (MoeGemmArgs::one_term).
template <typename T, bool kDual, bool kOneTerm>
__global__ void __launch_bounds__(kThreads, 2) moe_wgmma_kernel(MoeGemmArgs a) {
#if !defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __trap();  // the PTX for later GPUs: never launched there (MoeGemmArgs::warpgroup)
#else
  using S = TileShape<T>;
  static_assert(!S::kFp8 && S::kRowTiles == 4, "16-bit weights: two row tiles a warpgroup");
  constexpr int kWRows = S::kWRows, kStages = S::kStages;
  constexpr int kFirstTerm = kOneTerm ? 1 : 0;  // terms kFirstTerm .. 1 (mid, hi)
  grid_dependency_sync();
  int e, row0, rows;
  if (!moe_tile(a, int(blockIdx.y), e, row0, rows)) return;
  const int64_t n0 = int64_t(blockIdx.x) * (kDual ? kWRows / 2 : kWRows), K = a.k;
  const T* W = static_cast<const T*>(a.w[e]);
  const T* W2 = kDual ? static_cast<const T*>(a.w2[e]) : W;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ float row_inv[kTokens];
  __shared__ float row_max[kDual ? kTokens : 1], row_scale[kDual ? kTokens : 1];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, wm = warp % 4, wg = warp / 4;

  // Copy roles: weight rows cr + 64h, 8 columns from cc (as moe_mma_kernel); activations of
  // token x_tok, chunk x_chunk of each term.
  const int cr = tid / 4, cc = (tid % 4) * 8;
  const int x_tok = (tid / 32) * 8 + tid % 8, x_chunk = (tid / 8) % 4;
  const __half* xt = static_cast<const __half*>(a.x_terms);
  float inv;
  const __half* xrow = x_terms_row(a, row0, x_tok, rows, inv);
  if (x_chunk == 0) row_inv[x_tok] = inv;
  const T* wrow[4];
#pragma unroll
  for (int h = 0; h < 4; ++h) {
    const int sr = cr + 64 * h;
    const bool second = kDual && sr >= kWRows / 2;
    const int64_t r = n0 + (second ? sr - kWRows / 2 : sr);
    wrow[h] = r < a.m ? (second ? W2 : W) + r * K : nullptr;
  }
  auto issue = [&](int kt) {
    unsigned char* st = smem + (kt % kStages) * S::kStageBytes;
    T* Ws = reinterpret_cast<T*>(st);
    const int64_t k0 = int64_t(kt) * kTK + cc;
#pragma unroll
    for (int h = 0; h < 4; ++h) {
      const bool ok = wrow[h] && k0 < K;
      copy16_async_l2_256(Ws + (cr + 64 * h) * kLd + swz(cr, cc / 8), ok ? wrow[h] + k0 : W, ok);
    }
    const int64_t xk = int64_t(kt) * kTK + x_chunk * 8;
    const bool ok = xrow && xk < K;
#pragma unroll
    for (int term = kFirstTerm; term < kF16Terms; ++term) {
      copy16_async(
          st + S::kWBytes + term * kXPlaneBytes + kmajor_offset(x_tok, x_chunk, kXGroupBytes),
          ok ? xrow + term * a.x_terms_plane + xk : xt, ok);
    }
  };

  float acc[2][8][4] = {};
  const int nk = int((K + kTK - 1) / kTK);
  ring_start<kStages>(nk, issue);
  const int a_row = wm * 16 + lane % 16;  // ldmatrix: row lane % 16, 8 columns from (lane / 16)·8
  for (int kt = 0; kt < nk; ++kt) {
    ring_advance<kStages>(kt, nk, issue);
    const unsigned char* st = smem + (kt % kStages) * S::kStageBytes;
    const T* Ws = reinterpret_cast<const T*>(st);
    uint32_t af[kTK / 16][2][4];  // [16 k][row tile wg, wg + 2]: the weights' A fragments
#pragma unroll
    for (int h = 0; h < kTK / 16; ++h) {
#pragma unroll
      for (int ti = 0; ti < 2; ++ti) {
        const int i = wg + 2 * ti;
        ldmatrix_x4<false>(af[h][ti], Ws + (i * 64 + a_row) * kLd + swz(a_row, lane / 16 + 2 * h));
        if constexpr (std::is_same_v<T, __nv_bfloat16>) {
#pragma unroll
          for (int r = 0; r < 4; ++r) af[h][ti][r] = bf16x2_to_f16x2(af[h][ti][r]);
        }
      }
    }
    pin_registers(acc[0]);
    pin_registers(acc[1]);
    pin_registers(af);
    wgmma_fence();
#pragma unroll
    for (int h = 0; h < kTK / 16; ++h) {
#pragma unroll
      for (int ti = 0; ti < 2; ++ti) {
#pragma unroll
        for (int term = kFirstTerm; term < kF16Terms; ++term) {  // mid, then hi
          const unsigned char* xs = st + S::kWBytes + term * kXPlaneBytes + h * 256;
          wgmma_rs64_kmajor_f16(acc[ti], af[h][ti], wgmma_desc(xs, 128, kXGroupBytes), true);
        }
      }
    }
    wgmma_commit();
    wgmma_wait<0>();
    pin_registers(acc[0]);
    pin_registers(acc[1]);
  }
  copy_wait<0>();
  __syncthreads();  // Cs reuses the ring
  // Each sum times its token's inverse scale (exact) before the SwiGLU, as moe_mma_kernel.
  float* Cs = reinterpret_cast<float*>(smem);
  constexpr int kCsLd = S::kCsLd;
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int tok = 8 * j + 2 * t + u % 2, col = wm * 16 + g + (u / 2) * 8;
      const float tinv = row_inv[tok];
      if constexpr (kDual) {
        Cs[tok * kCsLd + wg * 64 + col] = silu(acc[0][j][u] * tinv) * (acc[1][j][u] * tinv);
      } else {
        Cs[tok * kCsLd + wg * 64 + col] = acc[0][j][u] * tinv;
        Cs[tok * kCsLd + (wg + 2) * 64 + col] = acc[1][j][u] * tinv;
      }
    }
  }
  __syncthreads();
  store_tile_outputs<kDual, kWRows, kCsLd>(a, Cs, row0, rows, n0, row_max, row_scale);
#endif
}

template <auto kKernel, typename T, bool kDual>
void launch_tiles(const MoeGemmArgs& a, unsigned max_tiles, cudaStream_t stream) {
  using S = TileShape<T>;
  const int64_t cols = kDual ? S::kWRows / 2 : S::kWRows;  // output columns per block
  const dim3 grid(unsigned((a.m + cols - 1) / cols), max_tiles);
  opt_in_smem<kKernel>(size_t(S::kSmemBytes));
  if (kDual) allow_nonportable_clusters<kKernel>();
  launch_kernel_clusters(kKernel, grid, kThreads, size_t(S::kSmemBytes), stream,
                         a.out_terms ? grid.x : 1u, a);
}
// 16-bit weights' tiles on warpgroup products where a.warpgroup says so.
template <typename T, bool kDual>
void launch(const MoeGemmArgs& a, unsigned max_tiles, cudaStream_t stream) {
  if constexpr (!TileShape<T>::kFp8) {
    if (a.warpgroup && a.one_term) {
      launch_tiles<moe_wgmma_kernel<T, kDual, true>, T, kDual>(a, max_tiles, stream);
      return;
    }
    if (a.warpgroup) {
      launch_tiles<moe_wgmma_kernel<T, kDual, false>, T, kDual>(a, max_tiles, stream);
      return;
    }
  }
  launch_tiles<moe_mma_kernel<T, kDual>, T, kDual>(a, max_tiles, stream);
}

// x [rows, k] → two f16 terms [2, rows, k] (mid, hi) of each row times 2^e (e from
// f16_row_exponent of the row's largest |value|), and inv_scale [rows] = 2^-e. kLanes threads
// share a row (lane = this thread's place among them; row_max gives their largest |value|); a
// lane's first kHeldChunks chunks of 8 are loaded at once and kept for the terms, so a row up to
// 8 · 8 · kLanes wide is read once with every load in flight (a loop of dependent loads, read
// twice, took 16.7 µs for 2,048 × 2,048 on the H200, 2 TB/s:
// bench/results/h200-session30-run1-prof-t2.txt). The largest |value| does not depend on the
// order it is found in, so every kLanes gives the same bits.
constexpr int kHeldChunks = 8;
template <int kLanes, typename RowMax>
__device__ __forceinline__ void split_f16_row(const float* row, int64_t k, bool vec, bool unit_rows,
                                              int lane, RowMax&& row_max, __half* terms_row,
                                              int64_t plane, float* inv_scale_row) {
  auto chunk = [&](int i) { return (int64_t(i) * kLanes + lane) * 8; };  // a lane's chunk i
  float held[kHeldChunks][8];
#pragma unroll
  for (int i = 0; i < kHeldChunks; ++i) {
    if (chunk(i) < k) load_f32x8(row + chunk(i), vec, held[i]);
  }
  float mx = 0.0f;
#pragma unroll
  for (int i = 0; i < kHeldChunks; ++i) {
    if (chunk(i) >= k) break;
#pragma unroll
    for (int q = 0; q < 8; ++q) mx = fmaxf(mx, fabsf(held[i][q]));
  }
  for (int64_t c = chunk(kHeldChunks); c < k; c += kLanes * 8) {  // wider rows: read twice
    float v[8];
    load_f32x8(row + c, vec, v);
#pragma unroll
    for (int q = 0; q < 8; ++q) mx = fmaxf(mx, fabsf(v[q]));
  }
  mx = row_max(mx);
  const int e = unit_rows && mx >= 0.25f && mx < 32768.0f ? 0 : f16_row_exponent(mx);
  const float scale = ldexpf(1.0f, e);
  auto store = [&](int64_t c, const float(&v)[8]) {
    uint4 pk[kF16Terms];
    __half* pt = reinterpret_cast<__half*>(pk);
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      __half t[kF16Terms];
      split_f16(v[q] * scale, t);
#pragma unroll
      for (int term = 0; term < kF16Terms; ++term) pt[term * 8 + q] = t[term];
    }
#pragma unroll
    for (int term = 0; term < kF16Terms; ++term) {
      *reinterpret_cast<uint4*>(terms_row + term * plane + c) = pk[term];
    }
  };
#pragma unroll
  for (int i = 0; i < kHeldChunks; ++i) {
    if (chunk(i) >= k) break;
    store(chunk(i), held[i]);
  }
  for (int64_t c = chunk(kHeldChunks); c < k; c += kLanes * 8) {
    float v[8];
    load_f32x8(row + c, vec, v);
    store(c, v);
  }
  if (lane == 0) *inv_scale_row = ldexpf(1.0f, -e);
}

// A warp a row: many rows (prompts).
__global__ void split_f16_rows_kernel(const float* x, int64_t ldx, int64_t rows, int64_t k,
                                      bool vec, bool unit_rows, __half* terms, float* inv_scale) {
  grid_dependency_sync();
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t r = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; r < rows;
       r += warps) {
    split_f16_row<32>(
        x + r * ldx, k, vec, unit_rows, int(threadIdx.x % 32),
        [](float mx) { return warp_max(mx); }, terms + r * k, rows * k, inv_scale + r);
  }
}

// A block a row: few wide rows (decode batches, short prompts), which a warp a row left on a
// few SMs (the 27B's 64-sequence step, H100: 11.4 µs a split of 64 × 5,120).
constexpr int kSplitBlockThreads = 256;
__global__ void __launch_bounds__(kSplitBlockThreads)
    split_f16_row_blocks_kernel(const float* x, int64_t ldx, int64_t rows, int64_t k, bool vec,
                                bool unit_rows, __half* terms, float* inv_scale) {
  grid_dependency_sync();
  __shared__ float warp_mx[kSplitBlockThreads / 32];
  const int64_t r = blockIdx.x;
  const auto block_max = [&](float mx) {
    mx = warp_max(mx);
    if (threadIdx.x % 32 == 0) warp_mx[threadIdx.x / 32] = mx;
    __syncthreads();
    mx = warp_mx[0];
#pragma unroll
    for (int w = 1; w < kSplitBlockThreads / 32; ++w) mx = fmaxf(mx, warp_mx[w]);
    return mx;
  };
  split_f16_row<kSplitBlockThreads>(x + r * ldx, k, vec, unit_rows, int(threadIdx.x), block_max,
                                    terms + r * k, rows * k, inv_scale + r);
}

}  // namespace

bool moe_mma_takes(int64_t d_ff, DType wdtype) {
  const int64_t cols =
      wdtype == DType::F8_E4M3 ? TileShape<uint8_t>::kWRows / 2 : TileShape<__half>::kWRows / 2;
  return (d_ff + cols - 1) / cols <= kMaxClusterBlocks;
}

void launch_f16_row_split(const float* x, int64_t ldx, int64_t rows, int64_t k, void* terms,
                          float* inv_scale, cudaStream_t stream, bool unit_rows) {
  RECUR_CHECK(k % 8 == 0);
  const bool vec = ldx % 4 == 0 && (reinterpret_cast<uintptr_t>(x) & 15) == 0;
  if (rows == 0) return;
  // A block a row while a warp would walk at least four chunks a lane and rows are few enough
  // that a warp a row would leave SMs idle.
  if (rows <= 2048 && k >= 4 * 32 * 8) {
    launch_kernel(split_f16_row_blocks_kernel, unsigned(rows), kSplitBlockThreads, 0, stream, x,
                  ldx, rows, k, vec, unit_rows, static_cast<__half*>(terms), inv_scale);
    return;
  }
  const unsigned blocks = unsigned(std::min<int64_t>((rows + 7) / 8, 1 << 16));
  launch_kernel(split_f16_rows_kernel, blocks, 256, 0, stream, x, ldx, rows, k, vec, unit_rows,
                static_cast<__half*>(terms), inv_scale);
}

void launch_moe_mma(const MoeGemmArgs& a, DType wdtype, bool dual, unsigned max_tiles,
                    cudaStream_t stream) {
  RECUR_CHECK(a.x_terms && a.x_scale && !(a.dense_w && dual) && !a.direct_ids);
  RECUR_CHECK(moe_wmma_pipelined(wdtype, a.k, a.w_aligned));
  RECUR_CHECK(!a.out_terms || (dual && a.out_scale && moe_mma_takes(a.m, wdtype)));
  RECUR_CHECK(!a.warpgroup || (wdtype != DType::F8_E4M3 && !a.dense_w));
  if (wdtype == DType::F8_E4M3) {
    RECUR_CHECK(fp8_wmma_blocks(a.fp8_block_rows, a.fp8_block_cols));
    dual ? launch<uint8_t, true>(a, max_tiles, stream)
         : launch<uint8_t, false>(a, max_tiles, stream);
  } else if (wdtype == DType::BF16) {
    dual ? launch<__nv_bfloat16, true>(a, max_tiles, stream)
         : launch<__nv_bfloat16, false>(a, max_tiles, stream);
  } else {
    RECUR_CHECK(wdtype == DType::F16);
    dual ? launch<__half, true>(a, max_tiles, stream) : launch<__half, false>(a, max_tiles, stream);
  }
}

}  // namespace recur::cuda
