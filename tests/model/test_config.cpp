// config.json in both styles found in the wild, and clear errors for missing or bad fields.
#include <gtest/gtest.h>

#include "model/config.h"

namespace recur {
namespace {

using json = nlohmann::json;

json base_config() {
  return json::parse(R"({
    "model_type": "qwen3_next", "hidden_size": 32, "num_hidden_layers": 5, "vocab_size": 100,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
    "linear_num_key_heads": 1, "linear_num_value_heads": 3, "linear_key_head_dim": 8,
    "linear_value_head_dim": 8, "linear_conv_kernel_dim": 3, "intermediate_size": 40,
    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
    "shared_expert_intermediate_size": 8, "rope_theta": 5000.0, "partial_rotary_factor": 0.5,
    "eos_token_id": 7})");
}

TEST(Config, OlderStyleDerivesLayerTypesFromTheInterval) {
  json j = base_config();
  j["full_attention_interval"] = 2;
  auto c = QwenHybridConfig::from_json(j, json::object());
  ASSERT_TRUE(c.ok()) << c.error().to_string();
  ASSERT_EQ(c->layer_types.size(), 5u);
  EXPECT_EQ(c->layer_types[0], LayerKind::kLinearAttention);
  EXPECT_EQ(c->layer_types[1], LayerKind::kFullAttention);
  EXPECT_EQ(c->layer_types[3], LayerKind::kFullAttention);
  EXPECT_EQ(c->rotary_dim(), 8);
  EXPECT_DOUBLE_EQ(c->rope_theta, 5000.0);
  EXPECT_TRUE(c->norm_topk_prob);  // the default
}

TEST(Config, NewerStyleReadsLayerTypesAndRopeParameters) {
  json j = base_config();
  j.erase("rope_theta");
  j.erase("partial_rotary_factor");
  j["rope_parameters"] = {{"rope_theta", 1e6}, {"partial_rotary_factor", 0.25}, {"rope_type", "default"}};
  j["layer_types"] = {"full_attention", "linear_attention", "linear_attention", "full_attention",
                      "linear_attention"};
  j["mlp_only_layers"] = {1};
  j["decoder_sparse_step"] = 2;
  j["norm_topk_prob"] = false;
  json gen = {{"eos_token_id", {7, 9}}};
  auto c = QwenHybridConfig::from_json(j, gen);
  ASSERT_TRUE(c.ok()) << c.error().to_string();
  EXPECT_EQ(c->layer_types[0], LayerKind::kFullAttention);
  EXPECT_EQ(c->layer_types[4], LayerKind::kLinearAttention);
  EXPECT_DOUBLE_EQ(c->rope_theta, 1e6);
  EXPECT_EQ(c->rotary_dim(), 4);
  EXPECT_FALSE(c->norm_topk_prob);
  EXPECT_FALSE(c->layer_is_moe(0));  // (0 + 1) % 2 != 0
  EXPECT_FALSE(c->layer_is_moe(1));  // mlp_only_layers
  EXPECT_TRUE(c->layer_is_moe(3));
  EXPECT_EQ(c->eos_token_ids, (std::vector<int32_t>{7, 9}));
}

TEST(Config, ErrorsNameTheField) {
  const std::vector<std::pair<std::function<void(json&)>, std::string>> cases = {
      {[](json& j) { j.erase("hidden_size"); }, "'hidden_size' is missing"},
      {[](json& j) { j["hidden_size"] = "big"; }, "'hidden_size' must be an integer"},
      {[](json& j) { j["model_type"] = "llama"; }, "model_type 'llama' is not supported"},
      {[](json& j) { j["linear_num_value_heads"] = 4; j["linear_num_key_heads"] = 3; },
       "'linear_num_value_heads'"},
      {[](json& j) { j["layer_types"] = {"linear_attention"}; }, "'layer_types'"},
      {[](json& j) { j["layer_types"] = {"a", "b", "c", "d", "e"}; }, "layer type"},
      {[](json& j) { j["rope_scaling"] = {{"rope_type", "yarn"}}; }, "'yarn' is not supported"},
      {[](json& j) { j["num_experts_per_tok"] = 9; }, "'num_experts_per_tok'"},
      {[](json& j) { j["eos_token_id"] = "x"; }, "eos_token_id"},
      {[](json& j) { j.erase("intermediate_size"); j["num_experts"] = 0; }, "'intermediate_size'"},
  };
  for (auto& [mutate, expect] : cases) {
    json j = base_config();
    mutate(j);
    auto c = QwenHybridConfig::from_json(j, json::object());
    ASSERT_FALSE(c.ok()) << expect;
    EXPECT_NE(c.error().message.find(expect), std::string::npos) << c.error().message;
  }
}

}  // namespace
}  // namespace recur
