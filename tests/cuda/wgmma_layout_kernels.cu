// One warpgroup's products through backend/cuda/wgmma.cuh on operands placed in shared memory
// as the prompt attention kernel places them, for test_cuda_wgmma.cpp.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "backend/cuda/wgmma.cuh"
#include "cuda/wgmma_layout_kernels.h"

namespace recur::testing {

using namespace recur::cuda;

namespace {

// a [64 × 16] row-major, b [16 × N] row-major (bits of M: __half or __nv_bfloat16); d [64 × N].
// kRegistersA: A goes into each warp's fragment registers (N 64, 128 or 256), else to shared memory
// K-major (k groups 128 bytes apart, row groups 256; N 32). B goes MN-major: k, n at (n/8)·256 +
// (k/8)·128 + (k%8)·16 + (n%8)·2, described with the given strides.
template <typename M, int N, bool kRegistersA>
__global__ void __launch_bounds__(128)
    wgmma_layout_kernel(const uint16_t* a, const uint16_t* b, uint32_t b_leading, uint32_t b_stride,
                        float* d) {
#if !defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __trap();  // sm_90a only
#else
  __shared__ __align__(128) uint16_t as[64 * 16];
  __shared__ __align__(128) uint16_t bs[16 * N];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, c = lane % 4;
  for (int e = tid; e < 64 * 16; e += 128) {
    const int r = e / 16, k = e % 16;
    as[((r / 8) * 256 + (k / 8) * 128 + (r % 8) * 16 + (k % 8) * 2) / 2] = a[e];
  }
  for (int e = tid; e < 16 * N; e += 128) {
    const int k = e / N, n = e % N;
    bs[((n / 8) * 256 + (k / 8) * 128 + (k % 8) * 16 + (n % 8) * 2) / 2] = b[e];
  }
  auto pair = [&](int r, int k) {
    return uint32_t(a[r * 16 + k]) | uint32_t(a[r * 16 + k + 1]) << 16;
  };
  const int r0 = 16 * warp + g;
  const uint32_t af[4] = {pair(r0, 2 * c), pair(r0 + 8, 2 * c), pair(r0, 2 * c + 8),
                          pair(r0 + 8, 2 * c + 8)};
  fence_async_shared();
  __syncthreads();
  float acc[N / 8][4];
  for (int j = 0; j < N / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  const uint64_t bd = wgmma_desc(bs, b_leading, b_stride);
  wgmma_fence();
  if constexpr (kRegistersA) {
    wgmma_rs<M, N>(acc, af, bd, true);
  } else {
    static_assert(N == 32, "the shared-memory A product is the scores' shape");
    wgmma_n32_ss<M>(acc, wgmma_desc(as, 128, 256), bd, true);
  }
  wgmma_commit();
  wgmma_wait<0>();
  for (int j = 0; j < N / 8; ++j) {
    for (int u = 0; u < 4; ++u) {
      const int r = 16 * warp + g + 8 * (u / 2), n = 8 * j + 2 * c + u % 2;
      d[r * N + n] = acc[j][u];
    }
  }
#endif
}

// The MoE layout's product (wgmma_kmajor_product): a [64 × 32], b [32 × 64] row-major f16 bits.
__global__ void __launch_bounds__(128)
    wgmma_kmajor_kernel(const uint16_t* a, const uint16_t* b, float* d) {
#if !defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __trap();  // sm_90a only
#else
  __shared__ __align__(128) uint16_t bs[32 * 64];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, c = lane % 4;
  for (int e = tid; e < 32 * 64; e += 128) {
    const int k = e / 64, n = e % 64;
    bs[(kmajor_offset(n, k / 8, 512) + (k % 8) * 2) / 2] = b[e];
  }
  auto pair = [&](int r, int k) {
    return uint32_t(a[r * 32 + k]) | uint32_t(a[r * 32 + k + 1]) << 16;
  };
  const int r0 = 16 * warp + g;
  uint32_t af[2][4];
  for (int h = 0; h < 2; ++h) {
    const int k0 = 16 * h + 2 * c;
    af[h][0] = pair(r0, k0), af[h][1] = pair(r0 + 8, k0);
    af[h][2] = pair(r0, k0 + 8), af[h][3] = pair(r0 + 8, k0 + 8);
  }
  fence_async_shared();
  __syncthreads();
  float acc[8][4] = {};
  wgmma_fence();
  for (int h = 0; h < 2; ++h) {
    const auto* bh = reinterpret_cast<const unsigned char*>(bs) + 256 * h;
    wgmma_rs64_kmajor_f16(acc, af[h], wgmma_desc(bh, 128, 512), true);
  }
  wgmma_commit();
  wgmma_wait<0>();
  for (int j = 0; j < 8; ++j) {
    for (int u = 0; u < 4; ++u) {
      const int r = 16 * warp + g + 8 * (u / 2), n = 8 * j + 2 * c + u % 2;
      d[r * 64 + n] = acc[j][u];
    }
  }
#endif
}

}  // namespace

bool wgmma_kmajor_product(const uint16_t* a, const uint16_t* b, float* d) {
  uint16_t *da = nullptr, *db = nullptr;
  float* dd = nullptr;
  bool ok = cudaMalloc(&da, 64 * 32 * 2) == cudaSuccess &&
            cudaMalloc(&db, 32 * 64 * 2) == cudaSuccess &&
            cudaMalloc(&dd, 64 * 64 * 4) == cudaSuccess &&
            cudaMemcpy(da, a, 64 * 32 * 2, cudaMemcpyHostToDevice) == cudaSuccess &&
            cudaMemcpy(db, b, 32 * 64 * 2, cudaMemcpyHostToDevice) == cudaSuccess;
  if (ok) wgmma_kmajor_kernel<<<1, 128>>>(da, db, dd);
  ok = ok && cudaGetLastError() == cudaSuccess &&
       cudaMemcpy(d, dd, 64 * 64 * 4, cudaMemcpyDeviceToHost) == cudaSuccess;
  cudaFree(da);
  cudaFree(db);
  cudaFree(dd);
  return ok;
}

bool wgmma_layout_product(const uint16_t* a, const uint16_t* b, int n, bool registers_a, bool bf16,
                          uint32_t b_leading, uint32_t b_stride, float* d) {
  if (registers_a ? (n != 64 && n != 128 && n != 256) : n != 32) return false;
  uint16_t *da = nullptr, *db = nullptr;
  float* dd = nullptr;
  bool ok = cudaMalloc(&da, 64 * 16 * 2) == cudaSuccess &&
            cudaMalloc(&db, size_t(16) * n * 2) == cudaSuccess &&
            cudaMalloc(&dd, size_t(64) * n * 4) == cudaSuccess &&
            cudaMemcpy(da, a, 64 * 16 * 2, cudaMemcpyHostToDevice) == cudaSuccess &&
            cudaMemcpy(db, b, size_t(16) * n * 2, cudaMemcpyHostToDevice) == cudaSuccess;
  if (ok) {
    auto launch = [&](auto m) {
      using M = decltype(m);
      if (n == 64) {
        wgmma_layout_kernel<M, 64, true><<<1, 128>>>(da, db, b_leading, b_stride, dd);
      } else if (n == 128) {
        wgmma_layout_kernel<M, 128, true><<<1, 128>>>(da, db, b_leading, b_stride, dd);
      } else if (n == 256) {
        wgmma_layout_kernel<M, 256, true><<<1, 128>>>(da, db, b_leading, b_stride, dd);
      } else {
        wgmma_layout_kernel<M, 32, false><<<1, 128>>>(da, db, b_leading, b_stride, dd);
      }
    };
    bf16 ? launch(__nv_bfloat16{}) : launch(__half{});
  }
  ok = ok && cudaGetLastError() == cudaSuccess &&
       cudaMemcpy(d, dd, size_t(64) * n * 4, cudaMemcpyDeviceToHost) == cudaSuccess;
  cudaFree(da);
  cudaFree(db);
  cudaFree(dd);
  return ok;
}

}  // namespace recur::testing
