// Block-FP8 weights (fp8.cuh's layout): adopting a checkpoint's, quantizing at load
// (--quantize fp8, on the device), and the matmuls that read them.
//   ≤ kGemvMaxTokens tokens, and decode batches on small weights (the caller's takes_gemv): a
//     warp-per-rows GEMV over the fp8 bytes and their scales, f32 arithmetic, no dequantized
//     copy; groups of weights sharing x in one launch.
//   Prompts: the tensor-core tiles of moe_wmma.cu, weights widened to bf16 in shared memory,
//     activations split into three bf16 terms (f32-class results); where the block sizes do not
//     suit those tiles, the GEMV kernel over token groups.
// The MoE experts' fp8 GEMV core is here too (kernels_moe.cu picks it).
#include <algorithm>
#include <string>

#include "backend/cuda/cuda_internal.cuh"
#include "backend/cuda/fp8.cuh"
#include "backend/cuda/moe.cuh"

namespace recur {

using namespace cuda;

namespace {

constexpr int kQuantBlock = 128;  // --quantize fp8: 128×128 blocks, as the FP8 releases
constexpr int kQuantThreads = 256;

// One block per 128×128 block of src [m, k] (grid (kb, mb)): scale = amax / 448, e4m3's
// largest (1 for an all-zero block), q = e4m3(v / scale) rounded to nearest even and saturated:
// the CPU's quantization (model/weights.cpp), value for value.
template <typename W>
__global__ void __launch_bounds__(kQuantThreads)
    quantize_fp8_kernel(const W* src, int64_t m, int64_t k, uint8_t* q, float* scales) {
  const int64_t r0 = int64_t(blockIdx.y) * kQuantBlock, c0 = int64_t(blockIdx.x) * kQuantBlock;
  const int64_t cols = min64(k, c0 + kQuantBlock) - c0;
  const int64_t n = (min64(m, r0 + kQuantBlock) - r0) * cols;
  float amax = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += kQuantThreads) {
    amax = fmaxf(amax, fabsf(to_f32(src[(r0 + i / cols) * k + c0 + i % cols])));
  }
  __shared__ float warp_amax[kQuantThreads / 32];
  __shared__ float block_scale;
  amax = warp_max(amax);
  if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = amax;
  __syncthreads();
  if (threadIdx.x == 0) {
    float a = 0.0f;
    for (int w = 0; w < kQuantThreads / 32; ++w) a = fmaxf(a, warp_amax[w]);
    block_scale = a > 0.0f ? a / 448.0f : 1.0f;
    scales[int64_t(blockIdx.y) * gridDim.x + blockIdx.x] = block_scale;
  }
  __syncthreads();
  const float scale = block_scale;
  for (int64_t i = threadIdx.x; i < n; i += kQuantThreads) {
    const int64_t at = (r0 + i / cols) * k + c0 + i % cols;
    q[at] = __nv_cvt_float_to_fp8(to_f32(src[at]) / scale, __NV_SATFINITE, __NV_E4M3);
  }
}

// Several weights sharing x: weight g takes blocks first_block[g] .. first_block[g + 1) - 1.
struct Fp8GemvGroup {
  Fp8Matrix w[Ops::kMaxMatmulGroup];
  float* out[Ops::kMaxMatmulGroup];  // [n, m_g], ldo_g apart
  int64_t ldo[Ops::kMaxMatmulGroup];
  int first_block[Ops::kMaxMatmulGroup + 1];
  int count;
};
// Bytes of each row a GEMV warp fetches into L2 before its PDL wait (whole rows of 4,096).
constexpr int64_t kFp8PrefetchBytes = 4096;
constexpr int kDenseWarpRows = 2;                                    // output rows per warp
constexpr int kDenseBlockRows = kDenseWarpRows * kGemvThreads / 32;  // per block

// out rows of token group blockIdx.y (NT tokens of x [n, k], rows ldx apart) for kDenseBlockRows
// weight rows per block; grid (first_block[count], ⌈n/NT⌉). A row's sums do not depend on the
// group, so a weight gives the same results alone or with others.
template <int NT, bool kVec>
__global__ void __launch_bounds__(kGemvThreads)
    fp8_gemv_kernel(Fp8GemvGroup g, const float* x, int64_t ldx, int n, bool accumulate) {
  int i = 0;
  while (i + 1 < g.count && int(blockIdx.x) >= g.first_block[i + 1]) ++i;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t row0 =
      int64_t(int(blockIdx.x) - g.first_block[i]) * kDenseBlockRows + warp * kDenseWarpRows;
  const int t0 = int(blockIdx.y) * NT, nt = min(NT, n - t0);
  const Fp8Matrix& w = g.w[i];
  const int rows = int(min64(kDenseWarpRows, w.m - row0));
  if (rows > 0) fp8_prefetch_rows(w.q + row0 * w.k, w.k, rows, lane, 32, kFp8PrefetchBytes);
  grid_dependency_sync();
  if (rows <= 0) return;  // nothing below waits for the block
  const float* xr[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) xr[t] = x + int64_t(t0 + (t < nt ? t : 0)) * ldx;
  float acc[kDenseWarpRows][NT] = {};
  fp8_partial<NT, kDenseWarpRows, kVec>(w, row0, rows, xr, lane, 32, acc);
  float* out = g.out[i] + int64_t(t0) * g.ldo[i] + row0;
#pragma unroll
  for (int r = 0; r < kDenseWarpRows; ++r) {
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const float v = warp_sum(acc[r][t]);
      if (lane == 0 && r < rows && t < nt) {
        float* o = out + int64_t(t) * g.ldo[i] + r;
        *o = accumulate ? *o + v : v;
      }
    }
  }
}

template <int NT>
void launch_fp8_gemv_nt(const Fp8GemvGroup& g, bool vec, const Tensor& x, int n, bool accumulate,
                        cudaStream_t stream) {
  const dim3 grid(unsigned(g.first_block[g.count]), unsigned((n + NT - 1) / NT));
  if (vec) {
    launch_kernel(fp8_gemv_kernel<NT, true>, grid, kGemvThreads, 0, stream, g, x.ptr<float>(),
                  x.stride[0], n, accumulate);
  } else {
    launch_kernel(fp8_gemv_kernel<NT, false>, grid, kGemvThreads, 0, stream, g, x.ptr<float>(),
                  x.stride[0], n, accumulate);
  }
}

void launch_fp8_gemv(const Fp8GemvGroup& g, bool vec, const Tensor& x, int n, bool accumulate,
                     cudaStream_t stream) {
  if (n == 1) {
    launch_fp8_gemv_nt<1>(g, vec, x, n, accumulate, stream);
  } else if (n == 2) {
    launch_fp8_gemv_nt<2>(g, vec, x, n, accumulate, stream);
  } else if (n <= 4) {
    launch_fp8_gemv_nt<4>(g, vec, x, n, accumulate, stream);
  } else {
    launch_fp8_gemv_nt<8>(g, vec, x, n, accumulate, stream);
  }
}

bool x_vec(const Tensor& x) {
  return (reinterpret_cast<uintptr_t>(x.data) & 15) == 0 && x.stride[0] % 4 == 0;
}

// Appends weight w (and its output) to group g.
void add_to_group(Fp8GemvGroup& g, const Tensor& w, const Tensor& out,
                  const CudaOps::Impl::Fp8Blocks& b) {
  const int i = g.count++;
  g.w[i] = fp8_matrix(w.data, w.shape[0], w.shape[1], b.rows, b.cols);
  g.out[i] = out.ptr<float>();
  g.ldo[i] = out.stride[0];
  g.first_block[i + 1] =
      g.first_block[i] + int((w.shape[0] + kDenseBlockRows - 1) / kDenseBlockRows);
}

// The MoE experts' fp8 GEMV (launch_moe_fp8_gemv): a warp per RW rows of the tile's expert.
template <int NT, bool kDual, bool kVec>
__global__ void __launch_bounds__(kGemvThreads) moe_fp8_gemv_kernel(MoeGemmArgs a) {
  constexpr int RW = kDual ? 2 : 4;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t orow = int64_t(blockIdx.x) * (kGemvThreads / 32) * RW + int64_t(warp) * RW;
  // One token: rows whose expert is known before the wait go to L2 meanwhile: the shared
  // expert's, and down's (the ids were stored before gate/up ran; a stale id costs only the
  // prefetch).
  const bool shared_tile = a.direct_shared >= 0 && int(blockIdx.y) == a.direct_k - 1;
  int pre_e;
  if (orow < a.m && (a.ids_early || shared_tile) && moe_direct_expert(a, blockIdx.y, pre_e)) {
    const int rows = int(min64(RW, a.m - orow));
    fp8_prefetch_rows(static_cast<const uint8_t*>(a.w[pre_e]) + orow * a.k, a.k, rows, lane, 32,
                      kFp8PrefetchBytes);
    if constexpr (kDual) {
      fp8_prefetch_rows(static_cast<const uint8_t*>(a.w2[pre_e]) + orow * a.k, a.k, rows, lane, 32,
                        kFp8PrefetchBytes);
    }
  }
  grid_dependency_sync();
  if (orow >= a.m) return;  // warp-uniform, and nothing below waits for the block
  int e, row0, nt;
  if (!moe_tile(a, blockIdx.y, e, row0, nt)) return;
  const int rows = int(min64(RW, a.m - orow));
  const float* xr[NT];
  moe_tile_rows<NT>(a, row0, nt, xr);
  float acc[RW][NT] = {}, acc2[RW][NT] = {};
  const int br = a.fp8_block_rows, bc = a.fp8_block_cols;
  fp8_partial<NT, RW, kVec>(fp8_matrix(a.w[e], a.m, a.k, br, bc), orow, rows, xr, lane, 32, acc);
  if constexpr (kDual) {
    fp8_partial<NT, RW, kVec>(fp8_matrix(a.w2[e], a.m, a.k, br, bc), orow, rows, xr, lane, 32,
                              acc2);
  }
#pragma unroll
  for (int r = 0; r < RW; ++r) {
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      float v = warp_sum(acc[r][t]);
      if constexpr (kDual) v = silu(v) * warp_sum(acc2[r][t]);
      if (lane == 0 && r < rows && t < nt) a.out[int64_t(row0 + t) * a.ldo + orow + r] = v;
    }
  }
}

template <int NT, bool kDual>
void launch_moe_fp8_nt(const MoeGemmArgs& a, bool vec, unsigned max_tiles, cudaStream_t stream) {
  constexpr int64_t kBlockRows = (kGemvThreads / 32) * (kDual ? 2 : 4);
  const dim3 grid(unsigned((a.m + kBlockRows - 1) / kBlockRows), max_tiles);
  if (vec) {
    launch_kernel(moe_fp8_gemv_kernel<NT, kDual, true>, grid, kGemvThreads, 0, stream, a);
  } else {
    launch_kernel(moe_fp8_gemv_kernel<NT, kDual, false>, grid, kGemvThreads, 0, stream, a);
  }
}

template <bool kDual>
void launch_moe_fp8_dual(const MoeGemmArgs& a, int nt, bool vec, unsigned max_tiles,
                         cudaStream_t stream) {
  if (nt == 1) {
    launch_moe_fp8_nt<1, kDual>(a, vec, max_tiles, stream);
  } else if (nt == 2) {
    launch_moe_fp8_nt<2, kDual>(a, vec, max_tiles, stream);
  } else if (nt <= 4) {
    launch_moe_fp8_nt<4, kDual>(a, vec, max_tiles, stream);
  } else {
    RECUR_CHECK(nt <= 8);
    launch_moe_fp8_nt<8, kDual>(a, vec, max_tiles, stream);
  }
}

}  // namespace

namespace cuda {
void launch_moe_fp8_gemv(const MoeGemmArgs& a, bool dual, int nt, bool vec, unsigned max_tiles,
                         cudaStream_t stream) {
  const bool v = vec && fp8_vec_shape(a.k, a.fp8_block_cols);
  if (dual) {
    launch_moe_fp8_dual<true>(a, nt, v, max_tiles, stream);
  } else {
    launch_moe_fp8_dual<false>(a, nt, v, max_tiles, stream);
  }
}
}  // namespace cuda

CudaOps::Impl::Fp8Blocks CudaOps::Impl::fp8_blocks_of(const Tensor& w) const {
  const auto it = fp8_blocks.find(w.data);
  if (it == fp8_blocks.end()) {
    cuda::fatal(
        "an F8_E4M3 weight that adopt_block_fp8_weight or quantize_matmul_weight did "
        "not make");
  }
  return it->second;
}

Result<Tensor> CudaOps::adopt_block_fp8_weight(const Tensor& w, const Tensor& scales,
                                               int block_rows, int block_cols,
                                               std::vector<Buffer>* owned) {
  Impl& s = *impl_;
  s.end_forward();
  if (w.dtype != DType::F8_E4M3 || w.ndim != 2 || !w.is_contiguous()) {
    return make_error(ErrorCode::kInvalidArgument,
                      "adopt_block_fp8_weight: the weight must be a contiguous 2-D F8_E4M3 tensor "
                      "(got {} {})",
                      dtype_name(w.dtype), w.shape_string());
  }
  const int64_t m = w.shape[0], k = w.shape[1];
  if (block_rows < 1 || block_cols < 1) {
    return make_error(ErrorCode::kInvalidArgument,
                      "adopt_block_fp8_weight: block sizes {} x {} must be positive", block_rows,
                      block_cols);
  }
  const int64_t mb = (m + block_rows - 1) / block_rows, kb = (k + block_cols - 1) / block_cols;
  if (scales.dtype != DType::F32 || scales.ndim != 2 || !scales.is_contiguous() ||
      scales.shape[0] != mb || scales.shape[1] != kb) {
    return make_error(ErrorCode::kInvalidArgument,
                      "adopt_block_fp8_weight: scales must be contiguous F32 [{}, {}] for a "
                      "[{}, {}] weight in {} x {} blocks (got {} {})",
                      mb, kb, m, k, block_rows, block_cols, dtype_name(scales.dtype),
                      scales.shape_string());
  }
  const int64_t off = fp8_scales_offset(m, k);
  RECUR_ASSIGN_OR_RETURN(void* dst, s.weight_memory(size_t(off + mb * kb * 4)));
  char* d = static_cast<char*>(dst);
  // Ordered on our stream, then waited for: the host tensors may be mappings that go away.
  RECUR_CUDA_CHECK(cudaMemcpyAsync(d, w.data, size_t(m * k), cudaMemcpyDefault, s.stream));
  RECUR_CUDA_CHECK(
      cudaMemcpyAsync(d + off, scales.data, size_t(mb * kb * 4), cudaMemcpyDefault, s.stream));
  RECUR_CUDA_CHECK(cudaStreamSynchronize(s.stream));
  s.fp8_blocks[dst] = {block_rows, block_cols};
  return Tensor::contiguous(dst, DType::F8_E4M3, {m, k}, Device::kCuda);
}

Result<Tensor> CudaOps::quantize_matmul_weight(const Tensor& w, DType dtype,
                                               std::vector<Buffer>* owned) {
  if (dtype != DType::F8_E4M3) return Ops::quantize_matmul_weight(w, dtype, owned);
  Impl& s = *impl_;
  s.end_forward();
  if (w.ndim != 2 || !w.is_contiguous() ||
      (w.dtype != DType::F32 && w.dtype != DType::BF16 && w.dtype != DType::F16)) {
    return make_error(ErrorCode::kInvalidArgument,
                      "quantize_matmul_weight: fp8 takes a contiguous 2-D F32, BF16 or F16 "
                      "weight (got {} {})",
                      dtype_name(w.dtype), w.shape_string());
  }
  const int64_t m = w.shape[0], k = w.shape[1];
  const int64_t mb = (m + kQuantBlock - 1) / kQuantBlock, kb = (k + kQuantBlock - 1) / kQuantBlock;
  const size_t src_bytes = size_t(m * k) * dtype_size(w.dtype);
  // A host weight is staged on the device for the kernel (one weight at a time).
  Buffer staging;
  const void* src = w.data;
  if (w.device != Device::kCuda) {
    RECUR_ASSIGN_OR_RETURN(staging, s.alloc.allocate(src_bytes, "weight to quantize"));
    RECUR_CUDA_CHECK(
        cudaMemcpyAsync(staging.data(), w.data, src_bytes, cudaMemcpyHostToDevice, s.stream));
    src = staging.data();
  }
  const int64_t off = fp8_scales_offset(m, k);
  RECUR_ASSIGN_OR_RETURN(void* dst, s.weight_memory(size_t(off + mb * kb * 4)));
  auto* q = static_cast<uint8_t*>(dst);
  auto* sc = reinterpret_cast<float*>(q + off);
  if (m > 0 && k > 0) {
    const dim3 grid{unsigned(kb), unsigned(mb)};
    dispatch_weight(w.dtype, [&](auto tag) {
      using W = decltype(tag);
      quantize_fp8_kernel<W>
          <<<grid, kQuantThreads, 0, s.stream>>>(static_cast<const W*>(src), m, k, q, sc);
    });
    s.launched("quantize fp8");
  }
  if (staging.data()) RECUR_CUDA_CHECK(cudaStreamSynchronize(s.stream));
  s.fp8_blocks[dst] = {kQuantBlock, kQuantBlock};
  return Tensor::contiguous(dst, DType::F8_E4M3, {m, k}, Device::kCuda);
}

void fp8_matmul(CudaOps::Impl& s, const Tensor& x, const Tensor& w, Tensor out, bool accumulate,
                bool gemv) {
  const CudaOps::Impl::Fp8Blocks b = s.fp8_blocks_of(w);
  const int64_t n = x.shape[0], m = w.shape[0], k = w.shape[1];
  if (!gemv && fp8_wmma_blocks(b.rows, b.cols)) {
    MoeGemmArgs a{};
    a.dense_w = w.data, a.dense_rows = n, a.accumulate = accumulate;
    a.m = m, a.k = k, a.x = x.ptr<float>(), a.ldx = x.stride[0];
    a.out = out.ptr<float>(), a.ldo = out.stride[0];
    a.w_aligned = true;  // weight_memory is 256-byte aligned
    a.fp8_block_rows = b.rows, a.fp8_block_cols = b.cols;
    if (s.options.profile) {
      s.work(2.0 * double(n) * double(m) * double(k),
             double(m * k) + 4.0 * double(n) * double(k + m));
    }
    launch_moe_wmma(a, DType::F8_E4M3, false, unsigned((n + kWmmaTileRows - 1) / kWmmaTileRows),
                    s.stream);
    s.launched(
        s.options.profile
            ? ("matmul fp8 tensor cores " + std::to_string(m) + "x" + std::to_string(k)).c_str()
            : "matmul (fp8, tensor cores)");
    return;
  }
  Fp8GemvGroup g{};
  add_to_group(g, w, out, b);
  if (s.options.profile) {
    s.work(2.0 * double(n) * double(m) * double(k),
           double(m * k) + 4.0 * double(n) * double(k + m));
  }
  launch_fp8_gemv(g, x_vec(x) && fp8_vec_shape(k, b.cols), x, int(n), accumulate, s.stream);
  s.launched(s.options.profile
                 ? ("matmul fp8 gemv " + std::to_string(m) + "x" + std::to_string(k)).c_str()
                 : "matmul (fp8 gemv)");
}

bool fp8_matmul_group(CudaOps::Impl& s, const Tensor& x, std::span<const Tensor> ws,
                      std::span<const Tensor> outs) {
  const int64_t n = x.shape[0], k = x.shape[1];
  Fp8GemvGroup g{};
  bool vec = false;
  double bytes = 0, rows = 0;
  for (size_t i = 0; i < ws.size(); ++i) {
    if (ws[i].dtype != DType::F8_E4M3 || ws[i].shape[0] == 0) return false;
    const CudaOps::Impl::Fp8Blocks b = s.fp8_blocks_of(ws[i]);
    const bool v = x_vec(x) && fp8_vec_shape(k, b.cols);
    if (i > 0 && v != vec) return false;  // one path for all: each row as matmul computes it
    vec = v;
    add_to_group(g, ws[i], outs[i], b);
    bytes += double(ws[i].numel());
    rows += double(ws[i].shape[0]);
  }
  if (s.options.profile)
    s.work(2.0 * double(n) * rows * double(k), bytes + 4.0 * double(n) * (double(k) + rows));
  launch_fp8_gemv(g, vec, x, int(n), false, s.stream);
  s.launched("matmul group (fp8 gemv)");
  return true;
}

}  // namespace recur
