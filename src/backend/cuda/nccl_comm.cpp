#include "backend/cuda/nccl_comm.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace recur {

namespace {

static_assert(sizeof(NcclId::bytes) == sizeof(ncclUniqueId), "NcclId holds an ncclUniqueId");

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

Result<NcclId> make_nccl_id() {
  ncclUniqueId id;
  if (const ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) {
    return nccl_error("ncclGetUniqueId", r);
  }
  NcclId out;
  std::memcpy(out.bytes, &id, sizeof(id));
  return out;
}

Result<std::unique_ptr<NcclCommunicator>> NcclCommunicator::create(const NcclId& id, int rank,
                                                                   int world, int device,
                                                                   void* stream,
                                                                   int64_t max_gather_floats) {
  if (world < 1 || rank < 0 || rank >= world || max_gather_floats < 0) {
    return make_error(ErrorCode::kInvalidArgument, "NCCL rank {} of {} ranks", rank, world);
  }
  // Before NCCL reads its environment (at the first communicator of the process).
  if (setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/1) != 0) {
    return make_error(ErrorCode::kInternal, "setenv NCCL_NVLS_ENABLE=0 failed");
  }
  if (const cudaError_t e = cudaSetDevice(device); e != cudaSuccess) {
    return cuda_error("cudaSetDevice", e);
  }
  std::unique_ptr<NcclCommunicator> c(new NcclCommunicator());
  c->rank_ = rank, c->world_ = world, c->device_ = device, c->stream_ = stream;
  c->gather_floats_ = max_gather_floats * world;
  if (c->gather_floats_ > 0) {
    void* p = nullptr;
    if (const cudaError_t e = cudaMalloc(&p, size_t(c->gather_floats_) * sizeof(float));
        e != cudaSuccess) {
      return cuda_error("cudaMalloc (NCCL gather scratch)", e);
    }
    c->gather_ = static_cast<float*>(p);
  }
  ncclUniqueId nid;
  std::memcpy(&nid, id.bytes, sizeof(nid));
  ncclComm_t comm = nullptr;
  if (const ncclResult_t r = ncclCommInitRank(&comm, world, nid, rank); r != ncclSuccess) {
    return nccl_error("ncclCommInitRank", r);
  }
  c->comm_ = comm;
  return c;
}

NcclCommunicator::~NcclCommunicator() {
  if (comm_ || gather_) cudaSetDevice(device_);
  if (comm_) ncclCommDestroy(static_cast<ncclComm_t>(comm_));
  if (gather_) cudaFree(gather_);
}

void NcclCommunicator::all_reduce_sum(Tensor x) {
  RECUR_CHECK(x.dtype == DType::F32 && x.ndim >= 1);
  const auto comm = static_cast<ncclComm_t>(comm_);
  const auto stream = static_cast<cudaStream_t>(stream_);
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
  RECUR_CHECK(out.rows() == rows && out.shape[1] == c * world_ && n * world_ <= gather_floats_);
  const auto stream = static_cast<cudaStream_t>(stream_);
  // [world, rows, c]: rank r's part at r·n, then each into its columns of out.
  fatal_if(ncclAllGather(part.data, gather_, size_t(n), ncclFloat32, static_cast<ncclComm_t>(comm_),
                         stream),
           "ncclAllGather");
  for (int r = 0; r < world_; ++r) {
    fatal_if(
        cudaMemcpy2DAsync(out.ptr<float>() + r * c, size_t(out.row_stride()) * sizeof(float),
                          gather_ + r * n, size_t(c) * sizeof(float), size_t(c) * sizeof(float),
                          size_t(rows), cudaMemcpyDeviceToDevice, stream),
        "cudaMemcpy2DAsync (gathered columns)");
  }
}

}  // namespace recur
