// The Qwen hybrid family's architectures: what is their own is their checkpoint layout, re-packed
// at load into the blocks of model/blocks.h. Both build from a config.json (and, without a
// checkpoint, from random weights).
#pragma once

#include <nlohmann/json.hpp>

#include "model/hybrid.h"

namespace recur {

// Qwen3-Next: 3 of every 4 layers Gated DeltaNet, 1 gated full attention, MoE feed-forward;
// in_proj_qkvz / in_proj_ba interleaved by key head.
Result<HybridSpec> build_qwen3_next(const nlohmann::json& config, const nlohmann::json& gen,
                                    WeightLoader& weights);

// Qwen3.5 dense and MoE, nested (Qwen3_5[Moe]ForConditionalGeneration, weights under
// model.language_model.) or flat (Qwen3_5[Moe]ForCausalLM, weights under model.); fused experts
// (gate_up_proj [E, 2I, H], down_proj [E, H, I]) or one tensor per expert.
Result<HybridSpec> build_qwen3_5(const nlohmann::json& config, const nlohmann::json& gen,
                                 WeightLoader& weights);

}  // namespace recur
