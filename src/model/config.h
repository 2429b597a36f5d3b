// Hyper-parameters of the Qwen hybrid family (Qwen3-Next, Qwen3.5 dense and MoE), read from
// config.json in every style found in the wild: the text config at the top or nested in
// `text_config`; `layer_types` or `full_attention_interval`; `rope_parameters` or top-level
// `rope_theta` / `partial_rotary_factor`.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/status.h"

namespace recur {

enum class LayerKind { kLinearAttention, kFullAttention };

enum class QwenFamily {
  kQwen3Next,  // qwen3_next: interleaved in_proj_qkvz / in_proj_ba, MoE per decoder_sparse_step
  kQwen3_5,    // qwen3_5 / qwen3_5_text: in_proj_qkv, _z, _b, _a; dense MLP in every layer
  kQwen3_5Moe  // qwen3_5_moe / qwen3_5_moe_text: as qwen3_5, MoE in every layer
};

struct QwenHybridConfig {
  QwenFamily family = QwenFamily::kQwen3Next;
  std::string model_type;  // as written (the outer one when nested)
  bool nested = false;     // the text config sat in `text_config`
  int hidden_size = 0;
  int num_layers = 0;
  int vocab_size = 0;
  float rms_norm_eps = 1e-6f;
  bool tie_word_embeddings = false;
  int max_position_embeddings = 0;

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
  // Image and video placeholders (Qwen3.5's vision tokens): a text-only engine refuses them.
  std::vector<int32_t> vision_token_ids;

  bool layer_is_moe(int layer) const;

  // Validates and derives everything; errors name the field.
  static Result<QwenHybridConfig> from_json(const nlohmann::json& config,
                                            const nlohmann::json& generation_config);
};

// Field readers shared by the architectures' config parsers: absent or null fields keep *out
// (an error when required); errors name the field.
Status config_int(const nlohmann::json& j, const std::string& key, int* out, bool required,
                  int min = 0, int max = 1 << 30);
Status config_double(const nlohmann::json& j, const std::string& key, double* out);
Status config_bool(const nlohmann::json& j, const std::string& key, bool* out);
// eos_token_id: an integer or a list of integers, appended to *out without repeats.
Status config_eos(const nlohmann::json& j, const char* file, std::vector<int32_t>* out);

}  // namespace recur
