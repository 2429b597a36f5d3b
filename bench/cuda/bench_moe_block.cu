// bench_moe_block: the MoE half of a batch-1 decode layer (issues 17, 20, 21: a step is a chain
// of small dependent kernels), run two ways on the same weights and the same device functions:
//   separate   one kernel per step in a CUDA graph with programmatic dependent launch, the
//              first weights of o_proj's, the router's and down's shared-expert rows loaded
//              before the wait (as recur's decode kernels load theirs);
//   persistent one cooperative kernel (every block resident) with a grid barrier between steps,
//              the same rows' first weights loaded before the barrier.
// Neither loads the routed experts' rows ahead (recur's down kernel does, from ids stored early).
// A layer, with the Qwen3.5-35B-A3B's shapes (hidden 2,048, bf16 weights): x = norm(h);
// h' = h + o_proj·x (2,048 × 4,096, x repeated); x = norm(h'); logits = router·x (256 experts and
// the shared expert's gate); top 8 by softmax, renormalised; gate/up of the 8 and the shared
// expert (512 each, SwiGLU); down (2,048 × 512 each) and the weighted sum into h = h' + ...
// Both ways compute the same bits (checked). The experts come from one pool of 256, the other
// weights are each layer's own (8 layers: more than L2 holds). Prints µs a layer for each way,
// the bytes a layer and the fraction of the copy bandwidth that time reaches.
// Usage: bench_moe_block [--layers N] [--steps N]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "gpu_bench.cuh"

namespace {

using namespace gpu_bench;

using bf16 = __nv_bfloat16;
constexpr int kHidden = 2048, kOIn = 4096, kExperts = 256, kTopK = 8, kFf = 512;
constexpr int kSlots = kTopK + 1;  // the routed experts and the shared one
constexpr int kRouterRows = kExperts + 1;
constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr int kPre = 4;  // 16-byte chunks of its first row a lane loads ahead

struct Weights {
  const bf16* o;       // [kHidden][kOIn]
  const bf16* router;  // [kRouterRows][kHidden]: the experts', then the shared expert's gate
  const bf16* shared_gate_up;  // [2][kFf][kHidden]
  const bf16* shared_down;     // [kHidden][kFf]
};
struct Args {
  const Weights* layers;  // [n_layers]
  const bf16* gate_up;    // [kExperts][2][kFf][kHidden]
  const bf16* down;       // [kExperts][kHidden][kFf]
  float *h, *h2;          // [kHidden] residual before and after the mixer's output
  float* x;               // [kHidden] normed (separate kernels)
  float* logits;          // [kRouterRows]
  int* ids;               // [kTopK]
  float* wts;             // [kTopK]
  float* hidden;          // [kSlots][kFf]
  unsigned* barrier;      // arrive count (persistent)
  int n_layers;
};

__device__ __forceinline__ uint4 load16(const bf16* p) {
  return __ldcs(reinterpret_cast<const uint4*>(p));
}
__device__ __forceinline__ float dot8(uint4 w, const float* x) {
  const uint32_t u[4] = {w.x, w.y, w.z, w.w};
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    s = fmaf(__uint_as_float(u[i] << 16), x[2 * i], s);
    s = fmaf(__uint_as_float(u[i] & 0xffff0000u), x[2 * i + 1], s);
  }
  return s;
}

// A lane's first kPre chunks of a row (chunk c = lane + 32q), loaded ahead.
struct Pre {
  uint4 v[kPre];
  const bf16* row = nullptr;
};
__device__ __forceinline__ void preload(Pre& p, const bf16* row, int K) {
  p.row = row;
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int q = 0; q < kPre; ++q) {
    const int c = lane + 32 * q;
    if (c * 8 < K) p.v[q] = load16(row + c * 8);
  }
}
// Σ row[k]·xs[k] over K (a multiple of 256), the lanes' chunks in order then the warp's sum:
// the same bits whichever way the row's first chunks arrived.
__device__ __forceinline__ float dot_row(const bf16* row, const float* xs, int K, const Pre* pre) {
  const int lane = threadIdx.x % 32, chunks = K / 8;
  float s = 0.0f;
  int q = 0;
  if (pre && pre->row == row) {
#pragma unroll
    for (; q < kPre; ++q) {
      const int c = lane + 32 * q;
      if (c < chunks) s += dot8(pre->v[q], xs + c * 8);
    }
  }
  for (int c = lane + 32 * q; c < chunks; c += 32) s += dot8(load16(row + c * 8), xs + c * 8);
  return warp_sum(s);
}

// xs[k] = v[k] / sqrt(mean(v²) + eps) for k < n (v [kHidden]; xs repeats it past kHidden), by
// every block alike: each thread's 8 values in order, the warps' sums in order.
__device__ void norm_into(const float* v, float* xs, int n) {
  __shared__ float part[kWarps];
  float ss = 0.0f;
  for (int k = threadIdx.x; k < kHidden; k += kThreads) {
    const float e = __ldcg(v + k);  // through L2: other blocks of a persistent kernel wrote it
    ss = fmaf(e, e, ss);
  }
  ss = warp_sum(ss);
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = ss;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < kWarps; ++w) total += part[w];
  const float inv = rsqrtf(total / kHidden + 1e-6f);
  for (int k = threadIdx.x; k < n; k += kThreads) xs[k] = __ldcg(v + k % kHidden) * inv;
  __syncthreads();
}

// Top kTopK of softmax(logits[0..kExperts)), renormalised, by one warp (ties: the lower id).
__device__ void route(const float* logits, int* ids, float* wts) {
  const int lane = threadIdx.x % 32;
  float l[kExperts / 32];
  float mx = -INFINITY;
  for (int i = 0; i < kExperts / 32; ++i) mx = fmaxf(mx, l[i] = __ldcg(logits + lane + 32 * i));
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  float sum = 0.0f;
  for (int i = 0; i < kExperts / 32; ++i) sum += (l[i] = expf(l[i] - mx));
  sum = warp_sum(sum);
  // The picks stay in registers (the same in every lane); lane 0 stores them once.
  int id[kTopK];
  float p[kTopK], top_sum = 0.0f;
  for (int k = 0; k < kTopK; ++k) {
    float best = -1.0f;
    int best_i = kExperts;
    for (int i = 0; i < kExperts / 32; ++i) {
      if (l[i] > best) best = l[i], best_i = lane + 32 * i;
    }
    for (int o = 16; o > 0; o >>= 1) {
      const float b = __shfl_xor_sync(0xffffffffu, best, o);
      const int bi = __shfl_xor_sync(0xffffffffu, best_i, o);
      if (b > best || (b == best && bi < best_i)) best = b, best_i = bi;
    }
    id[k] = best_i;
    p[k] = best / sum;
    top_sum += p[k];
    for (int i = 0; i < kExperts / 32; ++i) {
      if (best_i == lane + 32 * i) l[i] = -1.0f;
    }
  }
  if (lane == 0) {
    for (int k = 0; k < kTopK; ++k) ids[k] = id[k], wts[k] = p[k] / top_sum;
  }
}

// The steps of a layer as tasks over warps [w0, w0 + n_warps): each warp takes tasks w, w + n...
__device__ void o_proj_tasks(const Args& a, const Weights& L, const float* xs, int w, int n,
                             const Pre* pre) {
  for (int r = w; r < kHidden; r += n) {
    const float v = dot_row(L.o + int64_t(r) * kOIn, xs, kOIn, pre);
    if (threadIdx.x % 32 == 0) a.h2[r] = __ldcg(a.h + r) + v;
  }
}
__device__ void router_tasks(const Args& a, const Weights& L, const float* xs, int w, int n,
                             const Pre* pre) {
  for (int r = w; r < kRouterRows; r += n) {
    const float v = dot_row(L.router + int64_t(r) * kHidden, xs, kHidden, pre);
    if (threadIdx.x % 32 == 0) a.logits[r] = v;
  }
}
__device__ __forceinline__ const bf16* gate_row(const Args& a, const Weights& L, const int* ids,
                                                int slot, int j, int half) {
  return slot < kTopK ? a.gate_up + ((int64_t(ids[slot]) * 2 + half) * kFf + j) * kHidden
                      : L.shared_gate_up + (int64_t(half) * kFf + j) * kHidden;
}
__device__ void gate_up_tasks(const Args& a, const Weights& L, const int* ids, const float* xs,
                              int w, int n) {
  for (int t = w; t < kSlots * kFf; t += n) {
    const int slot = t / kFf, j = t % kFf;
    const float g = dot_row(gate_row(a, L, ids, slot, j, 0), xs, kHidden, nullptr);
    const float u = dot_row(gate_row(a, L, ids, slot, j, 1), xs, kHidden, nullptr);
    if (threadIdx.x % 32 == 0) a.hidden[t] = g / (1.0f + expf(-g)) * u;
  }
}
__device__ __forceinline__ const bf16* down_row(const Args& a, const Weights& L, const int* ids,
                                                int slot, int i) {
  return slot < kTopK ? a.down + (int64_t(ids[slot]) * kHidden + i) * kFf
                      : L.shared_down + int64_t(i) * kFf;
}
// hs: the slots' SwiGLU outputs [kSlots][kFf] in shared memory.
__device__ void down_tasks(const Args& a, const Weights& L, const int* ids, const float* wts,
                           const float* hs, int w, int n, const Pre* pre) {
  const float gate = 1.0f / (1.0f + expf(-__ldcg(a.logits + kExperts)));
  for (int i = w; i < kHidden; i += n) {
    float out = 0.0f;
    for (int slot = 0; slot < kSlots; ++slot) {
      const float y = dot_row(down_row(a, L, ids, slot, i), hs + slot * kFf, kFf, pre);
      out = fmaf(slot < kTopK ? wts[slot] : gate, y, out);
    }
    if (threadIdx.x % 32 == 0) a.h[i] = __ldcg(a.h2 + i) + out;
  }
}

// ---- separate kernels (grid sizes from the task counts) ----
__global__ void __launch_bounds__(kThreads) k_norm(Args a, bool after_mixer) {
  pdl_allow();
  pdl_wait();
  __shared__ float xs[kHidden];
  norm_into(after_mixer ? a.h2 : a.h, xs, kHidden);
  if (blockIdx.x == 0) {
    for (int k = threadIdx.x; k < kHidden; k += kThreads) a.x[k] = xs[k];
  }
}
__global__ void __launch_bounds__(kThreads) k_o_proj(Args a, int layer) {
  const Weights& L = a.layers[layer];
  const int w = blockIdx.x * kWarps + threadIdx.x / 32;
  Pre pre;
  if (w < kHidden) preload(pre, L.o + int64_t(w) * kOIn, kOIn);
  pdl_allow();
  pdl_wait();
  __shared__ float xs[kOIn];
  for (int k = threadIdx.x; k < kOIn; k += kThreads) xs[k] = __ldcg(a.x + k % kHidden);
  __syncthreads();
  o_proj_tasks(a, L, xs, w, gridDim.x * kWarps, &pre);
}
__global__ void __launch_bounds__(kThreads) k_router(Args a, int layer) {
  const Weights& L = a.layers[layer];
  const int w = blockIdx.x * kWarps + threadIdx.x / 32;
  Pre pre;
  if (w < kRouterRows) preload(pre, L.router + int64_t(w) * kHidden, kHidden);
  pdl_allow();
  pdl_wait();
  __shared__ float xs[kHidden];
  for (int k = threadIdx.x; k < kHidden; k += kThreads) xs[k] = __ldcg(a.x + k);
  __syncthreads();
  router_tasks(a, L, xs, w, gridDim.x * kWarps, &pre);
}
__global__ void __launch_bounds__(kThreads) k_gate_up(Args a, int layer) {
  pdl_wait();
  __shared__ float xs[kHidden];
  __shared__ int ids[kTopK];
  __shared__ float wts[kTopK];
  for (int k = threadIdx.x; k < kHidden; k += kThreads) xs[k] = __ldcg(a.x + k);
  if (threadIdx.x < 32) route(a.logits, ids, wts);
  __syncthreads();
  if (blockIdx.x == 0 && threadIdx.x < kTopK) {
    a.ids[threadIdx.x] = ids[threadIdx.x];
    a.wts[threadIdx.x] = wts[threadIdx.x];
  }
  pdl_allow();  // down's blocks may become resident (they read the ids only after their wait)
  gate_up_tasks(a, a.layers[layer], ids, xs, blockIdx.x * kWarps + threadIdx.x / 32,
                gridDim.x * kWarps);
}
__global__ void __launch_bounds__(kThreads) k_down(Args a, int layer) {
  const int w = blockIdx.x * kWarps + threadIdx.x / 32;
  Pre pre;  // the shared expert's row: known before the routing
  if (w < kHidden) preload(pre, a.layers[layer].shared_down + int64_t(w) * kFf, kFf);
  pdl_allow();
  pdl_wait();
  __shared__ float hs[kSlots * kFf];
  __shared__ int ids[kTopK];
  __shared__ float wts[kTopK];
  if (threadIdx.x < kTopK) {
    ids[threadIdx.x] = __ldcg(a.ids + threadIdx.x);
    wts[threadIdx.x] = __ldcg(a.wts + threadIdx.x);
  }
  for (int k = threadIdx.x; k < kSlots * kFf; k += kThreads) hs[k] = __ldcg(a.hidden + k);
  __syncthreads();
  down_tasks(a, a.layers[layer], ids, wts, hs, w, gridDim.x * kWarps, &pre);
}

// ---- one persistent kernel ----
__global__ void __launch_bounds__(kThreads) k_persistent(Args a) {
  __shared__ float xs[kOIn];
  __shared__ float hs[kSlots * kFf];
  __shared__ int ids[kTopK];
  __shared__ float wts[kTopK];
  const int w = blockIdx.x * kWarps + threadIdx.x / 32, n = gridDim.x * kWarps;
  unsigned phase = 0;
  Pre pre;
  if (w < kHidden) preload(pre, a.layers[0].o + int64_t(w) * kOIn, kOIn);
  for (int l = 0; l < a.n_layers; ++l) {
    const Weights& L = a.layers[l];
    norm_into(a.h, xs, kOIn);
    o_proj_tasks(a, L, xs, w, n, &pre);
    if (w < kRouterRows) preload(pre, L.router + int64_t(w) * kHidden, kHidden);
    grid_barrier(a.barrier, phase);
    norm_into(a.h2, xs, kHidden);
    router_tasks(a, L, xs, w, n, &pre);
    grid_barrier(a.barrier, phase);
    if (threadIdx.x < 32) route(a.logits, ids, wts);
    __syncthreads();
    gate_up_tasks(a, L, ids, xs, w, n);
    if (w < kHidden) preload(pre, L.shared_down + int64_t(w) * kFf, kFf);
    grid_barrier(a.barrier, phase);
    for (int k = threadIdx.x; k < kSlots * kFf; k += kThreads) hs[k] = __ldcg(a.hidden + k);
    __syncthreads();
    down_tasks(a, L, ids, wts, hs, w, n, &pre);
    if (l + 1 < a.n_layers && w < kHidden) {
      preload(pre, a.layers[l + 1].o + int64_t(w) * kOIn, kOIn);
    }
    grid_barrier(a.barrier, phase);
  }
}

// Spins ns nanoseconds (one thread).
__global__ void spin_kernel(long long ns) {
  long long t0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  long long t = t0;
  while (t - t0 < ns) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
}

__global__ void fill_kernel(bf16* p, size_t n, uint32_t seed, float scale) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    uint32_t v = uint32_t(i) * 2654435761u ^ seed;
    v ^= v >> 15, v *= 2246822519u, v ^= v >> 13;
    p[i] = __float2bfloat16((float(v & 0xffffu) / 32768.0f - 1.0f) * scale);
  }
}

bf16* random_bf16(size_t n, uint32_t seed, float scale) {
  bf16* p = nullptr;
  CHECK(cudaMalloc(&p, n * sizeof(bf16)));
  fill_kernel<<<1024, 256>>>(p, n, seed, scale);
  CHECK(cudaGetLastError());
  return p;
}

template <typename... Params>
void launch_pdl(void (*kernel)(Params...), int blocks, cudaStream_t s, Params... params) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(blocks));
  cfg.blockDim = dim3(kThreads);
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  CHECK(cudaLaunchKernelEx(&cfg, kernel, params...));
}

}  // namespace

int main(int argc, char** argv) {
  int n_layers = 8, steps = 20;
  if (!parse_int_options(argc, argv, "bench_moe_block [--layers N] [--steps N]",
                         {{"--layers", &n_layers, 1}, {"--steps", &steps, 1}})) {
    return 2;
  }
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

  // Weights: scales that keep the residual's scale steady over layers.
  std::vector<Weights> layers(n_layers);
  for (int l = 0; l < n_layers; ++l) {
    layers[l].o = random_bf16(size_t(kHidden) * kOIn, 11u + l, 0.02f);
    layers[l].router = random_bf16(size_t(kRouterRows) * kHidden, 101u + l, 0.05f);
    layers[l].shared_gate_up = random_bf16(size_t(2) * kFf * kHidden, 201u + l, 0.05f);
    layers[l].shared_down = random_bf16(size_t(kHidden) * kFf, 301u + l, 0.05f);
  }
  Args a = {};
  Weights* dlayers = nullptr;
  CHECK(cudaMalloc(&dlayers, sizeof(Weights) * n_layers));
  CHECK(cudaMemcpy(dlayers, layers.data(), sizeof(Weights) * n_layers, cudaMemcpyHostToDevice));
  a.layers = dlayers;
  a.gate_up = random_bf16(size_t(kExperts) * 2 * kFf * kHidden, 7u, 0.05f);
  a.down = random_bf16(size_t(kExperts) * kHidden * kFf, 9u, 0.05f);
  float* buf = nullptr;
  const size_t floats = 3 * kHidden + kRouterRows + kTopK + kSlots * kFf;
  CHECK(cudaMalloc(&buf, floats * sizeof(float)));
  a.h = buf, a.h2 = buf + kHidden, a.x = buf + 2 * kHidden, a.logits = buf + 3 * kHidden;
  a.wts = a.logits + kRouterRows, a.hidden = a.wts + kTopK;
  CHECK(cudaMalloc(&a.ids, kTopK * sizeof(int)));
  CHECK(cudaMalloc(&a.barrier, sizeof(unsigned)));
  a.n_layers = n_layers;
  std::vector<float> h0(kHidden);
  for (int i = 0; i < kHidden; ++i) h0[i] = std::sin(0.37f * float(i));
  auto reset_h = [&] {
    CHECK(cudaMemcpyAsync(a.h, h0.data(), kHidden * sizeof(float), cudaMemcpyHostToDevice, s));
    CHECK(cudaMemsetAsync(a.barrier, 0, sizeof(unsigned), s));
  };

  // Separate kernels, one graph of every layer.
  cudaGraph_t graph;
  CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int l = 0; l < n_layers; ++l) {
    launch_pdl(k_norm, 1, s, a, false);
    launch_pdl(k_o_proj, kHidden / kWarps, s, a, l);
    launch_pdl(k_norm, 1, s, a, true);
    launch_pdl(k_router, (kRouterRows + kWarps - 1) / kWarps, s, a, l);
    launch_pdl(k_gate_up, kSlots * kFf / kWarps, s, a, l);
    launch_pdl(k_down, kHidden / kWarps, s, a, l);
  }
  CHECK(cudaStreamEndCapture(s, &graph));
  cudaGraphExec_t exec;
  CHECK(cudaGraphInstantiate(&exec, graph, 0));

  int per_sm = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k_persistent, kThreads, 0));
  per_sm = std::min(per_sm, 3);
  CHECK(cudaDeviceSynchronize());  // the weights are filled (on the legacy stream)

  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  // Each run: h reset, a 50 µs spin (so that the launch below is queued before the GPU is
  // free: host launch latency stays out of the interval), then the timed run. The final h of
  // every run must equal the first separate run's, bit for bit.
  std::vector<float> ref, out(kHidden);
  int bad_runs = 0;
  auto time_us = [&](int persistent_blocks) {
    std::vector<float> t;
    for (int i = 0; i < steps + 1; ++i) {
      reset_h();
      spin_kernel<<<1, 1, 0, s>>>(50000);
      CHECK(cudaEventRecord(e0, s));
      if (persistent_blocks > 0) {
        void* pargs[] = {&a};
        CHECK(cudaLaunchCooperativeKernel(reinterpret_cast<void*>(k_persistent),
                                          dim3(unsigned(persistent_blocks)), dim3(kThreads), pargs,
                                          0, s));
      } else {
        CHECK(cudaGraphLaunch(exec, s));
      }
      CHECK(cudaEventRecord(e1, s));
      CHECK(cudaEventSynchronize(e1));
      float ms = 0;
      CHECK(cudaEventElapsedTime(&ms, e0, e1));
      if (i > 0) t.push_back(ms);  // the first is the warm-up
      CHECK(cudaMemcpy(out.data(), a.h, kHidden * sizeof(float), cudaMemcpyDeviceToHost));
      if (ref.empty()) ref = out;
      bad_runs += std::memcmp(out.data(), ref.data(), kHidden * sizeof(float)) != 0;
    }
    std::sort(t.begin(), t.end());
    return double(t[t.size() / 2]) * 1e3 / n_layers;
  };
  const double us_sep = time_us(0);
  std::vector<int> ids(kTopK);
  CHECK(cudaMemcpy(ids.data(), a.ids, kTopK * sizeof(int), cudaMemcpyDeviceToHost));
  std::vector<double> us_per;
  for (int b = 1; b <= per_sm; ++b) us_per.push_back(time_us(b * prop.multiProcessorCount));

  // Bytes a layer: o_proj, router, 9 experts' gate/up and down. The copy rate as recur's bench
  // measures it (bytes read plus written).
  const double bytes = 2.0 * (double(kHidden) * kOIn + double(kRouterRows) * kHidden +
                              double(kSlots) * 3 * kFf * kHidden);
  void* c0 = nullptr;
  void* c1 = nullptr;
  const size_t cbytes = size_t(1) << 30;
  CHECK(cudaMalloc(&c0, cbytes));
  CHECK(cudaMalloc(&c1, cbytes));
  CHECK(cudaMemcpyAsync(c1, c0, cbytes, cudaMemcpyDeviceToDevice, s));
  CHECK(cudaEventRecord(e0, s));
  for (int i = 0; i < 5; ++i) CHECK(cudaMemcpyAsync(c1, c0, cbytes, cudaMemcpyDeviceToDevice, s));
  CHECK(cudaEventRecord(e1, s));
  CHECK(cudaEventSynchronize(e1));
  float cms = 0;
  CHECK(cudaEventElapsedTime(&cms, e0, e1));
  const double copy_gbs = 2.0 * 5 * double(cbytes) / (cms * 1e-3) / 1e9;
  const double bound_us = bytes / (copy_gbs * 1e3);
  std::printf(
      "device %s, %d SMs; %d layers, median of %d steps; %.1f MB a layer; copy %.0f GB/s "
      "(read + written, as recur's bench), %.2f us a layer at it\n",
      prop.name, prop.multiProcessorCount, n_layers, steps, bytes / 1e6, copy_gbs, bound_us);
  std::printf("%-50s %10s %10s\n", "way", "us a layer", "fraction");
  std::printf("%-50s %10.2f %10.3f\n", "separate kernels, graph + PDL (6 a layer)", us_sep,
              bound_us / us_sep);
  for (size_t b = 0; b < us_per.size(); ++b) {
    char what[96];
    std::snprintf(what, sizeof what, "persistent, grid barriers (4 a layer), %zu blocks/SM", b + 1);
    std::printf("%-50s %10.2f %10.3f\n", what, us_per[b], bound_us / us_per[b]);
  }
  float max_abs = 0.0f;
  bool finite = true;
  for (float v : ref)
    finite = finite && std::isfinite(v), max_abs = std::max(max_abs, std::fabs(v));
  std::sort(ids.begin(), ids.end());
  const bool distinct = std::adjacent_find(ids.begin(), ids.end()) == ids.end() &&
                        ids.front() >= 0 && ids.back() < kExperts;
  std::printf(
      "outputs: %s (%d of %d runs differ from the first), %s, max |h| %.3g; last routing "
      "%s\n",
      bad_runs == 0 ? "identical" : "DIFFER", bad_runs, (steps + 1) * (1 + per_sm),
      finite ? "finite" : "NOT FINITE", max_abs, distinct ? "8 distinct experts" : "BAD IDS");
  return bad_runs == 0 && finite && distinct ? 0 : 1;
}
