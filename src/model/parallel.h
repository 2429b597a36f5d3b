// Tensor parallelism on one host: one Model made of `world` rank models, each holding a slice
// of every layer (model/shard.h says which: heads with the key heads they read, feed-forward
// columns, LM-head vocabulary rows; embedding, norms and routers whole) and the recurrent state
// and attention cache of its own heads. A forward runs every rank at once, each on its own
// thread and backend; the ranks' partial outputs join in one all-reduce per mixer and per
// feed-forward (hybrid.cpp), and rank 0's gathered logits are the model's. The collectives'
// transport is rank 0's backend's (Ops::create_group): host memory between CPU ranks, NCCL
// between GPUs, device memory between ranks that share one GPU.
#pragma once

#include <functional>
#include <memory>

#include "model/model.h"
#include "model/registry.h"
#include "ops/comm.h"

namespace recur {

// Loads one rank's part of the model for comm's rank (options as for that rank alone).
using RankLoader = std::function<Result<std::unique_ptr<Model>>(
    Ops& ops, const LoadOptions& options, Communicator& comm)>;

// The model over options.tensor_parallel ranks: rank 0 on `ops`, the others on backends from
// options.rank_backend; the budgets of `options` are shared evenly between the ranks. The
// calling thread stays bound to rank 0's device (Ops::bind_thread).
Result<std::unique_ptr<Model>> load_parallel_model(Ops& ops, const LoadOptions& options,
                                                   const RankLoader& load_rank);

}  // namespace recur
