// Qwen3-Next: 3 of every 4 layers Gated DeltaNet, 1 gated full attention, MoE feed-forward.
#pragma once

#include <memory>
#include <string>

#include "io/checkpoint.h"
#include "model/config.h"
#include "model/model.h"

namespace recur {

struct LoadOptions {
  int max_batch_tokens = 512;  // tokens per forward; sizes every workspace
  int max_logit_rows = 0;      // 0: same as max_batch_tokens
  StateConfig state;           // state.n_blocks 0: sized from the budget below
  int64_t kv_cache_budget_bytes = int64_t(1) << 30;
  int max_context = 0;         // 0: the model's max_position_embeddings
};

// The model keeps the checkpoint: its weights stay mapped for the model's lifetime.
Result<std::unique_ptr<Model>> load_qwen3_next(std::unique_ptr<Checkpoint> checkpoint, Ops& ops,
                                               const LoadOptions& options);

// A model from a config alone, with random weights made directly in the backend's memory
// (benchmarks of published configurations without checkpoints). Matrices in `dtype`.
Result<std::unique_ptr<Model>> load_random_model(const nlohmann::json& config, Ops& ops,
                                                 const LoadOptions& options, DType dtype,
                                                 uint64_t seed = 1);
// The config with only its first `layers` layers (no change when layers <= 0).
nlohmann::json cut_layers(nlohmann::json config, int layers);

// Opens a model directory and loads whatever architecture its config names.
Result<std::unique_ptr<Model>> load_model(const std::string& dir, Ops& ops,
                                          const LoadOptions& options);

}  // namespace recur
