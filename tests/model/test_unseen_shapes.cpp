// recur's Qwen3-Next forward on shapes the shipped reference data never covers (value/key
// head ratios, conv kernels, head dims that are not powers of two, partial rotary factors,
// dense/MoE mixes, tied embeddings, both config.json styles, F32/BF16/F16 storage), checked
// against an independent double-precision implementation on random checkpoints.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "backend/cpu/cpu_ops.h"
#include "model/naive_qwen3_next.h"
#include "model/qwen3_next.h"
#include "model/random_checkpoint.h"

namespace recur_test {
namespace {

using Logits = std::vector<std::vector<double>>;  // [rows, vocab]

// Far above f32 rounding (~1e-5 here) yet far below what any wrong index, sign or missing
// term produces (O(0.1) and up).
constexpr double kTolerance = 1e-3;
constexpr int kDecodeSteps = 10;
constexpr int kSlots = 4;
constexpr int kBlockSize = 16;
constexpr int kBlocksPerSlot = 16;  // 256 positions per sequence

std::vector<int32_t> random_tokens(int n, int vocab, uint64_t seed) {
  std::vector<int32_t> t;
  uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;
  for (int i = 0; i < n; ++i) {
    s ^= s << 13, s ^= s >> 7, s ^= s << 17;  // xorshift64
    t.push_back(int32_t(s % uint64_t(vocab)));
  }
  return t;
}

// Largest |a - b| over rows [0, rows) of two logit tables.
double max_diff(const Logits& a, const Logits& b, size_t rows) {
  double m = 0;
  for (size_t r = 0; r < rows; ++r) {
    for (size_t v = 0; v < a[r].size(); ++v) m = std::max(m, std::fabs(a[r][v] - b[r][v]));
  }
  return m;
}

// A recur model on random weights, fed by slot and position like the engine would.
class Recur {
 public:
  explicit Recur(const std::string& dir) {
    recur::LoadOptions opt;
    opt.max_batch_tokens = 256;
    opt.state = {kSlots, kSlots * kBlocksPerSlot, kBlockSize};
    auto m = recur::load_model(dir, ops_, opt);
    if (!m.ok()) throw std::runtime_error(m.error().to_string());
    model_ = std::move(m).value();
    vocab_ = model_->info().vocab_size;
    auto buf = ops_.allocator().allocate(size_t(256) * size_t(vocab_) * 4, "test logits");
    if (!buf.ok()) throw std::runtime_error(buf.error().to_string());
    logits_ = std::move(buf).value();
  }

  recur::Model& model() { return *model_; }

  // Interleaved across slots, so every block table is non-contiguous and a cache indexed by
  // slot instead of by block id would read another sequence's keys.
  static std::vector<int32_t> blocks(int slot, int n_positions) {
    std::vector<int32_t> b;
    for (int j = 0; j * kBlockSize < n_positions; ++j)
      b.push_back(j * kSlots + (kSlots - 1 - slot));
    return b;
  }

  struct Part {
    int slot;
    int first_pos;
    std::vector<int32_t> tokens;
  };

  // One forward call carrying every part; the logits of each part's tokens, in part order.
  std::vector<Logits> forward(const std::vector<Part>& parts) {
    recur::Batch batch;
    for (const Part& p : parts) {
      const auto bl = blocks(p.slot, p.first_pos + int(p.tokens.size()));
      batch.add_sequence(p.slot, p.first_pos, p.tokens, bl, recur::Batch::Logits::kAll);
    }
    const int rows = int(batch.logit_rows.size());
    recur::Tensor out = recur::view(logits_, recur::DType::F32, {rows, vocab_});
    recur::Status st = model_->forward(batch, out);
    if (!st.ok()) throw std::runtime_error(st.error().to_string());
    const float* f = logits_.as<float>();
    std::vector<Logits> res;
    int r = 0;
    for (const Part& p : parts) {
      Logits l;
      for (size_t i = 0; i < p.tokens.size(); ++i, ++r) {
        l.emplace_back(f + int64_t(r) * vocab_, f + int64_t(r + 1) * vocab_);
      }
      res.push_back(std::move(l));
    }
    return res;
  }

  // A whole sequence through one slot, split into calls of `piece` tokens (the prompt) and
  // then one token per call for the last `decode` tokens: teacher-forced generation.
  Logits run_sequence(int slot, const std::vector<int32_t>& tokens, int prompt_len, int piece) {
    model_->reset_slot(slot);
    Logits all;
    int pos = 0;
    while (pos < int(tokens.size())) {
      const int n = pos < prompt_len ? std::min(piece, prompt_len - pos) : 1;
      std::vector<int32_t> chunk(tokens.begin() + pos, tokens.begin() + pos + n);
      Logits l = forward({{slot, pos, chunk}})[0];
      all.insert(all.end(), l.begin(), l.end());
      pos += n;
    }
    return all;
  }

 private:
  recur::CpuOps ops_{2};  // declared first: the model keeps a reference to it
  std::unique_ptr<recur::Model> model_;
  recur::Buffer logits_;
  int vocab_ = 0;
};

void check_config(const RandomModelSpec& spec, uint64_t seed, int prompt_len) {
  TempDir dir;
  const RandomCheckpoint ck = make_random_checkpoint(spec, seed);
  write_checkpoint(dir.path(), ck);
  const NaiveQwen3Next naive(ck.config, ck.tensors);
  Recur recur(dir.path());
  ASSERT_EQ(recur.model().info().vocab_size, spec.vocab);

  // One sequence: prompt, then teacher-forced decode steps; the reference sees it whole.
  const auto tokens = random_tokens(prompt_len + kDecodeSteps, spec.vocab, seed + 1);
  const Logits ref = naive.forward(tokens);
  const size_t n = tokens.size();
  double scale = 0;  // largest |logit|, to read the differences against
  for (const auto& row : ref) {
    for (double v : row) scale = std::max(scale, std::fabs(v));
  }
  struct Mode {
    const char* name;
    int slot;
    int piece;
  };
  double worst = 0;
  for (const Mode& m : {Mode{"one call", 0, prompt_len}, Mode{"chunks of 17", 1, 17},
                        Mode{"token by token", 2, 1}}) {
    const Logits got = recur.run_sequence(m.slot, tokens, prompt_len, m.piece);
    ASSERT_EQ(got.size(), n);
    const double prompt_d = max_diff(got, ref, size_t(prompt_len));
    double decode_d = 0;
    for (size_t r = size_t(prompt_len); r < n; ++r) {
      decode_d = std::max(decode_d, max_diff({got[r]}, {ref[r]}, 1));
    }
    std::printf("  [%s] prompt in %-14s max|dlogit| prompt %.3g, decode %.3g (max|logit| %.3g)\n",
                ::testing::UnitTest::GetInstance()->current_test_info()->name(), m.name, prompt_d,
                decode_d, scale);
    EXPECT_LE(prompt_d, kTolerance) << m.name;
    EXPECT_LE(decode_d, kTolerance) << m.name;
    worst = std::max({worst, prompt_d, decode_d});
  }

  // Three sequences of different lengths share each forward call: first all prefill, then a
  // step mixing decode with a further prefill, then a pure decode step.
  const std::vector<std::vector<int>> steps = {{prompt_len - 9, 23, 1}, {1, 31, 1}, {1, 1, 1}};
  std::vector<std::vector<int32_t>> seqs;
  for (int s = 0; s < 3; ++s) {
    int len = 0;
    for (const auto& st : steps) len += st[size_t(s)];
    seqs.push_back(random_tokens(len, spec.vocab, seed + 10 + uint64_t(s)));
  }
  auto run_steps = [&](const std::vector<int>& which) {
    std::vector<Logits> out(3);
    std::vector<int> pos(3, 0);
    for (int s : which) recur.model().reset_slot(s + 1);
    for (const auto& st : steps) {
      std::vector<Recur::Part> parts;
      for (int s : which) {
        parts.push_back(
            {s + 1, pos[size_t(s)],
             std::vector<int32_t>(seqs[size_t(s)].begin() + pos[size_t(s)],
                                  seqs[size_t(s)].begin() + pos[size_t(s)] + st[size_t(s)])});
        pos[size_t(s)] += st[size_t(s)];
      }
      auto res = recur.forward(parts);
      for (size_t i = 0; i < which.size(); ++i) {
        auto& o = out[size_t(which[i])];
        o.insert(o.end(), res[i].begin(), res[i].end());
      }
    }
    return out;
  };
  const std::vector<Logits> batched = run_steps({0, 1, 2});
  double batch_vs_alone = 0, batch_vs_ref = 0;
  for (int s = 0; s < 3; ++s) {
    const Logits alone = run_steps({s})[size_t(s)];
    const Logits sref = naive.forward(seqs[size_t(s)]);
    ASSERT_EQ(batched[size_t(s)].size(), seqs[size_t(s)].size());
    ASSERT_EQ(alone.size(), seqs[size_t(s)].size());
    batch_vs_alone =
        std::max(batch_vs_alone, max_diff(batched[size_t(s)], alone, seqs[size_t(s)].size()));
    batch_vs_ref =
        std::max(batch_vs_ref, max_diff(batched[size_t(s)], sref, seqs[size_t(s)].size()));
  }
  std::printf("  [%s] batch of 3: max|dlogit| vs alone %.3g, vs reference %.3g\n",
              ::testing::UnitTest::GetInstance()->current_test_info()->name(), batch_vs_alone,
              batch_vs_ref);
  EXPECT_LE(batch_vs_alone, kTolerance);
  EXPECT_LE(batch_vs_ref, kTolerance);
  ::testing::Test::RecordProperty("max_abs_logit_diff",
                                  std::to_string(std::max(worst, batch_vs_ref)));
}

// Ratio 1, kernel 4, one KV head, head dim 24 with a quarter rotated, MoE everywhere;
// full_attention_interval and top-level rope fields.
TEST(UnseenShapes, RatioOneKernel4SingleKvHead) {
  RandomModelSpec s;
  s.hidden = 32, s.layers = 4, s.vocab = 96;
  s.heads = 4, s.kv_heads = 1, s.head_dim = 24, s.partial_rotary_factor = 0.25;
  s.rope_theta = 10000.0, s.rope_parameters_style = false, s.full_attention_interval = 4;
  s.linear_key_heads = 2, s.linear_value_heads = 2, s.linear_key_dim = 8;
  s.linear_value_dim = 12, s.conv_kernel = 4;
  s.experts = 4, s.experts_per_tok = 2, s.moe_intermediate = 16, s.shared_intermediate = 24;
  s.norm_topk_prob = true, s.decoder_sparse_step = 1;
  check_config(s, 101, 100);
}

// Ratio 2, kernel 3, KV heads == heads, head dim 12 half rotated, irregular layer_types,
// dense/MoE mix (sparse step 2 and an mlp_only layer), no top-k renormalisation, tied
// embeddings, rope_parameters, BF16 weights.
TEST(UnseenShapes, RatioTwoKernel3IrregularTiedBf16) {
  RandomModelSpec s;
  s.hidden = 24, s.layers = 5, s.vocab = 200, s.rms_norm_eps = 1e-5;
  s.tie_word_embeddings = true;
  s.heads = 2, s.kv_heads = 2, s.head_dim = 12, s.partial_rotary_factor = 0.5;
  s.rope_theta = 1e6, s.rope_parameters_style = true;
  s.layer_types = {"full_attention", "linear_attention", "linear_attention", "full_attention",
                   "linear_attention"};
  s.linear_key_heads = 2, s.linear_value_heads = 4, s.linear_key_dim = 12;
  s.linear_value_dim = 8, s.conv_kernel = 3;
  s.intermediate = 40;
  s.experts = 6, s.experts_per_tok = 3, s.moe_intermediate = 12, s.shared_intermediate = 20;
  s.norm_topk_prob = false, s.decoder_sparse_step = 2, s.mlp_only_layers = {3};
  s.dtype = StoreType::kBF16;
  check_config(s, 202, 131);
}

// Ratio 3 with a single key head, kernel 2, head dim 20 fully rotated, dense layers among MoE
// (mlp_only_layers), full_attention_interval with rope_parameters, F16 weights with A_log and
// dt_bias left in F32.
TEST(UnseenShapes, RatioThreeKernel2FullRotaryF16) {
  RandomModelSpec s;
  s.hidden = 48, s.layers = 6, s.vocab = 300;
  s.heads = 3, s.kv_heads = 1, s.head_dim = 20, s.partial_rotary_factor = 1.0;
  s.rope_theta = 5000.0, s.rope_parameters_style = true, s.full_attention_interval = 3;
  s.linear_key_heads = 1, s.linear_value_heads = 3, s.linear_key_dim = 16;
  s.linear_value_dim = 10, s.conv_kernel = 2;
  s.intermediate = 64;
  s.experts = 5, s.experts_per_tok = 2, s.moe_intermediate = 20, s.shared_intermediate = 16;
  s.norm_topk_prob = true, s.decoder_sparse_step = 1, s.mlp_only_layers = {0, 4};
  s.dtype = StoreType::kF16, s.gate_params_f32 = true;
  check_config(s, 303, 77);
}

// Three key heads of ratio 2, kernel 4, grouped KV (2 of 4), every layer dense, layer_types
// with top-level rope fields, the longest prompt (three 64-token chunks).
TEST(UnseenShapes, ThreeKeyHeadsDenseOnly) {
  RandomModelSpec s;
  s.hidden = 40, s.layers = 3, s.vocab = 64;
  s.heads = 4, s.kv_heads = 2, s.head_dim = 16, s.partial_rotary_factor = 0.5;
  s.rope_theta = 10000.0, s.rope_parameters_style = false;
  s.layer_types = {"linear_attention", "full_attention", "linear_attention"};
  s.linear_key_heads = 3, s.linear_value_heads = 6, s.linear_key_dim = 12;
  s.linear_value_dim = 12, s.conv_kernel = 4;
  s.intermediate = 56, s.experts = 0;
  check_config(s, 404, 150);
}

// ---- loading: every checkpoint defect is an error naming the culprit, never a crash ----

RandomModelSpec small_spec() {
  RandomModelSpec s;
  s.hidden = 16, s.layers = 4, s.vocab = 50, s.heads = 2, s.kv_heads = 1, s.head_dim = 8;
  s.linear_key_heads = 1, s.linear_value_heads = 2, s.linear_key_dim = 8;
  s.linear_value_dim = 8, s.conv_kernel = 4, s.experts = 2, s.experts_per_tok = 1;
  return s;
}

recur::Result<std::unique_ptr<recur::Model>> load(const RandomCheckpoint& ck, recur::Ops& ops) {
  TempDir dir;
  write_checkpoint(dir.path(), ck);
  recur::LoadOptions opt;
  opt.max_batch_tokens = 16;
  opt.state = {1, 4, 16};
  return recur::load_model(dir.path(), ops, opt);
}

TEST(UnseenShapesLoad, ValidCheckpointLoadsAndMtpTensorsAreIgnored) {
  recur::CpuOps ops(2);
  RandomCheckpoint ck = make_random_checkpoint(small_spec(), 7);
  auto plain = load(ck, ops);
  ASSERT_TRUE(plain.ok()) << plain.error().to_string();

  // Multi-token-prediction heads ship in released checkpoints; recur does not use them.
  ck.tensors["mtp.fc.weight"] = {{16, 32}, StoreType::kF32, std::vector<double>(16 * 32, 0.5)};
  ck.tensors["mtp.layers.0.input_layernorm.weight"] = {
      {16}, StoreType::kBF16, std::vector<double>(16, 1.0)};
  auto with_mtp = load(ck, ops);
  ASSERT_TRUE(with_mtp.ok()) << with_mtp.error().to_string();
}

TEST(UnseenShapesLoad, MissingTensorIsNamed) {
  recur::CpuOps ops(2);
  for (const char* name :
       {"model.layers.1.linear_attn.A_log", "model.layers.3.self_attn.q_norm.weight",
        "model.layers.2.mlp.experts.1.down_proj.weight", "lm_head.weight", "model.norm.weight"}) {
    RandomCheckpoint ck = make_random_checkpoint(small_spec(), 7);
    ASSERT_EQ(ck.tensors.erase(name), 1u) << name;
    auto m = load(ck, ops);
    ASSERT_FALSE(m.ok()) << name;
    std::printf("  %s\n", m.error().to_string().c_str());
    EXPECT_NE(m.error().message.find(name), std::string::npos) << m.error().to_string();
  }
}

TEST(UnseenShapesLoad, WrongShapeIsNamed) {
  recur::CpuOps ops(2);
  struct Case {
    const char* name;
    std::vector<int64_t> shape;
  };
  for (const Case& c : {Case{"model.layers.3.self_attn.k_norm.weight", {9}},
                        Case{"model.layers.0.linear_attn.conv1d.weight", {32, 1, 3}},
                        Case{"model.layers.1.linear_attn.in_proj_qkvz.weight", {16, 48}},
                        Case{"model.embed_tokens.weight", {51, 16}}}) {
    RandomCheckpoint ck = make_random_checkpoint(small_spec(), 7);
    StoredTensor& t = ck.tensors.at(c.name);
    int64_t n = 1;
    for (int64_t d : c.shape) n *= d;
    t.shape = c.shape;
    t.values.assign(size_t(n), 0.25);
    auto m = load(ck, ops);
    ASSERT_FALSE(m.ok()) << c.name;
    std::printf("  %s\n", m.error().to_string().c_str());
    EXPECT_NE(m.error().message.find(c.name), std::string::npos) << m.error().to_string();
  }
}

TEST(UnseenShapesLoad, UnexpectedTensorIsNamed) {
  recur::CpuOps ops(2);
  RandomCheckpoint ck = make_random_checkpoint(small_spec(), 7);
  const std::string extra = "model.layers.0.linear_attn.extra_bias";
  ck.tensors[extra] = {{4}, StoreType::kF32, std::vector<double>(4, 0.0)};
  auto m = load(ck, ops);
  ASSERT_FALSE(m.ok());
  std::printf("  %s\n", m.error().to_string().c_str());
  EXPECT_NE(m.error().message.find(extra), std::string::npos) << m.error().to_string();
}

TEST(UnseenShapesLoad, UnknownModelTypeIsNamed) {
  recur::CpuOps ops(2);
  RandomCheckpoint ck = make_random_checkpoint(small_spec(), 7);
  ck.config["model_type"] = "qwen9_hyper";
  auto m = load(ck, ops);
  ASSERT_FALSE(m.ok());
  std::printf("  %s\n", m.error().to_string().c_str());
  EXPECT_NE(m.error().message.find("qwen9_hyper"), std::string::npos) << m.error().to_string();
}

}  // namespace
}  // namespace recur_test
