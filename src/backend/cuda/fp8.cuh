// Block-FP8 weights on the CUDA backend (F8_E4M3, as released, or made by --quantize fp8), in
// gemv.cuh's layout (Fp8E4M3): the weight's tensor is the bytes' contiguous [m, k] view. The
// GEMV core (gemv.cuh) reads them for few tokens; prompts take the tensor-core tiles of
// moe_mma.cu (e4m3 widened to f16 in registers), or where k or the alignment does not suit
// them, moe_wmma.cu's (to bf16).
#pragma once

#include "backend/cuda/cuda_internal.cuh"
#include "backend/cuda/gemv.cuh"

namespace recur::cuda {

// A block-FP8 matrix as the kernels read it.
struct Fp8Matrix {
  const uint8_t* q = nullptr;     // [m, k]
  const float* scales = nullptr;  // [ceil(m / br), kb]
  int64_t m = 0, k = 0, kb = 0;   // kb = ceil(k / bc)
  int br = 0, bc = 0;             // rows and columns per scale
};
__host__ __device__ __forceinline__ Fp8Matrix fp8_matrix(const void* data, int64_t m, int64_t k,
                                                         int br, int bc) {
  Fp8Matrix f;
  f.q = static_cast<const uint8_t*>(data);
  f.scales = reinterpret_cast<const float*>(f.q + fp8_scales_offset(m, k));
  f.m = m, f.k = k, f.kb = (k + bc - 1) / bc, f.br = br, f.bc = bc;
  return f;
}

// Whether the tensor-core path (moe_wmma.cu) takes a block-FP8 weight: a 64-column output tile
// within one row block of scales and 32-column k stages within one column block.
inline bool fp8_wmma_blocks(int br, int bc) {
  return br % 64 == 0 && bc % 32 == 0;
}

}  // namespace recur::cuda

namespace recur {
// x [n, k] · w^T for a block-FP8 weight w [m, k] whose block sizes suit the tensor-core tiles
// (fp8_wmma_blocks), into out [n, m] (+= with accumulate): the prompt path (kernels_fp8.cu).
void fp8_matmul_tensor_cores(CudaOps::Impl& s, const Tensor& x, const Tensor& w, Tensor out,
                             bool accumulate);
}  // namespace recur
