// What the backend does besides the ops' math: argmax over logit rows, adopting and re-typing
// weights at load (bf16 to f16 where every value fits), host-to-device copies, random fills
// made on the device (benchmarks build tens of gigabytes of weights this way without staging
// them on the host), the copy-bandwidth ceiling, and the MoE experts' weight-pointer tables.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

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

// argmax_rows' rule for one thread: (value desc, index asc); a NaN never compares greater,
// so it ranks as -inf.
__device__ __forceinline__ void take_larger(float& best, int64_t& best_i, float v, int64_t i) {
  if (v > best || (v == best && i < best_i)) best = v, best_i = i;
}

// The block's best (value, index) into lane 0 of warp 0; red_v/red_i: [blockDim / 32].
__device__ __forceinline__ void block_argmax(float& best, int64_t& best_i, float* red_v,
                                             int64_t* red_i) {
  for (int o = 16; o > 0; o >>= 1) {
    take_larger(best, best_i, __shfl_xor_sync(0xffffffffu, best, o),
                __shfl_xor_sync(0xffffffffu, best_i, o));
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, n_warps = blockDim.x / 32;
  if (lane == 0) red_v[warp] = best, red_i[warp] = best_i;
  __syncthreads();
  if (warp != 0) return;
  best = lane < n_warps ? red_v[lane] : -INFINITY;
  best_i = lane < n_warps ? red_i[lane] : INT64_MAX;
  for (int o = 16; o > 0; o >>= 1) {
    take_larger(best, best_i, __shfl_xor_sync(0xffffffffu, best, o),
                __shfl_xor_sync(0xffffffffu, best_i, o));
  }
}

// ids[r] = argmax of row r of x [n, V] (rows ldx apart), as Ops::argmax_rows: a block per row;
// each thread keeps the first of its strided elements' largest values (a thread with nothing
// above -inf offers its first index), then the block keeps the largest. Rows beyond the split
// kernel's scratch only.
constexpr int kArgmaxThreads = 1024;
__global__ void __launch_bounds__(kArgmaxThreads)
    argmax_rows_kernel(const float* x, int64_t ldx, int64_t V, int32_t* ids) {
  grid_dependency_sync();
  const float* row = x + int64_t(blockIdx.x) * ldx;
  float best = -INFINITY;
  int64_t best_i = threadIdx.x;
  for (int64_t j = threadIdx.x; j < V; j += kArgmaxThreads) take_larger(best, best_i, row[j], j);
  __shared__ float red_v[kArgmaxThreads / 32];
  __shared__ int64_t red_i[kArgmaxThreads / 32];
  block_argmax(best, best_i, red_v, red_i);
  if (threadIdx.x == 0) ids[blockIdx.x] = int32_t(best_i);
}

// The same choice with a row spread over gridDim.x blocks (a vocabulary is read from L2 in
// one round trip instead of ~150 dependent ones): block (s, r) takes spans s, s + gridDim.x,
// ... of kArgmaxSpan elements, all its loads in flight at once, and leaves its pick in
// partial[r][s]; the last of the row's blocks to finish (counted in ticket[r], which it
// resets for the next call) picks among them. partial: [rows, kArgmaxMaxSlices].
constexpr int kArgmaxSplitThreads = 256, kArgmaxPerThread = 16;
constexpr int64_t kArgmaxSpan = int64_t(kArgmaxSplitThreads) * kArgmaxPerThread;
struct ArgmaxPick {
  float v;
  int32_t i;
};
// x [rows, V] (row stride ldx); ids [rows]; partial [rows, kArgmaxMaxSlices]; ticket [rows]
__global__ void __launch_bounds__(kArgmaxSplitThreads)
    argmax_rows_split_kernel(const float* x, int64_t ldx, int64_t V, int32_t* ids,
                             ArgmaxPick* partial, unsigned* ticket) {
  grid_dependency_sync();
  const int r = blockIdx.y, s = blockIdx.x, tid = threadIdx.x;
  const float* row = x + int64_t(r) * ldx;
  float best = -INFINITY;
  int64_t best_i = int64_t(s) * kArgmaxSpan + tid;
  for (int64_t base = int64_t(s) * kArgmaxSpan; base < V; base += gridDim.x * kArgmaxSpan) {
    float v[kArgmaxPerThread];
#pragma unroll
    for (int q = 0; q < kArgmaxPerThread; ++q) {
      const int64_t j = base + tid + q * kArgmaxSplitThreads;
      v[q] = j < V ? row[j] : -INFINITY;
    }
#pragma unroll
    for (int q = 0; q < kArgmaxPerThread; ++q) {
      take_larger(best, best_i, v[q], base + tid + q * kArgmaxSplitThreads);
    }
  }
  __shared__ float red_v[kArgmaxSplitThreads / 32];
  __shared__ int64_t red_i[kArgmaxSplitThreads / 32];
  __shared__ bool last;
  block_argmax(best, best_i, red_v, red_i);
  ArgmaxPick* row_partial = partial + int64_t(r) * kArgmaxMaxSlices;
  if (tid == 0) {
    row_partial[s] = {best, int32_t(best_i)};
    __threadfence();  // the pick is visible before the ticket counts it
    last = atomicAdd(&ticket[r], 1u) == gridDim.x - 1;
    __threadfence();  // and the last block reads the others' picks after its count
  }
  __syncthreads();
  if (!last || tid >= 32) return;
  best = -INFINITY;
  best_i = INT64_MAX;
  for (int j = tid; j < int(gridDim.x); j += 32) {
    const float2 p = __ldcg(reinterpret_cast<const float2*>(row_partial + j));
    take_larger(best, best_i, p.x, __float_as_int(p.y));
  }
  for (int o = 16; o > 0; o >>= 1) {
    take_larger(best, best_i, __shfl_xor_sync(0xffffffffu, best, o),
                __shfl_xor_sync(0xffffffffu, best_i, o));
  }
  if (tid == 0) {
    ids[r] = int32_t(best_i);
    ticket[r] = 0;
  }
}

}  // namespace

void CudaOps::argmax_rows(const Tensor& x, Tensor ids) {
  RECUR_CHECK(x.ndim == 2 && x.dtype == DType::F32 && x.stride[1] == 1);
  RECUR_CHECK(ids.dtype == DType::I32 && ids.numel() == x.shape[0] && ids.is_contiguous());
  Impl& s = *impl_;
  s.end_forward();
  const int64_t n = x.shape[0], V = x.shape[1];
  if (n == 0) return;
  if (n <= kArgmaxRows && V <= INT32_MAX) {
    const unsigned slices =
        unsigned(std::min<int64_t>(kArgmaxMaxSlices, (V + kArgmaxSpan - 1) / kArgmaxSpan));
    auto* partial = static_cast<ArgmaxPick*>(s.argmax_scratch.data());
    auto* ticket = reinterpret_cast<unsigned*>(partial + kArgmaxRows * kArgmaxMaxSlices);
    launch_kernel(argmax_rows_split_kernel, dim3(std::max(1u, slices), unsigned(n)),
                  kArgmaxSplitThreads, 0, s.stream, x.ptr<float>(), x.stride[0], V,
                  ids.ptr<int32_t>(), partial, ticket);
  } else {
    launch_kernel(argmax_rows_kernel, unsigned(n), kArgmaxThreads, 0, s.stream, x.ptr<float>(),
                  x.stride[0], V, ids.ptr<int32_t>());
  }
  s.launched("argmax_rows");
}

namespace {

// Blocks of 256 threads for a grid-stride pass over n elements at load: at most eight an SM.
unsigned load_pass_blocks(int64_t n, int sm_count) {
  return unsigned(std::min<int64_t>(blocks_for(n, 256), int64_t(sm_count) * 8));
}

// *flag = 1 when any of w [n] lies beyond f16's range (NaN does not; infinities do).
__global__ void beyond_f16_kernel(const __nv_bfloat16* w, int64_t n, int* flag) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    if (fabsf(__bfloat162float(w[i])) > 65504.0f) *flag = 1;
  }
}

}  // namespace

Result<Tensor> CudaOps::adopt_matmul_weight(const Tensor& host, std::vector<Buffer>*) {
  RECUR_ASSIGN_OR_RETURN(Tensor t, adopt_weight(host));
  if (t.dtype != DType::BF16 || t.numel() == 0) return t;
  if (!t.is_contiguous()) {  // a device view adopt_weight passed through: numel() elements
    return make_error(ErrorCode::kInvalidArgument,
                      "adopt_matmul_weight: BF16 tensor {} is not contiguous", t.shape_string());
  }
  Impl& s = *impl_;
  const Tensor* one[] = {&t};
  if (s.any_beyond_f16(one)) {
    const char* begin = static_cast<const char*>(t.data);
    s.beyond_f16.emplace_back(begin, begin + size_t(t.numel()) * 2);
  }
  return t;
}

bool CudaOps::Impl::any_beyond_f16(std::span<const Tensor* const> tensors) {
  if (!range_flag) {
    RECUR_CUDA_CHECK(
        cudaHostAlloc(reinterpret_cast<void**>(&range_flag), sizeof(int), cudaHostAllocMapped));
  }
  int* flag = nullptr;
  RECUR_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&flag), range_flag, 0));
  *range_flag = 0;
  for (const Tensor* t : tensors) {
    beyond_f16_kernel<<<load_pass_blocks(t->numel(), sm_count), 256, 0, stream>>>(
        t->ptr<__nv_bfloat16>(), t->numel(), flag);
  }
  RECUR_CUDA_CHECK(cudaGetLastError());
  RECUR_CUDA_CHECK(cudaStreamSynchronize(stream));
  return *range_flag != 0;
}

namespace {

// w [n] bf16 → f16 in place, rounded to nearest even (values in f16's range).
__global__ void bf16_to_f16_kernel(void* w, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float v = __bfloat162float(static_cast<const __nv_bfloat16*>(w)[i]);
    static_cast<__half*>(w)[i] = __float2half_rn(v);
  }
}

}  // namespace

void CudaOps::retype_weights(std::span<Tensor* const> all) {
  for (const Tensor* t : all) {
    if (t->dtype != DType::BF16 || !t->is_contiguous()) return;  // one type a block
  }
  Impl& s = *impl_;
  s.end_forward();
  // A tensor seen twice (views of one weight) is converted once.
  std::vector<const Tensor*> distinct;
  for (const Tensor* t : all) {
    const bool seen = std::any_of(distinct.begin(), distinct.end(),
                                  [&](const Tensor* d) { return d->data == t->data; });
    if (t->numel() > 0 && !seen) distinct.push_back(t);
  }
  if (s.any_beyond_f16(distinct)) return;  // a value beyond 65504: the block stays BF16
  for (const Tensor* t : distinct) {
    bf16_to_f16_kernel<<<load_pass_blocks(t->numel(), s.sm_count), 256, 0, s.stream>>>(t->data,
                                                                                       t->numel());
  }
  RECUR_CUDA_CHECK(cudaGetLastError());
  RECUR_CUDA_CHECK(cudaStreamSynchronize(s.stream));
  for (Tensor* t : all) t->dtype = DType::F16;
}

bool CudaOps::Impl::experts_fit_f16(std::span<const ExpertWeights> experts) const {
  if (beyond_f16.empty()) return true;
  for (const ExpertWeights& ew : experts) {
    for (const Tensor* t : {&ew.gate, &ew.up, &ew.down}) {
      const char* begin = static_cast<const char*>(t->data);
      const char* end = begin + size_t(t->numel()) * dtype_size(t->dtype);
      for (const auto& [b, e] : beyond_f16) {
        if (begin < e && b < end) return false;
      }
    }
  }
  return true;
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

std::optional<Fp8Activations> CudaOps::fp8_activations() const {
  return impl_->e4m3_activations ? Fp8Activations::kE4m3 : Fp8Activations::kF16;
}

std::optional<PromptActivations> CudaOps::prompt_activations() const {
  return impl_->one_term_prompts ? PromptActivations::kF16 : PromptActivations::kF16x2;
}

int64_t CudaOps::free_memory_bytes() {
  size_t free = 0, total = 0;
  RECUR_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  return int64_t(free);
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

// The experts' table of weight pointers (kernels_moe.cu): one per list of experts.
const void* const* CudaOps::Impl::expert_table(std::span<const ExpertWeights> experts,
                                               const ExpertWeights* extra) {
  const size_t E = experts.size() + (extra ? 1 : 0);
  auto expert = [&](size_t e) -> const ExpertWeights& {
    return e < experts.size() ? experts[e] : *extra;
  };
  // Found without building a list: an eager forward looks its layers' tables up every time.
  for (ExpertTable& t : expert_tables) {
    bool same = t.host.size() == 3 * E;
    for (size_t e = 0; same && e < E; ++e) {
      const ExpertWeights& w = expert(e);
      same = t.host[e] == w.gate.data && t.host[E + e] == w.up.data &&
             t.host[2 * E + e] == w.down.data;
    }
    if (same) return t.dev;
  }
  ExpertTable t;
  t.host.resize(3 * E);
  for (size_t e = 0; e < E; ++e) {
    t.host[e] = expert(e).gate.data;
    t.host[E + e] = expert(e).up.data;
    t.host[2 * E + e] = expert(e).down.data;
  }
  if (expert_table_used + 3 * E <= kExpertTablePointers) {
    t.dev = static_cast<const void* const*>(expert_table_pool.data()) + expert_table_used;
    expert_table_used += 3 * E;
  } else {
    auto r = alloc.allocate(3 * E * sizeof(void*), "expert table");
    if (!r.ok()) cuda::fatal(r.error().message.c_str());
    t.own = std::move(r.value());
    t.dev = static_cast<const void* const*>(t.own.data());
  }
  // The host array lives on in expert_tables (moving the list keeps each vector's storage),
  // so the asynchronous copy may read it later.
  expert_tables.push_back(std::move(t));
  ExpertTable& kept = expert_tables.back();
  RECUR_CUDA_CHECK(cudaMemcpyAsync(const_cast<const void**>(kept.dev), kept.host.data(),
                                   3 * E * sizeof(void*), cudaMemcpyHostToDevice, stream));
  return kept.dev;
}

}  // namespace recur
