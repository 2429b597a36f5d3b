// A plain, double-precision forward pass of the Qwen hybrid family (Qwen3-Next, Qwen3.5,
// Qwen3.5-MoE) written from the Hugging Face transformers definitions, sharing no code with
// recur: the oracle the unseen-shape tests compare against. It reads every checkpoint layout
// itself: Qwen3-Next's interleaved in_proj_qkvz / in_proj_ba; Qwen3.5's in_proj_qkv, _z, _b, _a;
// the text config at the top or nested in text_config (weights under model.language_model.);
// experts fused (gate_up_proj, down_proj) or one tensor per expert. One sequence from position
// 0, the whole sequence at once (no state carried between calls), every loop the textbook one.
// Slow and simple on purpose.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "model/random_checkpoint.h"

namespace recur_test {

class NaiveQwenHybrid {
 public:
  // Reads the hyper-parameters from config.json (any of the family's styles) and keeps a copy
  // of the weights; throws std::runtime_error naming a missing or misshapen tensor or field.
  NaiveQwenHybrid(const nlohmann::json& config, const TensorMap& weights);

  // Logits of every position of a sequence that starts at position 0.
  std::vector<std::vector<double>> forward(std::span<const int32_t> tokens) const;  // [n, V]

  int vocab_size() const { return vocab_; }

 private:
  using Vec = std::vector<double>;
  using Rows = std::vector<Vec>;  // [n_tokens, width]

  const Vec& w(const std::string& name, std::vector<int64_t> shape) const;
  bool has(const std::string& name) const { return weights_.count(name) != 0; }
  void rms_norm_centred(Vec& x, const Vec& w) const;
  // One token's Gated DeltaNet inputs in one layout: q | k | v of all heads, z, b, a.
  void linear_projections(const std::string& p, const Vec& x, Vec* mixed, Vec* z, Vec* b,
                          Vec* a) const;
  Rows linear_attention(int layer, const Rows& x) const;
  Rows full_attention(int layer, const Rows& x) const;
  Vec swiglu(const std::string& prefix, int64_t ff, const Vec& x) const;
  Vec expert(const std::string& mlp_prefix, int e, const Vec& x) const;
  Rows mlp(int layer, const Rows& x) const;

  enum class Family { kQwen3Next, kQwen3_5, kQwen3_5Moe };
  Family family_ = Family::kQwen3Next;
  std::string prefix_;  // the text model's weights: "model." or "model.language_model."
  TensorMap weights_;
  int hidden_ = 0, layers_ = 0, vocab_ = 0;
  double eps_ = 1e-6;
  bool tied_ = false;
  int heads_ = 0, kv_heads_ = 0, head_dim_ = 0, rot_dim_ = 0;
  double theta_ = 10000.0;
  int hk_ = 0, hv_ = 0, dk_ = 0, dv_ = 0, conv_k_ = 0;
  int intermediate_ = 0, experts_ = 0, topk_ = 0, moe_ff_ = 0, shared_ff_ = 0;
  bool norm_topk_ = true;
  std::vector<bool> full_attn_;  // [layers]
  std::vector<bool> moe_;        // [layers]
};

}  // namespace recur_test
