// Block-FP8 weights' prompt products on Hopper's FP8 tensor cores, the activations quantized to
// e4m3 per token and 128-channel group (BackendOptions::fp8_activations kE4m3, the default; kF16
// takes moe_mma.cu's two f16 terms of the f32 activations times the weights widened exactly,
// 25-35% slower prompts in session 40's H100 run). Results are not f32-class: a token's group is
// scaled by its largest |value| / 448 and rounded to e4m3 (3 significand bits); `recur verify
// --report` gives the error that costs.
//   A block: 256 threads, two warpgroups of one 64-row tile of weight rows each (kDual: gate's
// and up's rows of the same 64 output columns; else 128 consecutive rows), times a tile's 64
// tokens; k staged 64 bytes at a time through a ring of cp.async stages in the K-major layout of
// wgmma's descriptors (16-byte chunk c of row r at (r/8)·512 + c·128 + (r%8)·16). Each k block of
// 128 (one scale of the weights' 128-row block, one of each token's activations) is summed apart
// by wgmma.m64n64k32.e4m3 into f32, then added to the total times the two scales: Hopper sums an
// FP8 product's terms with fewer bits than f32, so no sum runs longer than a block.
#include <algorithm>

#include <cuda_fp8.h>

#include "backend/cuda/fp8.cuh"
#include "backend/cuda/moe.cuh"
#include "backend/cuda/moe_tile_io.cuh"
#include "backend/cuda/wgmma.cuh"

namespace recur::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kTokens = kWmmaTileRows;  // 64 tokens a tile
constexpr int kRows = 128;              // weight rows staged: two 64-row tiles
constexpr int kTK = 64;                 // k a stage (bytes of a staged row)
constexpr int kStagesPerBlock = kFp8ActBlock / kTK;
constexpr int kStages = 6;
constexpr int kGroupBytes = kTK / 16 * 128;         // between 8-row groups of a staged tile
constexpr int kWBytes = kRows / 8 * kGroupBytes;    // W [128 rows][64 k]
constexpr int kXBytes = kTokens / 8 * kGroupBytes;  // X [64 tokens][64 k]
constexpr int kStageBytes = kWBytes + kXBytes;
constexpr int kCsLd = kRows + 4;  // epilogue Cs [kTokens][kCsLd] f32, reusing the ring
constexpr int kSmemBytes = std::max(kStages * kStageBytes, kTokens* kCsLd * 4);
static_assert(kStagesPerBlock * kTK == kFp8ActBlock, "a k block is whole stages");
static_assert(kSmemBytes > (48 << 10), "opt_in_smem raises the limit");

// d (+)= A · B, A [64 × 32] and B [32 × 64] e4m3 in shared memory (K-major descriptors),
// f32 accumulators in wgmma.cuh's fragment order; accumulate = false ignores d's values.
[[maybe_unused]] __device__ __forceinline__ void wgmma_e4m3_n64(float (&d)[8][4], uint64_t a,
                                                                uint64_t b, bool accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3"
      " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "
      "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, p, 1, 1;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]),
        "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]),
        "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]),
        "+f"(d[7][2]), "+f"(d[7][3])
      : "l"(a), "l"(b), "r"(int(accumulate))
      : "memory");
}

// grid (⌈m/64⌉ when kDual, else ⌈m/128⌉; max_tiles); a.x_q and a.x_q_scale set, weights
// block-FP8 in 128 × 128 blocks. Writes f32 rows (store_tile_rows): kDual the SwiGLU outputs.
// Copies past the tile's tokens, the weights' rows or k are zeros (k a multiple of 16).
template <bool kDual>
__global__ void __launch_bounds__(kThreads, 2) moe_fp8_act_kernel(MoeGemmArgs a) {
#if !defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __trap();  // the PTX for later GPUs: never launched there (Impl::sm90a)
#else
  grid_dependency_sync();
  int e, row0, rows;
  if (!block_tile(a, e, row0, rows)) return;
  const int64_t n0 = int64_t(blockIdx.x) * (kDual ? kRows / 2 : kRows), K = a.k;
  const uint8_t* W = static_cast<const uint8_t*>(a.dense_w ? a.dense_w : a.w[e]);
  const uint8_t* W2 = kDual ? static_cast<const uint8_t*>(a.w2[e]) : W;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ float x_scale[kStages][kTokens];  // each stage's k block's activation scales
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, wm = warp % 4, wg = warp / 4;
  const int kbs = int((K + kFp8ActBlock - 1) / kFp8ActBlock);  // scale blocks along k

  // Copy roles: a quarter-warp's 8 copies are 8 rows of one chunk (one core matrix). Weight rows
  // w_row and w_row + 64, activations of token w_row (all of chunk w_chunk).
  const int w_row = (tid / 32) * 8 + tid % 8, w_chunk = (tid / 8) % 4;
  const uint8_t* wrow[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int sr = w_row + 64 * h;
    const bool second = kDual && h == 1;  // kDual: staged rows 64.. are up's of the same columns
    const int64_t r = n0 + (kDual ? w_row : sr);
    wrow[h] = r < a.m ? (second ? W2 : W) + r * K : nullptr;
  }
  const uint8_t* xrow = nullptr;
  const float* xsrow = a.x_q_scale;  // any valid address for tokens past the tile's
  if (w_row < rows) {
    const int64_t xr = a.x_row ? int64_t(a.x_row[row0 + w_row]) : int64_t(row0 + w_row);
    xrow = a.x_q + xr * K;
    xsrow = a.x_q_scale + xr * kbs;
  }
  auto issue = [&](int kt) {
    unsigned char* st = smem + (kt % kStages) * kStageBytes;
    const int64_t k0 = int64_t(kt) * kTK + w_chunk * 16;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const bool ok = wrow[h] && k0 < K;
      copy16_async_l2_256(st + kmajor_offset(w_row + 64 * h, w_chunk, kGroupBytes),
                          ok ? wrow[h] + k0 : W, ok);
    }
    copy16_async(st + kWBytes + kmajor_offset(w_row, w_chunk, kGroupBytes),
                 xrow && k0 < K ? xrow + k0 : a.x_q, xrow && k0 < K);
    if (w_chunk == 0) {  // the token's scale of this stage's k block (0 past the tile's tokens)
      copy4_async(&x_scale[kt % kStages][w_row], xsrow + kt / kStagesPerBlock, xrow != nullptr);
    }
  };
  // Weight block scales of this warpgroup's tile (rows past m: any valid row's; their products
  // are zeros).
  const float* srow;
  {
    const bool second = kDual && wg == 1;
    const int64_t r = n0 + (kDual ? 0 : 64 * wg);
    const Fp8Matrix f = fp8_matrix(second ? W2 : W, a.m, a.k, a.fp8_block_rows, a.fp8_block_cols);
    srow = f.scales + (r < a.m ? r / f.br : 0) * f.kb;
  }

  // acc: the total; part: the current k block's sums. Rows wg·64 + wm·16 + [0, 16) of the
  // staged weights × tokens [8j, 8j + 8).
  float acc[8][4] = {}, part[8][4] = {};
  const int nk = int((K + kTK - 1) / kTK);
  ring_start<kStages>(nk, issue);
  const int g = lane / 4, t = lane % 4;
  for (int kt = 0; kt < nk; ++kt) {
    ring_advance<kStages>(kt, nk, issue);
    const unsigned char* st = smem + (kt % kStages) * kStageBytes;
    const bool block_start = kt % kStagesPerBlock == 0;
    pin_registers(part);
    wgmma_fence();
#pragma unroll
    for (int s = 0; s < kTK / 32; ++s) {
      const uint64_t ad = wgmma_desc(st + wg * (64 / 8) * kGroupBytes + s * 256, 128, kGroupBytes);
      const uint64_t bd = wgmma_desc(st + kWBytes + s * 256, 128, kGroupBytes);
      wgmma_e4m3_n64(part, ad, bd, !(block_start && s == 0));
    }
    wgmma_commit();
    wgmma_wait<0>();
    pin_registers(part);
    if ((kt + 1) % kStagesPerBlock == 0 || kt == nk - 1) {  // the k block ends here
      const float ws = __ldg(srow + kt / kStagesPerBlock);
      const float* xs = x_scale[kt % kStages];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          acc[j][u] = fmaf(part[j][u], ws * xs[8 * j + 2 * t + u % 2], acc[j][u]);
        }
      }
    }
  }
  copy_wait<0>();
  __syncthreads();  // Cs reuses the ring
  float* Cs = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      Cs[(8 * j + 2 * t + u % 2) * kCsLd + wg * 64 + wm * 16 + g + (u / 2) * 8] = acc[j][u];
    }
  }
  __syncthreads();
  if constexpr (kDual) {  // columns [0, 64) gate's, [64, 128) up's
    for (int i = tid; i < kTokens * 64; i += kThreads) {
      float* c = Cs + (i / 64) * kCsLd + i % 64;
      c[0] = silu(c[0]) * c[64];
    }
    __syncthreads();
  }
  store_tile_rows<kDual ? kRows / 2 : kRows>(a, Cs, kCsLd, row0, rows, n0);
#endif
}

// x [rows, k] (rows ldx apart, k a multiple of 16) → q [rows, k] e4m3 and scale
// [rows, ⌈k/128⌉]: a warp per group of 128 values of a row, four a lane.
__global__ void quantize_e4m3_groups_kernel(const float* x, int64_t ldx, int64_t rows, int64_t k,
                                            uint8_t* q, float* scale) {
  grid_dependency_sync();
  const int lane = threadIdx.x % 32;
  const int64_t kbs = (k + kFp8ActBlock - 1) / kFp8ActBlock;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t w = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; w < rows * kbs;
       w += warps) {
    const int64_t r = w / kbs, c = (w % kbs) * kFp8ActBlock + 4 * lane;
    float v[4] = {};
    if (c < k) {  // k a multiple of 16: a lane's four are in or out together
#pragma unroll
      for (int i = 0; i < 4; ++i) v[i] = x[r * ldx + c + i];
    }
    float mx = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
    mx = warp_max(mx);
    const float inv = mx > 0.0f ? kFp8ActMax / mx : 0.0f;
    if (c < k) {
      const __nv_fp8x2_storage_t lo =
          __nv_cvt_float2_to_fp8x2(make_float2(v[0] * inv, v[1] * inv), __NV_SATFINITE, __NV_E4M3);
      const __nv_fp8x2_storage_t hi =
          __nv_cvt_float2_to_fp8x2(make_float2(v[2] * inv, v[3] * inv), __NV_SATFINITE, __NV_E4M3);
      *reinterpret_cast<uint32_t*>(q + r * k + c) = uint32_t(lo) | uint32_t(hi) << 16;
    }
    if (lane == 0) scale[w] = mx / kFp8ActMax;
  }
}

template <bool kDual>
void launch_tiles(const MoeGemmArgs& a, unsigned max_tiles, cudaStream_t stream) {
  const int64_t cols = kDual ? kRows / 2 : kRows;
  const dim3 grid(unsigned((a.m + cols - 1) / cols), max_tiles);
  opt_in_smem<moe_fp8_act_kernel<kDual>>(size_t(kSmemBytes));
  launch_kernel(moe_fp8_act_kernel<kDual>, grid, kThreads, size_t(kSmemBytes), stream, a);
}

}  // namespace

bool fp8_act_takes(int br, int bc, int64_t k, bool w_aligned) {
  return br == kFp8ActBlock && bc == kFp8ActBlock && k % 16 == 0 && w_aligned;
}

void launch_e4m3_group_quantize(const float* x, int64_t ldx, int64_t rows, int64_t k, uint8_t* q,
                                float* scale, cudaStream_t stream) {
  RECUR_CHECK(k % 16 == 0);
  const int64_t groups = rows * ((k + kFp8ActBlock - 1) / kFp8ActBlock);
  const unsigned blocks = unsigned(std::min<int64_t>((groups + 7) / 8, 1 << 16));
  if (blocks == 0) return;
  launch_kernel(quantize_e4m3_groups_kernel, blocks, 256, 0, stream, x, ldx, rows, k, q, scale);
}

void launch_moe_fp8_act(const MoeGemmArgs& a, bool dual, unsigned max_tiles, cudaStream_t stream) {
  RECUR_CHECK(a.x_q && a.x_q_scale && !a.out_terms && !a.direct_ids && !(a.dense_w && dual));
  RECUR_CHECK(fp8_act_takes(a.fp8_block_rows, a.fp8_block_cols, a.k, a.w_aligned));
  dual ? launch_tiles<true>(a, max_tiles, stream) : launch_tiles<false>(a, max_tiles, stream);
}

}  // namespace recur::cuda
