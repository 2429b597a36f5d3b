// The architectures recur loads, picked from config.json's model_type (or, without one, its
// architectures list).
#include "model/registry.h"

#include <string>

#include "model/kimi_linear.h"
#include "model/parallel.h"
#include "model/qwen3_next.h"

namespace recur {

namespace {

using Builder = Result<HybridSpec> (*)(const nlohmann::json& config, const nlohmann::json& gen,
                                       WeightLoader& weights);

struct Architecture {
  const char* model_type;
  const char* class_name;  // as `architectures` lists it
  Builder build;
  float norm_center = 0.0f;  // where trained norm weights sit: 0 for (1 + w), 1 for plain w
};

constexpr Architecture kArchitectures[] = {
    {"qwen3_next", "Qwen3NextForCausalLM", build_qwen3_next},
    {"qwen3_5", "Qwen3_5ForConditionalGeneration", build_qwen3_5},
    {"qwen3_5_text", "Qwen3_5ForCausalLM", build_qwen3_5},
    {"qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration", build_qwen3_5},
    {"qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", build_qwen3_5},
    {"kimi_linear", "KimiLinearForCausalLM", build_kimi_linear, 1.0f},
};

std::string supported_list() {
  std::string s;
  for (const Architecture& a : kArchitectures)
    s += std::string(s.empty() ? "" : ", ") + a.model_type;
  return s;
}

Result<const Architecture*> find_architecture(const nlohmann::json& config,
                                              const std::string& where) {
  if (config.contains("model_type") && config["model_type"].is_string()) {
    const std::string type = config["model_type"].get<std::string>();
    for (const Architecture& a : kArchitectures) {
      if (type == a.model_type) return &a;
    }
    return make_error(ErrorCode::kUnsupported,
                      "{}config.json: model_type '{}' is not supported (supported: {})", where,
                      type, supported_list());
  }
  if (config.contains("architectures") && config["architectures"].is_array()) {
    for (const nlohmann::json& name : config["architectures"]) {
      for (const Architecture& a : kArchitectures) {
        if (name.is_string() && name.get<std::string>() == a.class_name) return &a;
      }
    }
  }
  return make_error(ErrorCode::kInvalidArgument,
                    "{}config.json: no model_type and no supported entry in architectures "
                    "(supported: {})",
                    where, supported_list());
}

// One whole model, or with comm one tensor-parallel rank's part of it.
Result<std::unique_ptr<Model>> load_checkpoint_model(const std::string& dir, Ops& ops,
                                                     const LoadOptions& options,
                                                     Communicator* comm) {
  RECUR_ASSIGN_OR_RETURN(Checkpoint opened, Checkpoint::open(dir));
  auto ckpt = std::make_unique<Checkpoint>(std::move(opened));
  RECUR_ASSIGN_OR_RETURN(const Architecture* arch, find_architecture(ckpt->config(), dir + "/"));
  nlohmann::json config = ckpt->config();
  if (!config.contains("model_type")) config["model_type"] = arch->model_type;
  RECUR_ASSIGN_OR_RETURN(const Fp8BlockConfig fp8, read_quantization_config(config, dir));
  CheckpointWeights weights(*ckpt, ops, fp8, options.quantize);
  if (comm) weights.set_shard({comm->rank(), comm->world()});
  RECUR_ASSIGN_OR_RETURN(HybridSpec spec, arch->build(config, ckpt->generation_config(), weights));
  const nlohmann::json gen = ckpt->generation_config();
  return build_hybrid_model(std::move(spec), weights, std::move(ckpt), gen, ops, options, comm);
}

Result<std::unique_ptr<Model>> load_random_rank(const nlohmann::json& config, Ops& ops,
                                                const LoadOptions& options, DType dtype,
                                                uint64_t seed, Communicator* comm) {
  RECUR_ASSIGN_OR_RETURN(const Architecture* arch, find_architecture(config, ""));
  const nlohmann::json& text = config.contains("text_config") && config["text_config"].is_object()
                                   ? config["text_config"]
                                   : config;
  int layers = 1;
  if (text.contains("num_hidden_layers") && text["num_hidden_layers"].is_number_integer()) {
    layers = std::max(1, text["num_hidden_layers"].get<int>());
  }
  RandomWeights weights(ops, dtype, seed, layers, options.quantize);
  weights.set_norm_center(arch->norm_center);
  if (comm) weights.set_shard({comm->rank(), comm->world()});
  nlohmann::json c = config;
  if (!c.contains("model_type")) c["model_type"] = arch->model_type;
  RECUR_ASSIGN_OR_RETURN(HybridSpec spec, arch->build(c, nlohmann::json::object(), weights));
  return build_hybrid_model(std::move(spec), weights, nullptr, nlohmann::json::object(), ops,
                            options, comm);
}

}  // namespace

Result<std::unique_ptr<Model>> load_model(const std::string& dir, Ops& ops,
                                          const LoadOptions& options) {
  if (options.tensor_parallel == 1) return load_checkpoint_model(dir, ops, options, nullptr);
  return load_parallel_model(ops, options, [&](Ops& o, const LoadOptions& opt, Communicator& c) {
    return load_checkpoint_model(dir, o, opt, &c);
  });
}

Result<std::unique_ptr<Model>> load_random_model(const nlohmann::json& config, Ops& ops,
                                                 const LoadOptions& options, DType dtype,
                                                 uint64_t seed) {
  if (dtype != DType::F32 && dtype != DType::BF16 && dtype != DType::F16) {
    return make_error(ErrorCode::kUnsupported, "random weights: dtype must be F32, BF16 or F16");
  }
  if (options.tensor_parallel == 1) {
    return load_random_rank(config, ops, options, dtype, seed, nullptr);
  }
  return load_parallel_model(ops, options, [&](Ops& o, const LoadOptions& opt, Communicator& c) {
    return load_random_rank(config, o, opt, dtype, seed, &c);
  });
}

nlohmann::json cut_layers(nlohmann::json config, int layers) {
  if (layers <= 0) return config;
  const bool nested = config.contains("text_config") && config["text_config"].is_object();
  nlohmann::json& text = nested ? config["text_config"] : config;
  if (text.contains("num_hidden_layers") && text["num_hidden_layers"].is_number_integer() &&
      text["num_hidden_layers"].get<int>() > layers) {
    text["num_hidden_layers"] = layers;
    if (text.contains("layer_types") && text["layer_types"].is_array() &&
        int(text["layer_types"].size()) > layers) {
      text["layer_types"].erase(text["layer_types"].begin() + layers, text["layer_types"].end());
    }
    // Layer lists keep only the layers that remain (Kimi's count from 1).
    auto keep_layers = [&](nlohmann::json& list, int64_t end) {
      if (!list.is_array()) return;
      nlohmann::json kept = nlohmann::json::array();
      for (const auto& v : list) {
        if (!v.is_number_integer() || v.get<int64_t>() < end) kept.push_back(v);
      }
      list = std::move(kept);
    };
    if (text.contains("mlp_only_layers")) keep_layers(text["mlp_only_layers"], layers);
    if (text.contains("linear_attn_config") && text["linear_attn_config"].is_object()) {
      for (const char* key : {"kda_layers", "full_attn_layers"}) {
        nlohmann::json& lac = text["linear_attn_config"];
        if (lac.contains(key)) keep_layers(lac[key], int64_t(layers) + 1);
      }
    }
  }
  return config;
}

}  // namespace recur
