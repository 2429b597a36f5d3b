// Kimi-Linear's loading: clear errors for what the config gets wrong or recur does not support,
// random-weight models of other shapes (group-limited routing, conv width 3, more dense layers,
// odd head counts) whose prompt and token-by-token decode agree, and a cache that holds the
// latent, not expanded keys and values. The logits against transformers are checked by
// `recur verify` (tests/cli/verify.sh) on models/kimi-linear-tiny. RECUR_TEST_DEVICE=cuda runs
// the forwards on the CUDA backend (device machine).
#include <gtest/gtest.h>

#include <cmath>
#include <functional>

#include "backend/backend.h"
#include "io/checkpoint.h"
#include "model/registry.h"

namespace recur {
namespace {

using json = nlohmann::json;

const std::string kTiny = std::string(RECUR_SOURCE_DIR) + "/models/kimi-linear-tiny";

json tiny_config() {
  auto c = read_json_file(kTiny + "/config.json");
  EXPECT_TRUE(c.ok());
  return c.ok() ? *c : json::object();
}

LoadOptions small_options() {
  LoadOptions o;
  o.max_batch_tokens = 64;
  o.state.n_slots = 2;
  o.state.n_blocks = 16;
  o.state.block_size = 8;
  return o;
}

// The backend the forwards run on: RECUR_TEST_DEVICE (cuda on the device machine), else the CPU.
std::unique_ptr<Ops> test_backend() {
  const char* d = std::getenv("RECUR_TEST_DEVICE");
  auto ops = create_backend(d ? d : "cpu", 2);
  EXPECT_TRUE(ops.ok()) << ops.error().to_string();
  return ops.ok() ? std::move(ops).value() : nullptr;
}

std::string load_error(const json& config) {
  auto ops = test_backend();
  auto m = load_random_model(config, *ops, small_options(), DType::F32);
  return m.ok() ? "" : m.error().to_string();
}

TEST(KimiLinear, ConfigErrorsNameWhatIsWrong) {
  struct Case {
    std::function<void(json&)> edit;
    const char* expected;
  };
  const Case cases[] = {
      {[](json& c) { c["q_lora_rank"] = 64; }, "q_lora_rank"},
      {[](json& c) { c["mla_use_nope"] = false; }, "mla_use_nope"},
      {[](json& c) { c["moe_router_activation_func"] = "tanh"; }, "moe_router_activation_func"},
      {[](json& c) { c["hidden_act"] = "gelu"; }, "hidden_act"},
      {[](json& c) { c["num_key_value_heads"] = 2; }, "num_key_value_heads"},
      {[](json& c) { c.erase("linear_attn_config"); }, "linear_attn_config"},
      {[](json& c) {
         c["linear_attn_config"]["kda_layers"] = {1, 2, 3, 5, 6};
       },
       "layer 7 (1-based) is listed 0 times"},
      {[](json& c) { c["linear_attn_config"]["kda_layers"] = {0, 1, 2, 3, 5, 6, 7}; },
       "layer numbers count from 1"},
      {[](json& c) {
         c["linear_attn_config"]["full_attn_layers"] = {4, 8, 1};
       },
       "layer 1 (1-based) is listed 2 times"},
      {[](json& c) { c["linear_attn_config"].erase("head_dim"); }, "head_dim"},
      {[](json& c) { c["num_expert_group"] = 3; }, "8 experts in 3 groups"},
      {[](json& c) { c["num_expert_group"] = 4, c["topk_group"] = 5; }, "5 groups kept"},
      {[](json& c) { c["num_experts_per_token"] = 9; }, "cannot choose 9"},
      {[](json& c) { c.erase("model_max_length"); }, "max_position_embeddings"},
  };
  for (const Case& c : cases) {
    json j = tiny_config();
    c.edit(j);
    const std::string err = load_error(j);
    EXPECT_NE(err.find(c.expected), std::string::npos) << c.expected << ": " << err;
  }
  EXPECT_EQ(load_error(tiny_config()), "");
}

// The forward of a whole prompt, and of the same tokens one step each (the cached decode path:
// the conv and delta-rule state, the latent cache), at every position.
double prompt_vs_steps(const json& config, int len) {
  auto ops_owner = test_backend();
  Ops& ops = *ops_owner;
  auto m = load_random_model(config, ops, small_options(), DType::F32, 3);
  EXPECT_TRUE(m.ok()) << m.error().to_string();
  if (!m.ok()) return 1e9;
  Model& model = **m;
  const int V = model.info().vocab_size;
  std::vector<int32_t> tokens(static_cast<size_t>(len)), blocks = {0, 1, 2, 3, 4, 5, 6, 7};
  for (int i = 0; i < len; ++i) tokens[size_t(i)] = (i * 37 + 11) % V;
  std::vector<float> whole(size_t(len) * V), step(size_t(len) * V);
  auto buf = ops.allocator().allocate(size_t(len) * V * 4, "test logits");
  EXPECT_TRUE(buf.ok());
  auto run = [&](const Batch& b, float* out, int rows) {
    Tensor t = Tensor::contiguous(buf->data(), DType::F32, {rows, V}, buf->device());
    const Status s = model.forward(b, t);
    EXPECT_TRUE(s.ok()) << s.error().to_string();
    ops.copy_to_host(t, out);
  };
  Batch b;
  model.reset_slot(0);
  b.add_sequence(0, 0, tokens, blocks, Batch::Logits::kAll);
  run(b, whole.data(), len);
  model.reset_slot(1);
  for (int i = 0; i < len; ++i) {
    b.clear();
    b.add_sequence(1, i, {&tokens[size_t(i)], 1}, blocks, Batch::Logits::kLast);
    run(b, step.data() + size_t(i) * V, 1);
  }
  double worst = 0, scale = 0;
  for (size_t i = 0; i < whole.size(); ++i) {
    EXPECT_TRUE(std::isfinite(whole[i]));
    worst = std::max(worst, double(std::fabs(whole[i] - step[i])));
    scale = std::max(scale, double(std::fabs(whole[i])));
  }
  EXPECT_GT(scale, 1e-3) << "the logits must not all vanish";
  return worst;
}

// Shapes no shipped checkpoint has: three KDA heads with conv width 3, two dense layers, the
// latent attention with five heads and no shared key part, group-limited routing that matters
// (4 groups, 2 kept), softmax routing, a second shared expert.
TEST(KimiLinear, OtherShapesDecodeAsTheyPrefill) {
  json a = tiny_config();
  a["linear_attn_config"]["num_heads"] = 3;
  a["linear_attn_config"]["short_conv_kernel_size"] = 3;
  a["first_k_dense_replace"] = 2;
  a["num_expert_group"] = 4, a["topk_group"] = 2;
  a["num_experts_per_token"] = 3;
  EXPECT_LE(prompt_vs_steps(a, 21), 1e-4);
  json b = tiny_config();
  b["num_attention_heads"] = b["num_key_value_heads"] = 5;
  b["qk_rope_head_dim"] = 0;
  b["kv_lora_rank"] = 12;
  b["moe_router_activation_func"] = "softmax";
  b["num_shared_experts"] = 2;
  b["linear_attn_config"]["head_dim"] = 8;
  b["linear_attn_config"]["kda_layers"] = {2, 3, 4, 6, 7};
  b["linear_attn_config"]["full_attn_layers"] = {1, 5, 8};
  EXPECT_LE(prompt_vs_steps(b, 19), 1e-4);
}

// The attention layers cache per token the normed latent and the shared key part once (the key,
// r + dr floats, whose first r are the value), not heads · (dn + dr + dv).
TEST(KimiLinear, CacheHoldsTheLatentNotExpandedKeysAndValues) {
  const json c = tiny_config();
  auto ops = test_backend();
  auto m = load_random_model(c, *ops, small_options(), DType::F32);
  ASSERT_TRUE(m.ok()) << m.error().to_string();
  const int64_t r = c["kv_lora_rank"], dr = c["qk_rope_head_dim"], dn = c["qk_nope_head_dim"];
  const int64_t dv = c["v_head_dim"], heads = c["num_attention_heads"];
  const int64_t layers = int64_t(c["linear_attn_config"]["full_attn_layers"].size());
  EXPECT_EQ((*m)->info().kv_bytes_per_token, layers * (r + dr) * 4);
  EXPECT_LT((*m)->info().kv_bytes_per_token, layers * heads * (dn + dr + dv) * 4);
  EXPECT_EQ((*m)->info().attention_layers, layers);
}

}  // namespace
}  // namespace recur
