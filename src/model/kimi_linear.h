// Kimi-Linear (`kimi_linear`, KimiLinearForCausalLM) as published with its remote code: Kimi
// Delta Attention in most layers, latent attention without rotary in the others, dense then
// sigmoid-routed MoE feed-forwards.
#pragma once

#include <nlohmann/json.hpp>

#include "model/hybrid.h"

namespace recur {

Result<HybridSpec> build_kimi_linear(const nlohmann::json& config, const nlohmann::json& gen,
                                     WeightLoader& weights);

}  // namespace recur
