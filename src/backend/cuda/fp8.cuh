// Block-FP8 weights on the CUDA backend (F8_E4M3, as released, or made by --quantize fp8).
// Layout: one piece of device memory holds the fp8 bytes row-major [m, k], then, from
// fp8_scales_offset(m, k), the f32 block scales [ceil(m / br), ceil(k / bc)]:
// w[r][c] = fp8[r][c] · scales[r / br][c / bc] (edge blocks partial). The weight's tensor is the
// bytes' contiguous [m, k] view; the backend keeps its block sizes (Impl::fp8_blocks).
// The kernels widen e4m3 exactly (through f16) and scale each 16-column partial sum once.
#pragma once

#include <cuda_fp8.h>

#include "backend/cuda/cuda_internal.cuh"
#include "backend/cuda/gemv.cuh"

namespace recur::cuda {

// Bytes from a block-FP8 weight's data to its scales.
__host__ __device__ __forceinline__ int64_t fp8_scales_offset(int64_t m, int64_t k) {
  return (m * k + 15) / 16 * 16;
}

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

// One e4m3 byte to f32, exactly (the NaN codes give NaN).
__device__ __forceinline__ float fp8_to_f32(uint8_t b) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t(b), __NV_E4M3)));
}
// Four e4m3 bytes (the low byte first) to f32, exactly.
__device__ __forceinline__ void widen_fp8x4(uint32_t bits, float* out) {
  const float2 lo = __half22float2(
      __half2(__nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(bits & 0xffffu), __NV_E4M3)));
  const float2 hi = __half22float2(
      __half2(__nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(bits >> 16), __NV_E4M3)));
  out[0] = lo.x, out[1] = lo.y, out[2] = hi.x, out[3] = hi.y;
}

// Per-lane partial dot products of R rows of w from row0 (rows ≥ `rows` read row0 again, their
// sums to be discarded) with NT activation rows xr: acc[r][t] += this lane's share of
// Σ_i w[row0 + r][i] · x[t][i]. The lane takes 16-column chunks lane, lane + lanes, ...: each
// chunk's products are summed, then multiplied by its block's scale once.
// kVec: k and bc multiples of 16, the rows and x 16-byte aligned; else element by element.
template <int NT, int R, bool kVec>
__device__ __forceinline__ void fp8_partial(const Fp8Matrix& w, int64_t row0, int rows,
                                            const float* const (&xr)[NT], int lane, int lanes,
                                            float (&acc)[R][NT]) {
  const uint8_t* wr[R];
  const float* sr[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int64_t row = row0 + (r < rows ? r : 0);
    wr[r] = w.q + row * w.k;
    sr[r] = w.scales + (row / w.br) * w.kb;
  }
  if constexpr (kVec) {
    const int64_t n_chunks = w.k / 16;
    // Several chunks per row in flight for few tokens (the loads are the limit); one when the
    // FMAs of many tokens are.
    constexpr int kUnroll = NT * R <= 4 ? 4 : NT <= 2 ? 2 : 1;
#pragma unroll(kUnroll)
    for (int64_t c = lane; c < n_chunks; c += lanes) {
      uint4 raw[R];
      float s[R];
      const int64_t blk = c * 16 / w.bc;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        raw[r] = load_streaming(wr[r] + c * 16);
        s[r] = __ldg(sr[r] + blk);
      }
      float p[R][NT] = {};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float wv[R][4];
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const uint32_t bits = j == 0   ? raw[r].x
                                : j == 1 ? raw[r].y
                                : j == 2 ? raw[r].z
                                         : raw[r].w;
          widen_fp8x4(bits, wv[r]);
        }
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          const float4 xv = __ldg(reinterpret_cast<const float4*>(xr[t] + c * 16 + 4 * j));
#pragma unroll
          for (int r = 0; r < R; ++r) {
            p[r][t] = fmaf(wv[r][0], xv.x, p[r][t]);
            p[r][t] = fmaf(wv[r][1], xv.y, p[r][t]);
            p[r][t] = fmaf(wv[r][2], xv.z, p[r][t]);
            p[r][t] = fmaf(wv[r][3], xv.w, p[r][t]);
          }
        }
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int t = 0; t < NT; ++t) acc[r][t] = fmaf(s[r], p[r][t], acc[r][t]);
      }
    }
  } else {
    for (int64_t i = lane; i < w.k; i += lanes) {
      float wv[R];
#pragma unroll
      for (int r = 0; r < R; ++r) wv[r] = fp8_to_f32(wr[r][i]) * __ldg(sr[r] + i / w.bc);
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        const float xv = xr[t][i];
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r][t] = fmaf(wv[r], xv, acc[r][t]);
      }
    }
  }
}

// Fetches the first max_bytes of each of `rows` rows of fp8 bytes (q: the first row, k bytes
// apart) into L2, the lanes 128 bytes apart. Issued before a kernel's PDL wait (weights never
// depend on the kernel before it), so the loads after the wait find them there.
__device__ __forceinline__ void fp8_prefetch_rows(const uint8_t* q, int64_t k, int rows, int lane,
                                                  int lanes, int64_t max_bytes) {
  const int64_t n = k < max_bytes ? k : max_bytes;
  for (int r = 0; r < rows; ++r) {
    for (int64_t off = int64_t(lane) * 128; off < n; off += int64_t(lanes) * 128) {
      asm volatile("prefetch.global.L2 [%0];" ::"l"(q + r * k + off));
    }
  }
}

// Whether fp8_partial's 16-byte path fits a weight of k columns and bc columns per scale.
__host__ __device__ __forceinline__ bool fp8_vec_shape(int64_t k, int bc) {
  return k % 16 == 0 && bc % 16 == 0;
}

// Whether the tensor-core path (moe_wmma.cu) takes a block-FP8 weight: a 64-column output tile
// within one row block of scales and 32-column k stages within one column block.
inline bool fp8_wmma_blocks(int br, int bc) {
  return br % 64 == 0 && bc % 32 == 0;
}

}  // namespace recur::cuda

namespace recur {
// matmul and matmul_group for block-FP8 weights (kernels_fp8.cu); gemv: the caller's choice of
// the GEMV kernel (takes_gemv). fp8_matmul_group returns false when the weights do not go in one
// GEMV launch (the caller then runs one matmul each).
void fp8_matmul(CudaOps::Impl& s, const Tensor& x, const Tensor& w, Tensor out, bool accumulate,
                bool gemv);
bool fp8_matmul_group(CudaOps::Impl& s, const Tensor& x, std::span<const Tensor> ws,
                      std::span<const Tensor> outs);
}  // namespace recur
