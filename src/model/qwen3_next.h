// Qwen3-Next: 3 of every 4 layers Gated DeltaNet, 1 gated full attention, MoE feed-forward.
#pragma once

#include <memory>
#include <string>

#include "io/checkpoint.h"
#include "model/config.h"
#include "model/model.h"
#include "model/registry.h"

namespace recur {

// The model keeps the checkpoint: its weights stay mapped for the model's lifetime.
Result<std::unique_ptr<Model>> load_qwen3_next(std::unique_ptr<Checkpoint> checkpoint, Ops& ops,
                                               const LoadOptions& options);

}  // namespace recur
