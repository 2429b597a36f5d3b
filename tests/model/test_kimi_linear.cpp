// Kimi-Linear's loading: clear errors for what the config gets wrong or recur does not support;
// random-weight models of other shapes (group-limited routing, conv width 3, more dense layers,
// odd head counts) whose prompt and token-by-token decode agree; random checkpoints of such
// shapes against a naive double-precision forward written here (expanded latent attention,
// transformers' router); and a cache that holds the latent, not expanded keys and values. The
// logits against transformers are checked by `recur verify` (tests/cli/verify.sh) on
// models/kimi-linear-tiny. RECUR_TEST_DEVICE=cuda runs the forwards on the CUDA backend (device
// machine).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <stdexcept>

#include "backend/backend.h"
#include "backend/cpu/cpu_ops.h"
#include "io/checkpoint.h"
#include "model/random_checkpoint.h"
#include "model/registry.h"

namespace recur {
namespace {

using json = nlohmann::json;
using Vec = std::vector<double>;

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
      // Refused before anything is sized by it (a layer list of a billion entries).
      {[](json& c) { c["num_hidden_layers"] = 1 << 30; }, "num_hidden_layers"},
      {[](json& c) { c["rms_norm_eps"] = 1e308; }, "rms_norm_eps"},
      {[](json& c) { c["routed_scaling_factor"] = 1e308; }, "routed_scaling_factor"},
      {[](json& c) { c["kv_lora_rank"] = 32 * 576; }, "kv_lora_rank + qk_rope_head_dim"},
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
  EXPECT_EQ((*m)->info().expanded_kv_bytes_per_token, layers * heads * (dn + dr + dv) * 4);
  EXPECT_EQ((*m)->info().attention_layers, layers);
}

// ---- a naive oracle on checkpoints of shapes no reference has ----

// A plain double-precision Kimi-Linear forward written from the modeling code (docs/kimi-
// linear.md §2-6), sharing no code with recur: the latent attention expanded per head (not
// absorbed), the group-limited router as transformers writes it, the delta rule step by step.
// One sequence from position 0. Slow and simple on purpose.
class NaiveKimi {
 public:
  NaiveKimi(const json& c, const recur_test::TensorMap& w) : c_(c), w_(w) {}

  std::vector<Vec> forward(const std::vector<int32_t>& tokens) const {
    const int64_t n = int64_t(tokens.size()), H = c_["hidden_size"];
    const double eps = c_["rms_norm_eps"];
    std::vector<Vec> h(static_cast<size_t>(n));
    for (int64_t t = 0; t < n; ++t) h[size_t(t)] = row("model.embed_tokens.weight", tokens[t], H);
    const int layers = c_["num_hidden_layers"];
    const json& lac = c_["linear_attn_config"];
    for (int i = 0; i < layers; ++i) {
      const std::string p = "model.layers." + std::to_string(i) + ".";
      std::vector<Vec> x = h;
      for (Vec& r : x) rms(r, get(p + "input_layernorm.weight"), eps);
      bool kda = false;
      for (const json& l : lac["kda_layers"]) kda = kda || l.get<int>() == i + 1;
      const std::vector<Vec> a =
          kda ? kda_layer(p + "self_attn.", x) : mla_layer(p + "self_attn.", x);
      for (int64_t t = 0; t < n; ++t) add(h[size_t(t)], a[size_t(t)]);
      x = h;
      for (Vec& r : x) rms(r, get(p + "post_attention_layernorm.weight"), eps);
      const bool moe = i >= c_["first_k_dense_replace"].get<int>();
      for (int64_t t = 0; t < n; ++t) {
        add(h[size_t(t)],
            moe ? moe_token(p + "block_sparse_moe.", x[size_t(t)])
                : swiglu(p + "mlp.", x[size_t(t)], "gate_proj", "up_proj", "down_proj"));
      }
    }
    std::vector<Vec> logits;
    for (Vec& r : h) {
      rms(r, get("model.norm.weight"), eps);
      logits.push_back(matvec("lm_head.weight", r));
    }
    return logits;
  }

 private:
  const Vec& get(const std::string& name) const {
    auto it = w_.find(name);
    if (it == w_.end()) throw std::runtime_error("naive: no tensor " + name);
    return it->second.values;
  }
  Vec row(const std::string& name, int64_t r, int64_t cols) const {
    const Vec& v = get(name);
    return Vec(v.begin() + r * cols, v.begin() + (r + 1) * cols);
  }
  Vec matvec(const std::string& name, const Vec& x) const {  // W [m, k] · x
    const Vec& W = get(name);
    const size_t k = x.size(), m = W.size() / k;
    Vec y(m, 0.0);
    for (size_t i = 0; i < m; ++i)
      for (size_t j = 0; j < k; ++j) y[i] += W[i * k + j] * x[j];
    return y;
  }
  static void add(Vec& a, const Vec& b) {
    for (size_t i = 0; i < a.size(); ++i) a[i] += b[i];
  }
  static void rms(Vec& x, const Vec& w, double eps, size_t off = 0, size_t len = 0) {
    if (len == 0) len = x.size();
    double ss = 0;
    for (size_t i = 0; i < len; ++i) ss += x[off + i] * x[off + i];
    const double f = 1.0 / std::sqrt(ss / double(len) + eps);
    for (size_t i = 0; i < len; ++i) x[off + i] = x[off + i] * f * w[i];
  }
  static double silu(double v) { return v / (1 + std::exp(-v)); }
  static double sigmoid(double v) { return 1 / (1 + std::exp(-v)); }
  Vec swiglu(const std::string& p, const Vec& x, const char* g, const char* u,
             const char* d) const {
    Vec a = matvec(p + g + ".weight", x), b = matvec(p + u + ".weight", x);
    for (size_t i = 0; i < a.size(); ++i) a[i] = silu(a[i]) * b[i];
    return matvec(p + d + ".weight", a);
  }

  std::vector<Vec> kda_layer(const std::string& p, const std::vector<Vec>& x) const {
    const json& lac = c_["linear_attn_config"];
    const int64_t Hh = lac["num_heads"], d = lac["head_dim"], K = lac["short_conv_kernel_size"];
    const int64_t n = int64_t(x.size()), D = Hh * d;
    std::vector<Vec> q(static_cast<size_t>(n)), k(static_cast<size_t>(n)),
        v(static_cast<size_t>(n));
    const char* names[] = {"q", "k", "v"};
    std::vector<Vec>* outs[] = {&q, &k, &v};
    for (int s = 0; s < 3; ++s) {
      std::vector<Vec> pre(static_cast<size_t>(n));
      for (int64_t t = 0; t < n; ++t)
        pre[size_t(t)] = matvec(p + names[s] + "_proj.weight", x[size_t(t)]);
      const Vec& cw = get(p + names[s] + "_conv1d.weight");  // [D, 1, K]
      for (int64_t t = 0; t < n; ++t) {
        Vec y(size_t(D), 0.0);
        for (int64_t ch = 0; ch < D; ++ch) {
          for (int64_t j = 0; j < K; ++j) {
            const int64_t src = t - (K - 1) + j;
            if (src >= 0) y[size_t(ch)] += cw[size_t(ch * K + j)] * pre[size_t(src)][size_t(ch)];
          }
          y[size_t(ch)] = silu(y[size_t(ch)]);
        }
        (*outs[s])[size_t(t)] = y;
      }
    }
    const Vec& a_log = get(p + "A_log");
    const Vec& dt_bias = get(p + "dt_bias");
    const double eps = c_["rms_norm_eps"];
    std::vector<Vec> S(size_t(Hh), Vec(size_t(d * d), 0.0));  // [dk, dv] per head
    std::vector<Vec> out(static_cast<size_t>(n));
    for (int64_t t = 0; t < n; ++t) {
      const Vec f = matvec(p + "f_b_proj.weight", matvec(p + "f_a_proj.weight", x[size_t(t)]));
      const Vec gate = matvec(p + "g_b_proj.weight", matvec(p + "g_a_proj.weight", x[size_t(t)]));
      const Vec braw = matvec(p + "b_proj.weight", x[size_t(t)]);
      Vec o(static_cast<size_t>(D));
      for (int64_t hh = 0; hh < Hh; ++hh) {
        double qn = 0, kn = 0;
        for (int64_t i = 0; i < d; ++i) {
          qn += q[size_t(t)][size_t(hh * d + i)] * q[size_t(t)][size_t(hh * d + i)];
          kn += k[size_t(t)][size_t(hh * d + i)] * k[size_t(t)][size_t(hh * d + i)];
        }
        Vec qh(static_cast<size_t>(d)), kh(static_cast<size_t>(d)), vh(static_cast<size_t>(d));
        for (int64_t i = 0; i < d; ++i) {
          qh[size_t(i)] =
              q[size_t(t)][size_t(hh * d + i)] / std::sqrt(qn + 1e-6) / std::sqrt(double(d));
          kh[size_t(i)] = k[size_t(t)][size_t(hh * d + i)] / std::sqrt(kn + 1e-6);
          vh[size_t(i)] = v[size_t(t)][size_t(hh * d + i)];
        }
        const double beta = sigmoid(braw[size_t(hh)]);
        Vec& s = S[size_t(hh)];
        for (int64_t i = 0; i < d; ++i) {
          const double z = f[size_t(hh * d + i)] + dt_bias[size_t(hh * d + i)];
          const double g = -std::exp(a_log[size_t(hh)]) * (z > 20 ? z : std::log1p(std::exp(z)));
          for (int64_t j = 0; j < d; ++j) s[size_t(i * d + j)] *= std::exp(g);
        }
        for (int64_t j = 0; j < d; ++j) {
          double m = 0;
          for (int64_t i = 0; i < d; ++i) m += kh[size_t(i)] * s[size_t(i * d + j)];
          const double u = beta * (vh[size_t(j)] - m);
          for (int64_t i = 0; i < d; ++i) s[size_t(i * d + j)] += kh[size_t(i)] * u;
        }
        Vec oh(size_t(d), 0.0);
        for (int64_t j = 0; j < d; ++j)
          for (int64_t i = 0; i < d; ++i) oh[size_t(j)] += qh[size_t(i)] * s[size_t(i * d + j)];
        rms(oh, get(p + "o_norm.weight"), eps);
        for (int64_t j = 0; j < d; ++j)
          o[size_t(hh * d + j)] = oh[size_t(j)] * sigmoid(gate[size_t(hh * d + j)]);
      }
      out[size_t(t)] = matvec(p + "o_proj.weight", o);
    }
    return out;
  }

  // Expanded: keys and values of every head from kv_b_proj, attention per head.
  std::vector<Vec> mla_layer(const std::string& p, const std::vector<Vec>& x) const {
    const int64_t Hm = c_["num_attention_heads"], r = c_["kv_lora_rank"];
    const int64_t dn = c_["qk_nope_head_dim"], dr = c_["qk_rope_head_dim"], dv = c_["v_head_dim"];
    const int64_t n = int64_t(x.size());
    std::vector<Vec> q(static_cast<size_t>(n)), kv(static_cast<size_t>(n)),
        kpe(static_cast<size_t>(n));
    for (int64_t t = 0; t < n; ++t) {
      q[size_t(t)] = matvec(p + "q_proj.weight", x[size_t(t)]);
      Vec ckv = matvec(p + "kv_a_proj_with_mqa.weight", x[size_t(t)]);
      rms(ckv, get(p + "kv_a_layernorm.weight"), 1e-6, 0, size_t(r));
      kpe[size_t(t)] = Vec(ckv.begin() + r, ckv.end());
      kv[size_t(t)] = matvec(p + "kv_b_proj.weight", Vec(ckv.begin(), ckv.begin() + r));
    }
    std::vector<Vec> out(static_cast<size_t>(n));
    for (int64_t t = 0; t < n; ++t) {
      Vec o(size_t(Hm * dv), 0.0);
      for (int64_t hh = 0; hh < Hm; ++hh) {
        Vec sc(size_t(t + 1));
        double mx = -1e300;
        for (int64_t s = 0; s <= t; ++s) {
          double acc = 0;
          for (int64_t i = 0; i < dn; ++i)
            acc += q[size_t(t)][size_t(hh * (dn + dr) + i)] *
                   kv[size_t(s)][size_t(hh * (dn + dv) + i)];
          for (int64_t i = 0; i < dr; ++i)
            acc += q[size_t(t)][size_t(hh * (dn + dr) + dn + i)] * kpe[size_t(s)][size_t(i)];
          sc[size_t(s)] = acc / std::sqrt(double(dn + dr));
          mx = std::max(mx, sc[size_t(s)]);
        }
        double den = 0;
        for (double& e : sc) den += (e = std::exp(e - mx));
        for (int64_t s = 0; s <= t; ++s)
          for (int64_t j = 0; j < dv; ++j)
            o[size_t(hh * dv + j)] +=
                sc[size_t(s)] / den * kv[size_t(s)][size_t(hh * (dn + dv) + dn + j)];
      }
      out[size_t(t)] = matvec(p + "o_proj.weight", o);
    }
    return out;
  }

  // transformers' router: sigmoid scores; choice on score + bias among the topk_group groups
  // with the best sums of their two highest; weights the unbiased scores, renormalised, scaled.
  Vec moe_token(const std::string& p, const Vec& x) const {
    const Vec logits = matvec(p + "gate.weight", x);
    const Vec& bias = get(p + "gate.e_score_correction_bias");
    const int64_t E = int64_t(logits.size()), k = c_["num_experts_per_token"];
    const int64_t ng = c_["num_expert_group"], tg = c_["topk_group"], size = E / ng;
    Vec score(static_cast<size_t>(E)), choose(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) {
      score[size_t(e)] = sigmoid(logits[size_t(e)]);
      choose[size_t(e)] = score[size_t(e)] + bias[size_t(e)];
    }
    std::vector<std::pair<double, int64_t>> groups;
    for (int64_t g = 0; g < ng; ++g) {
      Vec v(choose.begin() + g * size, choose.begin() + (g + 1) * size);
      std::sort(v.rbegin(), v.rend());
      groups.push_back({-(v[0] + (size > 1 ? v[1] : 0.0)), g});
    }
    std::sort(groups.begin(), groups.end());
    std::vector<std::pair<double, int64_t>> cand;
    for (int64_t e = 0; e < E; ++e) {
      bool kept = false;
      for (int64_t j = 0; j < tg; ++j) kept = kept || groups[size_t(j)].second == e / size;
      if (kept) cand.push_back({-choose[size_t(e)], e});
    }
    std::sort(cand.begin(), cand.end());
    double sum = 0;
    for (int64_t j = 0; j < k; ++j) sum += score[size_t(cand[size_t(j)].second)];
    Vec y = swiglu(p + "shared_experts.", x, "gate_proj", "up_proj", "down_proj");
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = cand[size_t(j)].second;
      const double wgt =
          score[size_t(e)] / (sum + 1e-20) * c_["routed_scaling_factor"].get<double>();
      const Vec ye = swiglu(p + "experts." + std::to_string(e) + ".", x, "w1", "w3", "w2");
      for (size_t i = 0; i < y.size(); ++i) y[i] += wgt * ye[i];
    }
    return y;
  }

  json c_;
  const recur_test::TensorMap& w_;
};

// Random weights for `config`, named and shaped as the published checkpoints: matrices
// N(0, 1/fan_in), embeddings N(0, 1), norms 1 + N(0, 0.1²), A_log log U(1, 16), dt_bias
// N(0, 1), selection bias N(0, 0.05²).
recur_test::TensorMap random_kimi_tensors(const json& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal;
  recur_test::TensorMap m;
  auto add = [&](const std::string& name, std::vector<int64_t> shape, int kind) {
    int64_t count = 1;
    for (int64_t s : shape) count *= s;
    recur_test::StoredTensor t;
    t.shape = shape;
    for (int64_t i = 0; i < count; ++i) {
      const double z = normal(rng);
      double v = kind == 0   ? z / std::sqrt(double(shape.back()))
                 : kind == 1 ? z
                 : kind == 2 ? 1 + 0.1 * z
                 : kind == 3 ? std::log(1 + 15 * std::fabs(std::tanh(z)))
                             : 0.05 * z;
      t.values.push_back(double(float(v)));
    }
    m[name] = t;
  };
  const int64_t H = c["hidden_size"], V = c["vocab_size"], L = c["num_hidden_layers"];
  const json& lac = c["linear_attn_config"];
  const int64_t kh = lac["num_heads"], d = lac["head_dim"], K = lac["short_conv_kernel_size"];
  const int64_t Hm = c["num_attention_heads"], r = c["kv_lora_rank"];
  const int64_t dn = c["qk_nope_head_dim"], dr = c["qk_rope_head_dim"], dv = c["v_head_dim"];
  const int64_t E = c["num_experts"], I = c["moe_intermediate_size"], F = c["intermediate_size"];
  const int64_t S = c["num_shared_experts"];
  add("model.embed_tokens.weight", {V, H}, 1);
  add("model.norm.weight", {H}, 2);
  add("lm_head.weight", {V, H}, 0);
  for (int64_t i = 0; i < L; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    add(p + "input_layernorm.weight", {H}, 2);
    add(p + "post_attention_layernorm.weight", {H}, 2);
    bool kda = false;
    for (const json& l : lac["kda_layers"]) kda = kda || l.get<int64_t>() == i + 1;
    const std::string a = p + "self_attn.";
    if (kda) {
      for (const char* s : {"q", "k", "v"}) {
        add(a + s + "_proj.weight", {kh * d, H}, 0);
        add(a + s + "_conv1d.weight", {kh * d, 1, K}, 0);
      }
      add(a + "f_a_proj.weight", {d, H}, 0);
      add(a + "f_b_proj.weight", {kh * d, d}, 0);
      add(a + "g_a_proj.weight", {d, H}, 0);
      add(a + "g_b_proj.weight", {kh * d, d}, 0);
      add(a + "b_proj.weight", {kh, H}, 0);
      add(a + "A_log", {1, 1, kh, 1}, 3);
      add(a + "dt_bias", {kh * d}, 1);
      add(a + "o_norm.weight", {d}, 2);
      add(a + "o_proj.weight", {H, kh * d}, 0);
    } else {
      add(a + "q_proj.weight", {Hm * (dn + dr), H}, 0);
      add(a + "kv_a_proj_with_mqa.weight", {r + dr, H}, 0);
      add(a + "kv_a_layernorm.weight", {r}, 2);
      add(a + "kv_b_proj.weight", {Hm * (dn + dv), r}, 0);
      add(a + "o_proj.weight", {H, Hm * dv}, 0);
    }
    if (i < c["first_k_dense_replace"].get<int64_t>()) {
      add(p + "mlp.gate_proj.weight", {F, H}, 0);
      add(p + "mlp.up_proj.weight", {F, H}, 0);
      add(p + "mlp.down_proj.weight", {H, F}, 0);
    } else {
      const std::string b = p + "block_sparse_moe.";
      add(b + "gate.weight", {E, H}, 0);
      add(b + "gate.e_score_correction_bias", {E}, 4);
      for (int64_t e = 0; e < E; ++e) {
        const std::string x = b + "experts." + std::to_string(e) + ".";
        add(x + "w1.weight", {I, H}, 0);
        add(x + "w3.weight", {I, H}, 0);
        add(x + "w2.weight", {H, I}, 0);
      }
      add(b + "shared_experts.gate_proj.weight", {I * S, H}, 0);
      add(b + "shared_experts.up_proj.weight", {I * S, H}, 0);
      add(b + "shared_experts.down_proj.weight", {H, I * S}, 0);
    }
  }
  return m;
}

// recur on random checkpoints of shapes no reference has equals the naive oracle: latent
// attention with r ≠ dn (so the absorbed form's scale and W_uk's transpose matter), five heads,
// no shared key part; KDA with three heads, conv width 3, head size 8; two dense layers;
// group-limited routing that changes the choice, with a selection bias (stored in bf16 once).
TEST(KimiLinear, RandomCheckpointsOfOtherShapesMatchANaiveForward) {
  json a = tiny_config();
  a["kv_lora_rank"] = 12;
  a["qk_nope_head_dim"] = 10;
  a["v_head_dim"] = 6;
  a["num_attention_heads"] = a["num_key_value_heads"] = 5;
  a["linear_attn_config"]["num_heads"] = 3;
  a["linear_attn_config"]["head_dim"] = 8;
  a["linear_attn_config"]["short_conv_kernel_size"] = 3;
  a["first_k_dense_replace"] = 2;
  a["num_expert_group"] = 4, a["topk_group"] = 2, a["num_experts_per_token"] = 3;
  json b = a;
  b["qk_rope_head_dim"] = 0;
  b["num_shared_experts"] = 2;
  b["linear_attn_config"]["kda_layers"] = {2, 3, 4, 6, 7};
  b["linear_attn_config"]["full_attn_layers"] = {1, 5, 8};
  for (const json& c : {a, b}) {
    recur_test::TempDir dir;
    recur_test::TensorMap tensors = random_kimi_tensors(c, 5);
    if (c["qk_rope_head_dim"] == 0) {  // selection biases stored in bf16: read into f32
      for (auto& [name, t] : tensors) {
        if (!name.ends_with("e_score_correction_bias")) continue;
        t.type = recur_test::StoreType::kBF16;
        for (double& v : t.values) v = recur_test::round_to_store(t.type, v);
      }
    }
    recur_test::write_checkpoint(dir.path(), {c, tensors});
    auto ops = test_backend();
    auto m = load_model(dir.path(), *ops, small_options());
    ASSERT_TRUE(m.ok()) << m.error().to_string();
    const int len = 23;
    std::vector<int32_t> tokens(static_cast<size_t>(len));
    for (int i = 0; i < len; ++i) tokens[size_t(i)] = (i * 53 + 7) % 256;
    const std::vector<Vec> want = NaiveKimi(c, tensors).forward(tokens);
    Model& model = **m;
    const int V = model.info().vocab_size;
    auto buf = ops->allocator().allocate(size_t(len) * V * 4, "test logits");
    ASSERT_TRUE(buf.ok());
    Tensor t = Tensor::contiguous(buf->data(), DType::F32, {len, V}, buf->device());
    Batch batch;
    const std::vector<int32_t> blocks = {0, 1, 2, 3, 4, 5, 6, 7};
    batch.add_sequence(0, 0, tokens, blocks, Batch::Logits::kAll);
    ASSERT_TRUE(model.forward(batch, t).ok());
    std::vector<float> got(size_t(len) * V);
    ops->copy_to_host(t, got.data());
    double worst = 0, scale = 0;
    for (int i = 0; i < len; ++i) {
      for (int v = 0; v < V; ++v) {
        worst =
            std::max(worst, std::fabs(double(got[size_t(i * V + v)]) - want[size_t(i)][size_t(v)]));
        scale = std::max(scale, std::fabs(want[size_t(i)][size_t(v)]));
      }
    }
    EXPECT_GT(scale, 0.1);
    EXPECT_LE(worst, 1e-3) << "max |logit| " << scale;
    std::printf("  [kimi %s] max|dlogit| vs naive %.3g (max|logit| %.3g)\n",
                c["qk_rope_head_dim"] == 0 ? "no k_pe" : "k_pe", worst, scale);
  }
}

// Tensor parallel ranks (threads of this process) give the whole model's logits on random
// checkpoints whose heads split four ways: KDA and latent attention with four heads each (the
// latent computed and cached whole on every rank), with and without the shared key part, two
// shared experts; 23 prompt tokens in one forward, then decode steps.
TEST(KimiLinear, TensorParallelRanksGiveTheWholeModelsLogits) {
  json a = tiny_config();
  a["linear_attn_config"]["num_heads"] = 4;
  a["num_shared_experts"] = 2;
  json b = a;
  b["qk_rope_head_dim"] = 0;
  for (const json& c : {a, b}) {
    recur_test::TempDir dir;
    recur_test::write_checkpoint(dir.path(), {c, random_kimi_tensors(c, 9)});
    // Every logit of the forwards, over `world` ranks of one CPU thread each.
    auto run = [&](int world) {
      CpuOps ops(1);
      LoadOptions opt = small_options();
      opt.tensor_parallel = world;
      opt.rank_backend = [](int) -> Result<std::unique_ptr<Ops>> {
        return std::unique_ptr<Ops>(new CpuOps(1));
      };
      auto m = load_model(dir.path(), ops, opt);
      EXPECT_TRUE(m.ok()) << m.error().to_string();
      std::vector<float> all;
      if (!m.ok()) return all;
      const int V = (*m)->info().vocab_size, len = 23;
      auto buf = ops.allocator().allocate(size_t(len) * V * 4, "test logits");
      const std::vector<int32_t> blocks = {0, 1, 2, 3, 4, 5, 6, 7};
      std::vector<int32_t> tokens(static_cast<size_t>(len));
      for (int i = 0; i < len; ++i) tokens[size_t(i)] = (i * 53 + 7) % 256;
      for (int pos = 0; pos < len + 3;) {
        const int n = pos == 0 ? len : 1;
        const std::vector<int32_t> t(n, (pos * 31 + 3) % 256);
        Batch batch;
        batch.add_sequence(0, pos, pos == 0 ? tokens : t, blocks, Batch::Logits::kAll);
        const Tensor out = view(*buf, DType::F32, {n, V});
        EXPECT_TRUE((*m)->forward(batch, out).ok());
        all.resize(all.size() + size_t(n) * V);
        ops.copy_to_host(out, all.data() + all.size() - size_t(n) * V);
        pos += n;
      }
      return all;
    };
    const std::vector<float> whole = run(1);
    double scale = 0;
    for (float v : whole) scale = std::max(scale, double(std::fabs(v)));
    for (int world : {2, 4}) {
      const std::vector<float> split = run(world);
      ASSERT_EQ(split.size(), whole.size());
      double worst = 0;
      for (size_t i = 0; i < whole.size(); ++i) {
        worst = std::max(worst, std::fabs(double(split[i]) - double(whole[i])));
      }
      std::printf("  [kimi %s] %d ranks: max|dlogit| %.3g (max|logit| %.3g)\n",
                  c["qk_rope_head_dim"] == 0 ? "no k_pe" : "k_pe", world, worst, scale);
      // f32 rounding of sums split across ranks (tests/model/test_tensor_parallel.cpp)
      EXPECT_LE(worst, 1e-4 * std::max(scale, 1.0));
    }
  }
}

}  // namespace
}  // namespace recur
