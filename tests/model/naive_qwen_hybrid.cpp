#include "model/naive_qwen_hybrid.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>

namespace recur_test {

namespace {

using Vec = std::vector<double>;

[[noreturn]] void fail(const std::string& what) {
  throw std::runtime_error("naive: " + what);
}

// y[out] = W[first + out, in] · x[in]: rows [first, first + out) of a row-major matrix.
Vec matvec(const Vec& w, int64_t out, int64_t in, const Vec& x, int64_t first = 0) {
  if (int64_t(x.size()) != in) fail("matvec input width");
  if ((first + out) * in > int64_t(w.size())) fail("matvec rows out of range");
  Vec y(size_t(out), 0.0);
  for (int64_t o = 0; o < out; ++o) {
    double s = 0;
    for (int64_t i = 0; i < in; ++i) s += w[size_t((first + o) * in + i)] * x[size_t(i)];
    y[size_t(o)] = s;
  }
  return y;
}

double sigmoid(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}
double silu(double x) {
  return x * sigmoid(x);
}
// torch.nn.functional.softplus with its default threshold of 20.
double softplus(double x) {
  return x > 20 ? x : std::log1p(std::exp(x));
}

int get_int(const nlohmann::json& j, const char* key) {
  if (!j.contains(key) || !j[key].is_number_integer()) fail(std::string("config field ") + key);
  return j[key].get<int>();
}

template <typename T>
T get_or(const nlohmann::json& j, const char* key, T fallback) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  return j[key].get<T>();
}

}  // namespace

NaiveQwenHybrid::NaiveQwenHybrid(const nlohmann::json& outer, const TensorMap& weights)
    : weights_(weights) {
  // transformers' classes: Qwen3NextForCausalLM and Qwen3_5[Moe]ForCausalLM (model_type
  // qwen3_next, qwen3_5_text, qwen3_5_moe_text) hold the text model as `model`;
  // Qwen3_5[Moe]ForConditionalGeneration (qwen3_5, qwen3_5_moe) as `model.language_model`, its
  // config in text_config.
  const std::string type = get_or<std::string>(outer, "model_type", "");
  bool multimodal = false;
  if (type == "qwen3_next") {
    family_ = Family::kQwen3Next;
  } else if (type == "qwen3_5" || type == "qwen3_5_text") {
    family_ = Family::kQwen3_5, multimodal = type == "qwen3_5";
  } else if (type == "qwen3_5_moe" || type == "qwen3_5_moe_text") {
    family_ = Family::kQwen3_5Moe, multimodal = type == "qwen3_5_moe";
  } else {
    fail("model_type '" + type + "'");
  }
  const bool nested = outer.contains("text_config") && outer["text_config"].is_object();
  if (nested != multimodal) fail("text_config belongs to the multimodal model types only");
  prefix_ = multimodal ? "model.language_model." : "model.";
  const nlohmann::json& c = nested ? outer["text_config"] : outer;

  hidden_ = get_int(c, "hidden_size");
  layers_ = get_int(c, "num_hidden_layers");
  vocab_ = get_int(c, "vocab_size");
  eps_ = get_or<double>(c, "rms_norm_eps", 1e-6);
  tied_ = get_or<bool>(c, "tie_word_embeddings", false);
  if (nested) tied_ = get_or<bool>(outer, "tie_word_embeddings", tied_);  // the wrapper's flag

  heads_ = get_int(c, "num_attention_heads");
  kv_heads_ = get_int(c, "num_key_value_heads");
  head_dim_ = get_int(c, "head_dim");
  double prf = get_or<double>(c, "partial_rotary_factor", 0.25);
  theta_ = get_or<double>(c, "rope_theta", 10000.0);
  if (c.contains("rope_parameters") && c["rope_parameters"].is_object()) {
    const auto& rp = c["rope_parameters"];
    if (get_or<std::string>(rp, "rope_type", "default") != "default") fail("rope_type");
    prf = get_or<double>(rp, "partial_rotary_factor", prf);
    theta_ = get_or<double>(rp, "rope_theta", theta_);
    // mrope_section splits the frequencies among the temporal, height and width positions; a
    // text token has all three equal to its index, so every split gives the 1-D rotary.
  }
  rot_dim_ = int(std::floor(head_dim_ * prf));
  if (rot_dim_ % 2 != 0) fail("odd rotary dimension");

  hk_ = get_int(c, "linear_num_key_heads");
  hv_ = get_int(c, "linear_num_value_heads");
  dk_ = get_int(c, "linear_key_head_dim");
  dv_ = get_int(c, "linear_value_head_dim");
  conv_k_ = get_int(c, "linear_conv_kernel_dim");
  if (hv_ % hk_ != 0) fail("value heads not a multiple of key heads");

  if (c.contains("layer_types") && !c["layer_types"].is_null()) {
    const auto types = c["layer_types"].get<std::vector<std::string>>();
    if (int(types.size()) != layers_) fail("layer_types length");
    for (const auto& t : types) {
      if (t != "full_attention" && t != "linear_attention") fail("layer type " + t);
      full_attn_.push_back(t == "full_attention");
    }
  } else {
    const int interval = get_or<int>(c, "full_attention_interval", 4);
    for (int i = 0; i < layers_; ++i) full_attn_.push_back((i + 1) % interval == 0);
  }

  switch (family_) {
    case Family::kQwen3Next: {
      intermediate_ = get_or<int>(c, "intermediate_size", 0);
      experts_ = get_or<int>(c, "num_experts", 0);
      topk_ = get_or<int>(c, "num_experts_per_tok", 0);
      moe_ff_ = get_or<int>(c, "moe_intermediate_size", 0);
      shared_ff_ = get_or<int>(c, "shared_expert_intermediate_size", 0);
      norm_topk_ = get_or<bool>(c, "norm_topk_prob", true);
      const int sparse_step = get_or<int>(c, "decoder_sparse_step", 1);
      const auto mlp_only = get_or<std::vector<int>>(c, "mlp_only_layers", {});
      for (int i = 0; i < layers_; ++i) {
        const bool only = std::find(mlp_only.begin(), mlp_only.end(), i) != mlp_only.end();
        moe_.push_back(!only && experts_ > 0 && (i + 1) % sparse_step == 0);
      }
      break;
    }
    case Family::kQwen3_5:  // Qwen3_5MLP in every layer; the MoE fields are deleted
      intermediate_ = get_int(c, "intermediate_size");
      moe_.assign(size_t(layers_), false);
      break;
    case Family::kQwen3_5Moe:  // the sparse block in every layer; its router always renormalises
      experts_ = get_int(c, "num_experts");
      topk_ = get_int(c, "num_experts_per_tok");
      moe_ff_ = get_int(c, "moe_intermediate_size");
      shared_ff_ = get_int(c, "shared_expert_intermediate_size");
      norm_topk_ = true;
      moe_.assign(size_t(layers_), true);
      break;
  }
}

const Vec& NaiveQwenHybrid::w(const std::string& name, std::vector<int64_t> shape) const {
  auto it = weights_.find(name);
  if (it == weights_.end()) fail("missing tensor " + name);
  if (it->second.shape != shape) fail("tensor " + name + " has an unexpected shape");
  return it->second.values;
}

// Zero-centred RMSNorm: x / sqrt(mean(x²) + eps) · (1 + w), in place.
void NaiveQwenHybrid::rms_norm_centred(Vec& x, const Vec& wt) const {
  double ss = 0;
  for (double v : x) ss += v * v;
  const double inv = 1.0 / std::sqrt(ss / double(x.size()) + eps_);
  for (size_t i = 0; i < x.size(); ++i) x[i] = x[i] * inv * (1.0 + wt[i]);
}

void NaiveQwenHybrid::linear_projections(const std::string& p, const Vec& x, Vec* mixed, Vec* z,
                                         Vec* b, Vec* a) const {
  const int64_t D = hidden_, hk = hk_, hv = hv_, dk = dk_, dv = dv_, r = hv_ / hk_;
  const int64_t conv_dim = 2 * hk * dk + hv * dv;
  if (family_ != Family::kQwen3Next) {
    // Qwen3.5: in_proj_qkv rows are all q heads, all k heads, all v heads (value heads grouped
    // by key head), the conv's channel order as is.
    *mixed = matvec(w(p + "in_proj_qkv.weight", {conv_dim, D}), conv_dim, D, x);
    *z = matvec(w(p + "in_proj_z.weight", {hv * dv, D}), hv * dv, D, x);
    *b = matvec(w(p + "in_proj_b.weight", {hv, D}), hv, D, x);
    *a = matvec(w(p + "in_proj_a.weight", {hv, D}), hv, D, x);
    return;
  }
  // Qwen3-Next: per key head q, k, its r value heads, their z; then per key head r b, r a.
  const int64_t group = 2 * dk + 2 * r * dv;  // one key head's slice of in_proj_qkvz
  const Vec qkvz = matvec(w(p + "in_proj_qkvz.weight", {hk * group, D}), hk * group, D, x);
  const Vec ba = matvec(w(p + "in_proj_ba.weight", {hk * 2 * r, D}), hk * 2 * r, D, x);
  mixed->assign(size_t(conv_dim), 0.0);
  z->assign(size_t(hv * dv), 0.0);
  b->assign(size_t(hv), 0.0);
  a->assign(size_t(hv), 0.0);
  for (int64_t j = 0; j < hk; ++j) {
    const double* g = &qkvz[size_t(j * group)];
    for (int64_t i = 0; i < dk; ++i) {
      (*mixed)[size_t(j * dk + i)] = g[i];
      (*mixed)[size_t(hk * dk + j * dk + i)] = g[dk + i];
    }
    for (int64_t i = 0; i < r * dv; ++i) {
      (*mixed)[size_t(2 * hk * dk + j * r * dv + i)] = g[2 * dk + i];
      (*z)[size_t(j * r * dv + i)] = g[2 * dk + r * dv + i];
    }
    for (int64_t i = 0; i < r; ++i) {
      (*b)[size_t(j * r + i)] = ba[size_t(j * 2 * r + i)];
      (*a)[size_t(j * r + i)] = ba[size_t(j * 2 * r + r + i)];
    }
  }
}

NaiveQwenHybrid::Rows NaiveQwenHybrid::linear_attention(int layer, const Rows& x) const {
  const std::string p = prefix_ + "layers." + std::to_string(layer) + ".linear_attn.";
  const int64_t D = hidden_, hk = hk_, hv = hv_, dk = dk_, dv = dv_, r = hv_ / hk_, K = conv_k_;
  const int64_t conv_dim = 2 * hk * dk + hv * dv;
  const Vec& w_conv = w(p + "conv1d.weight", {conv_dim, 1, K});
  const Vec& dt_bias = w(p + "dt_bias", {hv});
  const Vec& a_log = w(p + "A_log", {hv});
  const Vec& w_norm = w(p + "norm.weight", {dv});
  const Vec& w_out = w(p + "out_proj.weight", {D, hv * dv});

  const size_t n = x.size();
  Rows mixed(n), z(n), b(n), a(n);  // [n, conv_dim] (q of all key heads, k, v), [n, Hv·dv], [n, Hv]
  for (size_t t = 0; t < n; ++t) linear_projections(p, x[t], &mixed[t], &z[t], &b[t], &a[t]);

  // Causal depthwise convolution over time, zero before the first token, then SiLU.
  Rows conv(n, Vec(size_t(conv_dim)));  // [n, conv_dim]
  for (size_t t = 0; t < n; ++t) {
    for (int64_t c = 0; c < conv_dim; ++c) {
      double s = 0;
      for (int64_t j = 0; j < K; ++j) {
        const int64_t src = int64_t(t) - (K - 1) + j;
        if (src >= 0) s += w_conv[size_t(c * K + j)] * mixed[size_t(src)][size_t(c)];
      }
      conv[t][size_t(c)] = silu(s);
    }
  }

  // The gated delta rule, one token at a time, state S_h [dk, dv] per value head.
  std::vector<Vec> S(size_t(hv), Vec(size_t(dk * dv), 0.0));
  Rows out(n);
  for (size_t t = 0; t < n; ++t) {
    Vec q(conv[t].begin(), conv[t].begin() + hk * dk);                // [Hk, dk]
    Vec k(conv[t].begin() + hk * dk, conv[t].begin() + 2 * hk * dk);  // [Hk, dk]
    const Vec v(conv[t].begin() + 2 * hk * dk, conv[t].end());        // [Hv, dv]
    for (int64_t j = 0; j < hk; ++j) {
      double sq = 0, sk = 0;
      for (int64_t i = 0; i < dk; ++i) {
        sq += q[size_t(j * dk + i)] * q[size_t(j * dk + i)];
        sk += k[size_t(j * dk + i)] * k[size_t(j * dk + i)];
      }
      const double iq = 1.0 / std::sqrt(sq + 1e-6) / std::sqrt(double(dk));
      const double ik = 1.0 / std::sqrt(sk + 1e-6);
      for (int64_t i = 0; i < dk; ++i) {
        q[size_t(j * dk + i)] *= iq;
        k[size_t(j * dk + i)] *= ik;
      }
    }
    Vec o_all(size_t(hv * dv));  // [Hv, dv] after the gated norm
    for (int64_t h = 0; h < hv; ++h) {
      const int64_t kh = h / r;
      const double g = -std::exp(a_log[size_t(h)]) * softplus(a[t][size_t(h)] + dt_bias[size_t(h)]);
      const double beta = sigmoid(b[t][size_t(h)]);
      const double decay = std::exp(g);
      Vec& s = S[size_t(h)];
      for (double& e : s) e *= decay;
      const double* kk = &k[size_t(kh * dk)];
      const double* qq = &q[size_t(kh * dk)];
      Vec delta(dv_, 0.0);
      for (int64_t jv = 0; jv < dv; ++jv) {
        double kv = 0;
        for (int64_t i = 0; i < dk; ++i) kv += s[size_t(i * dv + jv)] * kk[i];
        delta[size_t(jv)] = beta * (v[size_t(h * dv + jv)] - kv);
      }
      for (int64_t i = 0; i < dk; ++i) {
        for (int64_t jv = 0; jv < dv; ++jv) s[size_t(i * dv + jv)] += kk[i] * delta[size_t(jv)];
      }
      Vec o(size_t(dv), 0.0);
      for (int64_t jv = 0; jv < dv; ++jv) {
        for (int64_t i = 0; i < dk; ++i) o[size_t(jv)] += s[size_t(i * dv + jv)] * qq[i];
      }
      // Gated RMSNorm: plain weight (not 1 + w), gate silu(z).
      double ss = 0;
      for (double e : o) ss += e * e;
      const double inv = 1.0 / std::sqrt(ss / double(dv) + eps_);
      for (int64_t jv = 0; jv < dv; ++jv) {
        o_all[size_t(h * dv + jv)] =
            o[size_t(jv)] * inv * w_norm[size_t(jv)] * silu(z[t][size_t(h * dv + jv)]);
      }
    }
    out[t] = matvec(w_out, D, hv * dv, o_all);
  }
  return out;
}

NaiveQwenHybrid::Rows NaiveQwenHybrid::full_attention(int layer, const Rows& x) const {
  const std::string p = prefix_ + "layers." + std::to_string(layer) + ".self_attn.";
  const int64_t D = hidden_, H = heads_, Hkv = kv_heads_, hd = head_dim_;
  const Vec& wq = w(p + "q_proj.weight", {H * 2 * hd, D});
  const Vec& wk = w(p + "k_proj.weight", {Hkv * hd, D});
  const Vec& wv = w(p + "v_proj.weight", {Hkv * hd, D});
  const Vec& wo = w(p + "o_proj.weight", {D, H * hd});
  const Vec& qn = w(p + "q_norm.weight", {hd});
  const Vec& kn = w(p + "k_norm.weight", {hd});

  const size_t n = x.size();
  const int half = rot_dim_ / 2;
  // Rotates the first rot_dim channels of one head at position pos (rotate_half convention).
  auto rope = [&](double* head, int64_t pos) {
    for (int i = 0; i < half; ++i) {
      const double inv_freq = std::pow(theta_, -2.0 * i / rot_dim_);
      const double ang = double(pos) * inv_freq;
      const double x1 = head[i], x2 = head[i + half];
      head[i] = x1 * std::cos(ang) - x2 * std::sin(ang);
      head[i + half] = x2 * std::cos(ang) + x1 * std::sin(ang);
    }
  };
  Rows q(n, Vec(size_t(H * hd))), gate(n, Vec(size_t(H * hd)));  // [n, H·hd]
  Rows k(n), v(n);                                               // [n, Hkv·hd]
  for (size_t t = 0; t < n; ++t) {
    const Vec qg = matvec(wq, H * 2 * hd, D, x[t]);
    for (int64_t h = 0; h < H; ++h) {
      Vec head(qg.begin() + h * 2 * hd, qg.begin() + h * 2 * hd + hd);
      rms_norm_centred(head, qn);
      rope(head.data(), int64_t(t));
      std::copy(head.begin(), head.end(), q[t].begin() + h * hd);
      std::copy(qg.begin() + h * 2 * hd + hd, qg.begin() + (h + 1) * 2 * hd,
                gate[t].begin() + h * hd);
    }
    k[t] = matvec(wk, Hkv * hd, D, x[t]);
    v[t] = matvec(wv, Hkv * hd, D, x[t]);
    for (int64_t h = 0; h < Hkv; ++h) {
      Vec head(k[t].begin() + h * hd, k[t].begin() + (h + 1) * hd);
      rms_norm_centred(head, kn);
      rope(head.data(), int64_t(t));
      std::copy(head.begin(), head.end(), k[t].begin() + h * hd);
    }
  }
  const double scale = 1.0 / std::sqrt(double(hd));
  const int64_t group = H / Hkv;
  Rows out(n);
  for (size_t t = 0; t < n; ++t) {
    Vec attn(size_t(H * hd), 0.0);  // [H, hd]
    for (int64_t h = 0; h < H; ++h) {
      const int64_t kh = h / group;
      Vec score(t + 1);
      double mx = -INFINITY;
      for (size_t s = 0; s <= t; ++s) {
        double d = 0;
        for (int64_t i = 0; i < hd; ++i) d += q[t][size_t(h * hd + i)] * k[s][size_t(kh * hd + i)];
        score[s] = d * scale;
        mx = std::max(mx, score[s]);
      }
      double sum = 0;
      for (double& e : score) sum += (e = std::exp(e - mx));
      for (size_t s = 0; s <= t; ++s) {
        for (int64_t i = 0; i < hd; ++i) {
          attn[size_t(h * hd + i)] += score[s] / sum * v[s][size_t(kh * hd + i)];
        }
      }
      for (int64_t i = 0; i < hd; ++i) {
        attn[size_t(h * hd + i)] *= sigmoid(gate[t][size_t(h * hd + i)]);
      }
    }
    out[t] = matvec(wo, D, H * hd, attn);
  }
  return out;
}

// down(silu(gate·x) ⊙ (up·x)) for one SwiGLU block of width ff.
NaiveQwenHybrid::Vec NaiveQwenHybrid::swiglu(const std::string& prefix, int64_t ff,
                                             const Vec& x) const {
  const int64_t D = hidden_;
  const Vec g = matvec(w(prefix + "gate_proj.weight", {ff, D}), ff, D, x);
  const Vec u = matvec(w(prefix + "up_proj.weight", {ff, D}), ff, D, x);
  Vec hmid(size_t(ff), 0.0);
  for (int64_t i = 0; i < ff; ++i) hmid[size_t(i)] = silu(g[size_t(i)]) * u[size_t(i)];
  return matvec(w(prefix + "down_proj.weight", {D, ff}), D, ff, hmid);
}

// Routed expert e: fused (gate_up_proj [E, 2I, D], expert e's gate rows then its up rows;
// down_proj [E, D, I]) when the checkpoint has it, else one tensor per expert.
NaiveQwenHybrid::Vec NaiveQwenHybrid::expert(const std::string& p, int e, const Vec& x) const {
  const int64_t D = hidden_, I = moe_ff_, E = experts_;
  if (!has(p + "experts.gate_up_proj"))
    return swiglu(p + "experts." + std::to_string(e) + ".", I, x);
  const Vec& gate_up = w(p + "experts.gate_up_proj", {E, 2 * I, D});
  const Vec& down = w(p + "experts.down_proj", {E, D, I});
  const Vec g = matvec(gate_up, I, D, x, e * 2 * I);
  const Vec u = matvec(gate_up, I, D, x, e * 2 * I + I);
  Vec hmid(size_t(I), 0.0);
  for (int64_t i = 0; i < I; ++i) hmid[size_t(i)] = silu(g[size_t(i)]) * u[size_t(i)];
  return matvec(down, D, I, hmid, e * D);
}

NaiveQwenHybrid::Rows NaiveQwenHybrid::mlp(int layer, const Rows& x) const {
  const std::string p = prefix_ + "layers." + std::to_string(layer) + ".mlp.";
  const int64_t D = hidden_;
  Rows out(x.size());
  for (size_t t = 0; t < x.size(); ++t) {
    if (!moe_[size_t(layer)]) {
      out[t] = swiglu(p, intermediate_, x[t]);
      continue;
    }
    const int64_t E = experts_;
    Vec logits = matvec(w(p + "gate.weight", {E, D}), E, D, x[t]);
    const double mx = *std::max_element(logits.begin(), logits.end());
    double sum = 0;
    for (double& l : logits) sum += (l = std::exp(l - mx));
    for (double& l : logits) l /= sum;  // router probabilities
    std::vector<int> order(static_cast<size_t>(E), 0);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int i, int j) { return logits[size_t(i)] > logits[size_t(j)]; });
    double top_sum = 0;
    for (int j = 0; j < topk_; ++j) top_sum += logits[size_t(order[size_t(j)])];
    Vec acc(size_t(D), 0.0);
    for (int j = 0; j < topk_; ++j) {
      const int e = order[size_t(j)];
      const double weight = norm_topk_ ? logits[size_t(e)] / top_sum : logits[size_t(e)];
      const Vec y = expert(p, e, x[t]);
      for (int64_t i = 0; i < D; ++i) acc[size_t(i)] += weight * y[size_t(i)];
    }
    const Vec sg = matvec(w(p + "shared_expert_gate.weight", {1, D}), 1, D, x[t]);
    const Vec shared = swiglu(p + "shared_expert.", shared_ff_, x[t]);
    for (int64_t i = 0; i < D; ++i) acc[size_t(i)] += sigmoid(sg[0]) * shared[size_t(i)];
    out[t] = std::move(acc);
  }
  return out;
}

std::vector<std::vector<double>> NaiveQwenHybrid::forward(std::span<const int32_t> tokens) const {
  const int64_t D = hidden_, V = vocab_;
  const Vec& emb = w(prefix_ + "embed_tokens.weight", {V, D});
  Rows h;  // [n, D]: the residual stream
  for (int32_t id : tokens) {
    if (id < 0 || id >= V) fail("token out of range");
    h.emplace_back(emb.begin() + id * D, emb.begin() + (id + 1) * D);
  }
  for (int l = 0; l < layers_; ++l) {
    const std::string p = prefix_ + "layers." + std::to_string(l) + ".";
    Rows x = h;
    for (Vec& r : x) rms_norm_centred(r, w(p + "input_layernorm.weight", {D}));
    const Rows m = full_attn_[size_t(l)] ? full_attention(l, x) : linear_attention(l, x);
    for (size_t t = 0; t < h.size(); ++t) {
      for (int64_t i = 0; i < D; ++i) h[t][size_t(i)] += m[t][size_t(i)];
    }
    x = h;
    for (Vec& r : x) rms_norm_centred(r, w(p + "post_attention_layernorm.weight", {D}));
    const Rows f = mlp(l, x);
    for (size_t t = 0; t < h.size(); ++t) {
      for (int64_t i = 0; i < D; ++i) h[t][size_t(i)] += f[t][size_t(i)];
    }
  }
  const Vec& head = tied_ ? emb : w("lm_head.weight", {V, D});
  std::vector<std::vector<double>> logits;
  for (Vec& r : h) {
    rms_norm_centred(r, w(prefix_ + "norm.weight", {D}));
    logits.push_back(matvec(head, V, D, r));
  }
  return logits;
}

}  // namespace recur_test
