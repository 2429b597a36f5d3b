// Internals of the CUDA backend shared by its .cu files: error checks, the backend state
// (stream, cuBLAS, batch mirror, growable scratch), dtype dispatch and small device helpers.
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "backend/cuda/cuda_ops.h"

namespace recur::cuda {

[[noreturn]] void cuda_failed(const char* expr, cudaError_t err, const char* file, int line);
[[noreturn]] void cublas_failed(const char* expr, cublasStatus_t st, const char* file, int line);
[[noreturn]] void fatal(const char* what);

// The backend's debugging and measurement switches, read from the environment once, by
// CudaOps::create (README.md lists them). None changes results.
struct CudaOptions {
  bool sync = false;     // RECUR_CUDA_SYNC=1: wait for and check every launch (no graphs)
  bool profile = false;  // RECUR_CUDA_PROFILE=1: device time per op, printed at exit (no graphs)
  // RECUR_CUDA_TRACE_OUT=FILE: where a RECUR_CUDA_TRACE build writes its stamps at exit.
  std::string trace_out;
  // Set for tensor-parallel ranks that share one device (cuda_comm.cu): their collectives meet
  // at host barriers, which a replayed graph would pass by.
  bool host_ordered_collectives = false;
  // RECUR_CUDA_PORTABLE=1: the paths GPUs after Hopper take (the compute_90 PTX has no wgmma or
  // e4m3 tiles), so that a Hopper can test them.
  bool portable = false;
  // Decode forwards replay CUDA graphs unless a launch-by-launch switch is on.
  bool graphs() const { return !sync && !profile && !host_ordered_collectives; }
  static CudaOptions from_environment();
};

#ifdef RECUR_CUDA_TRACE
// Measurement build (cmake -DRECUR_CUDA_TRACE=ON): the first thread of each kernel's first
// block stamps %globaltimer as it reaches grid_dependency_sync and as its wait returns, into
// slot i of a ring (i taken before the wait, in launch order). RECUR_CUDA_TRACE_OUT names
// the file the ring and the decode graphs' kernel names are written to at exit.
constexpr unsigned kTraceSlots = 1u << 20;
struct TraceRing {
  // [kTraceSlots][4]: reached the wait, left it, grid x | y << 20 | z << 40, block threads
  unsigned long long* stamps = nullptr;
  unsigned* next = nullptr;  // [1] slots taken
};
// Every translation unit has its own copy of the device-side ring pointer; each registers a
// setter so the host can point them all at one ring.
void register_trace_setter(void (*set)(const TraceRing&));
namespace {
__device__ TraceRing g_trace_ring;
void set_trace_ring(const TraceRing& r) {
  const cudaError_t err = cudaMemcpyToSymbol(g_trace_ring, &r, sizeof r);
  if (err != cudaSuccess) cuda_failed("cudaMemcpyToSymbol(g_trace_ring)", err, __FILE__, __LINE__);
}
[[maybe_unused]] const bool g_trace_registered = (register_trace_setter(&set_trace_ring), true);
}  // namespace
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
#endif
}  // namespace recur::cuda

// Every CUDA runtime call goes through this: an error aborts with the call, the CUDA message
// and the source line (ops return nothing, and a failed device cannot be recovered in-process).
#define RECUR_CUDA_CHECK(expr)                                                                    \
  do {                                                                                            \
    cudaError_t recur_e_ = (expr);                                                                \
    if (recur_e_ != cudaSuccess) ::recur::cuda::cuda_failed(#expr, recur_e_, __FILE__, __LINE__); \
  } while (0)
#define RECUR_CUBLAS_CHECK(expr)                                         \
  do {                                                                   \
    cublasStatus_t recur_s_ = (expr);                                    \
    if (recur_s_ != CUBLAS_STATUS_SUCCESS)                               \
      ::recur::cuda::cublas_failed(#expr, recur_s_, __FILE__, __LINE__); \
  } while (0)

namespace recur {

// The CUDA allocator: plain cudaMalloc/cudaFree, counted by the base class.
class CudaAllocator final : public Allocator {
 public:
  CudaAllocator() : Allocator(Device::kCuda) {}
  int device = 0;  // where raw_allocate allocates

 protected:
  void* raw_allocate(size_t bytes) override;
  void raw_free(void* p, size_t bytes) override;
};

// Device pointers of a SeqLayout's arrays.
struct DevLayout {
  const int32_t* seq_start = nullptr;    // [n_seqs + 1]
  const int32_t* slot = nullptr;         // [n_seqs]
  const int32_t* positions = nullptr;    // [n_tokens]
  const int32_t* block_start = nullptr;  // [n_seqs + 1]
  const int32_t* block_ids = nullptr;    // [block_start[n_seqs]]
};

struct CudaOps::Impl {
  int device = 0;
  int sm_count = 0;
  size_t max_smem_optin = 0;  // bytes of shared memory a block may opt into
  // Compute capability 9.0 exactly: the build's sm_90a code (wgmma) runs here; newer GPUs run
  // the compute_90 PTX, in which those kernels are empty.
  bool sm90a = false;
  // Block-FP8 prompt products on FP8 tensor cores with e4m3 activations (moe_fp8_act.cu):
  // BackendOptions::fp8_activations kE4m3 where sm_90a code runs; else two f16 terms.
  bool e4m3_activations = false;
  // Prompt products over 16-bit weights on one f16 term of each activation row instead of two:
  // BackendOptions::prompt_activations kF16 where sm_90a code runs.
  bool one_term_prompts = false;
  // The current forward's tokens and how many of its first ones are one-token sequences
  // (decode tokens: the engine puts them first), from begin_forward.
  int64_t forward_tokens = 0, forward_decode_rows = 0;
  bool prompt_rows = false;  // set while an op runs on split_decode_rows's prompt rows
  // Where the rows that may take lower-precision prompt activations (e4m3, or one f16 term;
  // `lowp`: that form is on) begin in an op over n rows (n: none). Only prompt rows do: a
  // decode token keeps the f32-class products it has in a forward of its own, so its result
  // does not depend on the prompts beside it. Rows that are not the forward's tokens (logit
  // rows) are all kept f32-class.
  int64_t lowp_first_row(int64_t n, bool lowp) const {
    if (!lowp) return n;
    if (prompt_rows) return 0;
    return n == forward_tokens ? forward_decode_rows : n;
  }
  int64_t e4m3_first_row(int64_t n) const { return lowp_first_row(n, e4m3_activations); }
  int64_t one_term_first_row(int64_t n) const { return lowp_first_row(n, one_term_prompts); }
  // An op over n rows of a forward holding both decode and prompt rows as two, where a
  // lower-precision form is on (lowp): op(0, d) on the decode rows, as they would run alone,
  // then op(d, n) on the prompt rows with prompt_rows set. False (nothing run) when the rows
  // are not so mixed.
  template <typename Op>
  bool split_decode_rows(int64_t n, bool lowp, Op&& op) {
    const int64_t d = lowp_first_row(n, lowp);
    if (d == 0 || d >= n) return false;
    op(int64_t(0), d);
    prompt_rows = true;
    op(d, n);
    prompt_rows = false;
    return true;
  }
  CudaAllocator alloc;  // declared first: the buffers below return to it
  cudaStream_t stream = nullptr;
  cublasHandle_t cublas = nullptr;
  Buffer cublas_workspace;
  cuda::CudaOptions options;  // graphs there is off when sync or profile is on

  // Weight slabs: adopt_weight sub-allocates, 256-byte aligned; large weights get their own.
  std::vector<Buffer> slabs, weight_buffers;
  size_t slab_used = 0;
  // Block sizes of every block-FP8 weight this backend made (cuda/fp8.cuh has the layout),
  // by the weight's data pointer.
  struct Fp8Blocks {
    int rows = 0, cols = 0;
  };
  std::unordered_map<const void*, Fp8Blocks> fp8_blocks;
  // [begin, end) of each BF16 matmul weight holding a value beyond f16's range (65504), found
  // by adopt_matmul_weight: the MoE prompt tiles that multiply 16-bit weights as f16 leave the
  // experts among them to tiles that do not. range_flag: that check's result, mapped pinned.
  std::vector<std::pair<const char*, const char*>> beyond_f16;
  int* range_flag = nullptr;

  // The batch mirror: host arrays packed into pinned memory, one async copy to `mirror`.
  struct Mirrored {
    const int32_t* host;
    int64_t count;
    int64_t offset;                   // elements into the mirror
    const int32_t* device = nullptr;  // or already in device memory (begin_forward's tokens)
  };
  int32_t* pinned = nullptr;
  size_t pinned_capacity = 0;  // int32 elements, also the mirror's capacity
  Buffer mirror;
  cudaEvent_t upload_done = nullptr;
  // copy_to_host_start's staging: pinned, sized by reserve(); the copy's event and target.
  int32_t* copy_pinned = nullptr;
  size_t copy_capacity = 0;  // bytes
  cudaEvent_t copy_done = nullptr;
  // The copy runs on its own stream once the work before it is done (copy_ready), so a step
  // queued behind it does not wait for it (9 µs a pipelined batch-1 step of the 80B config).
  cudaStream_t copy_stream = nullptr;
  cudaEvent_t copy_ready = nullptr;
  void* copy_dst = nullptr;
  size_t copy_bytes = 0;
  std::vector<Mirrored> mirrored;

  // Arrays an op receives that were not mirrored (ops called outside a forward, in tests or
  // tools) are uploaded here per op from pageable memory, which the runtime stages at once.
  Buffer adhoc;
  std::vector<int32_t> adhoc_host;

  // Fixed scratch, allocated at start-up: ops that would need more work in pieces (matmul
  // splits the rows, attention caps its context splits), so no forward allocates.
  Buffer act_lowp;      // matmul: activations split into three 16-bit terms
  Buffer attn_partial;  // split-context attention partials
  Buffer gdn_chunks;    // the chunked delta rule's per-chunk key-side records
  // argmax_rows split over blocks: each row's per-block picks [kArgmaxRows, kArgmaxMaxSlices]
  // (8 bytes each), then a finished-block count per row [kArgmaxRows], zero between calls.
  Buffer argmax_scratch;

  // Device tables of expert weight pointers, built once per expert list, carved from a pool
  // allocated at start-up (a table that does not fit gets its own buffer).
  struct ExpertTable {
    std::vector<const void*> host;  // gate[E], up[E], down[E]
    const void* const* dev = nullptr;
    Buffer own;  // set when the pool was full
  };
  std::vector<ExpertTable> expert_tables;
  static constexpr size_t kExpertTablePointers = size_t(1) << 18;  // the pool's capacity
  Buffer expert_table_pool;
  size_t expert_table_used = 0;  // pointers

  // Limits announced by reserve(); max_context 0 until then.
  ForwardLimits limits;

  // CUDA graphs for decode forwards (every sequence brings one token): a shape's first forward
  // runs eagerly (buffers and tables settle), its second is captured, later ones replay the
  // graph. Kernel arguments are then fixed: the batch arrays sit at fixed offsets of the mirror
  // (block tables last) and no launch depends on host data beyond the shape.
  enum class Mode { kEager, kCapturing, kReplaying };
  // A decode graph begins with the batch upload (pinned buffer to mirror): upload_elems int32
  // elements, enough for the shape's arrays at the longest context.
  struct DecodeGraph {
    int n_tokens, n_seqs, n_logits;
    const void* output;  // the forward's result buffer: every other argument is the model's
    const int32_t* device_tokens;  // or null: the tokens come from the upload
    int runs = 0;
    cudaGraphExec_t exec = nullptr;
    size_t upload_elems = 0;
  };
  Mode mode = Mode::kEager;
  std::vector<DecodeGraph> decode_graphs;
  int current_graph = -1;
  cudaStream_t main_stream = nullptr;     // the ops' stream outside captures
  cudaStream_t capture_stream = nullptr;  // non-blocking: captures need no legacy-stream order
  cudaEvent_t capture_fork = nullptr;

  // options.profile (graphs off): an event after every launch; device time per op label and
  // forward shape, summed at each wait for the stream and printed to stderr at exit.
  std::vector<cudaEvent_t> prof_events;
  std::vector<std::string> prof_labels;              // label of the interval ending at event i
  std::vector<std::pair<double, double>> prof_work;  // its flops and bytes (0: not counted)
  size_t prof_used = 0;
  std::string prof_prefix;
  double next_flops = 0, next_bytes = 0;  // the work of the op launched next
  struct ProfTotal {
    double ms = 0;
    int64_t count = 0;
    double flops = 0, bytes = 0;
    std::vector<float> each_ms;  // every launch's interval, for the median
  };
  std::map<std::string, ProfTotal> prof_totals;
  // The arithmetic and memory traffic of the op about to be launched, for the profile's rates.
  void work(double flops, double bytes) {
    next_flops = flops;
    next_bytes = bytes;
  }
  void profile_mark(const char* what);
  void profile_collect();  // after the stream was synchronised

#ifdef RECUR_CUDA_TRACE
  cuda::TraceRing trace;     // device ring (cuda_internal.cuh, grid_dependency_sync)
  std::string trace_graphs;  // each captured decode graph's kernel names, in node order
  void trace_start();
  void trace_write();
#endif

  ~Impl();
  // True while a replayed forward's ops are skipped (the graph does their work).
  bool replaying() const {
    return mode == Mode::kReplaying;
  }
  // Ends a captured or replayed forward: instantiates and launches, or launches, its graph.
  // Every entry point that is not a forward op calls this first.
  void end_forward();
  void copy_to_host_finish_pending();  // completes copy_to_host_start's copy, if any
  bool on_device(const int32_t* p, int64_t count) const;  // begin_forward's device tokens
  // Decides how the forward whose arrays begin_forward packed (upload_elems of them) runs, and
  // uploads them: by a copy on the stream, or inside the decode graph.
  void start_forward(const SeqLayout& l, int n_logits, const void* output, size_t upload_elems,
                     const int32_t* device_tokens);
  // A device pointer holding `host[0..count)`: the mirror when begin_forward uploaded it,
  // otherwise an ad hoc upload.
  const int32_t* ints(const int32_t* host, int64_t count);
  DevLayout layout(const SeqLayout& l, bool with_blocks);
  void* grow(Buffer& b, size_t bytes, const char* what);  // outside forwards only (ad hoc)
  // The device list of the experts' gate, up and down pointers (then extra's, when given),
  // made and uploaded at its first use; no heap allocation after that.
  const void* const* expert_table(std::span<const ExpertWeights> experts,
                                  const ExpertWeights* extra = nullptr);
  // `bytes` of device memory for a weight that lives as long as this backend, 256-byte aligned:
  // carved from a slab, or its own buffer when large.
  Result<void*> weight_memory(size_t bytes);
  // The block sizes of a block-FP8 weight made by adopt_block_fp8_weight or
  // quantize_matmul_weight; fatal for any other F8_E4M3 tensor.
  Fp8Blocks fp8_blocks_of(const Tensor& w) const;
  // Whether every weight of these experts converts to f16 without leaving its range (none lies
  // in `beyond_f16`).
  bool experts_fit_f16(std::span<const ExpertWeights> experts) const;
  // Whether any of these contiguous BF16 tensors holds a value beyond f16's range (infinities
  // too): one device pass each into range_flag, one wait (load time only).
  bool any_beyond_f16(std::span<const Tensor* const> tensors);
  void launched(const char* what);  // checks the launch (and synchronises when debugging)

 private:
  const Mirrored* mirrored_entry(const int32_t* host, int64_t count) const;  // or null
  const int32_t* find_mirrored(const int32_t* host, int64_t count) const;
};

namespace cuda {

// argmax_rows splits rows of up to this many (the rows of a step's logits) over blocks.
constexpr int64_t kArgmaxRows = 1024;
constexpr int kArgmaxMaxSlices = 64;

// Element types as stored; the device reads them with these loads.
template <typename W>
__device__ __forceinline__ float to_f32(W v);
template <>
__device__ __forceinline__ float to_f32<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <>
__device__ __forceinline__ float to_f32<__half>(__half v) {
  return __half2float(v);
}

__host__ __device__ __forceinline__ int64_t min64(int64_t a, int64_t b) {
  return a < b ? a : b;
}

__device__ __forceinline__ float silu(float x) {
  return x / (1.0f + expf(-x));
}
__device__ __forceinline__ float sigmoid(float x) {
  return 1.0f / (1.0f + expf(-x));
}
__device__ __forceinline__ float softplus(float x) {
  return x > 20.0f ? x : log1pf(expf(x));
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
// 16 bytes global → shared, asynchronously (cp.async): the first `bytes` (0 to 16) of src, the
// rest zeros (nothing is read at 0). Copies are committed in groups; copy_wait<N> returns once
// at most N of this thread's groups are still in flight.
__device__ __forceinline__ void copy16_async_bytes(void* dst, const void* src, int bytes) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(bytes));
}
// All 16 bytes, or zeros when !valid.
__device__ __forceinline__ void copy16_async(void* dst, const void* src, bool valid) {
  copy16_async_bytes(dst, src, valid ? 16 : 0);
}
// As copy16_async, asking L2 to fetch the 256 bytes around src from memory at once: for rows
// read 16 bytes a thread and a few dozen bytes a stage, whose later stages then hit L2.
__device__ __forceinline__ void copy16_async_l2_256(void* dst, const void* src, bool valid) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src),
               "r"(valid ? 16 : 0));
}
// 4 bytes global → shared, as copy16_async (for rows of any alignment).
__device__ __forceinline__ void copy4_async(void* dst, const void* src, bool valid) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(d), "l"(src),
               "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void copy_commit() {
  asm volatile("cp.async.commit_group;\n");
}
template <int kPending>
__device__ __forceinline__ void copy_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sequence of token t: the last s with seq_start[s] <= t (binary search; n_seqs is small).
__device__ __forceinline__ int seq_of_token(const int32_t* seq_start, int n_seqs, int t) {
  int lo = 0, hi = n_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (seq_start[mid] <= t)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// Rows of an f32 tensor [..., d] with a contiguous last dimension: 2-D or 3-D, any outer
// strides (the device twin of cpu::RowView).
struct Rows {
  float* base;
  int64_t n_rows, d, inner, s0, s1;
  __device__ __forceinline__ float* row(int64_t r) const {
    return base + (r / inner) * s0 + (r % inner) * s1;
  }
};
Rows rows_of(const Tensor& t);

// Calls fn(W{}) with W the device type of a weight dtype.
template <typename Fn>
void dispatch_weight(DType dt, Fn&& fn) {
  switch (dt) {
    case DType::F32:
      fn(float{});
      break;
    case DType::BF16:
      fn(__nv_bfloat16{});
      break;
    case DType::F16:
      fn(__half{});
      break;
    default:
      fatal("weight dtype must be F32, BF16 or F16");
  }
}

// The wait half of grid_dependency_sync (below): until the kernel before has completed and
// its writes are visible.
__device__ __forceinline__ void grid_dependency_wait() {
#ifdef RECUR_CUDA_TRACE
  const bool stamp =
      (blockIdx.x | blockIdx.y | blockIdx.z | threadIdx.x | threadIdx.y | threadIdx.z) == 0 &&
      g_trace_ring.stamps;
  unsigned slot = 0;
  unsigned long long reached = 0;
  if (stamp) {
    reached = global_ns();
    slot = atomicAdd(g_trace_ring.next, 1u) % kTraceSlots;
  }
#endif
  asm volatile("griddepcontrol.wait;" ::: "memory");
#ifdef RECUR_CUDA_TRACE
  if (stamp) {
    unsigned long long* r = g_trace_ring.stamps + 4 * size_t(slot);
    r[0] = reached;
    r[1] = global_ns();
    r[2] = gridDim.x | (static_cast<unsigned long long>(gridDim.y) << 20) |
           (static_cast<unsigned long long>(gridDim.z) << 40);
    r[3] = blockDim.x * blockDim.y * blockDim.z;
  }
#endif
}

// The other half: lets the next kernel be scheduled. A kernel may call it later than its
// wait, after publishing (stores, then a fence, then a block barrier) what the next kernel
// reads before its own wait.
__device__ __forceinline__ void allow_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// Programmatic dependent launch (PDL): every forward kernel is launched with programmatic
// stream serialisation, so its blocks may be scheduled while the kernel before it in the
// stream still runs, hiding the launch latency between the small kernels of a decode step.
// Each such kernel calls grid_dependency_sync(): it waits until the previous kernel has
// completed and its writes are visible, then lets the next kernel be scheduled. Before that
// call a kernel may only read what the kernel before cannot write: weights, the batch mirror
// and ad hoc uploads (copies are never overlapped), state and cache entries written by earlier
// forwards and not by this one; and what kernels two or more back wrote, where the kernel
// directly before waits in every block before exiting (so they had completed when this one
// could launch); those go through L2 (__ldcg). Also what the kernel directly before published
// before its allow_dependents, in a kernel that calls the halves apart.
__device__ __forceinline__ void grid_dependency_sync() {
  grid_dependency_wait();
  allow_dependents();
}

// kernel<<<grid, block, smem, stream>>>(args...) with PDL allowed (see grid_dependency_sync),
// in clusters of cluster_x blocks along x when that is above 1 (grid.x a multiple of it).
template <typename... KArgs, typename... Args>
void launch_kernel_clusters(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem,
                            cudaStream_t stream, unsigned cluster_x, Args&&... args) {
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  unsigned n_attrs = 1;
  if (cluster_x > 1) {
    attr[n_attrs].id = cudaLaunchAttributeClusterDimension;
    attr[n_attrs].val.clusterDim.x = cluster_x;
    attr[n_attrs].val.clusterDim.y = 1;
    attr[n_attrs].val.clusterDim.z = 1;
    ++n_attrs;
  }
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = n_attrs;
  const cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
  if (e != cudaSuccess) cuda_failed("cudaLaunchKernelEx", e, __FILE__, __LINE__);
}

template <typename... KArgs, typename... Args>
void launch_kernel(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem,
                   cudaStream_t stream, Args&&... args) {
  launch_kernel_clusters(kernel, grid, block, smem, stream, 1u, std::forward<Args>(args)...);
}

// The device the calling thread drives (an index into per-device records).
constexpr int kMaxDevices = 64;
inline int current_device() {
  int dev = 0;
  RECUR_CUDA_CHECK(cudaGetDevice(&dev));
  RECUR_CHECK(dev >= 0 && dev < kMaxDevices);
  return dev;
}

// cudaFuncSetAttribute's settings belong to the current device (each has its own context), so a
// kernel opted in on one GPU is not on another (--device cuda:N, tensor-parallel ranks): these
// keep a record per kernel and device. opt_in_smem raises kKernel's limit of dynamic shared
// memory on the current device to smem bytes when that is more than it has been allowed there
// (48 KB without asking; a kernel whose static arrays take it past that with a ring of exactly
// 48 KB must ask for one byte more).
template <auto kKernel>
void opt_in_smem(size_t smem) {
  static std::atomic<size_t> opted_in[kMaxDevices];
  std::atomic<size_t>& o = opted_in[current_device()];
  if (smem > std::max<size_t>(o.load(std::memory_order_relaxed), 48 << 10)) {
    RECUR_CUDA_CHECK(
        cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    o.store(smem, std::memory_order_relaxed);
  }
}
// Lets kKernel launch in clusters beyond the portable 8 blocks on the current device.
template <auto kKernel>
void allow_nonportable_clusters() {
  static std::atomic<bool> allowed[kMaxDevices];
  std::atomic<bool>& a = allowed[current_device()];
  if (!a.load(std::memory_order_relaxed)) {
    RECUR_CUDA_CHECK(
        cudaFuncSetAttribute(kKernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    a.store(true, std::memory_order_relaxed);
  }
}

inline unsigned blocks_for(int64_t n, int threads) {
  return unsigned((n + threads - 1) / threads);
}

}  // namespace cuda
}  // namespace recur
