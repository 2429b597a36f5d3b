// The communicator of tensor-parallel ranks on GPUs: NCCL collectives, queued on the rank's
// stream in order with its kernels. Built with the CUDA backend when the toolkit has NCCL
// (RECUR_HAVE_NCCL). CudaOps::create_group makes a group of these for ranks on distinct devices.
//
// This header includes no CUDA or NCCL header, so plain C++ code can hold one.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "ops/comm.h"

namespace recur {

// Where a rank's collectives are queued: called at each collective, so that one recorded into
// a CUDA graph lands on the capture stream (returns a cudaStream_t; null: the default stream).
using StreamOf = std::function<void*()>;

class NcclCommunicator final : public Communicator {
 public:
  // Every rank of a group from this one thread, rank r as ranks[r] says (devices distinct;
  // the gather scratch from that device's allocator, which outlives the communicator). NVLink
  // multicast is turned off for the whole process first (NCCL_NVLS_ENABLE=0, whatever the
  // environment said): multicast can put a shared host's GPUs out of service.
  struct RankPlace {
    int device = 0;
    StreamOf stream;
    Allocator* alloc = nullptr;
  };
  static Result<std::vector<std::unique_ptr<NcclCommunicator>>> create_group(
      std::span<const RankPlace> ranks);
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
  // The gather scratch: world · part_floats floats on this rank's device, from its allocator.
  Status reserve_gather(int64_t part_floats) override;

 private:
  NcclCommunicator() = default;
  int rank_ = 0, world_ = 1, device_ = 0;
  void* comm_ = nullptr;  // ncclComm_t
  StreamOf stream_;
  Allocator* alloc_ = nullptr;
  Buffer gather_;  // [world, largest part] f32 device scratch
};

// The communicators of ranks on distinct GPUs of this process.
class NcclGroup final : public CommGroup {
 public:
  explicit NcclGroup(std::vector<std::unique_ptr<NcclCommunicator>> ranks)
      : ranks_(std::move(ranks)) {}
  int world() const override { return int(ranks_.size()); }
  Communicator& rank(int r) override { return *ranks_[size_t(r)]; }

 private:
  std::vector<std::unique_ptr<NcclCommunicator>> ranks_;
};

}  // namespace recur
