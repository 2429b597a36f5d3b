// Block-FP8 weights (fp8.cuh's layout): adopting a checkpoint's, quantizing at load
// (--quantize fp8, on the device), and the matmuls that read them.
//   ≤ kGemvMaxTokens tokens, and decode batches on small weights (the caller's takes_gemv): a
//     warp-per-rows GEMV over the fp8 bytes and their scales, f32 arithmetic, no dequantized
//     copy; groups of weights sharing x in one launch.
//   Prompts: with e4m3 activations (BackendOptions::fp8_activations, sm_90a), each row
//     quantized per 128 channels and multiplied on FP8 tensor cores (moe_fp8_act.cu); else,
//     where k suits the pipelined tiles, the f16 tiles of moe_mma.cu (e4m3 widened to f16 in
//     registers) on two f16 terms of each activation row scaled by a power of two (f32-class
//     results; split once into the start-up scratch act_lowp); else the tiles of
//     moe_wmma.cu, weights widened to bf16 in shared memory, each block splitting its f32 rows
//     into three bf16 terms; where the block sizes suit neither, the GEMV kernel over token
//     groups.
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

}  // namespace

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

void fp8_matmul_tensor_cores(CudaOps::Impl& s, const Tensor& x, const Tensor& w, Tensor out,
                             bool accumulate) {
  const CudaOps::Impl::Fp8Blocks b = s.fp8_blocks_of(w);
  RECUR_CHECK(fp8_wmma_blocks(b.rows, b.cols));
  const int64_t n = x.shape[0], m = w.shape[0], k = w.shape[1];
  MoeGemmArgs a{};
  a.dense_w = w.data, a.dense_rows = n, a.accumulate = accumulate;
  a.m = m, a.k = k, a.x = x.ptr<float>(), a.ldx = x.stride[0];
  a.out = out.ptr<float>(), a.ldo = out.stride[0];
  a.w_aligned = true;  // weight_memory is 256-byte aligned
  a.fp8_block_rows = b.rows, a.fp8_block_cols = b.cols;
  // The tiles over `rows` rows of x: launched, with their work for the profile.
  auto tiles = [&](const MoeGemmArgs& t, int64_t rows) {
    if (s.options.profile) {
      s.work(2.0 * double(rows) * double(m) * double(k),
             double(m * k) + 4.0 * double(rows) * double(k + m));
    }
    launch_moe_wmma(t, DType::F8_E4M3, false, unsigned((rows + kWmmaTileRows - 1) / kWmmaTileRows),
                    s.stream);
    s.launched(
        s.options.profile
            ? ("matmul fp8 tensor cores " + std::to_string(m) + "x" + std::to_string(k)).c_str()
            : "matmul (fp8, tensor cores)");
  };
  if (!moe_wmma_pipelined(DType::F8_E4M3, k, a.w_aligned)) {
    tiles(a, n);
    return;
  }
  if (s.e4m3_first_row(n) == 0 && fp8_act_takes(b.rows, b.cols, k, a.w_aligned)) {
    // e4m3 activations: x quantized per row and 128 channels, on FP8 tensor cores; rows in
    // pieces whose bytes and scales fit the start-up scratch.
    const int64_t kbs = (k + kFp8ActBlock - 1) / kFp8ActBlock;
    const int64_t piece = int64_t(s.act_lowp.bytes() / size_t(k + 4 * kbs + 256));
    RECUR_CHECK(piece >= 1);
    auto* q = static_cast<uint8_t*>(s.act_lowp.data());
    for (int64_t r0 = 0; r0 < n; r0 += piece) {
      const int64_t nr = std::min(piece, n - r0);
      auto* scale = reinterpret_cast<float*>(q + (nr * k + 255) / 256 * 256);
      launch_e4m3_group_quantize(a.x + r0 * a.ldx, a.ldx, nr, k, q, scale, s.stream);
      s.launched("matmul (e4m3 activations)");
      MoeGemmArgs p = a;
      p.x_q = q, p.x_q_scale = scale, p.dense_rows = nr, p.out = a.out + r0 * a.ldo;
      if (s.options.profile) {
        s.work(2.0 * double(nr) * double(m) * double(k), double(m * k) + double(nr * (k + 4 * m)));
      }
      launch_moe_fp8_act(p, false, unsigned((nr + kWmmaTileRows - 1) / kWmmaTileRows), s.stream);
      s.launched(
          s.options.profile
              ? ("matmul fp8 e4m3 wgmma " + std::to_string(m) + "x" + std::to_string(k)).c_str()
              : "matmul (fp8, e4m3 wgmma)");
    }
    return;
  }
  // The f16 tiles (moe_mma.cu) on x split once into the start-up scratch, two f16 terms of each
  // row scaled by a power of two, then the rows' inverse scales; in pieces of rows that fit.
  for_f16_row_pieces(x, s.act_lowp.data(), s.act_lowp.bytes(), /*unit_rows=*/false, s.stream,
                     [&](int64_t r0, int64_t nr, const void* terms, const float* inv_scale) {
                       s.launched("matmul (activation split)");
                       MoeGemmArgs p = a;
                       p.x_terms = terms, p.ldxt = k, p.x_terms_plane = nr * k;
                       p.x_scale = inv_scale, p.dense_rows = nr, p.out = a.out + r0 * a.ldo;
                       tiles(p, nr);
                     });
}

}  // namespace recur
