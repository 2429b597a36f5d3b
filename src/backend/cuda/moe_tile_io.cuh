// Shared by the MoE experts' tensor-core tiles (moe_wmma.cu, moe_mma.cu, moe_fp8_act.cu): f32
// activations split exactly into three terms of the weights' 16-bit type (the fallback tiles and
// the dense matmul's cuBLAS terms, split3) or into two f16 terms of a scaled row (moe_mma.cu), a
// finished tile's write-out from shared memory as f32 rows, and the warpgroup kernels' ring of
// cp.async stages.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "backend/cuda/moe.cuh"
#include "backend/cuda/wgmma.cuh"

namespace recur::cuda {

constexpr int kMoeTerms = 3;  // activation terms: lo, mid, hi

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

// v = t[2] + t[1] + t[0] (hi, mid, lo), each the nearest T to what the larger ones leave.
template <typename T>
__device__ __forceinline__ void split3(float v, T (&t)[kMoeTerms]) {
#pragma unroll
  for (int term = kMoeTerms - 1; term >= 0; --term) {
    t[term] = from_f32<T>(v);
    v -= to_f32(t[term]);
  }
}

// Eight consecutive f32 activations: two 16-byte loads when vec (src 16-byte aligned).
__device__ __forceinline__ void load_f32x8(const float* src, bool vec, float (&v)[8]) {
  if (vec) {
    const float4 f0 = *reinterpret_cast<const float4*>(src);
    const float4 f1 = *reinterpret_cast<const float4*>(src + 4);
    v[0] = f0.x, v[1] = f0.y, v[2] = f0.z, v[3] = f0.w;
    v[4] = f1.x, v[5] = f1.y, v[6] = f1.z, v[7] = f1.w;
  } else {
#pragma unroll
    for (int q = 0; q < 8; ++q) v[q] = src[q];
  }
}

// 16-bit weights multiply two f16 terms of each activation row scaled by a power of two
// (moe_mma.cu): mid, hi.
constexpr int kF16Terms = 2;

// v = t[1] + t[0] (hi, mid), each the nearest f16 to what the larger one leaves (|v| < 65504).
__device__ __forceinline__ void split_f16(float v, __half (&t)[kF16Terms]) {
  t[1] = __float2half_rn(v);
  t[0] = __float2half_rn(v - __half2float(t[1]));
}

// The exponent e that puts a row's largest |value| mx in [2^14, 2^15): the row's f16 terms
// then keep 22 bits of every value within 2^17 of mx and cannot overflow. 0 for a zero or
// non-finite mx (NaN and infinities pass through as they would in f32); within ±126, so 2^e
// and 2^-e are normal floats.
__device__ __forceinline__ int f16_row_exponent(float mx) {
  if (!(mx > 0.0f) || isinf(mx)) return 0;
  int p;
  frexpf(mx, &p);  // mx = f·2^p, f in [0.5, 1)
  return max(-126, min(126, 15 - p));
}

// A tile's results Cs [kWmmaTileRows][ldc] f32 (token rows, kW output columns from n0) to
// out rows row0 .. row0 + rows - 1 (added to them when a.accumulate). Called by every thread of
// the block after a barrier.
template <int kW>
__device__ __forceinline__ void store_tile_rows(const MoeGemmArgs& a, const float* Cs, int ldc,
                                                int row0, int rows, int64_t n0) {
  constexpr int kTM = kWmmaTileRows;
  for (int idx = threadIdx.x; idx < kTM * kW; idx += blockDim.x) {
    const int r = idx / kW, c = idx % kW;
    if (r < rows && n0 + c < a.m) {
      float* o = a.out + int64_t(row0 + r) * a.ldo + n0 + c;
      *o = a.accumulate ? *o + Cs[r * ldc + c] : Cs[r * ldc + c];
    }
  }
}

// A ring of kStages cp.async stages feeding a block's warpgroup products, k stage kt in slot
// kt % kStages (issue(kt) starts its copies). ring_start issues the first kStages - 1 stages
// (empty groups past nk too: the waits count kStages - 1 groups ahead).
template <int kStages, typename Issue>
__device__ __forceinline__ void ring_start(int nk, Issue&& issue) {
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < nk) issue(s);
    copy_commit();
  }
}
// Before stage kt's products: it has landed for every thread and is visible to the products,
// and every warpgroup has waited for its products of stage kt - 1, whose slot is refilled here
// with stage kt + kStages - 1. Every thread of the block calls it.
template <int kStages, typename Issue>
__device__ __forceinline__ void ring_advance(int kt, int nk, Issue&& issue) {
  copy_wait<kStages - 2>();
  fence_async_shared();
  __syncthreads();
  if (kt + kStages - 1 < nk) issue(kt + kStages - 1);
  copy_commit();
}

}  // namespace recur::cuda
