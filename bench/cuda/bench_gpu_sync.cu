// bench_gpu_sync: what one dependency between two steps of a GPU forward costs on this device,
// by mechanism, for the design of a batch-1 decode step (issues 17, 20, 21: a step is a chain of
// about ten dependent kernels a layer, each waiting on the one before). Measured:
//   - one dependent load from L2 and from DRAM (a single thread chasing pointers over 1 MB and
//     512 MB);
//   - a kernel boundary in a CUDA graph, without and with programmatic dependent launch (PDL),
//     for grids of 1, one per SM and four per SM: each kernel's block 0 reads what the kernel
//     before wrote and writes the next value;
//   - the same chain where the last block to finish (a ticket) does that step;
//   - a grid-wide barrier inside one persistent kernel (a block per SM, co-resident by a
//     cooperative launch): an arrive counter and an acquire spin, and cooperative_groups'
//     grid.sync();
//   - a flag handed between two blocks and back (one way = half a round).
// Every chain checks that its value came through (the count it ends at) and says so.
// Usage: bench_gpu_sync [--steps N] (default 2000 per measurement).
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "gpu_bench.cuh"

namespace {

using namespace gpu_bench;

// next[i] holds the index after i; steps dependent loads from start; the end in *out.
__global__ void chase_kernel(const unsigned* next, int steps, unsigned start, unsigned* out) {
  unsigned i = start;
  for (int s = 0; s < steps; ++s) i = __ldcg(next + i);
  *out = i;
}

// One step of a chain: block 0 reads x[0] (written by the kernel before) and writes x[0] + 1.
template <bool kPdl>
__global__ void chain_step_kernel(unsigned* x) {
  if constexpr (kPdl) {
    pdl_allow();  // the next kernel's blocks may become resident; they wait below
    pdl_wait();
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) x[0] = __ldcg(x) + 1;
}

// The same, done by the last block to arrive (ticket in x[1], reset by that block).
template <bool kPdl>
__global__ void last_block_step_kernel(unsigned* x) {
  if constexpr (kPdl) {
    pdl_allow();
    pdl_wait();
  }
  __shared__ bool last;
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(x + 1, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (last && threadIdx.x == 0) {
    __threadfence();
    x[0] = __ldcg(x) + 1;
    x[1] = 0;
  }
}

// The grid barriers' arrive counter, on its own line away from the chained value x[0].
constexpr int kCounter = 32;

// steps phases, each one block's step (a different block each phase, so that the value crosses
// multiprocessors and a broken barrier loses counts) then a grid barrier (arrive counter,
// acquire spin).
__global__ void barrier_kernel(unsigned* x, int steps) {
  unsigned phase = 0;
  for (int s = 0; s < steps; ++s) {
    if (blockIdx.x == unsigned(s) % gridDim.x && threadIdx.x == 0) x[0] = __ldcg(x) + 1;
    grid_barrier(x + kCounter, phase);
  }
}

__global__ void grid_sync_kernel(unsigned* x, int steps) {
  cooperative_groups::grid_group grid = cooperative_groups::this_grid();
  for (int s = 0; s < steps; ++s) {
    if (blockIdx.x == unsigned(s) % gridDim.x && threadIdx.x == 0) x[0] = __ldcg(x) + 1;
    grid.sync();
  }
}

// Blocks 0 and 1 hand a flag (x[kCounter]) back and forth: block b waits for an even (b = 1:
// odd) value, then adds one. rounds round trips.
__global__ void ping_pong_kernel(unsigned* x, int rounds) {
  if (threadIdx.x != 0 || blockIdx.x > 1) return;
  const unsigned b = blockIdx.x;
  for (int r = 0; r < rounds; ++r) {
    const unsigned want = 2u * unsigned(r) + b;
    while (load_acquire(x + kCounter) != want) {
    }
    store_release(x + kCounter, want + 1);
  }
  if (b == 1) x[0] = load_acquire(x + kCounter);
}

struct Timer {
  cudaEvent_t a, b;
  Timer() {
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
  }
  ~Timer() {
    cudaEventDestroy(a);
    cudaEventDestroy(b);
  }
  void start(cudaStream_t s) { CHECK(cudaEventRecord(a, s)); }
  float stop_ms(cudaStream_t s) {
    CHECK(cudaEventRecord(b, s));
    CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    return ms;
  }
};

unsigned read_count(const unsigned* x) {
  unsigned v = 0;
  CHECK(cudaMemcpy(&v, x, sizeof v, cudaMemcpyDeviceToHost));
  return v;
}

void report(const char* what, int blocks, double us, unsigned got, unsigned want) {
  std::printf("%-44s %6d %10.3f   %s\n", what, blocks, us, got == want ? "ok" : "WRONG COUNT");
  if (got != want) std::printf("  (count %u, expected %u)\n", got, want);
}

// µs per dependent load over a random cycle of `bytes` of indices: a warm walk first, then the
// timed walk from where it ended (lines the warm walk did not touch when the cycle is long);
// flush_l2: 256 MB written between them, so that those lines come from DRAM.
double chase_us(size_t bytes, int steps, bool flush_l2, cudaStream_t s) {
  const size_t n = bytes / sizeof(unsigned);
  std::vector<unsigned> next(n);
  std::mt19937_64 rng(1);
  // Indices 32 apart at least (distinct 128-byte lines), a random cycle through them.
  std::vector<unsigned> lines;
  for (size_t i = 0; i < n; i += 32) lines.push_back(unsigned(i));
  std::shuffle(lines.begin() + 1, lines.end(), rng);
  for (size_t i = 0; i < lines.size(); ++i) next[lines[i]] = lines[(i + 1) % lines.size()];
  unsigned *dnext = nullptr, *dout = nullptr;
  CHECK(cudaMalloc(&dnext, bytes));
  CHECK(cudaMalloc(&dout, sizeof(unsigned)));
  CHECK(cudaMemcpy(dnext, next.data(), bytes, cudaMemcpyHostToDevice));
  CHECK(cudaDeviceSynchronize());
  chase_kernel<<<1, 1, 0, s>>>(dnext, steps, 0u, dout);  // warm (L2 for the small buffer)
  unsigned start = 0;
  CHECK(cudaMemcpyAsync(&start, dout, sizeof start, cudaMemcpyDeviceToHost, s));
  CHECK(cudaStreamSynchronize(s));
  void* flush = nullptr;
  if (flush_l2) {
    CHECK(cudaMalloc(&flush, size_t(256) << 20));
    CHECK(cudaMemsetAsync(flush, 1, size_t(256) << 20, s));
  }
  Timer t;
  t.start(s);
  chase_kernel<<<1, 1, 0, s>>>(dnext, steps, start, dout);
  const double us = t.stop_ms(s) * 1e3 / steps;
  CHECK(cudaFree(dnext));
  CHECK(cudaFree(dout));
  if (flush) CHECK(cudaFree(flush));
  return us;
}

// A graph of `steps` launches of kernel (grid blocks × 128), with PDL when pdl; µs per launch
// over `replays` replays, and the count it ends at (x[0] from 0).
template <typename Kernel>
double graph_chain_us(Kernel kernel, int blocks, bool pdl, int steps, int replays, unsigned* x,
                      cudaStream_t s, unsigned& count) {
  cudaGraph_t graph;
  CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < steps; ++i) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(unsigned(blocks));
    cfg.blockDim = dim3(128);
    cfg.stream = s;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
    CHECK(cudaLaunchKernelEx(&cfg, kernel, x));
  }
  CHECK(cudaStreamEndCapture(s, &graph));
  cudaGraphExec_t exec;
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  CHECK(cudaMemsetAsync(x, 0, 64 * sizeof(unsigned), s));
  CHECK(cudaGraphLaunch(exec, s));  // warm
  CHECK(cudaStreamSynchronize(s));
  CHECK(cudaMemsetAsync(x, 0, 64 * sizeof(unsigned), s));
  Timer t;
  t.start(s);
  for (int r = 0; r < replays; ++r) CHECK(cudaGraphLaunch(exec, s));
  const double us = t.stop_ms(s) * 1e3 / (double(steps) * replays);
  count = read_count(x);
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(graph));
  return us;
}

}  // namespace

int main(int argc, char** argv) {
  int steps = 2000;
  if (!parse_int_options(argc, argv, "bench_gpu_sync [--steps N]", {{"--steps", &steps, 10}})) {
    return 2;
  }
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  int coop = 0;
  CHECK(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, 0));
  const int sms = prop.multiProcessorCount;
  std::printf("device %s, %d SMs, compute capability %d.%d; %d steps a measurement\n", prop.name,
              sms, prop.major, prop.minor, steps);
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  unsigned* x = nullptr;  // x[0]: the chained value; x[1]: the tickets; x[kCounter]: barriers
  CHECK(cudaMalloc(&x, 64 * sizeof(unsigned)));

  std::printf("%-44s %6s %10s\n", "mechanism", "blocks", "us a step");
  std::printf("%-44s %6d %10.3f\n", "dependent load, 1 MB (L2)", 1,
              chase_us(size_t(1) << 20, steps * 10, false, s));
  std::printf("%-44s %6d %10.3f\n", "dependent load, 512 MB (DRAM, with TLB misses)", 1,
              chase_us(size_t(512) << 20, steps * 10, true, s));

  const int replays = 5;
  const unsigned want = unsigned(steps) * replays;
  for (const int blocks : {1, sms, 4 * sms}) {
    unsigned got = 0;
    double us = graph_chain_us(chain_step_kernel<false>, blocks, false, steps, replays, x, s, got);
    report("kernel boundary, graph", blocks, us, got, want);
    us = graph_chain_us(chain_step_kernel<true>, blocks, true, steps, replays, x, s, got);
    report("kernel boundary, graph + PDL", blocks, us, got, want);
    us = graph_chain_us(last_block_step_kernel<true>, blocks, true, steps, replays, x, s, got);
    report("last-block ticket, graph + PDL", blocks, us, got, want);
  }

  if (!coop) {
    std::printf("no cooperative launch on this device: grid barriers not measured\n");
  } else {
    // A cooperative launch of kernel over blocks × threads with (x, n): ms of the second of
    // two launches (the first loads the module and warms), x reset before each.
    auto coop_ms = [&](void* kernel, int blocks, int threads, int n) {
      float ms = 0;
      for (int i = 0; i < 2; ++i) {
        CHECK(cudaMemsetAsync(x, 0, 64 * sizeof(unsigned), s));
        void* args[] = {&x, &n};
        Timer t;
        t.start(s);
        CHECK(cudaLaunchCooperativeKernel(kernel, dim3(unsigned(blocks)), dim3(unsigned(threads)),
                                          args, 0, s));
        ms = t.stop_ms(s);
      }
      return double(ms);
    };
    int per_sm = 0;
    CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, barrier_kernel, 128, 0));
    for (const int blocks : {sms, std::min(4, per_sm) * sms}) {
      double us =
          coop_ms(reinterpret_cast<void*>(barrier_kernel), blocks, 128, steps) * 1e3 / steps;
      report("grid barrier, counter + acquire spin", blocks, us, read_count(x), unsigned(steps));
      us = coop_ms(reinterpret_cast<void*>(grid_sync_kernel), blocks, 128, steps) * 1e3 / steps;
      report("grid barrier, grid.sync()", blocks, us, read_count(x), unsigned(steps));
    }
    const double us =
        coop_ms(reinterpret_cast<void*>(ping_pong_kernel), 2, 32, steps) * 1e3 / (2.0 * steps);
    report("flag between two blocks, one way", 2, us, read_count(x), 2u * unsigned(steps));
  }
  CHECK(cudaFree(x));
  CHECK(cudaStreamDestroy(s));
  return 0;
}
