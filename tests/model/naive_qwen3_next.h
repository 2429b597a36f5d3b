// A plain, double-precision Qwen3-Next forward pass written from the Hugging Face transformers
// definition, sharing no code with recur: the oracle the unseen-shape tests compare against.
// One sequence from position 0, the whole sequence at once (no state carried between calls),
// every loop the textbook one. Slow and simple on purpose.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "model/random_checkpoint.h"

namespace recur_test {

class NaiveQwen3Next {
 public:
  // Reads the hyper-parameters from config.json (either style) and keeps a copy of the
  // weights; throws std::runtime_error naming a missing or misshapen tensor or field.
  NaiveQwen3Next(const nlohmann::json& config, const TensorMap& weights);

  // Logits of every position of a sequence that starts at position 0.
  std::vector<std::vector<double>> forward(std::span<const int32_t> tokens) const;  // [n, V]

  int vocab_size() const { return vocab_; }

 private:
  using Rows = std::vector<std::vector<double>>;  // [n_tokens, width]

  const std::vector<double>& w(const std::string& name, std::vector<int64_t> shape) const;
  void rms_norm_centred(std::vector<double>& x, const std::vector<double>& w) const;
  Rows linear_attention(int layer, const Rows& x) const;
  Rows full_attention(int layer, const Rows& x) const;
  Rows mlp(int layer, const Rows& x) const;

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
