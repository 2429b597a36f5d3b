// bench_gpu_stream: how fast weight rows stream from DRAM into shared memory, by access pattern,
// for the prompt experts' kernel (issue 22: at 2,048 tokens its gate/up streams 2.4 GB a layer
// at about 2.7 TB/s and stays there with its products removed, bench/results/
// h200-session30-run1-prof-t0.txt). The buffer is 512 "experts" of 1,024 rows × 4 KB (2 GB, as
// the 80B-A3B's gate/up weights of a layer); a block streams 256 rows of one expert through a
// ring of stages in shared memory and reads each stage once, as the kernel's products would:
//   - cp.async of 16 bytes, R bytes of each row a stage (R = 64 is the kernel's today), with
//     and without the .L2::256B hint;
//   - one bulk copy (cp.async.bulk, on the TMA unit) of R bytes per row a stage, completing on
//     an mbarrier;
//   - each block streaming its rows' bytes in order (contiguous 16-byte copies);
//   - plain 16-byte loads over the whole buffer (no shared memory), and cudaMemcpy.
// Each line prints GB/s of weights read, its ratio to the plain loads' rate, the blocks an SM
// held, and whether every block read exactly its rows (the XOR of its bytes, against a plain
// reading of the same bytes). Blocks ask for at least 100 KB of shared memory, so that at most
// two share an SM, as in the experts' kernel.
// Usage: bench_gpu_stream [--repeats N] (default 5; the median is printed).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "gpu_bench.cuh"

namespace {

using namespace gpu_bench;

constexpr int kThreads = 256;
constexpr int kExperts = 512;
constexpr int kExpertRows = 1024;
constexpr int kRowBytes = 4096;
constexpr int kBlockRows = 256;
constexpr size_t kBytes = size_t(kExperts) * kExpertRows * kRowBytes;

__device__ __forceinline__ void copy16(void* dst, const void* src, bool hint) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  if (hint) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(d), "l"(src));
  } else {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src));
  }
}
__device__ __forceinline__ void commit() {
  asm volatile("cp.async.commit_group;");
}
template <int N>
__device__ __forceinline__ void wait_groups() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N));
}

// A thread's read of one stage (as the products would read it): its 16-byte slots, folded into
// acc; every byte of the stage is read by one thread.
__device__ __forceinline__ void consume(const char* st, int stage_bytes, uint32_t& acc) {
  for (int off = threadIdx.x * 16; off < stage_bytes; off += kThreads * 16) {
    const uint4 v = *reinterpret_cast<const uint4*>(st + off);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
}

// The XOR of the block's threads' acc into sink[block] (grid (x, y): block y·x + x).
__device__ __forceinline__ void store_block_xor(uint32_t acc, uint32_t* sink) {
  __shared__ uint32_t part[kThreads / 32];
  for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t x = 0;
    for (int w = 0; w < kThreads / 32; ++w) x ^= part[w];
    sink[blockIdx.y * gridDim.x + blockIdx.x] = x;
  }
}

// The reference: each block's region (its 256 rows) read with plain loads, XORed.
__global__ void __launch_bounds__(kThreads) region_xor_kernel(const char* w, uint32_t* sink) {
  const uint4* base = reinterpret_cast<const uint4*>(
      w + (int64_t(blockIdx.y) * kExpertRows + blockIdx.x * kBlockRows) * kRowBytes);
  uint32_t acc = 0;
  for (int i = threadIdx.x; i < kBlockRows * kRowBytes / 16; i += kThreads) {
    const uint4 v = base[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  store_block_xor(acc, sink);
}

// grid (kExpertRows / kBlockRows, kExperts). R bytes of each of the block's rows a stage, or
// (kInOrder) the rows' bytes in order, R · kBlockRows a stage; kStages stages.
template <int R, int kStages, bool kHint, bool kInOrder>
__global__ void __launch_bounds__(kThreads, 2) cp_async_kernel(const char* w, uint32_t* sink) {
  extern __shared__ __align__(128) char smem[];
  constexpr int kStageBytes = R * kBlockRows;
  const char* base = w + (int64_t(blockIdx.y) * kExpertRows + blockIdx.x * kBlockRows) * kRowBytes;
  constexpr int nk = kRowBytes / R;
  auto issue = [&](int kt) {
    char* st = smem + (kt % kStages) * kStageBytes;
    for (int c = threadIdx.x; c < kStageBytes / 16; c += kThreads) {
      const char* src;
      if constexpr (kInOrder) {
        src = base + int64_t(kt) * kStageBytes + c * 16;
      } else {
        const int r = c / (R / 16), chunk = c % (R / 16);
        src = base + int64_t(r) * kRowBytes + kt * R + chunk * 16;
      }
      copy16(st + c * 16, src, kHint);
    }
  };
  for (int s = 0; s < kStages - 1; ++s) {
    issue(s);
    commit();
  }
  uint32_t acc = 0;
  for (int kt = 0; kt < nk; ++kt) {
    wait_groups<kStages - 2>();
    __syncthreads();
    if (kt + kStages - 1 < nk) issue(kt + kStages - 1);
    commit();
    consume(smem + (kt % kStages) * kStageBytes, kStageBytes, acc);
  }
  store_block_xor(acc, sink);
}

// One bulk copy of R bytes per row a stage, each stage completing on its mbarrier; kStages
// stages.
template <int R, int kStages>
__global__ void __launch_bounds__(kThreads, 2) bulk_kernel(const char* w, uint32_t* sink) {
  extern __shared__ __align__(128) char smem[];
  __shared__ __align__(8) uint64_t full[kStages];
  constexpr int kStageBytes = R * kBlockRows;
  const char* base = w + (int64_t(blockIdx.y) * kExpertRows + blockIdx.x * kBlockRows) * kRowBytes;
  constexpr int nk = kRowBytes / R;
  if (threadIdx.x < kStages) {
    const unsigned b = static_cast<unsigned>(__cvta_generic_to_shared(&full[threadIdx.x]));
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(b));
  }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  __syncthreads();
  // Warp 0 issues: lane 0 arms the stage's barrier with its bytes, then each lane copies its
  // rows' R bytes.
  auto issue = [&](int kt) {
    if (threadIdx.x >= 32) return;
    const int s = kt % kStages;
    const unsigned bar = static_cast<unsigned>(__cvta_generic_to_shared(&full[s]));
    if (threadIdx.x == 0) {
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar),
                   "r"(kStageBytes)
                   : "memory");
    }
    __syncwarp();
    for (int r = threadIdx.x; r < kBlockRows; r += 32) {
      const unsigned dst =
          static_cast<unsigned>(__cvta_generic_to_shared(smem + s * kStageBytes + r * R));
      const char* src = base + int64_t(r) * kRowBytes + kt * R;
      asm volatile(
          "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, "
          "[%3];" ::"r"(dst),
          "l"(src), "r"(R), "r"(bar)
          : "memory");
    }
  };
  auto wait_full = [&](int kt) {
    const unsigned bar = static_cast<unsigned>(__cvta_generic_to_shared(&full[kt % kStages]));
    const unsigned parity = unsigned(kt / kStages) & 1u;
    unsigned done = 0;
    while (!done) {
      asm volatile(
          "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, "
          "0, p; }"
          : "=r"(done)
          : "r"(bar), "r"(parity)
          : "memory");
    }
  };
  for (int s = 0; s < kStages - 1; ++s) issue(s);
  uint32_t acc = 0;
  for (int kt = 0; kt < nk; ++kt) {
    wait_full(kt);
    __syncthreads();  // every thread is done with stage kt - 1, which the copies below refill
    if (kt + kStages - 1 < nk) issue(kt + kStages - 1);
    consume(smem + (kt % kStages) * kStageBytes, kStageBytes, acc);
  }
  store_block_xor(acc, sink);
}

// Plain 16-byte loads over the buffer, grid-strided, four in flight a thread.
__global__ void __launch_bounds__(kThreads) load_kernel(const uint4* w, size_t n, uint32_t* sink) {
  uint32_t acc = 0;
  const size_t stride = size_t(gridDim.x) * kThreads;
  for (size_t i = size_t(blockIdx.x) * kThreads + threadIdx.x; i < n; i += 4 * stride) {
    uint4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) v[u] = i + u * stride < n ? __ldcs(w + i + u * stride) : uint4{};
#pragma unroll
    for (int u = 0; u < 4; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (acc == 0x9e3779b9u) *sink = acc;  // keeps the loads
}

// Word i of the buffer: a hash of i, so that a copy from the wrong place changes a block's XOR.
__global__ void fill_kernel(uint32_t* w, size_t n) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    uint32_t v = uint32_t(i) * 2654435761u ^ uint32_t(i >> 32);
    v ^= v >> 15, v *= 2246822519u, v ^= v >> 13;
    w[i] = v;
  }
}

constexpr int kBlocks = (kExpertRows / kBlockRows) * kExperts;

// Times kKernel (stages × stage_bytes of ring, at least 100 KB asked for) and prints its line.
template <auto kKernel>
void rows_line(const char* what, int stages, int stage_bytes, const char* w, uint32_t* sink,
               const std::vector<uint32_t>& ref, int repeats, double load_gbs, cudaStream_t s) {
  const int smem = std::max(stages * stage_bytes, 100 << 10);
  CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  int per_sm = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kKernel, kThreads, smem));
  CHECK(cudaMemsetAsync(sink, 0, kBlocks * sizeof(uint32_t), s));
  const double ms = median_ms(
      [&] { kKernel<<<dim3(kExpertRows / kBlockRows, kExperts), kThreads, smem, s>>>(w, sink); },
      repeats, s);
  std::vector<uint32_t> got(kBlocks);
  CHECK(cudaMemcpyAsync(got.data(), sink, kBlocks * sizeof(uint32_t), cudaMemcpyDeviceToHost, s));
  CHECK(cudaStreamSynchronize(s));
  const double gbs = double(kBytes) / ms / 1e6;
  std::printf("%-58s %9.1f GB/s %6.3f %3d  %s\n", what, gbs, gbs / load_gbs, per_sm,
              got == ref ? "ok" : "WRONG BYTES");
}

}  // namespace

int main(int argc, char** argv) {
  int repeats = 5;
  if (!parse_int_options(argc, argv, "bench_gpu_stream [--repeats N]",
                         {{"--repeats", &repeats, 1}})) {
    return 2;
  }
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device %s, %d SMs; %.2f GB of weight rows, 4 KB each; median of %d runs\n",
              prop.name, prop.multiProcessorCount, double(kBytes) / 1e9, repeats);
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  char *w = nullptr, *copy = nullptr;
  uint32_t* sink = nullptr;
  CHECK(cudaMalloc(&w, kBytes));
  CHECK(cudaMalloc(&copy, kBytes));
  CHECK(cudaMalloc(&sink, kBlocks * sizeof(uint32_t)));
  fill_kernel<<<4096, 256, 0, s>>>(reinterpret_cast<uint32_t*>(w), kBytes / 4);
  region_xor_kernel<<<dim3(kExpertRows / kBlockRows, kExperts), kThreads, 0, s>>>(w, sink);
  std::vector<uint32_t> ref(kBlocks);
  CHECK(cudaMemcpyAsync(ref.data(), sink, kBlocks * sizeof(uint32_t), cudaMemcpyDeviceToHost, s));
  CHECK(cudaStreamSynchronize(s));

  const int grid = prop.multiProcessorCount * 8;
  const double load_ms = median_ms(
      [&] {
        load_kernel<<<grid, kThreads, 0, s>>>(reinterpret_cast<const uint4*>(w), kBytes / 16, sink);
      },
      repeats, s);
  const double load_gbs = double(kBytes) / load_ms / 1e6;
  std::printf("%-58s %14s %6s %3s\n", "pattern", "weights read", "ratio", "/SM");
  std::printf("%-58s %9.1f GB/s %6.3f\n", "plain 16-byte loads, whole buffer", load_gbs, 1.0);
  const double copy_ms = median_ms(
      [&] { CHECK(cudaMemcpyAsync(copy, w, kBytes, cudaMemcpyDeviceToDevice, s)); }, repeats, s);
  std::printf("%-58s %9.1f GB/s %6.3f\n", "cudaMemcpy device to device (read; as much written)",
              double(kBytes) / copy_ms / 1e6, double(kBytes) / copy_ms / 1e6 / load_gbs);
  // Rows a stage, stages: 64 B × 4 (the experts' kernel today), 128 B × 3, 256 B × 3 (192 KB,
  // one block an SM).
  rows_line<cp_async_kernel<64, 4, true, false>>(
      "cp.async, 64 B a row a stage x4, .L2::256B (today's)", 4, 64 * kBlockRows, w, sink, ref,
      repeats, load_gbs, s);
  rows_line<cp_async_kernel<64, 4, false, false>>("cp.async, 64 B a row a stage x4, no hint", 4,
                                                  64 * kBlockRows, w, sink, ref, repeats, load_gbs,
                                                  s);
  rows_line<cp_async_kernel<128, 3, true, false>>("cp.async, 128 B a row a stage x3, .L2::256B", 3,
                                                  128 * kBlockRows, w, sink, ref, repeats, load_gbs,
                                                  s);
  rows_line<cp_async_kernel<128, 3, false, false>>("cp.async, 128 B a row a stage x3, no hint", 3,
                                                   128 * kBlockRows, w, sink, ref, repeats,
                                                   load_gbs, s);
  rows_line<cp_async_kernel<64, 4, false, true>>(
      "cp.async, the rows' bytes in order, 16 KB a stage x4", 4, 64 * kBlockRows, w, sink, ref,
      repeats, load_gbs, s);
  rows_line<bulk_kernel<64, 4>>("bulk copy, 64 B a row a stage x4", 4, 64 * kBlockRows, w, sink,
                                ref, repeats, load_gbs, s);
  rows_line<bulk_kernel<128, 3>>("bulk copy, 128 B a row a stage x3", 3, 128 * kBlockRows, w, sink,
                                 ref, repeats, load_gbs, s);
  rows_line<bulk_kernel<256, 3>>("bulk copy, 256 B a row a stage x3", 3, 256 * kBlockRows, w, sink,
                                 ref, repeats, load_gbs, s);
  CHECK(cudaFree(w));
  CHECK(cudaFree(copy));
  CHECK(cudaFree(sink));
  CHECK(cudaStreamDestroy(s));
  return 0;
}
