// CudaOps set-up and memory traffic: the allocator, weight slabs, host copies, the per-forward
// upload of the batch's index arrays, the start-up scratch, and CUDA graphs for decode
// forwards. Kernels live in kernels_*.cu.
#include <cxxabi.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "backend/cuda/cuda_internal.cuh"

namespace recur {

namespace cuda {

void cuda_failed(const char* expr, cudaError_t err, const char* file, int line) {
  std::fprintf(stderr, "recur: CUDA error %s (%s) in %s at %s:%d\n", cudaGetErrorName(err),
               cudaGetErrorString(err), expr, file, line);
  std::abort();
}

void cublas_failed(const char* expr, cublasStatus_t st, const char* file, int line) {
  std::fprintf(stderr, "recur: cuBLAS error %d (%s) in %s at %s:%d\n", int(st),
               cublasGetStatusString(st), expr, file, line);
  std::abort();
}

void fatal(const char* what) {
  std::fprintf(stderr, "recur: CUDA backend: %s\n", what);
  std::abort();
}

namespace {
// On only when the variable is set to 1.
bool env_one(const char* name) {
  const char* v = std::getenv(name);
  return v && v[0] == '1';
}
std::string env_string(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}
// The sm_90a code runs on a Hopper (9.0) unless the options ask for the portable paths.
bool sm90a_paths(const cudaDeviceProp& prop, const CudaOptions& options) {
  return prop.major == 9 && prop.minor == 0 && !options.portable;
}
}  // namespace

CudaOptions CudaOptions::from_environment() {
  CudaOptions o;
  o.sync = env_one("RECUR_CUDA_SYNC");
  o.profile = env_one("RECUR_CUDA_PROFILE");
  o.trace_out = env_string("RECUR_CUDA_TRACE_OUT");
  o.portable = env_one("RECUR_CUDA_PORTABLE");
  return o;
}

Rows rows_of(const Tensor& t) {
  RECUR_CHECK(t.dtype == DType::F32 && t.ndim >= 2 && t.ndim <= 3 && t.stride[t.ndim - 1] == 1);
  Rows r;
  r.base = t.ptr<float>();
  r.d = t.shape[t.ndim - 1];
  if (t.ndim == 2) {
    r.n_rows = t.shape[0];
    r.inner = 1;
    r.s0 = t.stride[0];
    r.s1 = 0;
  } else {
    r.n_rows = t.shape[0] * t.shape[1];
    r.inner = std::max<int64_t>(t.shape[1], 1);
    r.s0 = t.stride[0];
    r.s1 = t.stride[1];
  }
  return r;
}

#ifdef RECUR_CUDA_TRACE
static std::vector<void (*)(const TraceRing&)>& trace_setters() {
  static std::vector<void (*)(const TraceRing&)> setters;
  return setters;
}
void register_trace_setter(void (*set)(const TraceRing&)) {
  trace_setters().push_back(set);
}
#endif

}  // namespace cuda

#ifdef RECUR_CUDA_TRACE
void CudaOps::Impl::trace_start() {
  RECUR_CUDA_CHECK(cudaMalloc(&trace.stamps, size_t(cuda::kTraceSlots) * 4 * 8));
  RECUR_CUDA_CHECK(cudaMalloc(&trace.next, sizeof(unsigned)));
  RECUR_CUDA_CHECK(cudaMemset(trace.next, 0, sizeof(unsigned)));
  for (auto set : cuda::trace_setters()) set(trace);
  RECUR_CUDA_CHECK(cudaDeviceSynchronize());
}

// Text: "graph" blocks of kernel names, then "stamps N" and N lines "reached left grid
// threads" (ns; grid x,y,z).
void CudaOps::Impl::trace_write() {
  const char* path = options.trace_out.c_str();
  if (options.trace_out.empty() || !trace.stamps) return;
  unsigned next = 0;
  RECUR_CUDA_CHECK(cudaMemcpy(&next, trace.next, sizeof next, cudaMemcpyDeviceToHost));
  const unsigned n = std::min(next, cuda::kTraceSlots);
  std::vector<unsigned long long> st(size_t(cuda::kTraceSlots) * 4);
  RECUR_CUDA_CHECK(cudaMemcpy(st.data(), trace.stamps, st.size() * 8, cudaMemcpyDeviceToHost));
  FILE* f = std::fopen(path, "w");
  if (!f) return;
  std::fputs(trace_graphs.c_str(), f);
  std::fprintf(f, "stamps %u\n", n);
  for (unsigned i = next - n; i < next; ++i) {
    const unsigned k = i % cuda::kTraceSlots;
    const unsigned long long* r = st.data() + 4 * size_t(k);
    std::fprintf(f, "%llu %llu %llu,%llu,%llu %llu\n", r[0], r[1], r[2] & 0xfffff,
                 (r[2] >> 20) & 0xfffff, r[2] >> 40, r[3]);
  }
  std::fclose(f);
}
#endif

namespace {
constexpr size_t kSlabBytes = size_t(512) << 20;  // weight slab; larger weights get their own
constexpr size_t kWeightAlign = 256;
constexpr size_t kCublasWorkspace = size_t(32) << 20;
constexpr size_t kInitialMirror = 64 << 10;       // int32 elements; reserve() sizes it exactly
constexpr size_t kLowpBytes = size_t(256) << 20;  // matmul: split activations
constexpr size_t kAttnPartialBytes = size_t(32) << 20;  // attention's context-split partials
constexpr size_t kGdnChunkBytes = size_t(128) << 20;    // delta rule's chunk records
constexpr size_t kMaxDecodeGraphs = 512;
// Int32 elements the mirror needs for a forward's parts, each rounded to 16 bytes.
size_t mirror_elems(int64_t tokens, int64_t seqs, int64_t blocks, int64_t logit_rows) {
  auto r4 = [](int64_t n) { return size_t(n + 3) / 4 * 4; };
  return 2 * r4(tokens) + 2 * r4(seqs + 1) + r4(seqs) + r4(blocks) + r4(logit_rows);
}
}  // namespace

void* CudaAllocator::raw_allocate(size_t bytes) {
  // On this allocator's device whichever device the calling thread is bound to (a
  // tensor-parallel model allocates every rank's buffers from one thread).
  int current = device;
  RECUR_CUDA_CHECK(cudaGetDevice(&current));
  if (current != device) RECUR_CUDA_CHECK(cudaSetDevice(device));
  void* p = nullptr;
  // A failed cudaMalloc is reported to the caller as an allocation failure (nullptr).
  if (cudaMalloc(&p, bytes) != cudaSuccess) {
    (void)cudaGetLastError();
    p = nullptr;
  }
  if (current != device) RECUR_CUDA_CHECK(cudaSetDevice(current));
  return p;
}

void CudaAllocator::raw_free(void* p, size_t) {
  // Buffers held by static objects may be freed after the runtime has shut down at exit.
  const cudaError_t e = cudaFree(p);
  if (e != cudaSuccess && e != cudaErrorCudartUnloading) {
    cuda::cuda_failed("cudaFree(p)", e, __FILE__, __LINE__);
  }
}

CudaOps::CudaOps() : impl_(std::make_unique<Impl>()) {}
CudaOps::~CudaOps() = default;

CudaOps::Impl::~Impl() {
  // The last owner may be a thread bound to another rank's device: bound to ours meanwhile.
  int caller_device = device;
  cudaGetDevice(&caller_device);
  cudaSetDevice(device);
  if (mode == Mode::kCapturing) {  // a forward begun and never waited for: drop its capture
    cudaGraph_t g = nullptr;
    if (cudaStreamEndCapture(capture_stream, &g) == cudaSuccess && g) cudaGraphDestroy(g);
    stream = main_stream;
  }
  if (stream) cudaStreamSynchronize(stream);
#ifdef RECUR_CUDA_TRACE
  trace_write();
#endif
  if (options.profile) {
    profile_collect();
    // By the median launch: a first call's set-up (cuBLAS choosing its kernels, say) and the
    // idle time before an op, both in its total, do not decide the order or the rates.
    struct Row {
      double median_ms;
      const std::string* label;
      const ProfTotal* v;
    };
    std::vector<Row> rows;
    for (auto& [label, v] : prof_totals) {
      std::vector<float>& e = v.each_ms;
      std::nth_element(e.begin(), e.begin() + e.size() / 2, e.end());
      rows.push_back({double(e[e.size() / 2]), &label, &v});
    }
    std::sort(rows.begin(), rows.end(), [](const Row& x, const Row& y) {
      return x.median_ms * double(x.v->count) > y.median_ms * double(y.v->count);
    });
    std::fprintf(stderr, "%-56s %12s %10s %12s %9s %9s   (rates at the median launch)\n",
                 "op (forward shape)", "total ms", "count", "median us", "TFLOP/s", "GB/s");
    for (const auto& [median_ms, label, vp] : rows) {
      const ProfTotal& v = *vp;
      const double n = double(v.count), s = std::max(median_ms, 1e-9) * 1e-3;
      std::fprintf(stderr, "%-56s %12.3f %10lld %12.2f", label->c_str(), v.ms,
                   static_cast<long long>(v.count), 1e3 * median_ms);
      if (v.flops > 0 || v.bytes > 0) {
        std::fprintf(stderr, " %9.2f %9.1f", v.flops / n / s * 1e-12, v.bytes / n / s * 1e-9);
      }
      std::fprintf(stderr, "\n");
    }
  }
  for (cudaEvent_t e : prof_events) cudaEventDestroy(e);
  for (DecodeGraph& g : decode_graphs) {
    if (g.exec) cudaGraphExecDestroy(g.exec);
  }
  if (capture_fork) cudaEventDestroy(capture_fork);
  if (capture_stream) cudaStreamDestroy(capture_stream);
  // Buffers return to `alloc` in their own destructors (members below it).
  if (cublas) cublasDestroy(cublas);
  if (upload_done) cudaEventDestroy(upload_done);
  if (copy_done) cudaEventDestroy(copy_done);
  if (copy_ready) cudaEventDestroy(copy_ready);
  if (copy_stream) {
    cudaStreamSynchronize(copy_stream);  // a started copy may still write copy_pinned
    cudaStreamDestroy(copy_stream);
  }
  if (pinned) cudaFreeHost(pinned);
  if (copy_pinned) cudaFreeHost(copy_pinned);
  if (range_flag) cudaFreeHost(range_flag);
  if (stream) cudaStreamDestroy(stream);
  cudaSetDevice(caller_device);
}

bool CudaOps::takes_sm90a_paths(int device) {
  cudaDeviceProp prop;
  return cudaGetDeviceProperties(&prop, device) == cudaSuccess &&
         cuda::sm90a_paths(prop, cuda::CudaOptions::from_environment());
}

Result<std::unique_ptr<CudaOps>> CudaOps::create(int device, const BackendOptions& options) {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    return make_error(ErrorCode::kUnsupported, "no CUDA device: {}",
                      e != cudaSuccess ? cudaGetErrorString(e) : "none found");
  }
  if (device < 0 || device >= count) {
    return make_error(ErrorCode::kInvalidArgument, "CUDA device {} does not exist ({} found)",
                      device, count);
  }
  RECUR_CUDA_CHECK(cudaSetDevice(device));
  cudaDeviceProp prop;
  RECUR_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  if (prop.major < 9) {
    return make_error(ErrorCode::kUnsupported,
                      "CUDA device {} ({}) has compute capability {}.{}; "
                      "this build needs 9.0",
                      device, prop.name, prop.major, prop.minor);
  }
  std::unique_ptr<CudaOps> ops(new CudaOps());
  Impl& s = *ops->impl_;
  s.device = device;
  s.alloc.device = device;
  s.sm_count = prop.multiProcessorCount;
  s.max_smem_optin = prop.sharedMemPerBlockOptin;
  s.options = cuda::CudaOptions::from_environment();
  s.sm90a = cuda::sm90a_paths(prop, s.options);
  s.e4m3_activations = s.sm90a && options.fp8_activations == Fp8Activations::kE4m3;
  s.one_term_prompts = s.sm90a && options.prompt_activations == PromptActivations::kF16;
  // A blocking stream: it also orders against work callers put on the legacy default stream
  // (plain cudaMemcpy/cudaMemset of buffers they then hand to the ops).
  RECUR_CUDA_CHECK(cudaStreamCreate(&s.stream));
  s.main_stream = s.stream;
  RECUR_CUDA_CHECK(cudaStreamCreateWithFlags(&s.capture_stream, cudaStreamNonBlocking));
  RECUR_CUDA_CHECK(cudaEventCreateWithFlags(&s.capture_fork, cudaEventDisableTiming));
  RECUR_CUDA_CHECK(cudaEventCreateWithFlags(&s.upload_done, cudaEventDisableTiming));
  RECUR_CUDA_CHECK(cudaEventCreateWithFlags(&s.copy_done, cudaEventDisableTiming));
  RECUR_CUDA_CHECK(cudaEventCreateWithFlags(&s.copy_ready, cudaEventDisableTiming));
  RECUR_CUDA_CHECK(cudaStreamCreateWithFlags(&s.copy_stream, cudaStreamNonBlocking));
  RECUR_CUBLAS_CHECK(cublasCreate(&s.cublas));
  RECUR_CUBLAS_CHECK(cublasSetStream(s.cublas, s.stream));
  // cuBLAS gets a fixed workspace so it never allocates during a forward.
  RECUR_ASSIGN_OR_RETURN(s.cublas_workspace,
                         s.alloc.allocate(kCublasWorkspace, "cuBLAS workspace"));
  RECUR_CUBLAS_CHECK(
      cublasSetWorkspace(s.cublas, s.cublas_workspace.data(), s.cublas_workspace.bytes()));
  // Pinned staging and its device mirror for the batch arrays.
  s.pinned_capacity = kInitialMirror;
  RECUR_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&s.pinned),
                                 s.pinned_capacity * sizeof(int32_t), cudaHostAllocDefault));
  RECUR_ASSIGN_OR_RETURN(s.mirror, s.alloc.allocate(s.pinned_capacity * 4, "batch mirror"));
  RECUR_ASSIGN_OR_RETURN(s.adhoc, s.alloc.allocate(kInitialMirror * 4, "ad hoc index upload"));
  RECUR_ASSIGN_OR_RETURN(s.act_lowp, s.alloc.allocate(kLowpBytes, "low-precision activations"));
  RECUR_ASSIGN_OR_RETURN(s.attn_partial, s.alloc.allocate(kAttnPartialBytes, "attention splits"));
  RECUR_ASSIGN_OR_RETURN(s.gdn_chunks, s.alloc.allocate(kGdnChunkBytes, "delta rule chunks"));
  RECUR_ASSIGN_OR_RETURN(s.argmax_scratch, s.alloc.allocate(size_t(cuda::kArgmaxRows) *
                                                                (cuda::kArgmaxMaxSlices * 8 + 4),
                                                            "argmax picks"));
  RECUR_CUDA_CHECK(cudaMemset(s.argmax_scratch.data(), 0, s.argmax_scratch.bytes()));
  RECUR_ASSIGN_OR_RETURN(
      s.expert_table_pool,
      s.alloc.allocate(Impl::kExpertTablePointers * sizeof(void*), "expert tables"));
#ifdef RECUR_CUDA_TRACE
  s.trace_start();
#endif
  return Result<std::unique_ptr<CudaOps>>(std::move(ops));
}

Allocator& CudaOps::allocator() {
  return impl_->alloc;
}

Status CudaOps::reserve(const ForwardLimits& limits) {
  Impl& s = *impl_;
  s.end_forward();
  // A new model: graphs recorded for another one's buffers must not replay.
  for (Impl::DecodeGraph& g : s.decode_graphs) {
    if (g.exec) RECUR_CUDA_CHECK(cudaGraphExecDestroy(g.exec));
  }
  s.decode_graphs.clear();
  s.limits = limits;
  const size_t need =
      mirror_elems(limits.max_tokens, limits.max_seqs, limits.max_blocks, limits.max_logit_rows);
  if (need > s.pinned_capacity) {
    RECUR_CUDA_CHECK(cudaStreamSynchronize(s.stream));
    RECUR_CUDA_CHECK(cudaFreeHost(s.pinned));
    s.pinned = nullptr;
    s.mirror.reset();
    s.pinned_capacity = need;
    RECUR_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&s.pinned),
                                   s.pinned_capacity * sizeof(int32_t), cudaHostAllocDefault));
    RECUR_ASSIGN_OR_RETURN(s.mirror, s.alloc.allocate(s.pinned_capacity * 4, "batch mirror"));
  }
  // copy_to_host_start's staging: a few values per logit row (the greedy ids).
  const size_t copy_need = size_t(std::max(limits.max_logit_rows, limits.max_seqs)) * 8;
  if (copy_need > s.copy_capacity) {
    s.copy_to_host_finish_pending();
    RECUR_CUDA_CHECK(cudaFreeHost(s.copy_pinned));
    s.copy_pinned = nullptr;
    RECUR_CUDA_CHECK(
        cudaHostAlloc(reinterpret_cast<void**>(&s.copy_pinned), copy_need, cudaHostAllocDefault));
    s.copy_capacity = copy_need;
  }
  return Status();
}

Result<Tensor> CudaOps::adopt_weight(const Tensor& host) {
  impl_->end_forward();
  if (host.device == Device::kCuda) return host;
  if (!host.is_contiguous()) {
    return make_error(ErrorCode::kInvalidArgument, "adopt_weight: tensor {} is not contiguous",
                      host.shape_string());
  }
  Impl& s = *impl_;
  const size_t bytes = size_t(host.numel()) * dtype_size(host.dtype);
  RECUR_ASSIGN_OR_RETURN(void* dst, s.weight_memory(bytes));
  // Ordered on our stream, then waited for: the host tensor may be a mapping that goes away.
  RECUR_CUDA_CHECK(cudaMemcpyAsync(dst, host.data, bytes, cudaMemcpyHostToDevice, s.stream));
  RECUR_CUDA_CHECK(cudaStreamSynchronize(s.stream));
  Tensor t = host;
  t.data = dst;
  t.device = Device::kCuda;
  return t;
}

void CudaOps::copy_to_host(const Tensor& src, void* dst) {
  RECUR_CHECK(src.is_contiguous());
  Impl& s = *impl_;
  s.end_forward();
  RECUR_CUDA_CHECK(cudaMemcpyAsync(dst, src.data, size_t(src.numel()) * dtype_size(src.dtype),
                                   cudaMemcpyDeviceToHost, s.stream));
  RECUR_CUDA_CHECK(cudaStreamSynchronize(s.stream));
  s.mirrored.clear();  // the forward is over; its host arrays may now be reused
  if (s.options.profile) s.profile_collect();
}

void CudaOps::copy_to_host_start(const Tensor& src, void* dst) {
  RECUR_CHECK(src.is_contiguous());
  Impl& s = *impl_;
  s.copy_to_host_finish_pending();
  const size_t bytes = size_t(src.numel()) * dtype_size(src.dtype);
  if (bytes > s.copy_capacity) return copy_to_host(src, dst);
  s.end_forward();
  RECUR_CUDA_CHECK(cudaEventRecord(s.copy_ready, s.stream));
  RECUR_CUDA_CHECK(cudaStreamWaitEvent(s.copy_stream, s.copy_ready, 0));
  RECUR_CUDA_CHECK(
      cudaMemcpyAsync(s.copy_pinned, src.data, bytes, cudaMemcpyDeviceToHost, s.copy_stream));
  RECUR_CUDA_CHECK(cudaEventRecord(s.copy_done, s.copy_stream));
  s.copy_dst = dst;
  s.copy_bytes = bytes;
}

void CudaOps::copy_to_host_finish() {
  impl_->copy_to_host_finish_pending();
}

void CudaOps::Impl::copy_to_host_finish_pending() {
  if (!copy_dst) return;
  RECUR_CUDA_CHECK(cudaEventSynchronize(copy_done));
  std::memcpy(copy_dst, copy_pinned, copy_bytes);
  copy_dst = nullptr;
  if (options.profile) profile_collect();
}

void CudaOps::fill_zero(Tensor t) {
  RECUR_CHECK(t.is_contiguous());
  impl_->end_forward();
  RECUR_CUDA_CHECK(
      cudaMemsetAsync(t.data, 0, size_t(t.numel()) * dtype_size(t.dtype), impl_->stream));
}

// In order with the forwards (a snapshot saved after a forward holds the state it left).
void CudaOps::copy(const Tensor& src, Tensor dst) {
  RECUR_CHECK(src.is_contiguous() && dst.is_contiguous() && src.dtype == dst.dtype &&
              src.numel() == dst.numel());
  impl_->end_forward();
  RECUR_CUDA_CHECK(cudaMemcpyAsync(dst.data, src.data, size_t(src.numel()) * dtype_size(src.dtype),
                                   cudaMemcpyDeviceToDevice, impl_->stream));
}

void CudaOps::synchronize() {
  impl_->end_forward();
  RECUR_CUDA_CHECK(cudaStreamSynchronize(impl_->stream));
  impl_->mirrored.clear();
  if (impl_->options.profile) impl_->profile_collect();
}

void CudaOps::begin_forward(const SeqLayout& l, std::span<const int32_t> tokens,
                            std::span<const int32_t> logit_rows, const void* output,
                            const int32_t* device_tokens) {
  Impl& s = *impl_;
  s.end_forward();
  // Only e4m3 activations ask where the decode rows end (Impl::e4m3_first_row).
  s.forward_tokens = l.n_tokens;
  s.forward_decode_rows = 0;
  while (s.e4m3_activations && l.seq_start && s.forward_decode_rows < l.n_seqs &&
         l.seq_start[s.forward_decode_rows + 1] - l.seq_start[s.forward_decode_rows] == 1) {
    ++s.forward_decode_rows;
  }
  const int64_t n_blocks = l.block_start ? l.block_start[l.n_seqs] : 0;
  struct Part {
    const int32_t* p;
    int64_t n;
  };
  // The block tables go last: for a given shape every other part keeps its offset, so a
  // captured decode graph's arguments stay valid as the tables grow.
  const Part parts[] = {{tokens.data(), int64_t(tokens.size())},
                        {l.positions, l.positions ? l.n_tokens : 0},
                        {l.seq_start, l.seq_start ? l.n_seqs + 1 : 0},
                        {l.slot, l.slot ? l.n_seqs : 0},
                        {l.block_start, l.block_start ? l.n_seqs + 1 : 0},
                        {logit_rows.data(), int64_t(logit_rows.size())},
                        {l.block_ids, n_blocks}};
  size_t total = 0;
  for (const Part& p : parts) total += size_t(p.n + 3) / 4 * 4;  // each part 16-byte aligned
  // The previous upload must have left the pinned buffer before it is rewritten (normally
  // done: the previous forward ended with a copy to the host, or its upload was its graph's
  // first node, which records the event; the forward itself may still run).
  RECUR_CUDA_CHECK(cudaEventSynchronize(s.upload_done));
  if (total > s.pinned_capacity) {
    // Beyond the limits given to reserve() (or without them, in tests): grow once more. The
    // graphs captured so far point into the old mirror.
    for (Impl::DecodeGraph& g : s.decode_graphs) {
      if (g.exec) RECUR_CUDA_CHECK(cudaGraphExecDestroy(g.exec));
    }
    s.decode_graphs.clear();
    RECUR_CUDA_CHECK(cudaStreamSynchronize(s.stream));  // the old mirror may still be read
    RECUR_CUDA_CHECK(cudaFreeHost(s.pinned));
    s.pinned = nullptr;
    s.mirror.reset();
    s.pinned_capacity = std::max(total, 2 * s.pinned_capacity);
    RECUR_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&s.pinned),
                                   s.pinned_capacity * sizeof(int32_t), cudaHostAllocDefault));
    auto m = s.alloc.allocate(s.pinned_capacity * 4, "batch mirror");
    if (!m.ok()) cuda::fatal(m.error().message.c_str());
    s.mirror = std::move(m.value());
  }
  s.mirrored.clear();
  int64_t off = 0;
  for (const Part& p : parts) {
    if (p.n == 0 || !p.p) continue;
    std::memcpy(s.pinned + off, p.p, size_t(p.n) * 4);
    s.mirrored.push_back({p.p, p.n, off});
    off += (p.n + 3) / 4 * 4;
  }
  // The tokens are uploaded as well (the offsets stay those of the shape) but not read.
  if (device_tokens) {
    s.mirrored.insert(s.mirrored.begin(), {device_tokens, l.n_tokens, 0, device_tokens});
  }
  s.start_forward(l, int(logit_rows.size()), output, size_t(off), device_tokens);
  if (s.options.profile) {
    const bool decode = l.n_tokens == l.n_seqs;
    s.prof_prefix = (decode ? "decode b=" : "prompt n=") + std::to_string(l.n_tokens) + " ";
    s.profile_mark(nullptr);
  }
}

void CudaOps::Impl::profile_mark(const char* what) {
  if (prof_used == prof_events.size()) {
    cudaEvent_t e;
    RECUR_CUDA_CHECK(cudaEventCreate(&e));
    prof_events.push_back(e);
    prof_labels.emplace_back();
    prof_work.emplace_back();
  }
  prof_labels[prof_used] = what ? prof_prefix + what : std::string();
  prof_work[prof_used] = {next_flops, next_bytes};
  RECUR_CUDA_CHECK(cudaEventRecord(prof_events[prof_used], stream));
  ++prof_used;
}

void CudaOps::Impl::profile_collect() {
  // Callers may not have waited for the stream (a copy started beside queued work).
  if (prof_used > 0) RECUR_CUDA_CHECK(cudaEventSynchronize(prof_events[prof_used - 1]));
  for (size_t i = 1; i < prof_used; ++i) {
    if (prof_labels[i].empty()) continue;  // a new forward's start: nothing ends here
    float ms = 0.0f;
    RECUR_CUDA_CHECK(cudaEventElapsedTime(&ms, prof_events[i - 1], prof_events[i]));
    ProfTotal& v = prof_totals[prof_labels[i]];
    v.ms += ms;
    v.count += 1;
    v.each_ms.push_back(ms);
    v.flops += prof_work[i].first;
    v.bytes += prof_work[i].second;
  }
  prof_used = 0;
}

void CudaOps::Impl::start_forward(const SeqLayout& l, int n_logits, const void* output,
                                  size_t upload_elems, const int32_t* device_tokens) {
  auto upload = [&](cudaStream_t st, size_t elems) {
    if (elems > 0) {
      RECUR_CUDA_CHECK(
          cudaMemcpyAsync(mirror.data(), pinned, elems * 4, cudaMemcpyHostToDevice, st));
    }
  };
  bool decode = options.graphs() && output && limits.max_context > 0 && l.n_tokens > 0 &&
                l.n_tokens == l.n_seqs && l.positions && l.slot && l.block_start &&
                l.block_size > 0;
  // Every sequence brings exactly one token (a shape such as lengths 0 and 2 would make other
  // launch choices on the host).
  for (int i = 0; decode && i < l.n_seqs; ++i) decode = l.seq_start[i + 1] - l.seq_start[i] == 1;
  auto eager = [&] {
    upload(main_stream, upload_elems);
    RECUR_CUDA_CHECK(cudaEventRecord(upload_done, main_stream));
  };
  if (!decode) return eager();
  int found = -1;
  for (size_t i = 0; i < decode_graphs.size(); ++i) {
    const DecodeGraph& g = decode_graphs[i];
    if (g.n_tokens == l.n_tokens && g.n_seqs == l.n_seqs && g.n_logits == n_logits &&
        g.output == output && g.device_tokens == device_tokens) {
      found = int(i);
      break;
    }
  }
  if (found < 0) {
    if (decode_graphs.size() >= kMaxDecodeGraphs) return eager();
    decode_graphs.push_back({l.n_tokens, l.n_seqs, n_logits, output, device_tokens});
    found = int(decode_graphs.size()) - 1;
  }
  DecodeGraph& g = decode_graphs[size_t(found)];
  current_graph = found;
  if (g.upload_elems == 0) {
    // Block tables at the longest context, one block to spare (a caller may hold the next);
    // a longer upload is copied before the graph (below).
    const int64_t per_seq = (int64_t(limits.max_context) + l.block_size - 1) / l.block_size + 1;
    const int64_t blocks = std::min<int64_t>(l.n_seqs * per_seq, limits.max_blocks);
    g.upload_elems =
        std::min(pinned_capacity, mirror_elems(l.n_tokens, l.n_seqs, blocks, n_logits));
  }
  if (!g.exec && g.runs == 0) {  // the shape's first forward runs eagerly: one whole upload
    ++g.runs;
    return eager();
  }
  if (upload_elems > g.upload_elems) {  // beyond the announced context: the rest goes first
    upload(main_stream, upload_elems);
  }
  if (g.exec) {
    // The graph (its upload first, then upload_done) goes to the GPU now; the forward's ops
    // then only return.
    RECUR_CUDA_CHECK(cudaGraphLaunch(g.exec, main_stream));
    mode = Mode::kReplaying;
    return;
  }
  ++g.runs;
  {
    // The capture runs on its own non-blocking stream, ordered after the work before it.
    RECUR_CUDA_CHECK(cudaEventRecord(capture_fork, main_stream));
    RECUR_CUDA_CHECK(cudaStreamWaitEvent(capture_stream, capture_fork, 0));
    RECUR_CUDA_CHECK(cudaStreamBeginCapture(capture_stream, cudaStreamCaptureModeRelaxed));
    stream = capture_stream;
    RECUR_CUBLAS_CHECK(cublasSetStream(cublas, stream));
    // Setting the stream resets cuBLAS to its own workspace pool: give it ours again.
    RECUR_CUBLAS_CHECK(
        cublasSetWorkspace(cublas, cublas_workspace.data(), cublas_workspace.bytes()));
    mode = Mode::kCapturing;
    // The graph's first node: replays read the pinned buffer as begin_forward left it. Then
    // upload_done, so the next forward may rewrite the buffer while this one runs.
    upload(capture_stream, g.upload_elems);
    RECUR_CUDA_CHECK(
        cudaEventRecordWithFlags(upload_done, capture_stream, cudaEventRecordExternal));
  }
}

#ifdef RECUR_CUDA_TRACE
namespace {
// A graph node (null when it is not one of our kernels) with its launch parameters and
// demangled name.
struct GraphKernel {
  cudaGraphNode_t node = nullptr;
  cudaKernelNodeParams params{};
  std::string name;
  bool library = false;  // a kernel of a library's module (cuBLAS): node null, never stamps
};

// Every node of graph in cudaGraphGetNodes' order (capture order, for a captured stream).
std::vector<GraphKernel> graph_kernels(cudaGraph_t graph) {
  size_t n = 0;
  RECUR_CUDA_CHECK(cudaGraphGetNodes(graph, nullptr, &n));
  std::vector<cudaGraphNode_t> nodes(n);
  RECUR_CUDA_CHECK(cudaGraphGetNodes(graph, nodes.data(), &n));
  std::vector<GraphKernel> out(n);
  for (size_t i = 0; i < n; ++i) {
    cudaGraphNodeType type;
    RECUR_CUDA_CHECK(cudaGraphNodeGetType(nodes[i], &type));
    if (type != cudaGraphNodeTypeKernel) continue;
    GraphKernel& k = out[i];
    // The runtime cannot describe a kernel of a module it did not load (cuBLAS's GEMMs in
    // graphs of several tokens).
    const cudaError_t got = cudaGraphKernelNodeGetParams(nodes[i], &k.params);
    if (got == cudaErrorInvalidDeviceFunction) {
      (void)cudaGetLastError();
      k.library = true;
      continue;
    }
    RECUR_CUDA_CHECK(got);
    k.node = nodes[i];
    const char* raw = nullptr;
    if (cudaFuncGetName(&raw, k.params.func) != cudaSuccess || !raw) raw = "?";
    int status = 0;
    char* dem = abi::__cxa_demangle(raw, nullptr, nullptr, &status);
    k.name = status == 0 && dem ? dem : raw;
    std::free(dem);
  }
  return out;
}
}  // namespace
#endif

void CudaOps::Impl::end_forward() {
  if (mode == Mode::kEager) return;
  if (mode == Mode::kReplaying) {  // launched by start_forward
    mode = Mode::kEager;
    current_graph = -1;
    return;
  }
  // Capturing: the graph is made and then runs this forward.
  DecodeGraph& g = decode_graphs[size_t(current_graph)];
  cudaGraph_t graph = nullptr;
  RECUR_CUDA_CHECK(cudaStreamEndCapture(capture_stream, &graph));
  stream = main_stream;
  RECUR_CUBLAS_CHECK(cublasSetStream(cublas, stream));
  RECUR_CUBLAS_CHECK(cublasSetWorkspace(cublas, cublas_workspace.data(), cublas_workspace.bytes()));
  RECUR_CUDA_CHECK(cudaGraphInstantiate(&g.exec, graph, 0));
#ifdef RECUR_CUDA_TRACE
  trace_graphs += "graph " + std::to_string(g.n_tokens) + "\n";
  for (const GraphKernel& k : graph_kernels(graph)) {
    if (!k.node) {
      trace_graphs += k.library ? "node (library kernel)\n" : "node (not a kernel)\n";
      continue;
    }
    const dim3 gd = k.params.gridDim, bd = k.params.blockDim;
    trace_graphs += "node " + k.name.substr(0, 100) + " grid " + std::to_string(gd.x) + "," +
                    std::to_string(gd.y) + "," + std::to_string(gd.z) + " threads " +
                    std::to_string(bd.x * bd.y * bd.z) + "\n";
  }
#endif
  RECUR_CUDA_CHECK(cudaGraphDestroy(graph));
  mode = Mode::kEager;
  current_graph = -1;
  RECUR_CUDA_CHECK(cudaGraphLaunch(g.exec, main_stream));
}

const CudaOps::Impl::Mirrored* CudaOps::Impl::mirrored_entry(const int32_t* host,
                                                             int64_t count) const {
  for (const Mirrored& m : mirrored) {
    if (host >= m.host && host + count <= m.host + m.count) return &m;
  }
  return nullptr;
}

const int32_t* CudaOps::Impl::find_mirrored(const int32_t* host, int64_t count) const {
  const Mirrored* m = mirrored_entry(host, count);
  if (!m) return nullptr;
  if (m->device) return m->device + (host - m->host);
  return mirror.as<int32_t>() + m->offset + (host - m->host);
}

bool CudaOps::Impl::on_device(const int32_t* p, int64_t count) const {
  const Mirrored* m = mirrored_entry(p, count);
  return m && m->device;
}

const int32_t* CudaOps::Impl::ints(const int32_t* host, int64_t count) {
  if (count <= 0) return nullptr;
  if (const int32_t* d = find_mirrored(host, count)) return d;
  // Ad hoc: the buffer is reused by the next op's upload, which the stream orders after this
  // op's kernels.
  void* dst = grow(adhoc, size_t(count) * 4, "ad hoc index upload");
  RECUR_CUDA_CHECK(cudaMemcpyAsync(dst, host, size_t(count) * 4, cudaMemcpyHostToDevice, stream));
  return static_cast<const int32_t*>(dst);
}

DevLayout CudaOps::Impl::layout(const SeqLayout& l, bool with_blocks) {
  const int64_t n_blocks = with_blocks ? l.block_start[l.n_seqs] : 0;
  struct Part {
    const int32_t* host;
    int64_t n;
    const int32_t** out;
  };
  DevLayout d;
  Part parts[] = {{l.seq_start, l.n_seqs + 1, &d.seq_start},
                  {l.slot, l.slot ? l.n_seqs : 0, &d.slot},
                  {l.positions, l.positions ? l.n_tokens : 0, &d.positions},
                  {l.block_start, with_blocks ? l.n_seqs + 1 : 0, &d.block_start},
                  {l.block_ids, n_blocks, &d.block_ids}};
  // Mirrored parts resolve directly; the others are packed into one ad hoc upload.
  adhoc_host.clear();
  std::vector<std::pair<const int32_t**, size_t>> pending;
  for (Part& p : parts) {
    if (p.n <= 0 || !p.host) continue;
    if (const int32_t* m = find_mirrored(p.host, p.n)) {
      *p.out = m;
    } else {
      pending.push_back({p.out, adhoc_host.size()});
      adhoc_host.insert(adhoc_host.end(), p.host, p.host + p.n);
    }
  }
  if (!pending.empty()) {
    int32_t* dst = static_cast<int32_t*>(grow(adhoc, adhoc_host.size() * 4, "ad hoc layout"));
    RECUR_CUDA_CHECK(cudaMemcpyAsync(dst, adhoc_host.data(), adhoc_host.size() * 4,
                                     cudaMemcpyHostToDevice, stream));
    for (auto& [out, off] : pending) *out = dst + off;
  }
  return d;
}

void* CudaOps::Impl::grow(Buffer& b, size_t bytes, const char* what) {
  if (b.bytes() < bytes) {
    // Kernels already queued may still read the old buffer.
    RECUR_CUDA_CHECK(cudaStreamSynchronize(stream));
    const size_t want = std::max(bytes, b.bytes() * 2);
    b.reset();
    auto r = alloc.allocate(want, what);
    if (!r.ok()) cuda::fatal(r.error().message.c_str());
    b = std::move(r.value());
  }
  return b.data();
}

Result<void*> CudaOps::Impl::weight_memory(size_t bytes) {
  if (bytes > kSlabBytes / 4) {
    RECUR_ASSIGN_OR_RETURN(Buffer b, alloc.allocate(bytes, "weight"));
    void* dst = b.data();
    weight_buffers.push_back(std::move(b));
    return dst;
  }
  const size_t off = (slab_used + kWeightAlign - 1) / kWeightAlign * kWeightAlign;
  if (slabs.empty() || off + bytes > slabs.back().bytes()) {
    RECUR_ASSIGN_OR_RETURN(Buffer b, alloc.allocate(kSlabBytes, "weight slab"));
    slabs.push_back(std::move(b));
    slab_used = 0;
  }
  const size_t at = (slab_used + kWeightAlign - 1) / kWeightAlign * kWeightAlign;
  slab_used = at + bytes;
  return static_cast<char*>(slabs.back().data()) + at;
}

void CudaOps::Impl::launched(const char* what) {
  cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess && options.sync && mode == Mode::kEager) e = cudaStreamSynchronize(stream);
  if (e != cudaSuccess) cuda::cuda_failed(what, e, __FILE__, __LINE__);
  if (options.profile && mode == Mode::kEager && prof_used > 0) profile_mark(what);
  next_flops = next_bytes = 0;
}

}  // namespace recur
