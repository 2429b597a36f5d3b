// Collectives between the ranks of a tensor-parallel model: each rank holds a slice of every
// layer's heads and columns and calls these at the points where the slices' partial results
// join. Model code sees only this interface; a backend provides the transport (Ops::
// create_group): threads of one process here, NCCL between GPUs or one GPU's memory for ranks
// that share it in backend/cuda.
#pragma once

#include <barrier>
#include <memory>
#include <vector>

#include "core/tensor.h"

namespace recur {

// One rank's end of a group. Collectives are called by every rank of the group, in the same
// order, with tensors of the same shapes; each returns when its result is in place on this
// rank (for a device backend: queued on the rank's stream in order with its other work).
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world() const = 0;
  // x [n, d] f32 (rows may be strided, each row contiguous), in place: the sum over the ranks
  // of their x, bitwise the same on every rank.
  virtual void all_reduce_sum(Tensor x) = 0;
  // part [rows, c] f32 on every rank, out [rows, world·c] f32 (rows may be strided):
  // out[:, r·c : (r+1)·c] = rank r's part, on every rank.
  virtual void all_gather_cols(const Tensor& part, Tensor out) = 0;
  // The most floats (rows · c) a part given to all_gather_cols will have, said at load, before
  // the first call: a transport that gathers through a scratch of its own makes it here.
  virtual Status reserve_gather(int64_t part_floats) { return Status(); }
};

// The communicators of one group's ranks, made together (ops.h: Ops::create_group).
class CommGroup {
 public:
  virtual ~CommGroup() = default;
  virtual int world() const = 0;
  virtual Communicator& rank(int r) = 0;
};

// Ranks that are threads of one process, over host memory: each collective publishes the
// ranks' tensor addresses, meets at a barrier, and has each rank do its share of the exchange
// on the others' memory directly, then meets again before anyone may write its tensor. The
// table of addresses and the barrier are made once; a collective allocates nothing.
class InProcessGroup final : public CommGroup {
 public:
  explicit InProcessGroup(int world);
  ~InProcessGroup() override;
  InProcessGroup(const InProcessGroup&) = delete;
  InProcessGroup& operator=(const InProcessGroup&) = delete;

  int world() const override { return int(ranks_.size()); }
  Communicator& rank(int r) override;

 private:
  class Rank;
  friend class Rank;
  struct Published {
    Tensor a, b;  // the collective's operands on this rank
  };
  std::vector<Published> published_;  // [world]
  std::barrier<> barrier_;
  std::vector<std::unique_ptr<Rank>> ranks_;
};

}  // namespace recur
