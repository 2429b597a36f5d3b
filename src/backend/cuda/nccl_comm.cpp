#include "backend/cuda/nccl_comm.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdio>
#include <cstdlib>

namespace recur {

namespace {

Error nccl_error(const char* what, ncclResult_t r) {
  return make_error(ErrorCode::kInternal, "{}: {}", what, ncclGetErrorString(r));
}

Error cuda_error(const char* what, cudaError_t e) {
  return make_error(ErrorCode::kInternal, "{}: {}", what, cudaGetErrorString(e));
}

// A collective that failed after the ranks set out together cannot be undone by one rank.
void fatal_if(ncclResult_t r, const char* what) {
  if (r == ncclSuccess) return;
  std::fprintf(stderr, "fatal: %s: %s\n", what, ncclGetErrorString(r));
  std::abort();
}

void fatal_if(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  std::fprintf(stderr, "fatal: %s: %s\n", what, cudaGetErrorString(e));
  std::abort();
}

}  // namespace

namespace {

Status disable_multicast() {
  // Before NCCL reads its environment (at the first communicator of the process).
  if (setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/1) != 0) {
    return make_error(ErrorCode::kInternal, "setenv NCCL_NVLS_ENABLE=0 failed");
  }
  return Status();
}

}  // namespace

Result<std::vector<std::unique_ptr<NcclCommunicator>>> NcclCommunicator::create_group(
    std::span<const RankPlace> ranks) {
  const int world = int(ranks.size());
  if (world < 1) return make_error(ErrorCode::kInvalidArgument, "an NCCL group of no ranks");
  for (const RankPlace& p : ranks) {
    if (!p.alloc) return make_error(ErrorCode::kInvalidArgument, "an NCCL rank without memory");
  }
  RECUR_RETURN_IF_ERROR(disable_multicast());
  int caller_device = 0;
  if (const cudaError_t e = cudaGetDevice(&caller_device); e != cudaSuccess) {
    return cuda_error("cudaGetDevice", e);
  }
  // Every device checked before the group starts: a rank that fails inside it would leave the
  // ranks already set up waiting for it.
  for (const RankPlace& p : ranks) {
    if (const cudaError_t e = cudaSetDevice(p.device); e != cudaSuccess) {
      cudaSetDevice(caller_device);
      return cuda_error("cudaSetDevice", e);
    }
  }
  ncclUniqueId nid;
  if (const ncclResult_t r = ncclGetUniqueId(&nid); r != ncclSuccess) {
    cudaSetDevice(caller_device);
    return nccl_error("ncclGetUniqueId", r);
  }
  std::vector<ncclComm_t> comms(size_t(world), nullptr);
  // One thread may make every rank's communicator between ncclGroupStart and ncclGroupEnd.
  ncclResult_t failed = ncclGroupStart();
  const char* what = "ncclGroupStart";
  if (failed == ncclSuccess) {
    for (int r = 0; r < world; ++r) {
      cudaSetDevice(ranks[size_t(r)].device);
      if (const ncclResult_t e = ncclCommInitRank(&comms[size_t(r)], world, nid, r);
          e != ncclSuccess && failed == ncclSuccess) {
        failed = e, what = "ncclCommInitRank";
      }
    }
    if (const ncclResult_t e = ncclGroupEnd(); e != ncclSuccess && failed == ncclSuccess) {
      failed = e, what = "ncclGroupEnd";
    }
  }
  cudaSetDevice(caller_device);
  if (failed != ncclSuccess) {
    for (ncclComm_t c : comms) {
      if (c) ncclCommAbort(c);  // a communicator whose setup failed is aborted, not destroyed
    }
    return nccl_error(what, failed);
  }
  std::vector<std::unique_ptr<NcclCommunicator>> out;
  for (int r = 0; r < world; ++r) {
    std::unique_ptr<NcclCommunicator> c(new NcclCommunicator());
    c->rank_ = r, c->world_ = world, c->device_ = ranks[size_t(r)].device;
    c->stream_ = ranks[size_t(r)].stream, c->alloc_ = ranks[size_t(r)].alloc;
    c->comm_ = comms[size_t(r)];
    out.push_back(std::move(c));
  }
  return out;
}

NcclCommunicator::~NcclCommunicator() {
  if (!comm_) return;
  int caller_device = device_;
  cudaGetDevice(&caller_device);
  cudaSetDevice(device_);
  ncclCommDestroy(static_cast<ncclComm_t>(comm_));
  cudaSetDevice(caller_device);
}

Status NcclCommunicator::reserve_gather(int64_t part_floats) {
  if (part_floats < 0) {
    return make_error(ErrorCode::kInvalidArgument, "a gather of {} floats", part_floats);
  }
  const size_t bytes = size_t(part_floats * world_) * sizeof(float);
  if (bytes <= gather_.bytes()) return Status();
  int previous = 0;
  if (const cudaError_t e = cudaGetDevice(&previous); e != cudaSuccess) {
    return cuda_error("cudaGetDevice", e);
  }
  if (const cudaError_t e = cudaSetDevice(device_); e != cudaSuccess) {
    return cuda_error("cudaSetDevice", e);
  }
  gather_.reset();
  auto b = alloc_->allocate(bytes, "NCCL gather scratch");
  cudaSetDevice(previous);
  if (!b.ok()) return b.error();
  gather_ = std::move(*b);
  return Status();
}

void NcclCommunicator::all_reduce_sum(Tensor x) {
  RECUR_CHECK(x.dtype == DType::F32 && x.ndim >= 1);
  const auto comm = static_cast<ncclComm_t>(comm_);
  const auto stream = static_cast<cudaStream_t>(stream_ ? stream_() : nullptr);
  if (x.is_contiguous()) {
    fatal_if(ncclAllReduce(x.data, x.data, size_t(x.numel()), ncclFloat32, ncclSum, comm, stream),
             "ncclAllReduce");
    return;
  }
  // Strided rows: one reduction per row, grouped into one launch.
  const int64_t rows = x.rows(), cols = x.row_size();
  fatal_if(ncclGroupStart(), "ncclGroupStart");
  for (int64_t r = 0; r < rows; ++r) {
    float* row = x.row<float>(r);
    fatal_if(ncclAllReduce(row, row, size_t(cols), ncclFloat32, ncclSum, comm, stream),
             "ncclAllReduce");
  }
  fatal_if(ncclGroupEnd(), "ncclGroupEnd");
}

void NcclCommunicator::all_gather_cols(const Tensor& part, Tensor out) {
  RECUR_CHECK(part.dtype == DType::F32 && out.dtype == DType::F32 && part.ndim == 2 &&
              out.ndim == 2 && part.is_contiguous());
  const int64_t rows = part.rows(), c = part.shape[1], n = rows * c;
  RECUR_CHECK(out.rows() == rows && out.shape[1] == c * world_ &&
              size_t(n * world_) * sizeof(float) <= gather_.bytes());
  const auto stream = static_cast<cudaStream_t>(stream_ ? stream_() : nullptr);
  // [world, rows, c]: rank r's part at r·n, then each into its columns of out.
  fatal_if(ncclAllGather(part.data, gather_.data(), size_t(n), ncclFloat32,
                         static_cast<ncclComm_t>(comm_), stream),
           "ncclAllGather");
  for (int r = 0; r < world_; ++r) {
    fatal_if(cudaMemcpy2DAsync(out.ptr<float>() + r * c, size_t(out.row_stride()) * sizeof(float),
                               gather_.as<float>() + r * n, size_t(c) * sizeof(float),
                               size_t(c) * sizeof(float), size_t(rows), cudaMemcpyDeviceToDevice,
                               stream),
             "cudaMemcpy2DAsync (gathered columns)");
  }
}

}  // namespace recur
