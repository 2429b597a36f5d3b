// The CUDA backend's side of tensor parallelism: binding a thread to a backend's device, and
// the group of a model's GPU ranks. Ranks on distinct devices talk through NCCL
// (nccl_comm.h). Ranks that share one device (a model split for testing on a machine with one
// GPU) talk through that device's memory here: each collective publishes the ranks' tensors,
// meets at a host barrier, has every rank's stream wait for the others' work so far (events),
// lets each rank reduce its share of the elements in every rank's copy, and meets again so no
// stream goes on before every share is written. Nothing is allocated per collective.
#include <barrier>
#include <vector>

#include "backend/cuda/cuda_internal.cuh"
#include "backend/cuda/cuda_ops.h"
#if defined(RECUR_HAVE_NCCL)
#include "backend/cuda/nccl_comm.h"
#endif

namespace recur {

void CudaOps::bind_thread() {
  RECUR_CUDA_CHECK(cudaSetDevice(impl_->device));
}

void* CudaOps::current_stream() const {
  return impl_->stream;
}

void CudaOps::release_graphs() {
  Impl& s = *impl_;
  s.end_forward();
  RECUR_CUDA_CHECK(cudaStreamSynchronize(s.main_stream));
  for (Impl::DecodeGraph& g : s.decode_graphs) {
    if (g.exec) RECUR_CUDA_CHECK(cudaGraphExecDestroy(g.exec));
  }
  s.decode_graphs.clear();
}

namespace {

constexpr int kMaxSameDeviceRanks = 8;

struct RankCopies {
  float* x[kMaxSameDeviceRanks];  // every rank's copy of the collective's tensor
};

// Elements [begin, end) of a [rows, cols] tensor whose rows lie `stride` floats apart (alike
// in every rank's copy): each the sum over the ranks in rank order, written to every copy.
__global__ void sum_rank_copies_kernel(RankCopies t, int world, int64_t cols, int64_t stride,
                                       int64_t begin, int64_t end) {
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = begin + int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < end; i += step) {
    const int64_t at = (i / cols) * stride + i % cols;
    float s = t.x[0][at];
    for (int k = 1; k < world; ++k) s += t.x[k][at];
    for (int k = 0; k < world; ++k) t.x[k][at] = s;
  }
}

class SameDeviceGroup final : public CommGroup {
 public:
  // host_ordered[r]: rank r's switch that keeps its decode off graphs, set while this group
  // lives (the backends may outlive it: rank 0's is the caller's).
  SameDeviceGroup(std::vector<CudaOps*> ops, std::vector<bool*> host_ordered)
      : ops_(std::move(ops)),
        host_ordered_(std::move(host_ordered)),
        published_(ops_.size()),
        ready_(ops_.size()),
        done_(ops_.size()),
        barrier_(std::ptrdiff_t(ops_.size())) {
    for (size_t r = 0; r < ops_.size(); ++r) {
      RECUR_CUDA_CHECK(cudaEventCreateWithFlags(&ready_[r], cudaEventDisableTiming));
      RECUR_CUDA_CHECK(cudaEventCreateWithFlags(&done_[r], cudaEventDisableTiming));
      ranks_.push_back(std::make_unique<Rank>(*this, int(r)));
      *host_ordered_[r] = true;
    }
  }
  ~SameDeviceGroup() override {
    for (bool* b : host_ordered_) *b = false;
    for (size_t r = 0; r < ops_.size(); ++r)
      cudaEventDestroy(ready_[r]), cudaEventDestroy(done_[r]);
  }
  int world() const override { return int(ops_.size()); }
  Communicator& rank(int r) override { return *ranks_[size_t(r)]; }

 private:
  class Rank final : public Communicator {
   public:
    Rank(SameDeviceGroup& g, int rank) : g_(g), rank_(rank) {}
    int rank() const override { return rank_; }
    int world() const override { return g_.world(); }

    void all_reduce_sum(Tensor x) override {
      RECUR_CHECK(x.dtype == DType::F32 && x.ndim >= 1);
      const int world = g_.world();
      const int64_t rows = x.ndim == 1 ? 1 : x.rows();
      const int64_t cols = x.ndim == 1 ? x.numel() : x.row_size();
      const int64_t stride = x.ndim == 1 ? cols : x.row_stride();
      const cudaStream_t s = meet(x, {});
      RankCopies t{};
      for (int k = 0; k < world; ++k) {
        const Tensor& o = g_.published_[size_t(k)].a;
        RECUR_CHECK(o.numel() == x.numel() && (o.ndim == 1 ? 1 : o.rows()) == rows &&
                    (o.ndim == 1 ? cols : o.row_stride()) == stride);
        t.x[k] = o.ptr<float>();
      }
      const int64_t total = rows * cols;
      const int64_t begin = total * rank_ / world, end = total * (rank_ + 1) / world;
      if (end > begin) {
        const int threads = 256;
        const int blocks = int(std::min<int64_t>((end - begin + threads - 1) / threads, 1024));
        sum_rank_copies_kernel<<<blocks, threads, 0, s>>>(t, world, cols, stride, begin, end);
        RECUR_CUDA_CHECK(cudaGetLastError());
      }
      part_done(s);
    }

    void all_gather_cols(const Tensor& part, Tensor out) override {
      RECUR_CHECK(part.dtype == DType::F32 && out.dtype == DType::F32 && part.ndim == 2 &&
                  out.ndim == 2);
      const int world = g_.world();
      const int64_t rows = part.rows(), c = part.shape[1];
      RECUR_CHECK(out.rows() == rows && out.shape[1] == c * world);
      const cudaStream_t s = meet(part, out);
      for (int k = 0; k < world; ++k) {
        const Tensor& p = g_.published_[size_t(k)].a;
        RECUR_CHECK(p.rows() == rows && p.shape[1] == c);
        if (rows == 0) continue;
        RECUR_CUDA_CHECK(cudaMemcpy2DAsync(
            out.ptr<float>() + k * c, size_t(out.row_stride()) * sizeof(float), p.ptr<float>(),
            size_t(p.row_stride()) * sizeof(float), size_t(c) * sizeof(float), size_t(rows),
            cudaMemcpyDeviceToDevice, s));
      }
      part_done(s);
    }

   private:
    // Publishes this rank's operands once its stream has made them, and returns its stream
    // made to wait for every rank's work before the collective.
    cudaStream_t meet(const Tensor& a, const Tensor& b) {
      const auto s = static_cast<cudaStream_t>(g_.ops_[size_t(rank_)]->current_stream());
      g_.published_[size_t(rank_)] = {a, b};
      RECUR_CUDA_CHECK(cudaEventRecord(g_.ready_[size_t(rank_)], s));
      g_.barrier_.arrive_and_wait();  // every rank's event recorded and operands published
      for (int k = 0; k < g_.world(); ++k) {
        if (k != rank_) RECUR_CUDA_CHECK(cudaStreamWaitEvent(s, g_.ready_[size_t(k)], 0));
      }
      return s;
    }
    // After this rank's share: no stream goes on (to overwrite its tensors) until every share
    // is done. A rank records an event again only after the next barrier, which every rank
    // reaches after queueing its waits on the last recording.
    void part_done(cudaStream_t s) {
      RECUR_CUDA_CHECK(cudaEventRecord(g_.done_[size_t(rank_)], s));
      g_.barrier_.arrive_and_wait();
      for (int k = 0; k < g_.world(); ++k) {
        if (k != rank_) RECUR_CUDA_CHECK(cudaStreamWaitEvent(s, g_.done_[size_t(k)], 0));
      }
    }

    SameDeviceGroup& g_;
    int rank_;
  };

  struct Published {
    Tensor a, b;  // the collective's operands on this rank
  };
  std::vector<CudaOps*> ops_;              // [world]
  std::vector<bool*> host_ordered_;        // [world]
  std::vector<Published> published_;       // [world]
  std::vector<cudaEvent_t> ready_, done_;  // [world]
  std::barrier<> barrier_;
  std::vector<std::unique_ptr<Rank>> ranks_;
};

}  // namespace

Result<std::unique_ptr<CommGroup>> CudaOps::create_group(std::span<Ops* const> ranks) {
  const int world = int(ranks.size());
  std::vector<CudaOps*> cuda;
  bool one_device = true, distinct = true;
  for (int r = 0; r < world; ++r) {
    if (ranks[size_t(r)]->device() != Device::kCuda) {
      return make_error(ErrorCode::kUnsupported,
                        "tensor-parallel rank {} is on the CPU and rank 0 on a GPU: ranks of "
                        "one group share a kind of device",
                        r);
    }
    cuda.push_back(static_cast<CudaOps*>(ranks[size_t(r)]));
    for (int k = 0; k < r; ++k) {
      const bool same = cuda[size_t(k)]->impl_->device == cuda.back()->impl_->device;
      one_device = one_device && same;
      distinct = distinct && !same;
    }
  }
  if (world < 1) return make_error(ErrorCode::kInvalidArgument, "a group of no ranks");
  if (one_device) {
    if (world > kMaxSameDeviceRanks) {
      return make_error(ErrorCode::kInvalidArgument,
                        "{} tensor-parallel ranks on one GPU: at most {} may share a device", world,
                        kMaxSameDeviceRanks);
    }
    std::vector<bool*> host_ordered;
    for (CudaOps* o : cuda) host_ordered.push_back(&o->impl_->options.host_ordered_collectives);
    return std::unique_ptr<CommGroup>(
        new SameDeviceGroup(std::move(cuda), std::move(host_ordered)));
  }
  if (!distinct) {
    return make_error(ErrorCode::kInvalidArgument,
                      "tensor-parallel ranks share some GPUs and not others: give every rank "
                      "its own device, or put them all on one");
  }
#if defined(RECUR_HAVE_NCCL)
  std::vector<NcclCommunicator::RankPlace> places;
  for (CudaOps* o : cuda) {
    places.push_back({o->impl_->device, [o] { return o->current_stream(); }, &o->allocator()});
  }
  RECUR_ASSIGN_OR_RETURN(auto comms, NcclCommunicator::create_group(places));
  return std::unique_ptr<CommGroup>(new NcclGroup(std::move(comms)));
#else
  return make_error(ErrorCode::kUnsupported,
                    "tensor parallelism over {} GPUs needs NCCL, and this build has none", world);
#endif
}

}  // namespace recur
