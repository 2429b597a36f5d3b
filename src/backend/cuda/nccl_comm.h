// The communicator of tensor-parallel ranks on GPUs: NCCL collectives, queued on the rank's
// stream in order with its kernels. Built with the CUDA backend when the toolkit has NCCL
// (RECUR_HAVE_NCCL); not yet driven by a model (the ranks of model/parallel.h are threads
// over host memory) and unrun here: no machine with several GPUs was lent.
//
// This header includes no CUDA or NCCL header, so plain C++ code can hold one.
#pragma once

#include <cstdint>
#include <memory>

#include "ops/comm.h"

namespace recur {

// The group's identity: made once by one rank (make_nccl_id), handed to every rank.
struct NcclId {
  char bytes[128];  // ncclUniqueId (NCCL_UNIQUE_ID_BYTES)
};
Result<NcclId> make_nccl_id();

class NcclCommunicator final : public Communicator {
 public:
  // Joins group `id` as `rank` of `world` on CUDA device `device`, with collectives on
  // `stream` (a cudaStream_t; null: the default stream) and a gather scratch of
  // max_gather_floats floats made here (all_gather_cols' part, times world). NVLink multicast
  // is turned off for the whole process first (NCCL_NVLS_ENABLE=0, whatever the environment
  // said): multicast can put a shared host's GPUs out of service.
  static Result<std::unique_ptr<NcclCommunicator>> create(const NcclId& id, int rank, int world,
                                                          int device, void* stream,
                                                          int64_t max_gather_floats);
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int world() const override { return world_; }
  // x in this rank's device memory. Queued; a failing NCCL call ends the program with its
  // message (a rank that stopped would leave the others waiting).
  void all_reduce_sum(Tensor x) override;
  // part contiguous; gathered rank after rank into the scratch, then copied into out's columns.
  void all_gather_cols(const Tensor& part, Tensor out) override;

 private:
  NcclCommunicator() = default;
  int rank_ = 0, world_ = 1, device_ = 0;
  void* comm_ = nullptr;     // ncclComm_t
  void* stream_ = nullptr;   // cudaStream_t
  float* gather_ = nullptr;  // [world · max part] device scratch
  int64_t gather_floats_ = 0;
};

}  // namespace recur
