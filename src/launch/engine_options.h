// What a front end (the CLI, the Python module) asks of the engine: the model, backend and
// engine settings in one struct, and the backend and engine configuration they describe.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "engine/engine.h"
#include "ops/ops.h"

namespace recur {

struct EngineOptions {
  std::string model;
  std::string device = "cpu";  // cpu, cuda or cuda:N
  int threads = 0;             // CPU threads, 0: all cores
  int max_batch = 8;
  int max_batch_tokens = 512;
  int max_context = 0;  // 0: the model's
  int64_t kv_cache_mb = 1024;
  int64_t prefix_cache_mb = 1024;  // EngineConfig::prefix_cache_bytes; 0: off
  int snapshot_interval = 2048;    // EngineConfig::snapshot_interval
  std::optional<uint64_t> seed;
  int pipeline_decode = -1;  // EngineConfig::pipeline_decode
  // --quantize: matmul weights of a bf16/f32 checkpoint converted at load (EngineConfig::quantize)
  Quantize quantize = Quantize::kNone;
  DType kv_cache_dtype = DType::F32;  // --kv-cache-dtype (EngineConfig::kv_cache_dtype)
  int tensor_parallel = 1;            // --tensor-parallel (EngineConfig::tensor_parallel)
  BackendOptions backend;             // --fp8-activations (ops.h)
};

// The backend of one of `ranks` tensor-parallel ranks on `device`: `threads` CPU threads (0: all
// cores) shared evenly among the ranks, at least one each. Rank 0's, and the maker of the
// others' (LoadOptions::rank_backend; empty for one rank).
Result<std::unique_ptr<Ops>> create_rank_backend(const std::string& device, int threads, int ranks,
                                                 const BackendOptions& options = {});
std::function<Result<std::unique_ptr<Ops>>(int rank)> rank_backend_maker(
    const std::string& device, int threads, int ranks, const BackendOptions& options = {});

// The backend for the options' device and threads (rank 0's under tensor_parallel); an
// unavailable device is an error that names it.
Result<std::unique_ptr<Ops>> create_backend(const EngineOptions& o);

// EngineConfig from the options (max_batch_tokens is raised to max_batch when below it).
EngineConfig engine_config(const EngineOptions& o);

}  // namespace recur
