// The MoE experts' grouped GEMM for prompts with 16-bit weights (bf16 or f16), on mma.sync
// m16n8k16: the weights are the products' rows (A, 16-row fragments) and a tile's tokens their
// columns (B, 8-token fragments), so a tile of fewer than 64 tokens — the common case when a
// prompt's tokens spread over hundreds of experts — computes only the 8-token groups it fills
// instead of a whole 64-row fragment grid. The activations come as their three exact terms
// (launch_wmma_split, or gate/up's epilogue for down), each multiplied with the weights into the
// same f32 accumulators, smallest first: the arithmetic of the WMMA tiles it replaces for these
// weights (moe_wmma.cu keeps block-FP8 weights and the fallback tiles).
//   A block: 256 threads, 128 weight rows (gate's 64 and up's 64 of the same output columns,
// SwiGLU applied in registers; or 128 rows of one weight) × one tile's 64 tokens, k staged 32
// at a time through a three-stage cp.async ring of unpadded, swizzled rows: 60 KB a block, so
// three blocks (24 warps) share an SM. The kernel waits on latency more than on its products or
// L2, and the third block's warps beat a deeper ring (80B-A3B cut to 6 layers, H200, 2,048 /
// 16,384-token prefill: 78,800 / 77,000 tok/s with four padded stages and two blocks an SM,
// 84,800 / 83,300 with these; two padded stages and three blocks 79,900 / 78,500).
#include <algorithm>

#include "backend/cuda/mma_16bit.cuh"
#include "backend/cuda/moe.cuh"
#include "backend/cuda/moe_tile_io.cuh"

namespace recur::cuda {

namespace {

constexpr int kThreads = 256;  // 8 warps: 4 along the weight rows × 2 along the tokens
constexpr int kWRows = 128;    // weight rows staged per block
constexpr int kTokens = kWmmaTileRows;
constexpr int kTK = 32;
constexpr int kLd = kTK;  // staged rows of 64 bytes, their 16-byte chunks swizzled (swz)
constexpr int kStages = 3;
constexpr int kWBytes = kWRows * kLd * 2;               // W [kWRows][kLd]
constexpr int kXBytes = kMoeTerms * kTokens * kLd * 2;  // X [3][kTokens][kLd]: lo, mid, hi
constexpr int kStageBytes = kWBytes + kXBytes;
constexpr int kCsLd = kWRows + 4;  // epilogue Cs [kTokens][kCsLd] f32, reusing the ring
constexpr int kSmemBytes = std::max(kStages * kStageBytes, kTokens* kCsLd * 4);
static_assert(kThreads == kTokens * (kTK / 8), "one 16-byte copy per thread per token row");

// The position of 16-byte chunk c of a staged row: ldmatrix's 8 consecutive rows at one chunk
// land in 8 distinct bank groups.
__device__ __forceinline__ int swz(int row, int c) {
  return (c ^ ((row >> 1) & 3)) * 8;
}

// grid (⌈m/64⌉ when kDual, else ⌈m/128⌉, max_tiles); a.x_terms set. Weight rows staged: kDual,
// gate's rows [n0, n0 + 64) then up's; else rows [n0, n0 + 128) of the one weight. Warp (wm, wn)
// multiplies staged rows i·64 + wm·16 + [0, 16) (i = 0, 1) with the tile's 8-token groups
// wn, wn + 2, wn + 4, wn + 6 that hold tokens. Copies past the tile's tokens, the weights' rows
// or k are zeros (k is a multiple of the 16-byte copies).
template <typename T, bool kDual>
__global__ void __launch_bounds__(kThreads, 3) moe_mma_kernel(MoeGemmArgs a) {
  grid_dependency_sync();
  int e, row0, rows;
  if (!moe_tile(a, int(blockIdx.y), e, row0, rows)) return;
  const int64_t n0 = int64_t(blockIdx.x) * (kDual ? kWRows / 2 : kWRows), K = a.k;
  const T* W = static_cast<const T*>(a.w[e]);
  const T* W2 = kDual ? static_cast<const T*>(a.w2[e]) : W;
  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, wm = warp % 4, wn = warp / 4;

  // Copy roles: token row cr of each term, weight rows cr and cr + 64; 8 columns from cc.
  const int cr = tid / 4, cc = (tid % 4) * 8;
  const T* xt = static_cast<const T*>(a.x_terms);
  const T* xrow = nullptr;
  if (cr < rows) xrow = xt + (a.x_row ? int64_t(a.x_row[row0 + cr]) : int64_t(row0 + cr)) * a.ldxt;
  const T* wrow[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t r = kDual ? n0 + cr : n0 + cr + 64 * h;
    wrow[h] = r < a.m ? (kDual && h == 1 ? W2 : W) + r * K : nullptr;
  }
  auto issue = [&](int kt) {
    unsigned char* st = smem + (kt % kStages) * kStageBytes;
    T* Ws = reinterpret_cast<T*>(st);
    T* Xs = reinterpret_cast<T*>(st + kWBytes);
    const int64_t k0 = int64_t(kt) * kTK + cc;
    const bool k_in = k0 < K;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const bool ok = wrow[h] && k_in;
      copy16_async(Ws + (cr + 64 * h) * kLd + swz(cr, cc / 8), ok ? wrow[h] + k0 : W, ok);
    }
    const bool ok = xrow && k_in;
#pragma unroll
    for (int term = 0; term < kMoeTerms; ++term) {
      copy16_async(Xs + (term * kTokens + cr) * kLd + swz(cr, cc / 8),
                   ok ? xrow + term * a.x_terms_plane + k0 : xt, ok);
    }
  };

  // acc[i][j]: staged rows i·64 + wm·16 + [0, 16) × tokens of group wn + 2j.
  float acc[2][4][4] = {};
  const int groups = (rows + 7) / 8, active = (groups - wn + 1) / 2;  // this warp's groups
  const int nk = int((K + kTK - 1) / kTK);
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < nk) issue(s);
    copy_commit();  // empty groups too: the waits below count kStages - 1 groups ahead
  }
  // ldmatrix lanes: A rows lane % 16 at column (lane / 16)·8; B matrix lane / 8 is group
  // 2p + (lane / 16) of the pair p, columns ((lane / 8) % 2)·8, its token lane % 8.
  const int a_row = wm * 16 + lane % 16, b_tok = (wn + 2 * (lane / 16)) * 8 + lane % 8;
  for (int kt = 0; kt < nk; ++kt) {
    copy_wait<kStages - 2>();
    // Stage kt has landed for every thread, and every warp is done with stage kt - 1, whose
    // slot the copies below refill.
    __syncthreads();
    if (kt + kStages - 1 < nk) issue(kt + kStages - 1);
    copy_commit();
    const unsigned char* st = smem + (kt % kStages) * kStageBytes;
    const T* Ws = reinterpret_cast<const T*>(st);
    const T* Xs = reinterpret_cast<const T*>(st + kWBytes);
#pragma unroll
    for (int kk = 0; kk < kTK; kk += 16) {
      uint32_t af[2][4];
#pragma unroll
      for (int i = 0; i < 2; ++i)
        ldmatrix_x4<false>(af[i], Ws + (i * 64 + a_row) * kLd + swz(a_row, lane / 16 + kk / 8));
#pragma unroll
      for (int p = 0; p < 2; ++p) {
        if (2 * p >= active) break;  // warp-uniform
        uint32_t bf[kMoeTerms][4];   // [term]: groups 2p (regs 0, 1) and 2p + 1 (regs 2, 3)
#pragma unroll
        for (int term = 0; term < kMoeTerms; ++term) {
          ldmatrix_x4<false>(bf[term], Xs + (term * kTokens + b_tok + 32 * p) * kLd +
                                           swz(b_tok, (lane / 8) % 2 + kk / 8));
        }
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          if (2 * p + q >= active) break;
#pragma unroll
          for (int i = 0; i < 2; ++i) {
#pragma unroll
            for (int term = 0; term < kMoeTerms; ++term) {
              mma16<T>(acc[i][2 * p + q], af[i], bf[term][2 * q], bf[term][2 * q + 1]);
            }
          }
        }
      }
    }
  }
  copy_wait<0>();
  __syncthreads();  // Cs reuses the ring
  // Accumulator (row g or g + 8, columns 2t, 2t + 1) is weight row (output column) × token.
  float* Cs = reinterpret_cast<float*>(smem);
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if (j >= active) break;
    const int tok = (wn + 2 * j) * 8 + 2 * t;
#pragma unroll
    for (int i = 0; i < (kDual ? 1 : 2); ++i) {
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int col = i * 64 + wm * 16 + g + (u / 2) * 8;
        const float v = kDual ? silu(acc[0][j][u]) * acc[1][j][u] : acc[i][j][u];
        Cs[(tok + u % 2) * kCsLd + col] = v;
      }
    }
  }
  __syncthreads();
  store_tile_rows<T, kDual ? kWRows / 2 : kWRows>(a, Cs, kCsLd, row0, rows, n0);
}

template <typename T, bool kDual>
void launch(const MoeGemmArgs& a, unsigned max_tiles, cudaStream_t stream) {
  const int64_t cols = kDual ? kWRows / 2 : kWRows;  // output columns per block
  const dim3 grid(unsigned((a.m + cols - 1) / cols), max_tiles);
  opt_in_smem<moe_mma_kernel<T, kDual>>(size_t(kSmemBytes));
  launch_kernel(moe_mma_kernel<T, kDual>, grid, kThreads, size_t(kSmemBytes), stream, a);
}

}  // namespace

void launch_moe_mma(const MoeGemmArgs& a, DType wdtype, bool dual, unsigned max_tiles,
                    cudaStream_t stream) {
  RECUR_CHECK(a.x_terms && !a.dense_w && !a.direct_ids);
  RECUR_CHECK(moe_wmma_pipelined(wdtype, a.k, a.w_aligned));
  RECUR_CHECK(!a.out_terms || (dual && a.m % 8 == 0));
  if (wdtype == DType::BF16) {
    dual ? launch<__nv_bfloat16, true>(a, max_tiles, stream)
         : launch<__nv_bfloat16, false>(a, max_tiles, stream);
  } else {
    RECUR_CHECK(wdtype == DType::F16);
    dual ? launch<__half, true>(a, max_tiles, stream) : launch<__half, false>(a, max_tiles, stream);
  }
}

}  // namespace recur::cuda
