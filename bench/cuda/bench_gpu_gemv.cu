// bench_gpu_gemv: one token's GEMV at decode shapes (issues 17, 20, 21: a batch-1 step's short
// projections run well under the copy rate; in the session 45 H100 traces gate/up ran at about
// 1.8 TB/s, down 1.5 and out_proj 1.8 where in_proj reached 2.6). Each arm is a chain of
// launches in one CUDA graph, as a decode step's kernels are, each launch over its own copy of
// the weight (a pool of 1 GiB, so L2 holds none of it when it is read). Arms, with R the rows a
// block the backend takes (kGemvRows: 4 of bf16, 8 of block-FP8):
//   flat-read    the launch's bytes read flat by 4 blocks of 512 threads an SM, no products;
//   read         the core's grid and loads (128 threads, R rows a block, 16-byte streaming loads),
//                no products: what the access pattern alone reaches;
//   core         recur's GEMV core (gemv.cuh) as matmul_gemv_kernel runs it for one token: the
//                first 8 / R chunks of each row loaded before the PDL wait;
//   core-nopre   the same without the loads before the wait;
//   core-serial  the same launched without PDL (each launch waits for the last to finish);
//   core-r8/-r4  the core with the other row count (bf16: 8 rows, block-FP8: 4);
//   warp         a warp per R rows as the experts' warp kernel reads them (shuffle sums, no
//                block barrier), 4 warps a block;
//   bulk         the block's rows (contiguous) into shared memory by one bulk copy (TMA) issued
//                before the PDL wait, then the core's products from there;
//   allregs      every load of a thread's share of its block's rows issued before the wait and
//                before any product, then the core's products and reduction (all in flight).
// Each line prints µs a launch, GB/s of weights and its ratio to a plain read of the whole pool
// measured in the same run; every arm's outputs are checked against a host f64 reference.
// Shapes (m × k): bf16 2,048 × 4,096 (out_proj), 8,192 × 2,048 (a fused input projection),
// 4,096 × 2,048, 2,048 × 2,048, 2,048 × 512 (a down projection's short rows); block-FP8 (128 ×
// 128 blocks, as published) 2,048 × 4,096, 8,192 × 2,048, 2,048 × 2,048.
// Usage: bench_gpu_gemv [--launches N] [--repeats N]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "backend/cuda/gemv.cuh"
#include "backend/cuda/tma.cuh"
#include "gpu_bench.cuh"

namespace {

using bf16 = __nv_bfloat16;
using recur::cuda::Fp8E4M3;
using recur::cuda::kGemvThreads;
using recur::cuda::RowScales;
constexpr int kFp8Block = 128;  // block-FP8 scales: one per 128 × 128 weights (as published)

// y[row0 + r] of one block: the core's reduction of acc.
template <int R>
__device__ __forceinline__ void store_rows(float (&acc)[R][1], float* y, int64_t row0, int rows) {
  __shared__ float red[R * (kGemvThreads / 32)];
  float unused[R][1];
  recur::cuda::gemv_reduce<1, R, false>(acc, unused, red);
  if (int(threadIdx.x) < rows) y[row0 + threadIdx.x] = red[threadIdx.x];
}

// The block scales of rows row0 .. of w [m, k] (none for bf16).
template <typename W, int R>
__device__ __forceinline__ RowScales<W, R> scales_of(const void* w, int64_t m, int64_t k,
                                                     int64_t row0, int rows) {
  return recur::cuda::row_scales<W, R>(w, m, k, kFp8Block, kFp8Block, row0, rows);
}

// w [m, k] of W (block-FP8: its scales after the bytes), x [k], y [m]: block b computes rows
// R b .. R b + R - 1 (k a multiple of a 16-byte chunk).
template <typename W, int R, int kPre, bool kPdl>
__global__ void __launch_bounds__(kGemvThreads)
    core_kernel(const void* wv, int64_t m, int64_t k, const float* x, float* y) {
  const W* w = static_cast<const W*>(wv);
  const int64_t row0 = int64_t(blockIdx.x) * R;
  const int rows = int(std::min<int64_t>(R, m - row0));
  uint4 pre[kPre > 0 ? kPre : 1][R];
  if constexpr (kPre > 0) recur::cuda::gemv_preload<W, R, kPre>(w + row0 * k, k, rows, pre);
  if constexpr (kPdl) {
    gpu_bench::pdl_wait();
    gpu_bench::pdl_allow();
  }
  const float* xr[1] = {x};
  float acc[R][1] = {}, unused[R][1];
  const RowScales<W, R> sc = scales_of<W, R>(wv, m, k, row0, rows);
  recur::cuda::gemv_partial<W, 1, R, false, true, kPre>(w + row0 * k, nullptr, k, rows, sc, sc, xr,
                                                        acc, unused, kPre > 0 ? pre : nullptr);
  store_rows<R>(acc, y, row0, rows);
}

// The core's loads without its products: each thread XORs its chunks of the block's R rows.
template <typename W, int R>
__global__ void __launch_bounds__(kGemvThreads)
    read_kernel(const void* wv, int64_t m, int64_t k, const float*, float* y) {
  constexpr int E = recur::cuda::kChunkElems<W>;
  const W* w = static_cast<const W*>(wv);
  gpu_bench::pdl_wait();
  gpu_bench::pdl_allow();
  const int64_t row0 = int64_t(blockIdx.x) * R;
  const int rows = int(std::min<int64_t>(R, m - row0));
  const W* wr[R];  // as gemv_partial: rows past the end read the block's first
#pragma unroll
  for (int r = 0; r < R; ++r) wr[r] = w + (row0 + (r < rows ? r : 0)) * k;
  unsigned v = 0;
#pragma unroll 4
  for (int c = threadIdx.x; c < int(k / E); c += kGemvThreads) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const uint4 q = recur::cuda::load_streaming(wr[r] + c * E);
      v ^= q.x ^ q.y ^ q.z ^ q.w;
    }
  }
  if (v == 0x9e3779b9u) y[0] = float(v);  // keeps the loads (practically never true)
}

// Every chunk of the thread's share (kPer a row: k = kPer · 128 chunks) loaded before the wait,
// then the core's products and reduction.
template <typename W, int R, int kPer>
__global__ void __launch_bounds__(kGemvThreads)
    allregs_kernel(const void* wv, int64_t m, int64_t k, const float* x, float* y) {
  constexpr int E = recur::cuda::kChunkElems<W>;
  const W* w = static_cast<const W*>(wv);
  const int64_t row0 = int64_t(blockIdx.x) * R;
  const int rows = int(std::min<int64_t>(R, m - row0));
  uint4 raw[kPer][R];
#pragma unroll
  for (int p = 0; p < kPer; ++p) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      raw[p][r] = recur::cuda::load_streaming(w + (row0 + (r < rows ? r : 0)) * k +
                                              (threadIdx.x + int64_t(p) * kGemvThreads) * E);
    }
  }
  gpu_bench::pdl_wait();
  gpu_bench::pdl_allow();
  const float* xr[1] = {x};
  float acc[R][1] = {};
  const RowScales<W, R> sc = scales_of<W, R>(wv, m, k, row0, rows);
#pragma unroll
  for (int p = 0; p < kPer; ++p) {
    recur::cuda::fma_chunk_raw<W, R, 1>(raw[p], sc, xr, threadIdx.x + int64_t(p) * kGemvThreads,
                                        acc);
  }
  store_rows<R>(acc, y, row0, rows);
}

// The block's R rows (contiguous: R · k · sizeof(W) bytes) copied into shared memory by one bulk
// copy (the TMA unit) issued before the PDL wait, then the core's products from there.
template <typename W, int R>
__global__ void __launch_bounds__(kGemvThreads)
    bulk_kernel(const void* wv, int64_t m, int64_t k, const float* x, float* y) {
  extern __shared__ __align__(128) unsigned char rows_smem[];  // [R][k] of W
  __shared__ uint64_t bar;
  const W* w = static_cast<const W*>(wv);
  const int64_t row0 = int64_t(blockIdx.x) * R;
  const int rows = int(std::min<int64_t>(R, m - row0));
  if (threadIdx.x == 0) {
    using recur::cuda::smem_addr;
    const uint32_t bytes = uint32_t(rows * k * int64_t(sizeof(W)));
    recur::cuda::mbar_init(&bar);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    recur::cuda::mbar_expect(&bar, bytes);
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, "
        "[%3];\n" ::"r"(smem_addr(rows_smem)),
        "l"(w + row0 * k), "r"(bytes), "r"(smem_addr(&bar))
        : "memory");
  }
  __syncthreads();  // the barrier is set up before anyone waits on it
  gpu_bench::pdl_wait();
  gpu_bench::pdl_allow();
  recur::cuda::mbar_wait(&bar, 0);
  constexpr int E = recur::cuda::kChunkElems<W>;
  const uint4* rs = reinterpret_cast<const uint4*>(rows_smem);
  const int64_t row_chunks = k / E;
  const float* xr[1] = {x};
  float acc[R][1] = {};
  const RowScales<W, R> sc = scales_of<W, R>(wv, m, k, row0, rows);
  for (int64_t c = threadIdx.x; c < row_chunks; c += kGemvThreads) {
    uint4 raw[R];
#pragma unroll
    for (int r = 0; r < R; ++r) raw[r] = rs[(r < rows ? r : 0) * row_chunks + c];
    recur::cuda::fma_chunk_raw<W, R, 1>(raw, sc, xr, c, acc);
  }
  store_rows<R>(acc, y, row0, rows);
}

// A warp per RW rows, as the experts' warp kernel (moe_gemv.cu) reads its rows: the lanes stride
// each row in 16-byte chunks (16 / RW chunks a row in flight per lane) and sum by shuffles, no
// shared memory or block barrier; 4 warps a block.
template <typename W, int RW>
__global__ void __launch_bounds__(kGemvThreads)
    warp_kernel(const void* wv, int64_t m, int64_t k, const float* x, float* y) {
  constexpr int E = recur::cuda::kChunkElems<W>;
  const W* w = static_cast<const W*>(wv);
  gpu_bench::pdl_wait();
  gpu_bench::pdl_allow();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t row0 = (int64_t(blockIdx.x) * (kGemvThreads / 32) + warp) * RW;
  if (row0 >= m) return;
  const int rows = int(std::min<int64_t>(RW, m - row0));
  const W* wr[RW];
#pragma unroll
  for (int r = 0; r < RW; ++r) wr[r] = w + (row0 + (r < rows ? r : 0)) * k;
  const RowScales<W, RW> sc = scales_of<W, RW>(wv, m, k, row0, rows);
  const float* xr[1] = {x};
  float acc[RW][1] = {}, unused[RW][1];
#pragma unroll(16 / RW)
  for (int64_t c = lane; c < k / E; c += 32) {
    recur::cuda::fma_chunk<W, RW, 1, false>(wr, wr, sc, sc, xr, c, acc, unused);
  }
#pragma unroll
  for (int r = 0; r < RW; ++r) {
    const float v = recur::cuda::warp_sum(acc[r][0]);
    if (lane == 0 && r < rows) y[row0 + r] = v;
  }
}

// The launch's weight bytes (m · k · sizeof(W), k·sizeof(W) a multiple of 16) read flat
// (consecutive threads on consecutive 16-byte chunks) by 4 blocks of 512 threads an SM: about
// the best a kernel reading that many bytes can do.
template <typename W>
__global__ void __launch_bounds__(512)
    flat_read_kernel(const void* wv, int64_t m, int64_t k, const float*, float* y) {
  gpu_bench::pdl_wait();
  gpu_bench::pdl_allow();
  const uint4* p = static_cast<const uint4*>(wv);
  const int n = int(m * k * int64_t(sizeof(W)) / 16);
  unsigned v = 0;
#pragma unroll 4
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const uint4 q = recur::cuda::load_streaming(p + i);
    v ^= q.x ^ q.y ^ q.z ^ q.w;
  }
  if (v == 0x9e3779b9u) y[0] = float(v);  // keeps the loads (practically never true)
}

using Kernel = void (*)(const void*, int64_t, int64_t, const float*, float*);

struct Arm {
  const char* name;
  Kernel kernel;
  int rows;  // a block's (0: flat_read_kernel's grid, 4 blocks of 512 threads an SM)
  bool pdl;
  bool checked;               // computes y
  bool rows_in_smem = false;  // dynamic shared memory of its rows (bulk_kernel)
};

// The arms for weights of type W with rows of k: the backend's rows a block (kGemvRows: 4 of
// bf16, 8 of block-FP8) and pre-wait chunks (8 / rows), then the other row count.
template <typename W>
std::vector<Arm> arms_for(int64_t k) {
  constexpr bool kFp8 = sizeof(W) == 1;
  constexpr int R = kFp8 ? 8 : 4, R2 = kFp8 ? 4 : 8;
  std::vector<Arm> arms = {
      {"flat-read", flat_read_kernel<W>, 0, true, false},
      {"read", read_kernel<W, R>, R, true, false},
      {"core", core_kernel<W, R, 8 / R, true>, R, true, true},
      {"core-nopre", core_kernel<W, R, 0, true>, R, true, true},
      {"core-serial", core_kernel<W, R, 8 / R, false>, R, false, true},
      {kFp8 ? "core-r4" : "core-r8", core_kernel<W, R2, 8 / R2, true>, R2, true, true},
      {"warp", warp_kernel<W, R>, R * (kGemvThreads / 32), true, true},
      {"bulk", bulk_kernel<W, R>, R, true, true, true}};
  constexpr int64_t kRowChunks = kGemvThreads * recur::cuda::kChunkElems<W>;  // k a kPer step
  if (k == 4096)
    arms.push_back({"allregs", allregs_kernel<W, R, 4096 / kRowChunks>, R, true, true});
  if (k == 2048)
    arms.push_back({"allregs", allregs_kernel<W, R, 2048 / kRowChunks>, R, true, true});
  return arms;
}

float weight_value(int64_t r, int64_t c) {
  return float(int((r * 7919 + c * 104729) % 2001) - 1000) * (1.0f / 4096.0f);
}
float x_value(int64_t c) {
  return float(int((c * 2654435761u) % 997) - 498) * (1.0f / 512.0f);
}

// One copy of a weight [m, k] as the backend lays it out (block-FP8: the bytes, then the f32
// scales from fp8_scales_offset), and y's reference for x, in f64.
struct Weight {
  std::vector<uint8_t> bytes;
  size_t read_bytes = 0;  // what a GEMV streams: m · k elements
  std::vector<double> ref;
};

template <typename W>
Weight make_weight(int64_t m, int64_t k, const std::vector<float>& x) {
  Weight w;
  w.ref.assign(size_t(m), 0.0);
  if constexpr (sizeof(W) == 2) {
    w.read_bytes = size_t(m * k) * 2;
    w.bytes.resize(w.read_bytes);
    bf16* e = reinterpret_cast<bf16*>(w.bytes.data());
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t c = 0; c < k; ++c) {
        const bf16 v = __float2bfloat16(weight_value(r, c));
        e[r * k + c] = v;
        w.ref[size_t(r)] += double(__bfloat162float(v)) * double(x[size_t(c)]);
      }
    }
  } else {
    const int64_t kb = (k + kFp8Block - 1) / kFp8Block, mb = (m + kFp8Block - 1) / kFp8Block;
    const int64_t off = recur::cuda::fp8_scales_offset(m, k);
    w.read_bytes = size_t(m * k);
    w.bytes.assign(size_t(off + mb * kb * 4), 0);
    float* scales = reinterpret_cast<float*>(w.bytes.data() + off);
    for (int64_t b = 0; b < mb * kb; ++b) scales[b] = 1.0f + float(b % 5) * 0.25f;
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t c = 0; c < k; ++c) {
        const __nv_fp8_storage_t b =
            __nv_cvt_float_to_fp8(weight_value(r, c), __NV_SATFINITE, __NV_E4M3);
        w.bytes[size_t(r * k + c)] = b;
        const float v = __half2float(__half(__nv_cvt_fp8_to_halfraw(b, __NV_E4M3)));
        w.ref[size_t(r)] +=
            double(v) * double(scales[(r / kFp8Block) * kb + c / kFp8Block]) * double(x[size_t(c)]);
      }
    }
  }
  return w;
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
  uint8_t* pool = nullptr;
  CHECK(cudaMalloc(&pool, pool_bytes));
  float* sink = nullptr;  // the read kernels' output (never written in practice)
  CHECK(cudaMalloc(&sink, 4));

  // The ceiling: the whole pool read flat (flat_read_kernel, 8 blocks an SM; its bytes are not
  // yet set: reads of any bytes cost the same).
  const double pool_ms = gpu_bench::median_ms(
      [&] {
        flat_read_kernel<uint8_t><<<prop.multiProcessorCount * 8, 512, 0, stream>>>(
            pool, 1, int64_t(pool_bytes), nullptr, sink);
      },
      repeats, stream);
  const double ceiling = double(pool_bytes) / (pool_ms * 1e-3) * 1e-9;
  std::printf("%s, %d SMs; a plain read of the %zu MiB pool: %.1f GB/s (the ceiling below)\n",
              prop.name, prop.multiProcessorCount, pool_bytes >> 20, ceiling);
  std::printf("%d launches a graph, each over its own weight copy; the median of %d replays\n",
              launches, repeats);
  std::printf("%-6s %-13s %-12s %10s %10s %9s %12s\n", "type", "m x k", "arm", "us/launch", "GB/s",
              "of read", "max rel err");

  struct Shape {
    bool fp8;
    int64_t m, k;
  };
  const Shape shapes[] = {{false, 2048, 4096}, {false, 8192, 2048}, {false, 4096, 2048},
                          {false, 2048, 2048}, {false, 2048, 512},  {true, 2048, 4096},
                          {true, 8192, 2048},  {true, 2048, 2048}};
  for (const Shape& sh : shapes) {
    const int64_t m = sh.m, k = sh.k;
    std::vector<float> host_x(static_cast<size_t>(k));
    for (int64_t c = 0; c < k; ++c) host_x[size_t(c)] = x_value(c);
    const Weight w = sh.fp8 ? make_weight<Fp8E4M3>(m, k, host_x) : make_weight<bf16>(m, k, host_x);
    const std::vector<Arm> arms = sh.fp8 ? arms_for<Fp8E4M3>(k) : arms_for<bf16>(k);
    // One copy made here, then repeated across the pool (256-byte aligned copies).
    const size_t stride = (w.bytes.size() + 255) / 256 * 256;
    const int copies = int(pool_bytes / stride);
    CHECK(cudaMemcpy(pool, w.bytes.data(), w.bytes.size(), cudaMemcpyHostToDevice));
    for (int i = 1; i < copies; ++i) {
      CHECK(cudaMemcpy(pool + size_t(i) * stride, pool, w.bytes.size(), cudaMemcpyDeviceToDevice));
    }
    float *x = nullptr, *y = nullptr;
    CHECK(cudaMalloc(&x, size_t(k) * 4));
    CHECK(cudaMalloc(&y, size_t(m) * 4));
    CHECK(cudaMemcpy(x, host_x.data(), size_t(k) * 4, cudaMemcpyHostToDevice));
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
        cfg.dynamicSmemBytes = arm.rows_in_smem ? size_t(arm.rows * k) * (sh.fp8 ? 1 : 2) : 0;
        cfg.stream = stream;
        cfg.attrs = attr;
        cfg.numAttrs = arm.pdl ? 1 : 0;
        const void* wi = pool + size_t(i % copies) * stride;
        CHECK(cudaLaunchKernelEx(&cfg, arm.kernel, wi, m, k, static_cast<const float*>(x), y));
      }
      CHECK(cudaStreamEndCapture(stream, &graph));
      cudaGraphExec_t exec;
      CHECK(cudaGraphInstantiate(&exec, graph, 0));
      const double ms =
          gpu_bench::median_ms([&] { CHECK(cudaGraphLaunch(exec, stream)); }, repeats, stream);
      char err_text[32] = "-";
      bool wrong = false;
      if (arm.checked) {
        std::vector<float> got(static_cast<size_t>(m));
        CHECK(cudaMemcpy(got.data(), y, size_t(m) * 4, cudaMemcpyDeviceToHost));
        double err = 0;
        for (int64_t r = 0; r < m; ++r) {
          const double want = w.ref[size_t(r)];
          err = std::max(err,
                         std::fabs(double(got[size_t(r)]) - want) / std::max(1.0, std::fabs(want)));
        }
        std::snprintf(err_text, sizeof err_text, "%.2e", err);
        wrong = !(err <= 1e-4);
      }
      const double us = ms * 1e3 / launches, gbs = double(w.read_bytes) / (us * 1e-6) * 1e-9;
      char shape[48];
      std::snprintf(shape, sizeof shape, "%lld x %lld", static_cast<long long>(m),
                    static_cast<long long>(k));
      std::printf("%-6s %-13s %-12s %10.2f %10.1f %9.3f %12s%s\n", sh.fp8 ? "fp8" : "bf16", shape,
                  arm.name, us, gbs, gbs / ceiling, err_text, wrong ? "  WRONG" : "");
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
