// Loading a model of any supported architecture: the registry picks it from config.json.
#pragma once

#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "model/model.h"
#include "model/weights.h"

namespace recur {

struct LoadOptions {
  int max_batch_tokens = 512;  // tokens per forward; sizes every workspace
  int max_logit_rows = 0;      // 0: same as max_batch_tokens
  StateConfig state;           // state.n_blocks 0: sized from the budget below
  int64_t kv_cache_budget_bytes = int64_t(1) << 30;
  // The prefix cache's memory (0: none): state.n_snapshots snapshot slots (0: from this budget)
  // and attention-cache blocks added to state.n_blocks, split so that each snapshot comes with
  // the blocks of snapshot_interval tokens.
  int64_t prefix_cache_budget_bytes = 0;
  int snapshot_interval = 2048;
  int max_context = 0;  // 0: the model's max_position_embeddings
  // Matmul weights of F32/BF16/F16 checkpoints quantized at load (see Quantize in weights.h).
  Quantize quantize = Quantize::kNone;
  // Element type of the attention cache: F32, BF16, F16 (saturating at ±65504) or F8_E4M3
  // (plain e4m3, no scales: keys are normalised per head and values stay far inside its range;
  // see the README).
  DType kv_cache_dtype = DType::F32;
  // Tensor parallelism (model/parallel.h): ranks that each hold a slice of every layer's heads
  // and columns and run each forward together; 1: one whole model. The memory budgets above
  // are the ranks' together. rank_backend makes the backend of ranks 1.. (rank 0 runs on the
  // Ops given to load_model); the model keeps them.
  int tensor_parallel = 1;
  std::function<Result<std::unique_ptr<Ops>>(int rank)> rank_backend;
};

// Opens a model directory and loads whatever architecture its config names.
Result<std::unique_ptr<Model>> load_model(const std::string& dir, Ops& ops,
                                          const LoadOptions& options);

// A model from a config alone, with random weights made directly in the backend's memory
// (benchmarks of published configurations without checkpoints). Matrices in `dtype`.
Result<std::unique_ptr<Model>> load_random_model(const nlohmann::json& config, Ops& ops,
                                                 const LoadOptions& options, DType dtype,
                                                 uint64_t seed = 1);
// The config with only its first `layers` layers (no change when layers <= 0).
nlohmann::json cut_layers(nlohmann::json config, int layers);

}  // namespace recur
