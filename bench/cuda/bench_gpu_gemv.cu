// bench_gpu_gemv: one token's GEMV at decode shapes (issues 17, 20, 21: a batch-1 step's short
// projections run well under the copy rate; in the session 45 H100 traces gate/up ran at about
// 1.8 TB/s, down 1.5 and out_proj 1.8 where in_proj reached 2.6). Each arm is a chain of
// launches in one CUDA graph, as a decode step's kernels are, each launch over its own copy of
// the weight (a pool of at least 1 GiB, so L2 holds none of it when it is read). Arms:
//   flat-read    the launch's bytes read flat by 4 blocks of 512 threads an SM, no products;
//   read         the core's grid and loads (128 threads, R rows a block, 16-byte streaming loads),
//                no products: what the access pattern alone reaches;
//   core         recur's GEMV core (gemv.cuh) as matmul_gemv_kernel runs it for one token: the
//                first 8 / R chunks of each row loaded before the PDL wait, R = 4;
//   core-nopre   the same without the loads before the wait;
//   core-serial  the same launched without PDL (each launch waits for the last to finish);
//   core-r8      the core with 8 rows a block (half the blocks, each streaming twice the bytes);
//   allregs      every load of a thread's share of its block's rows issued before the wait and
//                before any product, then the core's products and reduction (all in flight).
// Each line prints µs a launch, GB/s of weights and its ratio to a plain read of the whole pool
// measured in the same run; every arm's outputs are checked against a host f64 reference.
// Shapes (bf16 weights, m × k): 2,048 × 4,096 (out_proj), 8,192 × 2,048 (a fused input
// projection), 4,096 × 2,048, 2,048 × 2,048, 2,048 × 512 (a down projection's short rows).
// Usage: bench_gpu_gemv [--launches N] [--repeats N]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "backend/cuda/gemv.cuh"
#include "gpu_bench.cuh"

namespace {

using bf16 = __nv_bfloat16;
using recur::cuda::kGemvThreads;
using recur::cuda::RowScales;
constexpr int kChunk = 8;  // bf16 elements in a 16-byte chunk

// y[row0 + r] of one block: the core's products and reduction over raw chunks or from w.
template <int R>
__device__ __forceinline__ void store_rows(float (&acc)[R][1], float* y, int64_t row0, int rows) {
  __shared__ float red[R * (kGemvThreads / 32)];
  float unused[R][1];
  recur::cuda::gemv_reduce<1, R, false>(acc, unused, red);
  if (int(threadIdx.x) < rows) y[row0 + threadIdx.x] = red[threadIdx.x];
}

// w [m, k], x [k], y [m]: block b computes rows R b .. R b + R - 1 (k a multiple of 8).
template <int R, int kPre, bool kPdl>
__global__ void __launch_bounds__(kGemvThreads)
    core_kernel(const bf16* __restrict__ w, int64_t m, int64_t k, const float* x, float* y) {
  const int64_t row0 = int64_t(blockIdx.x) * R;
  const int rows = int(std::min<int64_t>(R, m - row0));
  uint4 pre[kPre > 0 ? kPre : 1][R];
  if constexpr (kPre > 0) recur::cuda::gemv_preload<bf16, R, kPre>(w + row0 * k, k, rows, pre);
  if constexpr (kPdl) {
    gpu_bench::pdl_wait();
    gpu_bench::pdl_allow();
  }
  const float* xr[1] = {x};
  float acc[R][1] = {}, unused[R][1];
  const RowScales<bf16, R> sc{};
  recur::cuda::gemv_partial<bf16, 1, R, false, true, kPre>(
      w + row0 * k, nullptr, k, rows, sc, sc, xr, acc, unused, kPre > 0 ? pre : nullptr);
  store_rows<R>(acc, y, row0, rows);
}

// The core's loads without its products: each thread XORs its chunks of the block's R rows.
template <int R>
__global__ void __launch_bounds__(kGemvThreads)
    read_kernel(const bf16* __restrict__ w, int64_t m, int64_t k, const float*, float* y) {
  gpu_bench::pdl_wait();
  gpu_bench::pdl_allow();
  const int64_t row0 = int64_t(blockIdx.x) * R;
  const int rows = int(std::min<int64_t>(R, m - row0));
  const bf16* wr[R];  // as gemv_partial: rows past the end read the block's first
#pragma unroll
  for (int r = 0; r < R; ++r) wr[r] = w + (row0 + (r < rows ? r : 0)) * k;
  unsigned v = 0;
#pragma unroll 4
  for (int c = threadIdx.x; c < int(k / kChunk); c += kGemvThreads) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const uint4 q = recur::cuda::load_streaming(wr[r] + c * kChunk);
      v ^= q.x ^ q.y ^ q.z ^ q.w;
    }
  }
  if (v == 0x9e3779b9u) y[0] = float(v);  // keeps the loads (practically never true)
}

// Every chunk of the thread's share (kPer a row, k = kPer · 128 · 8) loaded before the wait.
template <int R, int kPer>
__global__ void __launch_bounds__(kGemvThreads)
    allregs_kernel(const bf16* __restrict__ w, int64_t m, int64_t k, const float* x, float* y) {
  const int64_t row0 = int64_t(blockIdx.x) * R;
  const int rows = int(std::min<int64_t>(R, m - row0));
  uint4 raw[kPer][R];
#pragma unroll
  for (int p = 0; p < kPer; ++p) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      raw[p][r] = recur::cuda::load_streaming(w + (row0 + (r < rows ? r : 0)) * k +
                                              (threadIdx.x + int64_t(p) * kGemvThreads) * kChunk);
    }
  }
  gpu_bench::pdl_wait();
  gpu_bench::pdl_allow();
  const float* xr[1] = {x};
  float acc[R][1] = {};
  const RowScales<bf16, R> sc{};
#pragma unroll
  for (int p = 0; p < kPer; ++p) {
    recur::cuda::fma_chunk_raw<bf16, R, 1>(raw[p], sc, xr, threadIdx.x + int64_t(p) * kGemvThreads,
                                           acc);
  }
  store_rows<R>(acc, y, row0, rows);
}

// The launch's bytes read flat (16-byte loads, consecutive threads on consecutive chunks) by
// 4 blocks of 512 threads an SM: the best a kernel reading that many bytes is likely to do.
__global__ void __launch_bounds__(512)
    flat_read_kernel(const bf16* __restrict__ w, int64_t m, int64_t k, const float*, float* y) {
  gpu_bench::pdl_wait();
  gpu_bench::pdl_allow();
  const uint4* p = reinterpret_cast<const uint4*>(w);
  const int n = int(m * k / kChunk);
  unsigned v = 0;
#pragma unroll 4
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const uint4 q = recur::cuda::load_streaming(p + i);
    v ^= q.x ^ q.y ^ q.z ^ q.w;
  }
  if (v == 0x9e3779b9u) y[0] = float(v);  // keeps the loads (practically never true)
}

// The whole pool read once by a grid-stride kernel: the ceiling the arms are measured against.
__global__ void pool_read_kernel(const uint4* p, size_t n, unsigned* sink) {
  unsigned v = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    const uint4 q = recur::cuda::load_streaming(p + i);
    v ^= q.x ^ q.y ^ q.z ^ q.w;
  }
  if (v == 0x9e3779b9u) *sink = v;
}

using Kernel = void (*)(const bf16*, int64_t, int64_t, const float*, float*);

struct Arm {
  const char* name;
  Kernel kernel;
  int rows;  // a block's (0: flat_read_kernel's grid, 4 blocks of 512 threads an SM)
  bool pdl;
  bool checked;  // computes y
};

float weight_value(int64_t r, int64_t c) {
  return float(int((r * 7919 + c * 104729) % 2001) - 1000) * (1.0f / 4096.0f);
}
float x_value(int64_t c) {
  return float(int((c * 2654435761u) % 997) - 498) * (1.0f / 512.0f);
}

float median_ms(std::vector<float> v) {
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

// Median time of `repeats` replays of g.
float time_graph(cudaGraphExec_t g, cudaStream_t s, int repeats) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  CHECK(cudaGraphLaunch(g, s));  // warm
  CHECK(cudaStreamSynchronize(s));
  std::vector<float> ms;
  for (int i = 0; i < repeats; ++i) {
    CHECK(cudaEventRecord(a, s));
    CHECK(cudaGraphLaunch(g, s));
    CHECK(cudaEventRecord(b, s));
    CHECK(cudaEventSynchronize(b));
    float t = 0;
    CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  return median_ms(ms);
}

template <int K>
Kernel allregs_for() {
  return allregs_kernel<4, K / (kGemvThreads * kChunk)>;
}

}  // namespace

int main(int argc, char** argv) {
  int launches = 64, repeats = 9;
  if (!gpu_bench::parse_int_options(argc, argv, "bench_gpu_gemv [--launches N] [--repeats N]",
                                    {{"--launches", &launches, 2}, {"--repeats", &repeats, 1}})) {
    return 2;
  }
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const size_t pool_bytes = size_t(1) << 30;
  bf16* pool = nullptr;
  CHECK(cudaMalloc(&pool, pool_bytes));
  unsigned* sink = nullptr;
  CHECK(cudaMalloc(&sink, 4));

  // The ceiling: the whole pool read by a grid-stride kernel (its bytes are not yet set: reads
  // of any bytes cost the same).
  float pool_ms = 0;
  {
    std::vector<float> ms;
    cudaEvent_t a, b;
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
    for (int i = 0; i <= repeats; ++i) {
      CHECK(cudaEventRecord(a, stream));
      pool_read_kernel<<<prop.multiProcessorCount * 8, 512, 0, stream>>>(
          reinterpret_cast<const uint4*>(pool), pool_bytes / 16, sink);
      CHECK(cudaEventRecord(b, stream));
      CHECK(cudaEventSynchronize(b));
      float t = 0;
      CHECK(cudaEventElapsedTime(&t, a, b));
      if (i > 0) ms.push_back(t);
    }
    pool_ms = median_ms(ms);
    CHECK(cudaEventDestroy(a));
    CHECK(cudaEventDestroy(b));
  }
  const double ceiling = double(pool_bytes) / (pool_ms * 1e-3) * 1e-9;
  std::printf("%s, %d SMs; a plain read of the %zu MiB pool: %.1f GB/s (the ceiling below)\n",
              prop.name, prop.multiProcessorCount, pool_bytes >> 20, ceiling);
  std::printf("%d launches a graph, the median of %d replays\n", launches, repeats);
  std::printf("%-13s %-13s %10s %10s %9s %12s\n", "shape m x k", "arm", "us/launch", "GB/s",
              "of read", "max rel err");

  struct Shape {
    int64_t m, k;
    Kernel allregs;
  };
  const Shape shapes[] = {{2048, 4096, allregs_for<4096>()},
                          {8192, 2048, allregs_for<2048>()},
                          {4096, 2048, allregs_for<2048>()},
                          {2048, 2048, allregs_for<2048>()},
                          {2048, 512, nullptr}};
  for (const Shape& sh : shapes) {
    const int64_t m = sh.m, k = sh.k;
    const size_t copy_elems = size_t(m * k), copy_bytes = copy_elems * 2;
    const int copies = int(pool_bytes / copy_bytes);
    // One copy made here, then repeated across the pool on the device.
    std::vector<bf16> host_w(copy_elems);
    std::vector<double> ref(size_t(m), 0.0);
    std::vector<float> host_x(static_cast<size_t>(k));
    for (int64_t c = 0; c < k; ++c) host_x[size_t(c)] = x_value(c);
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t c = 0; c < k; ++c) {
        const bf16 v = __float2bfloat16(weight_value(r, c));
        host_w[size_t(r * k + c)] = v;
        ref[size_t(r)] += double(__bfloat162float(v)) * double(host_x[size_t(c)]);
      }
    }
    CHECK(cudaMemcpy(pool, host_w.data(), copy_bytes, cudaMemcpyHostToDevice));
    for (int i = 1; i < copies; ++i) {
      CHECK(cudaMemcpy(pool + size_t(i) * copy_elems, pool, copy_bytes, cudaMemcpyDeviceToDevice));
    }
    float *x = nullptr, *y = nullptr;
    CHECK(cudaMalloc(&x, size_t(k) * 4));
    CHECK(cudaMalloc(&y, size_t(m) * 4));
    CHECK(cudaMemcpy(x, host_x.data(), size_t(k) * 4, cudaMemcpyHostToDevice));

    std::vector<Arm> arms = {{"flat-read", flat_read_kernel, 0, true, false},
                             {"read", read_kernel<4>, 4, true, false},
                             {"core", core_kernel<4, 2, true>, 4, true, true},
                             {"core-nopre", core_kernel<4, 0, true>, 4, true, true},
                             {"core-serial", core_kernel<4, 2, false>, 4, false, true},
                             {"core-r8", core_kernel<8, 1, true>, 8, true, true}};
    if (sh.allregs) arms.push_back({"allregs", sh.allregs, 4, true, true});
    for (const Arm& arm : arms) {
      CHECK(cudaMemset(y, 0, size_t(m) * 4));
      cudaGraph_t graph;
      CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      for (int i = 0; i < launches; ++i) {
        cudaLaunchAttribute attr[1];
        attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[0].val.programmaticStreamSerializationAllowed = 1;
        cudaLaunchConfig_t cfg{};
        cfg.gridDim = dim3(arm.rows > 0 ? unsigned((m + arm.rows - 1) / arm.rows)
                                        : unsigned(4 * prop.multiProcessorCount));
        cfg.blockDim = dim3(arm.rows > 0 ? kGemvThreads : 512);
        cfg.stream = stream;
        cfg.attrs = attr;
        cfg.numAttrs = arm.pdl ? 1 : 0;
        const bf16* w = pool + size_t(i % copies) * copy_elems;
        CHECK(cudaLaunchKernelEx(&cfg, arm.kernel, w, m, k, static_cast<const float*>(x), y));
      }
      CHECK(cudaStreamEndCapture(stream, &graph));
      cudaGraphExec_t exec;
      CHECK(cudaGraphInstantiate(&exec, graph, 0));
      const float ms = time_graph(exec, stream, repeats);
      double err = 0;
      if (arm.checked) {
        std::vector<float> got(static_cast<size_t>(m));
        CHECK(cudaMemcpy(got.data(), y, size_t(m) * 4, cudaMemcpyDeviceToHost));
        for (int64_t r = 0; r < m; ++r) {
          const double want = ref[size_t(r)];
          err = std::max(err,
                         std::fabs(double(got[size_t(r)]) - want) / std::max(1.0, std::fabs(want)));
        }
      }
      const double us = ms * 1e3 / launches, gbs = double(copy_bytes) / (us * 1e-6) * 1e-9;
      char shape[48];
      std::snprintf(shape, sizeof shape, "%lld x %lld", static_cast<long long>(m),
                    static_cast<long long>(k));
      if (arm.checked) {
        std::printf("%-13s %-13s %10.2f %10.1f %9.3f %12.2e%s\n", shape, arm.name, us, gbs,
                    gbs / ceiling, err, err > 1e-4 ? "  WRONG" : "");
      } else {
        std::printf("%-13s %-13s %10.2f %10.1f %9.3f %12s\n", shape, arm.name, us, gbs,
                    gbs / ceiling, "-");
      }
      CHECK(cudaGraphExecDestroy(exec));
      CHECK(cudaGraphDestroy(graph));
    }
    CHECK(cudaFree(x));
    CHECK(cudaFree(y));
  }
  CHECK(cudaFree(pool));
  CHECK(cudaFree(sink));
  return 0;
}
