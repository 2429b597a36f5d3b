// Qwen3-Next hyper-parameters, read from config.json in either style found in the wild:
// `layer_types` or `full_attention_interval`; `rope_parameters` or top-level `rope_theta` /
// `partial_rotary_factor`.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/status.h"

namespace recur {

enum class LayerKind { kLinearAttention, kFullAttention };

struct Qwen3NextConfig {
  int hidden_size = 0;
  int num_layers = 0;
  int vocab_size = 0;
  float rms_norm_eps = 1e-6f;
  bool tie_word_embeddings = false;
  int max_position_embeddings = 0;
  std::string dtype;  // torch_dtype / dtype as written; weights are used as stored

  // Gated attention
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  double rope_theta = 10000.0;
  double partial_rotary_factor = 1.0;
  int rotary_dim() const { return int(head_dim * partial_rotary_factor) / 2 * 2; }

  // Gated DeltaNet
  int linear_num_key_heads = 0;
  int linear_num_value_heads = 0;
  int linear_key_head_dim = 0;
  int linear_value_head_dim = 0;
  int linear_conv_kernel = 0;

  // Feed-forward
  int intermediate_size = 0;  // dense MLP layers
  int num_experts = 0;
  int num_experts_per_tok = 0;
  int moe_intermediate_size = 0;
  int shared_expert_intermediate_size = 0;
  bool norm_topk_prob = true;
  int decoder_sparse_step = 1;
  std::vector<int> mlp_only_layers;

  std::vector<LayerKind> layer_types;  // one per layer
  std::vector<int32_t> eos_token_ids;  // from config.json and generation_config.json

  bool layer_is_moe(int layer) const;

  // Validates and derives everything; errors name the field.
  static Result<Qwen3NextConfig> from_json(const nlohmann::json& config,
                                           const nlohmann::json& generation_config);
};

}  // namespace recur
