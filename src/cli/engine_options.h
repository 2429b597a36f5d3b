// The model, backend and engine flags that `recur generate` and `recur serve` share, and the
// backend and engine configuration they describe.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "cli/commands.h"
#include "engine/engine.h"
#include "ops/ops.h"

namespace recur::cli {

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
};

// Registers --tensor-parallel N on cmd, writing into *n.
void add_tensor_parallel_option(CLI::App* cmd, int* n);
// Registers --device (cpu, cuda, cuda:N, cuda:N,M,...) on cmd, writing into *device.
void add_device_option(CLI::App* cmd, std::string* device);

// The backend of one of `ranks` tensor-parallel ranks on `device`: `threads` CPU threads (0: all
// cores) shared evenly among the ranks, at least one each. Rank 0's, and the maker of the
// others' (LoadOptions::rank_backend; empty for one rank).
Result<std::unique_ptr<Ops>> create_rank_backend(const std::string& device, int threads, int ranks);
std::function<Result<std::unique_ptr<Ops>>(int rank)> rank_backend_maker(const std::string& device,
                                                                         int threads, int ranks);

// Registers --quantize none|fp8|int8|q4 on cmd, writing into *q.
void add_quantize_option(CLI::App* cmd, Quantize* q);

// Registers --kv-cache-dtype f32|bf16|f16|fp8 on cmd, writing into *t.
void add_kv_cache_dtype_option(CLI::App* cmd, DType* t);

// Registers --model, --device, --threads, --max-batch, --max-batch-tokens, --max-context,
// --kv-cache-mb, --prefix-cache-mb, --snapshot-interval, --seed (described by seed_help),
// --pipeline-decode, --quantize, --kv-cache-dtype and --tensor-parallel on cmd, writing into *o;
// the defaults are what *o holds.
void add_engine_options(CLI::App* cmd, EngineOptions* o, const std::string& seed_help);

// The backend for --device and --threads (rank 0's under --tensor-parallel); an unavailable
// device is an error that names it.
Result<std::unique_ptr<Ops>> create_backend(const EngineOptions& o);

// EngineConfig from the flags (max_batch_tokens is raised to max_batch when below it).
EngineConfig engine_config(const EngineOptions& o);

}  // namespace recur::cli
