#include "launch/engine_options.h"

#include <fmt/format.h>

#include <algorithm>

#include "backend/backend.h"
#include "core/threads.h"

namespace recur {

namespace {
int threads_per_rank(int threads, int ranks) {
  const int total = threads > 0 ? threads : default_thread_count();
  return std::max(1, total / std::max(ranks, 1));
}
}  // namespace

Result<std::unique_ptr<Ops>> create_rank_backend(const std::string& device, int threads, int ranks,
                                                 const BackendOptions& options) {
  return recur::create_backend(device, ranks > 1 ? threads_per_rank(threads, ranks) : threads, 0,
                               std::max(ranks, 1), options);
}

std::function<Result<std::unique_ptr<Ops>>(int rank)> rank_backend_maker(
    const std::string& device, int threads, int ranks, const BackendOptions& options) {
  if (ranks <= 1) return nullptr;
  const int per_rank = threads_per_rank(threads, ranks);
  return [device, per_rank, ranks, options](int rank) {
    return recur::create_backend(device, per_rank, rank, ranks, options);
  };
}

Result<std::unique_ptr<Ops>> create_backend(const EngineOptions& o) {
  auto ops = create_rank_backend(o.device, o.threads, o.tensor_parallel, o.backend);
  if (ops.ok() || ops.error().message.find(o.device) != std::string::npos) return ops;
  return Error{ops.error().code, fmt::format("device {}: {}", o.device, ops.error().message)};
}

EngineConfig engine_config(const EngineOptions& o) {
  EngineConfig cfg;
  cfg.max_batch = o.max_batch;
  cfg.max_batch_tokens = std::max(o.max_batch_tokens, o.max_batch);
  cfg.max_context = o.max_context;
  cfg.kv_cache_bytes = o.kv_cache_mb << 20;
  cfg.prefix_cache_bytes = o.prefix_cache_mb << 20;
  cfg.snapshot_interval = o.snapshot_interval;
  if (o.seed) cfg.seed = *o.seed;
  cfg.pipeline_decode = o.pipeline_decode;
  cfg.quantize = o.quantize;
  cfg.kv_cache_dtype = o.kv_cache_dtype;
  cfg.tensor_parallel = o.tensor_parallel;
  cfg.rank_backend = rank_backend_maker(o.device, o.threads, o.tensor_parallel, o.backend);
  return cfg;
}

}  // namespace recur
