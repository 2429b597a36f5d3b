// recur's Qwen3-Next and Qwen3.5 forwards on shapes and layouts the shipped reference data never
// covers (value/key head ratios, key and value head sizes apart, conv kernels, head dims that are
// not powers of two, partial rotary factors and multimodal rotary sections, dense/MoE mixes, tied
// embeddings, every config.json style, nested and flat Qwen3.5 checkpoints, fused and per-expert
// experts, F32/BF16/F16 storage), checked against an independent double-precision
// implementation (itself checked against transformers in test_naive_oracle.cpp) on random
// checkpoints. RECUR_TEST_DEVICE=cuda runs the forwards on the CUDA backend (device machine).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/cpu_ops.h"
#include "model/naive_qwen_hybrid.h"
#include "model/random_checkpoint.h"
#include "model/registry.h"

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

// Largest |a - b| over rows [0, rows) of two logit tables.
double max_diff(const Logits& a, const Logits& b, size_t rows) {
  double m = 0;
  for (size_t r = 0; r < rows; ++r) {
    for (size_t v = 0; v < a[r].size(); ++v) m = std::max(m, std::fabs(a[r][v] - b[r][v]));
  }
  return m;
}

// The backend the forwards run on: RECUR_TEST_DEVICE (cuda on the device machine), else the CPU.
std::unique_ptr<recur::Ops> test_backend() {
  const char* d = std::getenv("RECUR_TEST_DEVICE");
  auto ops = recur::create_backend(d ? d : "cpu", 2);
  if (!ops.ok()) throw std::runtime_error(ops.error().to_string());
  return std::move(ops).value();
}

// A recur model on random weights, fed by slot and position like the engine would.
class Recur {
 public:
  explicit Recur(const std::string& dir) : ops_(test_backend()) {
    recur::LoadOptions opt;
    opt.max_batch_tokens = 256;
    opt.state = {kSlots, kSlots * kBlocksPerSlot, kBlockSize};
    auto m = recur::load_model(dir, *ops_, opt);
    if (!m.ok()) throw std::runtime_error(m.error().to_string());
    model_ = std::move(m).value();
    vocab_ = model_->info().vocab_size;
    auto buf = ops_->allocator().allocate(size_t(256) * size_t(vocab_) * 4, "test logits");
    if (!buf.ok()) throw std::runtime_error(buf.error().to_string());
    logits_ = std::move(buf).value();
    host_logits_.resize(size_t(256) * size_t(vocab_));
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
    ops_->copy_to_host(out, host_logits_.data());
    const float* f = host_logits_.data();
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
  std::unique_ptr<recur::Ops> ops_;  // declared first: the model keeps a reference to it
  std::unique_ptr<recur::Model> model_;
  recur::Buffer logits_;            // [256, vocab] on the backend
  std::vector<float> host_logits_;  // [256, vocab]
  int vocab_ = 0;
};

void check_config(const RandomModelSpec& spec, uint64_t seed, int prompt_len) {
  TempDir dir;
  const RandomCheckpoint ck = make_random_checkpoint(spec, seed);
  write_checkpoint(dir.path(), ck);
  const NaiveQwenHybrid naive(ck.config, ck.tensors);
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

// ---- Qwen3.5: in_proj_qkv / _z / _b / _a, nested or flat, dense or MoE ----

// Dense, nested as published (weights under model.language_model., vision tower and MTP head to
// skip), tied embeddings (the wrapper's flag; no lm_head.weight), ratio 1 with three key heads,
// dk 12 != dv 20, kernel 5, head dim 24 with 6 channels rotated in sections [1, 1, 1].
TEST(UnseenShapes, Qwen3_5DenseNestedTiedRatio1Kernel5) {
  RandomModelSpec s;
  s.family = Family::kQwen3_5, s.nested = true, s.tie_word_embeddings = true;
  s.hidden = 36, s.layers = 4, s.vocab = 97, s.full_attention_interval = 2;
  s.heads = 3, s.kv_heads = 1, s.head_dim = 24, s.partial_rotary_factor = 0.25;
  s.rope_theta = 1e7, s.mrope_section = {1, 1, 1};
  s.linear_key_heads = 3, s.linear_value_heads = 3, s.linear_key_dim = 12;
  s.linear_value_dim = 20, s.conv_kernel = 5;
  s.intermediate = 44, s.experts = 0;
  check_config(s, 505, 70);
}

// Dense, flat text-only (Qwen3_5ForCausalLM, weights under model.), BF16 with A_log and
// dt_bias in F32 as the releases store them, ratio 3 over two key heads (value heads grouped by
// key head), dk 10 != dv 6, kernel 2, head dim 20 half rotated in sections [3, 1, 1].
TEST(UnseenShapes, Qwen3_5DenseFlatBf16Ratio3Kernel2) {
  RandomModelSpec s;
  s.family = Family::kQwen3_5, s.nested = false;
  s.hidden = 30, s.layers = 3, s.vocab = 150, s.rms_norm_eps = 1e-5;
  s.layer_types = {"linear_attention", "linear_attention", "full_attention"};
  s.heads = 4, s.kv_heads = 2, s.head_dim = 20, s.partial_rotary_factor = 0.5;
  s.rope_theta = 10000.0, s.mrope_section = {3, 1, 1};
  s.linear_key_heads = 2, s.linear_value_heads = 6, s.linear_key_dim = 10;
  s.linear_value_dim = 6, s.conv_kernel = 2;
  s.intermediate = 50, s.experts = 0;
  s.dtype = StoreType::kBF16, s.gate_params_f32 = true;
  check_config(s, 606, 60);
}

// MoE, nested with fused experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]) in BF16 with
// F32 gate parameters, as the bf16 releases are; ratio 2 over two key heads, dk 8 != dv 12,
// kernel 3, head dim 12 half rotated; the config also carries Qwen3-Next's norm_topk_prob false,
// decoder_sparse_step 2 and mlp_only_layers, which Qwen3.5-MoE ignores (it always renormalises,
// every layer MoE).
TEST(UnseenShapes, Qwen3_5MoeNestedFusedBf16Ratio2Kernel3) {
  RandomModelSpec s;
  s.family = Family::kQwen3_5Moe, s.nested = true, s.fused_experts = true;
  s.hidden = 24, s.layers = 4, s.vocab = 120, s.full_attention_interval = 4;
  s.heads = 2, s.kv_heads = 2, s.head_dim = 12, s.partial_rotary_factor = 0.5;
  s.rope_theta = 1e6, s.mrope_section = {1, 1, 1};
  s.linear_key_heads = 2, s.linear_value_heads = 4, s.linear_key_dim = 8;
  s.linear_value_dim = 12, s.conv_kernel = 3;
  s.experts = 6, s.experts_per_tok = 3, s.moe_intermediate = 10, s.shared_intermediate = 14;
  s.norm_topk_prob = false, s.decoder_sparse_step = 2, s.mlp_only_layers = {0};
  s.dtype = StoreType::kBF16, s.gate_params_f32 = true;
  check_config(s, 707, 66);
}

// MoE, flat with one tensor per expert, tied, F16; a single key head of ratio 2, dk 14 != dv 10,
// kernel 4, attention first, head dim 40 with 10 channels rotated in sections [2, 2, 1].
TEST(UnseenShapes, Qwen3_5MoeFlatPerExpertTiedF16) {
  RandomModelSpec s;
  s.family = Family::kQwen3_5Moe, s.nested = false, s.fused_experts = false;
  s.tie_word_embeddings = true;
  s.hidden = 32, s.layers = 3, s.vocab = 80;
  s.layer_types = {"full_attention", "linear_attention", "linear_attention"};
  s.heads = 5, s.kv_heads = 1, s.head_dim = 40, s.partial_rotary_factor = 0.25;
  s.rope_theta = 10000.0, s.mrope_section = {2, 2, 1};
  s.linear_key_heads = 1, s.linear_value_heads = 2, s.linear_key_dim = 14;
  s.linear_value_dim = 10, s.conv_kernel = 4;
  s.experts = 5, s.experts_per_tok = 2, s.moe_intermediate = 12, s.shared_intermediate = 8;
  s.dtype = StoreType::kF16;
  check_config(s, 808, 55);
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

// Expects loading to fail with an error that names `culprit`.
void expect_named_error(const RandomCheckpoint& ck, const std::string& culprit) {
  recur::CpuOps ops(2);
  auto m = load(ck, ops);
  ASSERT_FALSE(m.ok()) << culprit;
  std::printf("  %s\n", m.error().to_string().c_str());
  EXPECT_NE(m.error().message.find(culprit), std::string::npos) << m.error().to_string();
}

// Gives a stored tensor another shape (its values all 0.25).
void set_shape(StoredTensor& t, const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  t.shape = shape;
  t.values.assign(size_t(n), 0.25);
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
  for (const char* name :
       {"model.layers.1.linear_attn.A_log", "model.layers.3.self_attn.q_norm.weight",
        "model.layers.2.mlp.experts.1.down_proj.weight", "lm_head.weight", "model.norm.weight"}) {
    RandomCheckpoint ck = make_random_checkpoint(small_spec(), 7);
    ASSERT_EQ(ck.tensors.erase(name), 1u) << name;
    expect_named_error(ck, name);
  }
}

TEST(UnseenShapesLoad, WrongShapeIsNamed) {
  struct Case {
    const char* name;
    std::vector<int64_t> shape;
  };
  for (const Case& c : {Case{"model.layers.3.self_attn.k_norm.weight", {9}},
                        Case{"model.layers.0.linear_attn.conv1d.weight", {32, 1, 3}},
                        Case{"model.layers.1.linear_attn.in_proj_qkvz.weight", {16, 48}},
                        Case{"model.embed_tokens.weight", {51, 16}}}) {
    RandomCheckpoint ck = make_random_checkpoint(small_spec(), 7);
    set_shape(ck.tensors.at(c.name), c.shape);
    expect_named_error(ck, c.name);
  }
}

TEST(UnseenShapesLoad, UnexpectedTensorIsNamed) {
  RandomCheckpoint ck = make_random_checkpoint(small_spec(), 7);
  const std::string extra = "model.layers.0.linear_attn.extra_bias";
  ck.tensors[extra] = {{4}, StoreType::kF32, std::vector<double>(4, 0.0)};
  expect_named_error(ck, extra);
}

TEST(UnseenShapesLoad, UnknownModelTypeIsNamed) {
  RandomCheckpoint ck = make_random_checkpoint(small_spec(), 7);
  ck.config["model_type"] = "qwen9_hyper";
  expect_named_error(ck, "qwen9_hyper");
}

// ---- loading Qwen3.5 checkpoints ----

RandomModelSpec small_qwen3_5_spec(Family family, bool nested, bool fused) {
  RandomModelSpec s = small_spec();
  s.family = family, s.nested = nested, s.fused_experts = fused;
  s.mrope_section = {1, 0, 0};  // head dim 8 × 0.25: 2 channels rotated
  s.intermediate = 24, s.moe_intermediate = 8, s.shared_intermediate = 12;
  if (family == Family::kQwen3_5) s.experts = 0;
  return s;
}

TEST(UnseenShapesLoad, Qwen3_5SkipsVisionAndMtpAndReportsThem) {
  struct Case {
    Family family;
    bool nested, fused;
    const char* architecture;
  };
  for (const Case& c : {Case{Family::kQwen3_5Moe, true, true, "qwen3_5_moe"},
                        Case{Family::kQwen3_5, true, false, "qwen3_5"},
                        Case{Family::kQwen3_5, false, false, "qwen3_5_text"},
                        Case{Family::kQwen3_5Moe, false, false, "qwen3_5_moe_text"}}) {
    const RandomModelSpec s = small_qwen3_5_spec(c.family, c.nested, c.fused);
    const RandomCheckpoint ck = make_random_checkpoint(s, 9);
    recur::CpuOps ops(2);
    auto m = load(ck, ops);
    ASSERT_TRUE(m.ok()) << c.architecture << ": " << m.error().to_string();
    const recur::ModelInfo& info = (*m)->info();
    EXPECT_EQ(info.architecture, c.architecture);
    EXPECT_EQ(info.vocab_size, s.vocab);
    EXPECT_NE(std::find(info.eos_token_ids.begin(), info.eos_token_ids.end(), s.vocab - 1),
              info.eos_token_ids.end());
    EXPECT_EQ(info.moe_layers, c.family == Family::kQwen3_5Moe ? s.layers : 0) << c.architecture;
    // Each skipped part is reported with its tensor count.
    for (const std::string prefix : {"model.visual.", "mtp."}) {
      int count = 0;
      for (const auto& [name, t] : ck.tensors) count += name.rfind(prefix, 0) == 0;
      bool reported = false;
      for (const std::string& note : info.notes) {
        reported |= note.find(prefix) != std::string::npos &&
                    note.find(std::to_string(count) + " tensors") != std::string::npos;
      }
      EXPECT_EQ(reported, count > 0) << c.architecture << " " << prefix;
    }
    for (const std::string& note : info.notes)
      std::printf("  %s: %s\n", c.architecture, note.c_str());
    // The multimodal wrapper's image and video placeholders are refused, not embedded.
    const auto& refused = info.refused_token_ids;
    EXPECT_EQ(std::find(refused.begin(), refused.end(), 248056) != refused.end(), c.nested);
  }
}

TEST(UnseenShapesLoad, Qwen3_5MissingTensorIsNamed) {
  const std::string L = "model.language_model.layers.";
  struct Case {
    RandomModelSpec spec;
    std::string name;
  };
  const RandomModelSpec dense = small_qwen3_5_spec(Family::kQwen3_5, true, false);
  const RandomModelSpec fused = small_qwen3_5_spec(Family::kQwen3_5Moe, true, true);
  const RandomModelSpec flat = small_qwen3_5_spec(Family::kQwen3_5Moe, false, false);
  for (const Case& c :
       {Case{dense, L + "0.linear_attn.in_proj_z.weight"},
        Case{dense, L + "1.linear_attn.in_proj_qkv.weight"},
        Case{dense, L + "2.linear_attn.in_proj_a.weight"}, Case{dense, L + "3.mlp.up_proj.weight"},
        Case{dense, "lm_head.weight"}, Case{dense, "model.language_model.norm.weight"},
        Case{fused, L + "1.mlp.experts.down_proj"},
        Case{fused, L + "2.mlp.shared_expert_gate.weight"},
        Case{flat, "model.layers.0.linear_attn.in_proj_b.weight"},
        Case{flat, "model.layers.3.mlp.experts.1.up_proj.weight"}}) {
    RandomCheckpoint ck = make_random_checkpoint(c.spec, 7);
    ASSERT_EQ(ck.tensors.erase(c.name), 1u) << c.name;
    expect_named_error(ck, c.name);
  }
}

TEST(UnseenShapesLoad, Qwen3_5WrongShapeIsNamed) {
  const std::string L = "model.language_model.layers.";
  const RandomModelSpec dense = small_qwen3_5_spec(Family::kQwen3_5, true, false);
  const RandomModelSpec fused = small_qwen3_5_spec(Family::kQwen3_5Moe, true, true);
  // small spec: hidden 16, E 2, I 8, Hk 1 × dk 8, Hv 2 × dv 8 (conv channels 32).
  struct Case {
    RandomModelSpec spec;
    std::string name;
    std::vector<int64_t> shape;
  };
  for (const Case& c :
       {Case{fused, L + "0.mlp.experts.gate_up_proj", {2, 8, 16}},  // gate rows only
        Case{fused, L + "1.mlp.experts.gate_up_proj", {2, 16, 17}},
        Case{fused, L + "2.mlp.experts.gate_up_proj", {16, 16}},
        Case{fused, L + "0.mlp.experts.down_proj", {2, 8, 16}},  // transposed
        Case{dense, L + "0.linear_attn.in_proj_qkv.weight", {24, 16}},
        Case{dense, L + "1.linear_attn.in_proj_z.weight", {8, 16}},
        Case{dense, L + "2.linear_attn.in_proj_b.weight", {1, 16}},
        Case{dense, L + "3.self_attn.q_proj.weight", {16, 16}}}) {
    RandomCheckpoint ck = make_random_checkpoint(c.spec, 7);
    set_shape(ck.tensors.at(c.name), c.shape);
    expect_named_error(ck, c.name);
  }
}

TEST(UnseenShapesLoad, Qwen3_5UnexpectedTensorIsNamed) {
  const std::string L = "model.language_model.layers.";
  const RandomModelSpec fused = small_qwen3_5_spec(Family::kQwen3_5Moe, true, true);
  const RandomModelSpec flat = small_qwen3_5_spec(Family::kQwen3_5, false, false);
  struct Case {
    RandomModelSpec spec;
    std::string name;
  };
  // Qwen3-Next's projections in a Qwen3.5 checkpoint; per-expert tensors beside fused ones; a
  // tower that is not the vision one; a prefix that only starts like model.visual.; experts in
  // a dense model.
  for (const Case& c :
       {Case{fused, L + "0.linear_attn.in_proj_qkvz.weight"},
        Case{fused, L + "1.mlp.experts.0.gate_proj.weight"},
        Case{fused, "model.audio_tower.proj.weight"}, Case{fused, "model.visualizer.proj.weight"},
        Case{flat, "model.layers.0.linear_attn.in_proj_ba.weight"},
        Case{flat, "model.layers.1.mlp.experts.gate_up_proj"}}) {
    RandomCheckpoint ck = make_random_checkpoint(c.spec, 7);
    ASSERT_TRUE(
        ck.tensors
            .emplace(c.name, StoredTensor{{4, 16}, StoreType::kF32, std::vector<double>(64, 0.5)})
            .second)
        << c.name;
    expect_named_error(ck, c.name);
  }
}

}  // namespace
}  // namespace recur_test
