#include "model/config.h"

#include <algorithm>

namespace recur {

using json = nlohmann::json;

namespace {

Error field_error(const std::string& key, const char* what) {
  return make_error(ErrorCode::kInvalidArgument, "config.json: field '{}' {}", key, what);
}

Status read_int(const json& j, const std::string& key, int* out, bool required, int min = 0) {
  if (!j.contains(key) || j[key].is_null()) {
    return required ? field_error(key, "is missing") : Status();
  }
  if (!j[key].is_number_integer()) return field_error(key, "must be an integer");
  int64_t v = j[key].get<int64_t>();
  if (v < min || v > (int64_t(1) << 30)) return field_error(key, "is out of range");
  *out = int(v);
  return Status();
}

Status read_double(const json& j, const std::string& key, double* out) {
  if (!j.contains(key) || j[key].is_null()) return Status();
  if (!j[key].is_number()) return field_error(key, "must be a number");
  *out = j[key].get<double>();
  return Status();
}

Status read_bool(const json& j, const std::string& key, bool* out) {
  if (!j.contains(key) || j[key].is_null()) return Status();
  if (!j[key].is_boolean()) return field_error(key, "must be true or false");
  *out = j[key].get<bool>();
  return Status();
}

// eos_token_id is an integer or a list of integers.
Status read_eos(const json& j, const char* file, std::vector<int32_t>* out) {
  if (!j.contains("eos_token_id") || j["eos_token_id"].is_null()) return Status();
  const json& e = j["eos_token_id"];
  auto add = [&](const json& v) -> Status {
    if (!v.is_number_integer() || v.get<int64_t>() < 0) {
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

}  // namespace

bool Qwen3NextConfig::layer_is_moe(int layer) const {
  bool mlp_only = std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) !=
                  mlp_only_layers.end();
  return !mlp_only && num_experts > 0 && (layer + 1) % decoder_sparse_step == 0;
}

Result<Qwen3NextConfig> Qwen3NextConfig::from_json(const json& j, const json& gen) {
  Qwen3NextConfig c;
  if (!j.contains("model_type") || !j["model_type"].is_string()) {
    return field_error("model_type", "is missing");
  }
  std::string model_type = j["model_type"].get<std::string>();
  if (model_type != "qwen3_next") {
    return make_error(ErrorCode::kUnsupported,
                      "config.json: model_type '{}' is not supported (supported: qwen3_next)",
                      model_type);
  }
  RECUR_RETURN_IF_ERROR(read_int(j, "hidden_size", &c.hidden_size, true, 1));
  RECUR_RETURN_IF_ERROR(read_int(j, "num_hidden_layers", &c.num_layers, true, 1));
  RECUR_RETURN_IF_ERROR(read_int(j, "vocab_size", &c.vocab_size, true, 1));
  double eps = c.rms_norm_eps;
  RECUR_RETURN_IF_ERROR(read_double(j, "rms_norm_eps", &eps));
  c.rms_norm_eps = float(eps);
  RECUR_RETURN_IF_ERROR(read_bool(j, "tie_word_embeddings", &c.tie_word_embeddings));
  c.max_position_embeddings = 262144;
  RECUR_RETURN_IF_ERROR(read_int(j, "max_position_embeddings", &c.max_position_embeddings, false, 1));
  for (const char* key : {"torch_dtype", "dtype"}) {
    if (j.contains(key) && j[key].is_string()) c.dtype = j[key].get<std::string>();
  }

  RECUR_RETURN_IF_ERROR(read_int(j, "num_attention_heads", &c.num_heads, true, 1));
  c.num_kv_heads = c.num_heads;
  RECUR_RETURN_IF_ERROR(read_int(j, "num_key_value_heads", &c.num_kv_heads, false, 1));
  if (c.num_heads % c.num_kv_heads != 0) {
    return field_error("num_key_value_heads", "must divide num_attention_heads");
  }
  c.head_dim = c.hidden_size / c.num_heads;
  RECUR_RETURN_IF_ERROR(read_int(j, "head_dim", &c.head_dim, false, 1));

  // Rotary: the newer nested rope_parameters, or the older top-level fields.
  RECUR_RETURN_IF_ERROR(read_double(j, "rope_theta", &c.rope_theta));
  RECUR_RETURN_IF_ERROR(read_double(j, "partial_rotary_factor", &c.partial_rotary_factor));
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
    if (!j.contains(key) || j[key].is_null()) continue;
    const json& rp = j[key];
    if (!rp.is_object()) return field_error(key, "must be an object");
    std::string type = "default";
    for (const char* t : {"rope_type", "type"}) {
      if (rp.contains(t) && rp[t].is_string()) type = rp[t].get<std::string>();
    }
    if (type != "default") {
      return make_error(ErrorCode::kUnsupported, "config.json: {} type '{}' is not supported",
                        key, type);
    }
    if (std::string(key) == "rope_parameters") {
      RECUR_RETURN_IF_ERROR(read_double(rp, "rope_theta", &c.rope_theta));
      RECUR_RETURN_IF_ERROR(read_double(rp, "partial_rotary_factor", &c.partial_rotary_factor));
    }
  }
  if (c.partial_rotary_factor <= 0 || c.partial_rotary_factor > 1 || c.rope_theta <= 0) {
    return field_error("partial_rotary_factor", "must be in (0, 1] with rope_theta > 0");
  }

  RECUR_RETURN_IF_ERROR(read_int(j, "linear_num_key_heads", &c.linear_num_key_heads, true, 1));
  RECUR_RETURN_IF_ERROR(read_int(j, "linear_num_value_heads", &c.linear_num_value_heads, true, 1));
  RECUR_RETURN_IF_ERROR(read_int(j, "linear_key_head_dim", &c.linear_key_head_dim, true, 1));
  RECUR_RETURN_IF_ERROR(read_int(j, "linear_value_head_dim", &c.linear_value_head_dim, true, 1));
  RECUR_RETURN_IF_ERROR(read_int(j, "linear_conv_kernel_dim", &c.linear_conv_kernel, true, 1));
  if (c.linear_num_value_heads % c.linear_num_key_heads != 0) {
    return field_error("linear_num_value_heads", "must be a multiple of linear_num_key_heads");
  }
  if (c.linear_conv_kernel > 16) return field_error("linear_conv_kernel_dim", "exceeds 16");
  if (c.linear_value_head_dim > 1024 || c.head_dim > 1024) {
    return field_error("head_dim", "exceeds 1024");
  }

  RECUR_RETURN_IF_ERROR(read_int(j, "intermediate_size", &c.intermediate_size, false, 1));
  RECUR_RETURN_IF_ERROR(read_int(j, "num_experts", &c.num_experts, false, 0));
  if (c.num_experts > 0) {
    RECUR_RETURN_IF_ERROR(read_int(j, "num_experts_per_tok", &c.num_experts_per_tok, true, 1));
    RECUR_RETURN_IF_ERROR(read_int(j, "moe_intermediate_size", &c.moe_intermediate_size, true, 1));
    RECUR_RETURN_IF_ERROR(read_int(j, "shared_expert_intermediate_size",
                                   &c.shared_expert_intermediate_size, false, 0));
    if (c.num_experts_per_tok > c.num_experts || c.num_experts_per_tok > 64) {
      return field_error("num_experts_per_tok", "must be at most num_experts and 64");
    }
  }
  RECUR_RETURN_IF_ERROR(read_bool(j, "norm_topk_prob", &c.norm_topk_prob));
  RECUR_RETURN_IF_ERROR(read_int(j, "decoder_sparse_step", &c.decoder_sparse_step, false, 1));
  if (j.contains("mlp_only_layers") && !j["mlp_only_layers"].is_null()) {
    if (!j["mlp_only_layers"].is_array()) return field_error("mlp_only_layers", "must be a list");
    for (auto& v : j["mlp_only_layers"]) {
      if (!v.is_number_integer()) return field_error("mlp_only_layers", "must hold integers");
      c.mlp_only_layers.push_back(v.get<int>());
    }
  }

  if (j.contains("layer_types") && !j["layer_types"].is_null()) {
    const json& lt = j["layer_types"];
    if (!lt.is_array() || int(lt.size()) != c.num_layers) {
      return field_error("layer_types", "must list one type per layer");
    }
    for (auto& t : lt) {
      std::string s = t.is_string() ? t.get<std::string>() : "";
      if (s == "linear_attention") {
        c.layer_types.push_back(LayerKind::kLinearAttention);
      } else if (s == "full_attention") {
        c.layer_types.push_back(LayerKind::kFullAttention);
      } else {
        return make_error(ErrorCode::kUnsupported, "config.json: layer type '{}' is not supported",
                          t.dump());
      }
    }
  } else {
    int interval = 4;
    RECUR_RETURN_IF_ERROR(read_int(j, "full_attention_interval", &interval, false, 1));
    for (int i = 0; i < c.num_layers; ++i) {
      c.layer_types.push_back((i + 1) % interval ? LayerKind::kLinearAttention
                                                 : LayerKind::kFullAttention);
    }
  }
  for (int i = 0; i < c.num_layers; ++i) {
    if (!c.layer_is_moe(i) && c.intermediate_size <= 0) {
      return field_error("intermediate_size", "is missing but a layer has a dense MLP");
    }
  }
  RECUR_RETURN_IF_ERROR(read_eos(j, "config.json", &c.eos_token_ids));
  RECUR_RETURN_IF_ERROR(read_eos(gen, "generation_config.json", &c.eos_token_ids));
  return c;
}

}  // namespace recur
