// config.json in every style found in the wild (Qwen3-Next's two; Qwen3.5's nested multimodal
// wrapper and flat text-only config), and clear errors for missing or bad fields.
#include <gtest/gtest.h>

#include <functional>
#include <tuple>

#include "backend/backend.h"
#include "model/config.h"
#include "model/registry.h"

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
  j["rope_parameters"] = {
      {"rope_theta", 1e6}, {"partial_rotary_factor", 0.25}, {"rope_type", "default"}};
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
      {[](json& j) { j["model_type"] = "llama"; }, "model_type 'llama' is not a Qwen hybrid model"},
      {[](json& j) {
         j["linear_num_value_heads"] = 4;
         j["linear_num_key_heads"] = 3;
       },
       "'linear_num_value_heads'"},
      {[](json& j) { j["layer_types"] = {"linear_attention"}; }, "'layer_types'"},
      {[](json& j) {
         j["layer_types"] = {"a", "b", "c", "d", "e"};
       },
       "layer type"},
      {[](json& j) {
         j["rope_scaling"] = {{"rope_type", "yarn"}};
       },
       "'yarn' is not supported"},
      {[](json& j) { j["num_experts_per_tok"] = 9; }, "'num_experts_per_tok'"},
      {[](json& j) { j["eos_token_id"] = "x"; }, "eos_token_id"},
      {[](json& j) {
         j.erase("intermediate_size");
         j["num_experts"] = 0;
       },
       "'intermediate_size'"},
      {[](json& j) { j["rms_norm_eps"] = -1; }, "'rms_norm_eps'"},
      {[](json& j) {
         j.erase("head_dim");
         j["hidden_size"] = 31;  // not a multiple of the 2 heads
       },
       "'head_dim' is missing"},
      {[](json& j) {
         j["head_dim"] = 10;  // int(10 x 0.3) = 3 rotary channels: odd
         j["partial_rotary_factor"] = 0.3;
       },
       "rotary channels; they must be even"},
      {[](json& j) { j["mlp_only_layers"] = {5}; }, "'mlp_only_layers'"},
      {[](json& j) { j["eos_token_id"] = 1 << 20; }, "outside the vocabulary"},
      {[](json& j) { j["eos_token_id"] = int64_t(1) << 33; }, "eos_token_id"},
      {[](json& j) { j["hidden_act"] = "gelu"; }, "hidden_act \"gelu\""},
      {[](json& j) { j["model_type"] = 5; }, "'model_type' must be a string"},
      {[](json& j) { j["rope_theta"] = 0; }, "'rope_theta' must be > 0"},
      {[](json& j) { j["partial_rotary_factor"] = 2; },
       "'partial_rotary_factor' must be in (0, 1]"},
      // An unsigned value past int64 is printed as it is, not wrapped to a negative number.
      {[](json& j) { j["num_hidden_layers"] = uint64_t(1) << 63; },
       "'num_hidden_layers' is 9223372036854775808, outside"},
      // A query group attention cannot take is refused at load, not at the first forward.
      {[](json& j) { j["num_attention_heads"] = 128, j["num_key_value_heads"] = 1; },
       "128 query heads per key/value head"},
  };
  for (auto& [mutate, expect] : cases) {
    json j = base_config();
    mutate(j);
    auto c = QwenHybridConfig::from_json(j, json::object());
    ASSERT_FALSE(c.ok()) << expect;
    EXPECT_NE(c.error().message.find(expect), std::string::npos) << c.error().message;
  }
}

// ---- Qwen3.5 ----

// The text config of a Qwen3.5(-MoE) release, as its text_config holds it (or a flat
// Qwen3_5[Moe]ForCausalLM config.json, given the model_type).
json qwen3_5_text(bool moe) {
  json t = json::parse(R"({
    "hidden_size": 64, "num_hidden_layers": 4, "vocab_size": 300, "rms_norm_eps": 1e-6,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "linear_num_key_heads": 2, "linear_num_value_heads": 6, "linear_key_head_dim": 16,
    "linear_value_head_dim": 24, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "max_position_embeddings": 8192, "partial_rotary_factor": 0.25, "mamba_ssm_dtype": "float32",
    "mtp_num_hidden_layers": 1, "attn_output_gate": true, "eos_token_id": null,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                        "mrope_section": [2, 1, 1], "mrope_interleaved": true}})");
  t["model_type"] = moe ? "qwen3_5_moe_text" : "qwen3_5_text";
  if (moe) {
    t["num_experts"] = 8;
    t["num_experts_per_tok"] = 2;
    t["moe_intermediate_size"] = 32;
    t["shared_expert_intermediate_size"] = 48;
  } else {
    t["intermediate_size"] = 128;
  }
  return t;
}

// The multimodal wrapper around it (Qwen3_5[Moe]ForConditionalGeneration).
json qwen3_5_nested(bool moe) {
  json c;
  c["architectures"] = {moe ? "Qwen3_5MoeForConditionalGeneration"
                            : "Qwen3_5ForConditionalGeneration"};
  c["model_type"] = moe ? "qwen3_5_moe" : "qwen3_5";
  c["text_config"] = qwen3_5_text(moe);
  c["tie_word_embeddings"] = false;
  c["image_token_id"] = 248056;
  c["video_token_id"] = 248057;
  c["vision_start_token_id"] = 248053;
  c["vision_end_token_id"] = 248054;
  c["vision_config"] = {{"depth", 1}, {"hidden_size", 32}};
  return c;
}

// --layers cuts a config to its first layers; the layer lists keep only those that remain, in the
// flat and the nested form, so the cut config still parses.
TEST(Config, CutLayersTrimsTheLayerLists) {
  json j = base_config();
  j["layer_types"] = {"linear_attention", "full_attention", "linear_attention", "full_attention",
                      "linear_attention"};
  j["mlp_only_layers"] = {0, 3, 4};
  for (bool nested : {false, true}) {
    json cfg = nested ? json{{"model_type", "qwen3_5"}, {"text_config", j}} : j;
    if (nested) cfg["text_config"]["model_type"] = "qwen3_5_text";
    json cut = cut_layers(cfg, 2);
    const json& text = nested ? cut["text_config"] : cut;
    EXPECT_EQ(text["num_hidden_layers"], 2) << nested;
    EXPECT_EQ(text["layer_types"].size(), 2u) << nested;
    EXPECT_EQ(text["mlp_only_layers"], json::array({0})) << nested;
    if (!nested) {
      auto c = QwenHybridConfig::from_json(cut, json::object());
      ASSERT_TRUE(c.ok()) << c.error().to_string();
      EXPECT_FALSE(c->layer_is_moe(0));
      EXPECT_TRUE(c->layer_is_moe(1));
    }
  }
}

// A config cut to its recurrent layers alone (benchmarks cut published configs so) has no
// attention cache: its blocks cost nothing, so every slot holds the whole context.
TEST(Config, WithoutAttentionLayersEverySlotHoldsTheContext) {
  const json cfg = cut_layers(qwen3_5_nested(false), 2);  // layers 0 and 1: linear attention
  auto ops = create_backend("cpu", 1);
  ASSERT_TRUE(ops.ok());
  LoadOptions o;
  o.max_batch_tokens = 16;
  o.max_context = 1000;
  o.state.n_slots = 3;
  o.state.n_blocks = 0;  // sized from the budget, as an engine asks
  o.state.block_size = 16;
  auto m = load_random_model(cfg, **ops, o, DType::F32);
  ASSERT_TRUE(m.ok()) << m.error().to_string();
  EXPECT_EQ((*m)->info().kv_bytes_per_token, 0);
  EXPECT_EQ((*m)->state_config().n_blocks, 3 * 63);  // 1000 tokens in blocks of 16, per slot
}

TEST(Config, Qwen3_5NestedAndFlatParseAlike) {
  for (bool moe : {false, true}) {
    const json gen = {{"eos_token_id", {5, 6}}};
    auto nested = QwenHybridConfig::from_json(qwen3_5_nested(moe), gen);
    auto flat = QwenHybridConfig::from_json(qwen3_5_text(moe), gen);
    ASSERT_TRUE(nested.ok()) << nested.error().to_string();
    ASSERT_TRUE(flat.ok()) << flat.error().to_string();
    const QwenHybridConfig& a = *nested;
    const QwenHybridConfig& b = *flat;
    EXPECT_EQ(a.family, moe ? QwenFamily::kQwen3_5Moe : QwenFamily::kQwen3_5);
    EXPECT_EQ(b.family, a.family);
    EXPECT_TRUE(a.nested);
    EXPECT_FALSE(b.nested);
    EXPECT_EQ(a.model_type, moe ? "qwen3_5_moe" : "qwen3_5");
    EXPECT_EQ(b.model_type, moe ? "qwen3_5_moe_text" : "qwen3_5_text");
    EXPECT_EQ(a.hidden_size, 64);
    EXPECT_EQ(a.num_layers, 4);
    EXPECT_EQ(a.vocab_size, 300);
    EXPECT_EQ(a.max_position_embeddings, 8192);
    EXPECT_EQ(a.head_dim, 32);
    EXPECT_EQ(a.rotary_dim(), 8);  // 32 × 0.25; the sections [2, 1, 1] split its 4 frequencies
    EXPECT_DOUBLE_EQ(a.rope_theta, 1e7);
    EXPECT_EQ(a.linear_num_value_heads, 6);
    EXPECT_EQ(a.linear_key_head_dim, 16);
    EXPECT_EQ(a.linear_value_head_dim, 24);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(a.layer_is_moe(i), moe) << i;
    if (moe) {
      EXPECT_EQ(a.num_experts, 8);
      EXPECT_EQ(a.moe_intermediate_size, 32);
      EXPECT_EQ(a.shared_expert_intermediate_size, 48);
    } else {
      EXPECT_EQ(a.intermediate_size, 128);
    }
    // Everything the text model is made of is the same in both styles.
    auto text_model = [](const QwenHybridConfig& c) {
      return std::tie(
          c.family, c.hidden_size, c.num_layers, c.vocab_size, c.rms_norm_eps,
          c.tie_word_embeddings, c.max_position_embeddings, c.num_heads, c.num_kv_heads, c.head_dim,
          c.rope_theta, c.partial_rotary_factor, c.linear_num_key_heads, c.linear_num_value_heads,
          c.linear_key_head_dim, c.linear_value_head_dim, c.linear_conv_kernel, c.intermediate_size,
          c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
          c.shared_expert_intermediate_size, c.norm_topk_prob, c.layer_types, c.eos_token_ids);
    };
    EXPECT_TRUE(text_model(a) == text_model(b)) << (moe ? "qwen3_5_moe" : "qwen3_5");
    EXPECT_EQ(a.eos_token_ids, (std::vector<int32_t>{5, 6}));
    // Only the wrapper names the vision placeholders.
    EXPECT_EQ(a.vision_token_ids, (std::vector<int32_t>{248056, 248057, 248053, 248054}));
    EXPECT_TRUE(b.vision_token_ids.empty());
  }
}

TEST(Config, Qwen3_5TiesByTheWrappersFlag) {
  json j = qwen3_5_nested(false);
  j["tie_word_embeddings"] = true;  // text_config says false, as Qwen3.5-0.8B-like wrappers may
  auto c = QwenHybridConfig::from_json(j, json::object());
  ASSERT_TRUE(c.ok()) << c.error().to_string();
  EXPECT_TRUE(c->tie_word_embeddings);
  json flat = qwen3_5_text(false);
  flat["tie_word_embeddings"] = true;
  auto f = QwenHybridConfig::from_json(flat, json::object());
  ASSERT_TRUE(f.ok()) << f.error().to_string();
  EXPECT_TRUE(f->tie_word_embeddings);
}

// Fields Qwen3-Next reads but the Qwen3.5 configs delete mean nothing there: Qwen3.5 is dense in
// every layer, Qwen3.5-MoE sparse in every layer and always renormalises its top k.
TEST(Config, Qwen3_5IgnoresQwen3NextOnlyFields) {
  json moe = qwen3_5_nested(true);
  moe["text_config"]["norm_topk_prob"] = false;
  moe["text_config"]["decoder_sparse_step"] = 2;
  moe["text_config"]["mlp_only_layers"] = {0, 1};
  auto m = QwenHybridConfig::from_json(moe, json::object());
  ASSERT_TRUE(m.ok()) << m.error().to_string();
  EXPECT_TRUE(m->norm_topk_prob);
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(m->layer_is_moe(i)) << i;

  json dense = qwen3_5_text(false);
  dense["num_experts"] = 8;
  dense["num_experts_per_tok"] = 2;
  dense["moe_intermediate_size"] = 32;
  auto d = QwenHybridConfig::from_json(dense, json::object());
  ASSERT_TRUE(d.ok()) << d.error().to_string();
  EXPECT_EQ(d->num_experts, 0);
  for (int i = 0; i < 4; ++i) EXPECT_FALSE(d->layer_is_moe(i)) << i;
}

TEST(Config, Qwen3_5ErrorsNameTheField) {
  struct Case {
    bool moe, nested;
    std::function<void(json& outer, json& text)> mutate;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {false, true,
       [](json&, json& t) {
         t["rope_parameters"]["mrope_section"] = {2, 1, 2};
       },
       "mrope_section sums to 5 but the rotary dimension is 8"},
      {true, false,
       [](json&, json& t) {
         t["rope_parameters"]["mrope_section"] = {1, 1};
       },
       "'mrope_section' must list three section sizes"},
      {false, true,
       [](json&, json& t) {
         t["rope_parameters"]["mrope_section"] = {2, -1, 3};
       },
       "'mrope_section' must hold non-negative integers"},
      {false, true, [](json&, json& t) { t["model_type"] = "qwen3_5_moe_text"; },
       "text_config.model_type 'qwen3_5_moe_text' does not match model_type 'qwen3_5'"},
      {true, true, [](json&, json& t) { t["model_type"] = "qwen3_next"; },
       "text_config.model_type 'qwen3_next' does not match model_type 'qwen3_5_moe'"},
      {false, true, [](json&, json& t) { t["model_type"] = "llama"; }, "model_type 'llama'"},
      {true, true, [](json&, json& t) { t.erase("num_experts"); }, "'num_experts' is missing"},
      {true, false, [](json&, json& t) { t.erase("num_experts"); }, "'num_experts' is missing"},
      {true, true, [](json&, json& t) { t["num_experts"] = 0; }, "'num_experts' is missing"},
      {true, true, [](json&, json& t) { t.erase("moe_intermediate_size"); },
       "'moe_intermediate_size' is missing"},
      {false, true, [](json&, json& t) { t.erase("intermediate_size"); }, "'intermediate_size'"},
      {false, true, [](json& o, json&) { o["text_config"] = "qwen3_5_text"; },
       "'text_config' must be an object"},
      {false, true, [](json&, json& t) { t.erase("linear_value_head_dim"); },
       "'linear_value_head_dim' is missing"},
      {true, true, [](json& o, json&) { o["tie_word_embeddings"] = "yes"; },
       "'tie_word_embeddings' must be true or false"},
      {false, true, [](json& o, json&) { o["image_token_id"] = -3; }, "'image_token_id'"},
  };
  for (const Case& c : cases) {
    json j = c.nested ? qwen3_5_nested(c.moe) : qwen3_5_text(c.moe);
    json text = c.nested ? j["text_config"] : json();
    c.mutate(j, c.nested ? text : j);
    if (c.nested && j["text_config"].is_object()) j["text_config"] = text;
    auto r = QwenHybridConfig::from_json(j, json::object());
    ASSERT_FALSE(r.ok()) << c.expect;
    EXPECT_NE(r.error().message.find(c.expect), std::string::npos) << r.error().message;
  }
}

}  // namespace
}  // namespace recur
