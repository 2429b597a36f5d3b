#include "model/config.h"

#include <algorithm>
#include <cmath>

#include "ops/ops.h"

namespace recur {

using json = nlohmann::json;

namespace {

Error field_error(const std::string& key, const char* what) {
  return make_error(ErrorCode::kInvalidArgument, "config.json: field '{}' {}", key, what);
}

}  // namespace

Status config_int(const json& j, const std::string& key, int* out, bool required, int min,
                  int max) {
  if (!j.contains(key) || j[key].is_null()) {
    return required ? field_error(key, "is missing") : Status();
  }
  if (!j[key].is_number_integer()) return field_error(key, "must be an integer");
  if (j[key].is_number_unsigned() && j[key].get<uint64_t>() > uint64_t(max)) {
    return make_error(ErrorCode::kInvalidArgument,
                      "config.json: field '{}' is {}, outside [{}, {}]", key,
                      j[key].get<uint64_t>(), min, max);
  }
  const int64_t v = j[key].get<int64_t>();
  if (v < min || v > max) {
    return make_error(ErrorCode::kInvalidArgument,
                      "config.json: field '{}' is {}, outside [{}, {}]", key, v, min, max);
  }
  *out = int(v);
  return Status();
}

Status config_double(const json& j, const std::string& key, double* out) {
  if (!j.contains(key) || j[key].is_null()) return Status();
  if (!j[key].is_number()) return field_error(key, "must be a number");
  *out = j[key].get<double>();
  if (!std::isfinite(*out)) return field_error(key, "must be finite");
  return Status();
}

Status config_bool(const json& j, const std::string& key, bool* out) {
  if (!j.contains(key) || j[key].is_null()) return Status();
  if (!j[key].is_boolean()) return field_error(key, "must be true or false");
  *out = j[key].get<bool>();
  return Status();
}

Status config_eos(const json& j, const char* file, std::vector<int32_t>* out) {
  if (!j.contains("eos_token_id") || j["eos_token_id"].is_null()) return Status();
  const json& e = j["eos_token_id"];
  auto add = [&](const json& v) -> Status {
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > INT32_MAX) {
      return make_error(ErrorCode::kInvalidArgument, "{}: eos_token_id must be integers", file);
    }
    int32_t id = int32_t(v.get<int64_t>());
    if (std::find(out->begin(), out->end(), id) == out->end()) out->push_back(id);
    return Status();
  };
  if (e.is_array()) {
    for (auto& v : e) RECUR_RETURN_IF_ERROR(add(v));
    return Status();
  }
  return add(e);
}

bool QwenHybridConfig::layer_is_moe(int layer) const {
  // Qwen3.5-MoE: every layer (its parse leaves decoder_sparse_step 1, no mlp_only_layers).
  if (num_experts <= 0) return false;
  const bool mlp_only =
      std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) != mlp_only_layers.end();
  return !mlp_only && (layer + 1) % decoder_sparse_step == 0;
}

namespace {

Result<QwenFamily> family_of(const std::string& model_type) {
  if (model_type == "qwen3_next") return QwenFamily::kQwen3Next;
  if (model_type == "qwen3_5" || model_type == "qwen3_5_text") return QwenFamily::kQwen3_5;
  if (model_type == "qwen3_5_moe" || model_type == "qwen3_5_moe_text") {
    return QwenFamily::kQwen3_5Moe;
  }
  return make_error(ErrorCode::kUnsupported,
                    "config.json: model_type '{}' is not a Qwen hybrid model (qwen3_next, qwen3_5, "
                    "qwen3_5_moe, qwen3_5_text, qwen3_5_moe_text)",
                    model_type);
}

// The rotary settings: the nested rope_parameters (newer) or top-level fields (older). Qwen3.5's
// interleaved multimodal rotary (mrope_section) rotates text exactly like the 1-D partial rotary,
// since all three position axes of a text token are equal.
Status read_rope(const json& j, QwenHybridConfig* c) {
  RECUR_RETURN_IF_ERROR(config_double(j, "rope_theta", &c->rope_theta));
  RECUR_RETURN_IF_ERROR(config_double(j, "partial_rotary_factor", &c->partial_rotary_factor));
  std::vector<int> mrope_section;
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
    if (!j.contains(key) || j[key].is_null()) continue;
    const json& rp = j[key];
    if (!rp.is_object()) return field_error(key, "must be an object");
    std::string type = "default";
    for (const char* t : {"rope_type", "type"}) {
      if (rp.contains(t) && rp[t].is_string()) type = rp[t].get<std::string>();
    }
    if (type != "default" && !(type == "mrope" && rp.contains("mrope_section"))) {
      return make_error(ErrorCode::kUnsupported, "config.json: {} type '{}' is not supported", key,
                        type);
    }
    RECUR_RETURN_IF_ERROR(config_double(rp, "rope_theta", &c->rope_theta));
    RECUR_RETURN_IF_ERROR(config_double(rp, "partial_rotary_factor", &c->partial_rotary_factor));
    if (rp.contains("mrope_section") && !rp["mrope_section"].is_null()) {
      const json& ms = rp["mrope_section"];
      if (!ms.is_array() || ms.size() != 3) {
        return field_error("mrope_section", "must list three section sizes");
      }
      for (const json& v : ms) {
        if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > 4096) {
          return field_error("mrope_section", "must hold non-negative integers");
        }
        mrope_section.push_back(v.get<int>());
      }
    }
  }
  if (!(c->partial_rotary_factor > 0 && c->partial_rotary_factor <= 1)) {
    return field_error("partial_rotary_factor", "must be in (0, 1]");
  }
  if (!(c->rope_theta > 0)) return field_error("rope_theta", "must be > 0");
  if (!mrope_section.empty()) {
    const int sum = mrope_section[0] + mrope_section[1] + mrope_section[2];
    if (2 * sum != c->rotary_dim()) {
      return make_error(ErrorCode::kInvalidArgument,
                        "config.json: mrope_section sums to {} but the rotary dimension is {} "
                        "(head_dim {} × partial_rotary_factor {}): the sum must be half of it",
                        sum, c->rotary_dim(), c->head_dim, c->partial_rotary_factor);
    }
  }
  return Status();
}

Status read_layer_types(const json& j, QwenHybridConfig* c) {
  if (j.contains("layer_types") && !j["layer_types"].is_null()) {
    const json& lt = j["layer_types"];
    if (!lt.is_array() || int(lt.size()) != c->num_layers) {
      return field_error("layer_types", "must list one type per layer");
    }
    for (auto& t : lt) {
      const std::string s = t.is_string() ? t.get<std::string>() : "";
      if (s == "linear_attention") {
        c->layer_types.push_back(LayerKind::kLinearAttention);
      } else if (s == "full_attention") {
        c->layer_types.push_back(LayerKind::kFullAttention);
      } else {
        return make_error(ErrorCode::kUnsupported, "config.json: layer type '{}' is not supported",
                          t.dump());
      }
    }
    return Status();
  }
  int interval = 4;
  RECUR_RETURN_IF_ERROR(config_int(j, "full_attention_interval", &interval, false, 1));
  for (int i = 0; i < c->num_layers; ++i) {
    c->layer_types.push_back((i + 1) % interval ? LayerKind::kLinearAttention
                                                : LayerKind::kFullAttention);
  }
  return Status();
}

}  // namespace

Result<QwenHybridConfig> QwenHybridConfig::from_json(const json& outer, const json& gen) {
  QwenHybridConfig c;
  if (!outer.contains("model_type")) return field_error("model_type", "is missing");
  if (!outer["model_type"].is_string()) return field_error("model_type", "must be a string");
  c.model_type = outer["model_type"].get<std::string>();
  RECUR_ASSIGN_OR_RETURN(c.family, family_of(c.model_type));
  // Multimodal releases nest the language model's config in text_config.
  c.nested = outer.contains("text_config") && !outer["text_config"].is_null();
  if (c.nested && !outer["text_config"].is_object()) {
    return field_error("text_config", "must be an object");
  }
  const json& j = c.nested ? outer["text_config"] : outer;
  if (c.nested && j.contains("model_type") && j["model_type"].is_string()) {
    RECUR_ASSIGN_OR_RETURN(QwenFamily inner, family_of(j["model_type"].get<std::string>()));
    if (inner != c.family) {
      return make_error(ErrorCode::kInvalidArgument,
                        "config.json: text_config.model_type '{}' does not match model_type '{}'",
                        j["model_type"].get<std::string>(), c.model_type);
    }
  }

  RECUR_RETURN_IF_ERROR(config_int(j, "hidden_size", &c.hidden_size, true, 1, 1 << 16));
  RECUR_RETURN_IF_ERROR(config_int(j, "num_hidden_layers", &c.num_layers, true, 1, 4096));
  RECUR_RETURN_IF_ERROR(config_int(j, "vocab_size", &c.vocab_size, true, 1, 1 << 24));
  // The MLPs, experts and gates are built with SiLU; another activation would run as SiLU.
  if (j.contains("hidden_act") && j["hidden_act"] != "silu") {
    return make_error(ErrorCode::kUnsupported, "config.json: hidden_act {} (only \"silu\")",
                      j["hidden_act"].dump());
  }
  double eps = c.rms_norm_eps;
  RECUR_RETURN_IF_ERROR(config_double(j, "rms_norm_eps", &eps));
  if (!(eps > 0 && eps < 1)) return field_error("rms_norm_eps", "must be in (0, 1)");
  c.rms_norm_eps = float(eps);
  // The multimodal wrapper ties its LM head by its own flag; the text config's is the fallback.
  RECUR_RETURN_IF_ERROR(config_bool(j, "tie_word_embeddings", &c.tie_word_embeddings));
  if (c.nested)
    RECUR_RETURN_IF_ERROR(config_bool(outer, "tie_word_embeddings", &c.tie_word_embeddings));
  c.max_position_embeddings = 262144;
  RECUR_RETURN_IF_ERROR(
      config_int(j, "max_position_embeddings", &c.max_position_embeddings, false, 1));

  RECUR_RETURN_IF_ERROR(config_int(j, "num_attention_heads", &c.num_heads, true, 1, 1024));
  c.num_kv_heads = c.num_heads;
  RECUR_RETURN_IF_ERROR(config_int(j, "num_key_value_heads", &c.num_kv_heads, false, 1, 1024));
  if (c.num_heads % c.num_kv_heads != 0) {
    return field_error("num_key_value_heads", "must divide num_attention_heads");
  }
  c.head_dim = 0;
  RECUR_RETURN_IF_ERROR(config_int(j, "head_dim", &c.head_dim, false, 1, 1024));
  if (c.head_dim == 0) {
    if (c.hidden_size % c.num_heads != 0) {
      return field_error("head_dim",
                         "is missing and hidden_size is not a multiple of "
                         "num_attention_heads");
    }
    c.head_dim = c.hidden_size / c.num_heads;
  }
  const int64_t group = c.num_heads / c.num_kv_heads;
  if (group > Ops::kMaxAttentionGroup || group * c.head_dim > Ops::kMaxAttentionGroupDims) {
    return make_error(ErrorCode::kUnsupported,
                      "config.json: {} query heads per key/value head of {} channels "
                      "(num_attention_heads / num_key_value_heads, head_dim): attention takes "
                      "at most {} heads and {} channels in a group",
                      group, c.head_dim, Ops::kMaxAttentionGroup, Ops::kMaxAttentionGroupDims);
  }
  RECUR_RETURN_IF_ERROR(read_rope(j, &c));
  // transformers rotates int(head_dim · factor) channels, rounded up to even: an odd count
  // would rotate a pair with a frequency base recur does not use, so it is refused.
  const int rotary = int(c.head_dim * c.partial_rotary_factor);
  if (rotary % 2 != 0 || rotary < 2) {
    return make_error(ErrorCode::kInvalidArgument,
                      "config.json: head_dim {} × partial_rotary_factor {} gives {} rotary "
                      "channels; they must be even and at least 2",
                      c.head_dim, c.partial_rotary_factor, rotary);
  }

  RECUR_RETURN_IF_ERROR(
      config_int(j, "linear_num_key_heads", &c.linear_num_key_heads, true, 1, 1024));
  RECUR_RETURN_IF_ERROR(
      config_int(j, "linear_num_value_heads", &c.linear_num_value_heads, true, 1, 1024));
  RECUR_RETURN_IF_ERROR(
      config_int(j, "linear_key_head_dim", &c.linear_key_head_dim, true, 1, 1024));
  RECUR_RETURN_IF_ERROR(
      config_int(j, "linear_value_head_dim", &c.linear_value_head_dim, true, 1, 1024));
  RECUR_RETURN_IF_ERROR(
      config_int(j, "linear_conv_kernel_dim", &c.linear_conv_kernel, true, 1, 16));
  if (c.linear_num_value_heads % c.linear_num_key_heads != 0) {
    return field_error("linear_num_value_heads", "must be a multiple of linear_num_key_heads");
  }

  RECUR_RETURN_IF_ERROR(config_int(j, "intermediate_size", &c.intermediate_size, false, 1));
  if (c.family != QwenFamily::kQwen3_5) {
    RECUR_RETURN_IF_ERROR(config_int(j, "num_experts", &c.num_experts, false, 0, 1 << 16));
  }
  if (c.family == QwenFamily::kQwen3_5Moe && c.num_experts < 1) {
    return field_error("num_experts", "is missing (every layer of a qwen3_5_moe model is MoE)");
  }
  if (c.num_experts > 0) {
    RECUR_RETURN_IF_ERROR(config_int(j, "num_experts_per_tok", &c.num_experts_per_tok, true, 1));
    RECUR_RETURN_IF_ERROR(
        config_int(j, "moe_intermediate_size", &c.moe_intermediate_size, true, 1));
    RECUR_RETURN_IF_ERROR(config_int(j, "shared_expert_intermediate_size",
                                     &c.shared_expert_intermediate_size, false, 0));
    if (c.num_experts_per_tok > c.num_experts || c.num_experts_per_tok > 64) {
      return field_error("num_experts_per_tok", "must be at most num_experts and 64");
    }
  }
  if (c.family == QwenFamily::kQwen3Next) {  // Qwen3.5 always renormalises its top k
    RECUR_RETURN_IF_ERROR(config_bool(j, "norm_topk_prob", &c.norm_topk_prob));
    RECUR_RETURN_IF_ERROR(config_int(j, "decoder_sparse_step", &c.decoder_sparse_step, false, 1));
    if (j.contains("mlp_only_layers") && !j["mlp_only_layers"].is_null()) {
      if (!j["mlp_only_layers"].is_array()) return field_error("mlp_only_layers", "must be a list");
      for (auto& v : j["mlp_only_layers"]) {
        if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= c.num_layers) {
          return field_error("mlp_only_layers",
                             "must hold layer indices in [0, num_hidden_layers)");
        }
        c.mlp_only_layers.push_back(v.get<int>());
      }
    }
  }
  RECUR_RETURN_IF_ERROR(read_layer_types(j, &c));
  for (int i = 0; i < c.num_layers; ++i) {
    if (!c.layer_is_moe(i) && c.intermediate_size <= 0) {
      return field_error("intermediate_size", "is missing but a layer has a dense MLP");
    }
  }
  for (const char* key :
       {"image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"}) {
    int id = -1;
    RECUR_RETURN_IF_ERROR(config_int(outer, key, &id, false, 0));
    if (id >= 0) c.vision_token_ids.push_back(int32_t(id));
  }
  RECUR_RETURN_IF_ERROR(config_eos(j, "config.json", &c.eos_token_ids));
  if (c.nested) RECUR_RETURN_IF_ERROR(config_eos(outer, "config.json", &c.eos_token_ids));
  RECUR_RETURN_IF_ERROR(config_eos(gen, "generation_config.json", &c.eos_token_ids));
  for (int32_t id : c.eos_token_ids) {
    if (id >= c.vocab_size) {
      return make_error(ErrorCode::kInvalidArgument,
                        "eos_token_id {} is outside the vocabulary [0, {})", id, c.vocab_size);
    }
  }
  return c;
}

}  // namespace recur
