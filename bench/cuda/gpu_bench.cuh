// What the GPU microbenchmarks share (bench/cuda/*.cu): the CUDA error check, the PTX of
// programmatic dependent launch and of the acquire/release accesses, a grid barrier, a warp sum,
// the integer options of their command lines and a median time of runs.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <vector>

#define CHECK(expr)                                                                               \
  do {                                                                                            \
    const cudaError_t e_ = (expr);                                                                \
    if (e_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                                               \
    }                                                                                             \
  } while (0)

namespace gpu_bench {

__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void add_release(unsigned* p, unsigned v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void store_release(unsigned* p, unsigned v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void pdl_wait() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}
__device__ __forceinline__ void pdl_allow() {
  asm volatile("griddepcontrol.launch_dependents;");
}
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// A barrier of every block of a co-resident (cooperative) grid: each block's thread 0 adds its
// arrival to *count (zero at launch) and spins until every block has arrived `phase` times.
__device__ __forceinline__ void grid_barrier(unsigned* count, unsigned& phase) {
  __syncthreads();
  ++phase;
  if (threadIdx.x == 0) {
    __threadfence();  // the block's writes (ordered before by the barrier) before the arrival
    add_release(count, 1u);
    const unsigned target = phase * gridDim.x;
    while (load_acquire(count) < target) {
    }
  }
  __syncthreads();
}

// An integer option of a command line: `--name N`, at least min.
struct IntOption {
  const char* name;
  int* value;
  int min;
};
// Parses argv into the options; false (after printing usage) on anything else.
inline bool parse_int_options(int argc, char** argv, const char* usage,
                              std::initializer_list<IntOption> options) {
  for (int i = 1; i < argc; ++i) {
    const IntOption* hit = nullptr;
    for (const IntOption& o : options) {
      if (std::strcmp(argv[i], o.name) == 0) hit = &o;
    }
    if (!hit || i + 1 >= argc) {
      std::fprintf(stderr, "usage: %s\n", usage);
      return false;
    }
    *hit->value = std::max(hit->min, std::atoi(argv[++i]));
  }
  return true;
}

// Median ms of `repeats` runs of fn on stream s, after one run to warm up.
inline double median_ms(const std::function<void()>& fn, int repeats, cudaStream_t s) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  fn();  // warm
  std::vector<double> t;
  for (int r = 0; r < repeats; ++r) {
    CHECK(cudaEventRecord(a, s));
    fn();
    CHECK(cudaEventRecord(b, s));
    CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  CHECK(cudaGetLastError());
  std::sort(t.begin(), t.end());
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  return t[t.size() / 2];
}

}  // namespace gpu_bench
