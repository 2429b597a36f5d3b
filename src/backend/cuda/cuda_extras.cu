// Host-to-device copies, random fills made on the device (benchmarks build tens of gigabytes
// of weights this way without staging them on the host), and the copy-bandwidth ceiling.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "backend/cuda/cuda_internal.cuh"
#include "backend/cuda/cuda_ops.h"

namespace recur {

using namespace cuda;

namespace {

// The same splitmix64 of (seed, index) as Ops::fill_random_uniform on the host.
__device__ inline uint64_t mix(uint64_t seed, uint64_t i) {
  uint64_t z = seed + (i + 1) * 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

template <typename T>
__global__ void fill_uniform_kernel(T* out, int64_t n, uint64_t seed, float lo, float hi) {  // [n]
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float u = float(mix(seed, uint64_t(i)) >> 40) * (1.0f / float(1 << 24));
    const float v = lo + (hi - lo) * u;
    if constexpr (std::is_same_v<T, float>) {
      out[i] = v;
    } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      out[i] = __float2bfloat16_rn(v);
    } else {
      out[i] = __float2half_rn(v);
    }
  }
}

// ids[r] = argmax of row r of x [n, V] (rows ldx apart), as Ops::argmax_rows: a block per row;
// each thread keeps the first of its strided elements' largest values (a NaN never compares
// greater; a thread with nothing above -inf offers its first index), then the block keeps
// the largest by (value desc, index asc).
constexpr int kArgmaxThreads = 1024;
__global__ void __launch_bounds__(kArgmaxThreads)
    argmax_rows_kernel(const float* x, int64_t ldx, int64_t V, int32_t* ids) {
  grid_dependency_sync();
  const float* row = x + int64_t(blockIdx.x) * ldx;
  float best = -INFINITY;
  int64_t best_i = threadIdx.x;
  for (int64_t j = threadIdx.x; j < V; j += kArgmaxThreads) {
    const float v = row[j];
    if (v > best) best = v, best_i = j;
  }
  auto take = [&](float v, int64_t i) {
    if (v > best || (v == best && i < best_i)) best = v, best_i = i;
  };
  for (int o = 16; o > 0; o >>= 1) {
    take(__shfl_xor_sync(0xffffffffu, best, o), __shfl_xor_sync(0xffffffffu, best_i, o));
  }
  __shared__ float warp_v[kArgmaxThreads / 32];
  __shared__ int64_t warp_i[kArgmaxThreads / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warp_v[warp] = best, warp_i[warp] = best_i;
  __syncthreads();
  if (warp != 0) return;
  best = warp_v[lane], best_i = warp_i[lane];  // kArgmaxThreads / 32 == 32 warps
  for (int o = 16; o > 0; o >>= 1) {
    take(__shfl_xor_sync(0xffffffffu, best, o), __shfl_xor_sync(0xffffffffu, best_i, o));
  }
  if (lane == 0) ids[blockIdx.x] = int32_t(best_i);
}

}  // namespace

void CudaOps::argmax_rows(const Tensor& x, Tensor ids) {
  RECUR_CHECK(x.ndim == 2 && x.dtype == DType::F32 && x.stride[1] == 1);
  RECUR_CHECK(ids.dtype == DType::I32 && ids.numel() == x.shape[0] && ids.is_contiguous());
  Impl& s = *impl_;
  s.end_forward();
  if (x.shape[0] == 0) return;
  launch_kernel(argmax_rows_kernel, unsigned(x.shape[0]), kArgmaxThreads, 0, s.stream,
                x.ptr<float>(), x.stride[0], x.shape[1], ids.ptr<int32_t>());
  s.launched("argmax_rows");
}

void CudaOps::copy_from_host(Tensor dst, const void* src) {
  RECUR_CHECK(dst.is_contiguous());
  impl_->end_forward();
  RECUR_CUDA_CHECK(cudaMemcpyAsync(dst.data, src, size_t(dst.numel()) * dtype_size(dst.dtype),
                                   cudaMemcpyHostToDevice, impl_->stream));
  RECUR_CUDA_CHECK(cudaStreamSynchronize(impl_->stream));
}

void CudaOps::fill_random_uniform(Tensor t, uint64_t seed, float lo, float hi) {
  RECUR_CHECK(t.is_contiguous());
  impl_->end_forward();
  const int64_t n = t.numel();
  if (n == 0) return;
  const int threads = 256;
  const int blocks =
      int(std::min<int64_t>((n + threads - 1) / threads, int64_t(impl_->sm_count) * 32));
  switch (t.dtype) {
    case DType::F32:
      fill_uniform_kernel<<<blocks, threads, 0, impl_->stream>>>(t.ptr<float>(), n, seed, lo, hi);
      break;
    case DType::BF16:
      fill_uniform_kernel<<<blocks, threads, 0, impl_->stream>>>(t.ptr<__nv_bfloat16>(), n, seed,
                                                                 lo, hi);
      break;
    case DType::F16:
      fill_uniform_kernel<<<blocks, threads, 0, impl_->stream>>>(t.ptr<__half>(), n, seed, lo, hi);
      break;
    default:
      RECUR_CHECK(false && "fill_random_uniform: F32, BF16 or F16 only");
  }
  RECUR_CUDA_CHECK(cudaGetLastError());
}

double CudaOps::measure_copy_bandwidth(size_t bytes) {
  impl_->end_forward();
  void *a = nullptr, *b = nullptr;
  RECUR_CUDA_CHECK(cudaMalloc(&a, bytes));
  RECUR_CUDA_CHECK(cudaMalloc(&b, bytes));
  RECUR_CUDA_CHECK(cudaMemsetAsync(a, 1, bytes, impl_->stream));
  cudaEvent_t start, stop;
  RECUR_CUDA_CHECK(cudaEventCreate(&start));
  RECUR_CUDA_CHECK(cudaEventCreate(&stop));
  RECUR_CUDA_CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, impl_->stream));  // warm
  const int reps = 10;
  RECUR_CUDA_CHECK(cudaEventRecord(start, impl_->stream));
  for (int r = 0; r < reps; ++r) {
    RECUR_CUDA_CHECK(cudaMemcpyAsync(r % 2 ? a : b, r % 2 ? b : a, bytes, cudaMemcpyDeviceToDevice,
                                     impl_->stream));
  }
  RECUR_CUDA_CHECK(cudaEventRecord(stop, impl_->stream));
  RECUR_CUDA_CHECK(cudaEventSynchronize(stop));
  float ms = 0;
  RECUR_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaFree(a);
  cudaFree(b);
  return 2.0 * double(bytes) * reps / (double(ms) * 1e-3);  // bytes read plus written
}

}  // namespace recur
