// Kimi-Linear, top to bottom like its modeling code (the published remote code,
// modeling_kimi.py): embedding; per layer a token mixer (Kimi Delta Attention, or latent
// attention without rotary) and a feed-forward (a dense SwiGLU in the first layers, then
// sigmoid-routed experts beside one ungated shared expert), each behind a plain RMSNorm (w, not
// 1 + w) and a residual; final norm; LM head. docs/kimi-linear.md has every formula and how it
// was checked against transformers.
#include "model/kimi_linear.h"

#include <cmath>
#include <set>

#include "model/blocks.h"
#include "model/config.h"
#include "model/qwen_common.h"

namespace recur {

namespace {

using json = nlohmann::json;

// ---- configuration (configuration_kimi.py) ----

struct KimiLinearConfig {
  int hidden_size = 0, num_layers = 0, vocab_size = 0;
  float rms_norm_eps = 1e-6f;
  bool tie_word_embeddings = false;
  int max_position = 0;
  std::vector<bool> is_kda;  // per layer: Kimi Delta Attention, else latent attention

  // Kimi Delta Attention (linear_attn_config)
  int kda_heads = 0, kda_head_dim = 0, conv_kernel = 0;

  // Latent attention
  int heads = 0, kv_lora_rank = 0, qk_nope_dim = 0, qk_rope_dim = 0, v_head_dim = 0;

  // Feed-forward
  int intermediate_size = 0, first_k_dense_replace = 0, moe_layer_freq = 1;
  int num_experts = 0, experts_per_token = 0, moe_intermediate_size = 0, num_shared_experts = 0;
  double routed_scaling_factor = 1.0;
  bool renormalize = true, sigmoid_router = true;
  int n_group = 1, topk_group = 1;

  std::vector<int32_t> eos_token_ids;

  bool layer_is_moe(int i) const {
    return num_experts > 0 && i >= first_k_dense_replace && i % moe_layer_freq == 0;
  }
  static Result<KimiLinearConfig> from_json(const json& j, const json& gen);
};

Error unsupported(const std::string& what) {
  return make_error(ErrorCode::kUnsupported, "config.json: {}", what);
}

// An integer field under either of its names (the remote code's first, transformers' second).
Status int_field(const json& j, const char* name, const char* alias, int* out, bool required,
                 int min = 0) {
  if (j.contains(name) && !j[name].is_null()) return config_int(j, name, out, true, min);
  return config_int(j, alias, out, required, min);
}

// linear_attn_config's 1-based layer numbers, into is_kda (each layer listed exactly once).
Status read_layer_lists(const json& lac, int layers, std::vector<bool>* is_kda) {
  std::vector<int> listed(size_t(layers), 0);
  is_kda->assign(size_t(layers), false);
  for (const char* key : {"kda_layers", "full_attn_layers"}) {
    if (!lac.contains(key) || !lac[key].is_array()) {
      return make_error(ErrorCode::kInvalidArgument,
                        "config.json: linear_attn_config.{} must be a list of layer numbers", key);
    }
    for (const json& v : lac[key]) {
      if (!v.is_number_integer() || v.get<int64_t>() < 1 || v.get<int64_t>() > layers) {
        return make_error(ErrorCode::kInvalidArgument,
                          "config.json: linear_attn_config.{} holds {}: layer numbers count "
                          "from 1 to num_hidden_layers ({})",
                          key, v.dump(), layers);
      }
      const int i = int(v.get<int64_t>()) - 1;
      ++listed[size_t(i)];
      (*is_kda)[size_t(i)] = std::string(key) == "kda_layers";
    }
  }
  for (int i = 0; i < layers; ++i) {
    if (listed[size_t(i)] != 1) {
      return make_error(ErrorCode::kInvalidArgument,
                        "config.json: layer {} (1-based) is listed {} times in "
                        "linear_attn_config's kda_layers and full_attn_layers (must be once)",
                        i + 1, listed[size_t(i)]);
    }
  }
  return Status();
}

Result<KimiLinearConfig> KimiLinearConfig::from_json(const json& j, const json& gen) {
  KimiLinearConfig c;
  RECUR_RETURN_IF_ERROR(config_int(j, "hidden_size", &c.hidden_size, true, 1));
  RECUR_RETURN_IF_ERROR(config_int(j, "num_hidden_layers", &c.num_layers, true, 1, 4096));
  RECUR_RETURN_IF_ERROR(config_int(j, "vocab_size", &c.vocab_size, true, 1));
  double eps = 1e-6;
  RECUR_RETURN_IF_ERROR(config_double(j, "rms_norm_eps", &eps));
  if (!(eps > 0 && eps < 1)) return unsupported("rms_norm_eps outside (0, 1)");
  c.rms_norm_eps = float(eps);
  RECUR_RETURN_IF_ERROR(config_bool(j, "tie_word_embeddings", &c.tie_word_embeddings));
  RECUR_RETURN_IF_ERROR(
      int_field(j, "model_max_length", "max_position_embeddings", &c.max_position, true, 1));
  if (j.contains("hidden_act") && j["hidden_act"] != "silu") {
    return unsupported("hidden_act " + j["hidden_act"].dump() + " (only silu)");
  }

  if (!j.contains("linear_attn_config") || !j["linear_attn_config"].is_object()) {
    return make_error(ErrorCode::kInvalidArgument,
                      "config.json: linear_attn_config (the Kimi Delta Attention layers) is "
                      "missing");
  }
  const json& lac = j["linear_attn_config"];
  RECUR_RETURN_IF_ERROR(read_layer_lists(lac, c.num_layers, &c.is_kda));
  RECUR_RETURN_IF_ERROR(config_int(lac, "num_heads", &c.kda_heads, true, 1));
  RECUR_RETURN_IF_ERROR(config_int(lac, "head_dim", &c.kda_head_dim, true, 1, 4096));
  RECUR_RETURN_IF_ERROR(config_int(lac, "short_conv_kernel_size", &c.conv_kernel, true, 1, 8));

  RECUR_RETURN_IF_ERROR(config_int(j, "num_attention_heads", &c.heads, true, 1));
  int kv_heads = c.heads;
  RECUR_RETURN_IF_ERROR(config_int(j, "num_key_value_heads", &kv_heads, false, 1));
  if (kv_heads != c.heads) {
    return unsupported(fmt::format(
        "num_key_value_heads {} differs from num_attention_heads {} (latent attention expands "
        "the latent into every head)",
        kv_heads, c.heads));
  }
  if (j.contains("q_lora_rank") && !j["q_lora_rank"].is_null()) {
    return unsupported("q_lora_rank (a low-rank query projection) is not supported");
  }
  bool nope = false;
  RECUR_RETURN_IF_ERROR(config_bool(j, "mla_use_nope", &nope));
  if (!nope) return unsupported("mla_use_nope false (latent attention with rotary)");
  if (j.contains("mla_use_output_gate") && j["mla_use_output_gate"] == true) {
    return unsupported("mla_use_output_gate (a gated latent attention output)");
  }
  RECUR_RETURN_IF_ERROR(config_int(j, "kv_lora_rank", &c.kv_lora_rank, true, 1));
  RECUR_RETURN_IF_ERROR(config_int(j, "qk_nope_head_dim", &c.qk_nope_dim, true, 1));
  RECUR_RETURN_IF_ERROR(config_int(j, "qk_rope_head_dim", &c.qk_rope_dim, true, 0));
  RECUR_RETURN_IF_ERROR(config_int(j, "v_head_dim", &c.v_head_dim, true, 1));
  // Each latent head attends with r + dr key channels and r value channels.
  if (int64_t(c.kv_lora_rank) + c.qk_rope_dim > Ops::kMaxAttentionGroupDims) {
    return make_error(ErrorCode::kUnsupported,
                      "config.json: kv_lora_rank + qk_rope_head_dim = {} channels a latent head; "
                      "attention takes at most {}",
                      int64_t(c.kv_lora_rank) + c.qk_rope_dim, Ops::kMaxAttentionGroupDims);
  }

  RECUR_RETURN_IF_ERROR(config_int(j, "intermediate_size", &c.intermediate_size, true, 1));
  RECUR_RETURN_IF_ERROR(config_int(j, "first_k_dense_replace", &c.first_k_dense_replace, false));
  RECUR_RETURN_IF_ERROR(config_int(j, "moe_layer_freq", &c.moe_layer_freq, false, 1));
  RECUR_RETURN_IF_ERROR(int_field(j, "num_experts", "num_local_experts", &c.num_experts, false));
  if (c.num_experts > 0) {
    RECUR_RETURN_IF_ERROR(int_field(j, "num_experts_per_token", "num_experts_per_tok",
                                    &c.experts_per_token, true, 1));
    RECUR_RETURN_IF_ERROR(
        config_int(j, "moe_intermediate_size", &c.moe_intermediate_size, true, 1));
    RECUR_RETURN_IF_ERROR(
        int_field(j, "num_shared_experts", "n_shared_experts", &c.num_shared_experts, false));
    RECUR_RETURN_IF_ERROR(config_double(j, "routed_scaling_factor", &c.routed_scaling_factor));
    if (!(c.routed_scaling_factor > 0 && c.routed_scaling_factor < 1e6)) {
      return unsupported("routed_scaling_factor outside (0, 1e6)");
    }
    const char* renorm = j.contains("moe_renormalize") ? "moe_renormalize" : "norm_topk_prob";
    RECUR_RETURN_IF_ERROR(config_bool(j, renorm, &c.renormalize));
    if (j.contains("moe_router_activation_func")) {
      const json& f = j["moe_router_activation_func"];
      if (f != "sigmoid" && f != "softmax") {
        return unsupported("moe_router_activation_func " + f.dump() +
                           " (only sigmoid and softmax)");
      }
      c.sigmoid_router = f == "sigmoid";
    }
    bool grouped = true;  // the published code limits by groups whatever this says
    RECUR_RETURN_IF_ERROR(config_bool(j, "use_grouped_topk", &grouped));
    RECUR_RETURN_IF_ERROR(int_field(j, "num_expert_group", "n_group", &c.n_group, false, 1));
    RECUR_RETURN_IF_ERROR(config_int(j, "topk_group", &c.topk_group, false, 1));
    if (c.experts_per_token > c.num_experts || c.num_experts % c.n_group != 0 ||
        c.topk_group > c.n_group ||
        int64_t(c.topk_group) * (c.num_experts / c.n_group) < c.experts_per_token) {
      return make_error(ErrorCode::kInvalidArgument,
                        "config.json: {} experts in {} groups, {} groups kept, cannot choose {} "
                        "per token",
                        c.num_experts, c.n_group, c.topk_group, c.experts_per_token);
    }
  }
  RECUR_RETURN_IF_ERROR(config_eos(j, "config.json", &c.eos_token_ids));
  RECUR_RETURN_IF_ERROR(config_eos(gen, "generation_config.json", &c.eos_token_ids));
  return c;
}

// ---- Kimi Delta Attention (KimiDeltaAttention) ----

// q, k, v projections, each through its own causal depthwise conv with SiLU; q and k
// L2-normalised (q scaled by dk^-1/2); a decay per key channel, -exp(A_log[h]) ·
// softplus(f_b(f_a(x)) + dt_bias); beta = σ(b_proj(x)); the gated delta rule with that decay;
// RMSNorm per head gated by σ(g_b(g_a(x))); o_proj.
class KimiDeltaAttention final : public TokenMixer {
 public:
  int heads = 0, head_dim = 0, conv_kernel = 0;
  float eps = 1e-6f;  // of the output norm
  Tensor qkv_proj;    // [3·H·d, hidden]: q_proj | k_proj | v_proj
  Tensor b_proj;      // [H, hidden]
  Tensor conv1d;      // [3·H·d, K]: q_conv1d | k_conv1d | v_conv1d
  Tensor fg_a_proj;   // [2·r, hidden]: f_a_proj | g_a_proj
  // f_b_proj and g_b_proj stacked, one product of two heads: [2, H·d, r] (the gates' low rank
  // r is the head size in the published code, so both have it)
  Tensor fg_b_proj;
  Tensor a_log;    // [H, 1]
  Tensor dt_bias;  // [H·d]
  Tensor o_norm;   // [d]
  Tensor o_proj;   // [hidden, H·d]

  int64_t dim() const { return int64_t(heads) * head_dim; }
  int64_t rank() const { return fg_a_proj.shape[0] / 2; }

  // The projections that read x or feed h (fg_b_proj's per-head products keep their type).
  void finish_load(Ops& ops) override {
    Tensor* ws[] = {&qkv_proj, &b_proj, &fg_a_proj, &o_proj};
    ops.retype_weights(ws);
  }

  void plan(ModelPlan& plan) override {
    state_ = plan.recurrent_state(conv_kernel - 1, 3 * dim(), heads, head_dim, head_dim);
    ScratchNeeds& s = plan.scratch();
    s.conv_channels = std::max(s.conv_channels, 3 * dim());
    s.value_dim = std::max(s.value_dim, dim());
    s.recurrent_heads = std::max<int64_t>(s.recurrent_heads, heads);
    s.decay_dim = std::max(s.decay_dim, 2 * dim());  // the decay | the output gate
    s.low_rank = std::max(s.low_rank, 2 * rank());
    s.delta_scratch_bytes =
        std::max<int64_t>(s.delta_scratch_bytes,
                          int64_t(plan.ops().gated_delta_rule_scratch_bytes(head_dim, head_dim)));
  }

  void forward(const LayerIo& io) const override {
    const int n = io.n;
    const int64_t D = dim();
    Ops& ops = io.ops;
    const Scratch& s = io.s;
    Tensor mixed = s.conv_in.slice_rows(0, n).slice_cols(0, 3 * D);      // [n, 3·H·d]: q | k | v
    Tensor b = s.b.slice_rows(0, n).slice_cols(0, heads);                // [n, H]
    Tensor low = s.low_rank.slice_rows(0, n).slice_cols(0, 2 * rank());  // [n, 2·r]: f | g
    {
      const Tensor ws[] = {qkv_proj, b_proj, fg_a_proj}, outs[] = {mixed, b, low};
      ops.matmul_group(io.x, ws, outs);
    }
    Tensor gates = s.decay.slice_rows(0, n).slice_cols(0, 2 * D);  // [n, 2·H·d]
    Tensor g = gates.slice_cols(0, D);                             // [n, H·d]: f, then the decay
    Tensor gate = gates.slice_cols(D, 2 * D);                      // [n, H·d]: the output gate
    ops.matmul_heads(low.col_heads(0, 2, rank()), fg_b_proj, gates.col_heads(0, 2, D));
    // Convs with SiLU (one conv over the three: each channel has its own taps), the L2 norms
    // and the gates, the decay written over f.
    Tensor conv = s.conv_out.slice_rows(0, n).slice_cols(0, 3 * D);
    Tensor beta = s.beta.slice_rows(0, n).slice_cols(0, heads);  // [n, H]
    {
      GdnInputArgs in;
      in.key_heads = heads, in.value_heads = heads, in.dk = head_dim, in.dv = head_dim;
      in.l2_eps = 1e-6f, in.q_scale = 1.0f / std::sqrt(float(head_dim));
      in.mixed = mixed, in.a = g, in.b = b;
      in.conv_weight = conv1d, in.a_log = a_log, in.dt_bias = dt_bias;
      in.conv_state = io.state.conv[size_t(state_)];
      in.conv_out = conv, in.g = g, in.beta = beta;
      ops.gdn_inputs(in, io.layout);
    }
    Tensor q = conv.col_heads(0, heads, head_dim), k = conv.col_heads(D, heads, head_dim);
    Tensor v = conv.col_heads(2 * D, heads, head_dim);  // [n, H, d]
    Tensor core = s.core.slice_rows(0, n).col_heads(0, heads, head_dim);
    Tensor normed = s.core_normed.slice_rows(0, n).slice_cols(0, D);
    ops.gated_delta_rule_norm(q, k, v, g.col_heads(0, heads, head_dim), beta,
                              io.state.delta[size_t(state_)], io.layout, core, s.delta,
                              gate.col_heads(0, heads, head_dim), o_norm, eps,
                              GateActivation::kSigmoid, normed.col_heads(0, heads, head_dim));
    ops.matmul(normed, o_proj, io.h, /*accumulate=*/true);  // h += the mixer's output
  }

 private:
  int state_ = -1;
};

// ---- latent attention without rotary (KimiMLAAttention) ----

// Per token the cache holds only the normed latent c (kv_lora_rank) and the key part shared by
// all heads (k_pe), as one key of r + dr channels whose first r are also the value. The attention
// runs in the latent space (the absorbed form): each head's query absorbs kv_b_proj's key half,
// q_lat[h] = (W_uk[h]ᵀ q_nope[h] | q_pe[h]), so that q·k = q_lat[h]·(c | k_pe); the latent
// output absorbs the value half, o[h] = W_uv[h] · o_lat[h]. Every head reads one latent cache.
class LatentAttention final : public TokenMixer {
 public:
  int heads = 0, rank = 0, nope_dim = 0, rope_dim = 0, v_dim = 0;
  float latent_eps = 1e-6f;  // kv_a_layernorm is built with its class default eps
  Tensor q_nope_proj;        // [heads·dn, hidden]: q_proj's non-positional rows
  Tensor q_pe_proj;          // [heads, dr, hidden]: its positional rows (when dr > 0)
  Tensor kv_a_proj;          // [r + dr, hidden]: c | k_pe
  Tensor kv_a_norm;          // [r]
  Tensor k_absorb;           // [heads, r, dn]: W_uk[h]ᵀ
  Tensor v_absorb;           // [heads, dv, r]: W_uv[h]
  Tensor o_proj;             // [hidden, heads·dv]

  int64_t key_dim() const { return int64_t(rank) + rope_dim; }

  // The projections that read x or feed h (the absorbed per-head products keep their type).
  void finish_load(Ops& ops) override {
    Tensor* ws[] = {&q_nope_proj, &kv_a_proj, &o_proj};
    ops.retype_weights(ws);
  }

  void plan(ModelPlan& plan) override {
    cache_ = plan.attention_cache(1, key_dim(), rank, /*values_in_keys=*/true);
    ScratchNeeds& s = plan.scratch();
    s.attn_q = std::max(s.attn_q, heads * key_dim());               // q_lat
    s.attn_k = std::max(s.attn_k, key_dim());                       // c | k_pe
    s.attn_v = std::max<int64_t>(s.attn_v, int64_t(heads) * rank);  // o_lat
    s.attn_out = std::max<int64_t>(s.attn_out, int64_t(heads) * std::max(nope_dim, v_dim));
  }

  void forward(const LayerIo& io) const override {
    const int n = io.n;
    const int64_t kd = key_dim();
    Ops& ops = io.ops;
    const Scratch& s = io.s;
    // The attention scratch, by shape: [n, heads·dn], [n, r + dr] (c | k_pe),
    // [n, heads·(r + dr)] (per head its latent query | q_pe), [n, heads·r], [n, heads·dv].
    Tensor q_nope = s.gate.slice_rows(0, n).slice_cols(0, int64_t(heads) * nope_dim);
    Tensor latent = s.k.slice_rows(0, n).slice_cols(0, kd);
    Tensor q_lat = s.q.slice_rows(0, n).slice_cols(0, heads * kd);
    Tensor o_lat = s.v.slice_rows(0, n).slice_cols(0, int64_t(heads) * rank);
    Tensor out = s.attn_out.slice_rows(0, n).slice_cols(0, int64_t(heads) * v_dim);
    {
      const Tensor ws[] = {q_nope_proj, kv_a_proj}, outs[] = {q_nope, latent};
      ops.matmul_group(io.x, ws, outs);
    }
    Tensor c = latent.slice_cols(0, rank);
    ops.rms_norm(c, kv_a_norm, 0.0f, latent_eps, c);
    // Per head, into q_lat's (r | dr) channels: W_uk[h]ᵀ q_nope[h], and q_pe[h] from x (read by
    // every head: head stride 0).
    ops.matmul_heads(q_nope.col_heads(0, heads, nope_dim), k_absorb,
                     q_lat.col_heads(0, heads, rank, kd));
    if (rope_dim > 0) {
      ops.matmul_heads(io.x.col_heads(0, heads, io.x.shape[1], 0), q_pe_proj,
                       q_lat.col_heads(rank, heads, rope_dim, kd));
    }
    const Tensor& kc = io.state.k_cache[size_t(cache_)];
    const Tensor& vc = io.state.v_cache[size_t(cache_)];
    // The value view is the key's first r channels: writing it rewrites the same numbers.
    ops.kv_cache_write(latent.col_heads(0, 1, kd), latent.col_heads(0, 1, rank), kc, vc, io.layout);
    // Heads in groups of at most kMaxAttentionGroupDims / (r + dr) per call: the published
    // 48B's 32 heads of r + dr = 576 take one call, reading the latent cache once.
    const float scale = 1.0f / std::sqrt(float(nope_dim + rope_dim));
    const int per_call =
        int(std::clamp<int64_t>(Ops::kMaxAttentionGroupDims / kd, 1, Ops::kMaxAttentionGroup));
    for (int h0 = 0; h0 < heads; h0 += per_call) {
      const int h1 = std::min(heads, h0 + per_call);
      ops.paged_attention(q_lat.col_heads(h0 * kd, h1 - h0, kd), kc, vc, io.layout, scale,
                          o_lat.col_heads(int64_t(h0) * rank, h1 - h0, rank));
    }
    ops.matmul_heads(o_lat.col_heads(0, heads, rank), v_absorb, out.col_heads(0, heads, v_dim));
    ops.matmul(out, o_proj, io.h, /*accumulate=*/true);  // h += the mixer's output
  }

  void describe(ModelInfo& info) const override {
    ++info.attention_layers;
    info.attention_dim = int64_t(heads) * key_dim();
    info.expanded_kv_bytes_per_token += int64_t(heads) * (nope_dim + rope_dim + v_dim) * 4;
  }

 private:
  int cache_ = -1;
};

// ---- loading ----

Status load_kda(const KimiLinearConfig& c, const std::string& p, WeightLoader& w,
                KimiDeltaAttention* a) {
  const int64_t H = c.hidden_size, heads = c.kda_heads, d = c.kda_head_dim, D = heads * d;
  const int64_t K = c.conv_kernel;
  // A tensor-parallel rank's heads (each its own key and value head); the gates' low-rank
  // inputs (f_a, g_a) are whole on every rank.
  RECUR_ASSIGN_OR_RETURN(
      const HeadShard part,
      split_heads(w.shard(), heads, heads, "Kimi Delta Attention", "heads", "heads"));
  const int64_t h0 = part.heads.first, hn = part.heads.count, Dn = hn * d;
  a->heads = int(hn), a->head_dim = c.kda_head_dim, a->conv_kernel = c.conv_kernel;
  a->eps = c.rms_norm_eps;
  // Rows [h0·per_head, +hn·per_head) of a [heads·per_head, cols] matrix.
  auto head_rows = [&](const char* name, int64_t per_head, int64_t cols, Tensor* out) -> Status {
    const RowPiece rows{p + name, {heads * per_head, cols}, h0 * per_head, hn * per_head};
    RECUR_ASSIGN_OR_RETURN(*out,
                           w.load_rows({&rows, 1}, {hn * per_head, cols}, WeightUse::kMatrix));
    return Status();
  };
  // The projections that read x, stacked by rows into three weights of one matmul group.
  const std::vector<int64_t> qkv_shape = {D, H};
  const RowPiece qkv[] = {{p + "q_proj.weight", qkv_shape, h0 * d, Dn},
                          {p + "k_proj.weight", qkv_shape, h0 * d, Dn},
                          {p + "v_proj.weight", qkv_shape, h0 * d, Dn}};
  RECUR_ASSIGN_OR_RETURN(a->qkv_proj, w.load_rows(qkv, {3 * Dn, H}, WeightUse::kMatrix));
  RECUR_RETURN_IF_ERROR(head_rows("b_proj.weight", 1, H, &a->b_proj));
  // The low rank of the gates is the head size in the published code.
  const RowPiece fg_a[] = {{p + "f_a_proj.weight", {d, H}, 0, d},
                           {p + "g_a_proj.weight", {d, H}, 0, d}};
  RECUR_ASSIGN_OR_RETURN(a->fg_a_proj, w.load_rows(fg_a, {2 * d, H}, WeightUse::kMatrix));
  const RowPiece fg_b[] = {{p + "f_b_proj.weight", {D, d}, h0 * d, Dn},
                           {p + "g_b_proj.weight", {D, d}, h0 * d, Dn}};
  RECUR_ASSIGN_OR_RETURN(a->fg_b_proj, w.load_rows(fg_b, {2, Dn, d}, WeightUse::kHeads));
  const RowPiece o{p + "o_proj.weight", {H, D}, 0, H, h0 * d, Dn};
  RECUR_ASSIGN_OR_RETURN(a->o_proj, w.load_rows({&o, 1}, {H, Dn}, WeightUse::kMatrix));
  // The three convs' taps as one conv over q | k | v.
  const std::vector<int64_t> conv_shape = {D, 1, K};
  const RowPiece convs[] = {{p + "q_conv1d.weight", conv_shape, h0 * d, Dn},
                            {p + "k_conv1d.weight", conv_shape, h0 * d, Dn},
                            {p + "v_conv1d.weight", conv_shape, h0 * d, Dn}};
  RECUR_ASSIGN_OR_RETURN(a->conv1d, w.load_rows(convs, {3 * Dn, 1, K}, WeightUse::kVector));
  a->conv1d = a->conv1d.reshaped({3 * Dn, K});
  // A_log [1, 1, H, 1]: one value per head. Both in f32, whatever the checkpoint stores: the
  // gates read them as one type.
  RECUR_ASSIGN_OR_RETURN(a->a_log, w.load_vector_f32(p + "A_log", heads, {1, 1, heads, 1}, h0, hn));
  RECUR_ASSIGN_OR_RETURN(a->dt_bias, w.load_vector_f32(p + "dt_bias", D, {}, h0 * d, Dn));
  RECUR_ASSIGN_OR_RETURN(a->o_norm, w.load(p + "o_norm.weight", {d}, WeightUse::kVector));
  return Status();
}

// Tensor parallel: split by heads after the latent. Every rank computes and caches the whole
// latent (c | k_pe: one head's worth, shared by all heads) and holds its heads' query rows,
// absorbed projections and o_proj columns.
Status load_mla(const KimiLinearConfig& c, const std::string& p, WeightLoader& w,
                LatentAttention* a) {
  const int64_t H = c.hidden_size, heads = c.heads, r = c.kv_lora_rank;
  const int64_t dn = c.qk_nope_dim, dr = c.qk_rope_dim, dv = c.v_head_dim;
  RECUR_ASSIGN_OR_RETURN(
      const HeadShard part,
      split_heads(w.shard(), heads, heads, "the latent attention", "heads", "heads"));
  const int64_t h0 = part.heads.first, hn = part.heads.count;
  a->heads = int(hn), a->rank = c.kv_lora_rank;
  a->nope_dim = c.qk_nope_dim, a->rope_dim = c.qk_rope_dim, a->v_dim = c.v_head_dim;
  // q_proj [heads·(dn + dr), H]: per head dn query rows, then dr rows against k_pe.
  const std::string q = p + "q_proj.weight";
  const std::vector<int64_t> q_shape = {heads * (dn + dr), H};
  std::vector<RowPiece> nope;
  for (int64_t h = h0; h < h0 + hn; ++h) nope.push_back({q, q_shape, h * (dn + dr), dn});
  RECUR_ASSIGN_OR_RETURN(a->q_nope_proj, w.load_rows(nope, {hn * dn, H}, WeightUse::kMatrix));
  // kv_b_proj [heads·(dn + dv), r]: per head dn key rows (absorbed into the query, transposed)
  // and dv value rows (absorbed into the output).
  const std::string kv_b = p + "kv_b_proj.weight";
  const std::vector<int64_t> kv_b_shape = {heads * (dn + dv), r};
  // Each as one [heads, rows, cols] weight for matmul_heads.
  std::vector<RowPiece> pe, uk, uv;
  for (int64_t h = h0; h < h0 + hn; ++h) {
    pe.push_back({q, q_shape, h * (dn + dr) + dn, dr});
    uk.push_back({kv_b, kv_b_shape, h * (dn + dv), dn});
    uv.push_back({kv_b, kv_b_shape, h * (dn + dv) + dn, dv});
  }
  if (dr > 0) {
    RECUR_ASSIGN_OR_RETURN(a->q_pe_proj, w.load_rows(pe, {hn, dr, H}, WeightUse::kHeads));
  }
  RECUR_ASSIGN_OR_RETURN(a->k_absorb, w.load_transposed(uk, {hn, r, dn}, WeightUse::kHeads));
  RECUR_ASSIGN_OR_RETURN(a->v_absorb, w.load_rows(uv, {hn, dv, r}, WeightUse::kHeads));
  RECUR_ASSIGN_OR_RETURN(a->kv_a_proj,
                         w.load(p + "kv_a_proj_with_mqa.weight", {r + dr, H}, WeightUse::kMatrix));
  RECUR_ASSIGN_OR_RETURN(a->kv_a_norm,
                         w.load(p + "kv_a_layernorm.weight", {r}, WeightUse::kVector));
  const RowPiece o{p + "o_proj.weight", {H, heads * dv}, 0, H, h0 * dv, hn * dv};
  RECUR_ASSIGN_OR_RETURN(a->o_proj, w.load_rows({&o, 1}, {H, hn * dv}, WeightUse::kMatrix));
  return Status();
}

// block_sparse_moe: the router (`gate`, with its selection bias), experts.E.{w1 gate, w3 up,
// w2 down}, and the shared experts as one ungated SwiGLU of their summed width.
Status load_moe(const KimiLinearConfig& c, const std::string& p, WeightLoader& w, SparseMoe* m) {
  const int64_t H = c.hidden_size, E = c.num_experts, I = c.moe_intermediate_size;
  m->routing.score = c.sigmoid_router ? MoeRouting::Score::kSigmoid : MoeRouting::Score::kSoftmax;
  m->routing.k = c.experts_per_token;
  m->routing.renormalize = c.renormalize;
  m->routing.scale = float(c.routed_scaling_factor);
  m->routing.n_group = c.n_group, m->routing.topk_group = c.topk_group;
  RECUR_ASSIGN_OR_RETURN(m->router, w.load(p + "gate.weight", {E, H}, WeightUse::kMatrix));
  // The selection bias in f32, as routing reads it, whatever the checkpoint stores.
  RECUR_ASSIGN_OR_RETURN(m->routing.selection_bias,
                         w.load_vector_f32(p + "gate.e_score_correction_bias", E, {}));
  m->experts.resize(size_t(E));
  // A tensor-parallel rank's columns f of each expert's hidden layer.
  RECUR_ASSIGN_OR_RETURN(const ShardRange f, column_part(w.shard(), I, "an expert"));
  for (int64_t e = 0; e < E; ++e) {
    const std::string x = p + "experts." + std::to_string(e) + ".";
    ExpertWeights& ew = m->experts[size_t(e)];
    const RowPiece gate{x + "w1.weight", {I, H}, f.first, f.count};
    const RowPiece up{x + "w3.weight", {I, H}, f.first, f.count};
    const RowPiece down{x + "w2.weight", {H, I}, 0, H, f.first, f.count};
    RECUR_ASSIGN_OR_RETURN(ew.gate, w.load_rows({&gate, 1}, {f.count, H}, WeightUse::kExpert));
    RECUR_ASSIGN_OR_RETURN(ew.up, w.load_rows({&up, 1}, {f.count, H}, WeightUse::kExpert));
    RECUR_ASSIGN_OR_RETURN(ew.down, w.load_rows({&down, 1}, {H, f.count}, WeightUse::kExpert));
  }
  if (c.num_shared_experts > 0) {
    RECUR_RETURN_IF_ERROR(load_swiglu(w, p + "shared_experts.", I * c.num_shared_experts, H,
                                      WeightUse::kMatrix, &m->shared));
  }
  return Status();
}

Status load_layer(const KimiLinearConfig& c, int i, const std::string& p, WeightLoader& w,
                  DecoderLayer* L) {
  if (c.is_kda[size_t(i)]) {
    auto a = std::make_unique<KimiDeltaAttention>();
    RECUR_RETURN_IF_ERROR(load_kda(c, p + "self_attn.", w, a.get()));
    L->mixer = std::move(a);
  } else {
    auto a = std::make_unique<LatentAttention>();
    RECUR_RETURN_IF_ERROR(load_mla(c, p + "self_attn.", w, a.get()));
    L->mixer = std::move(a);
  }
  if (c.layer_is_moe(i)) {
    auto m = std::make_unique<SparseMoe>();
    RECUR_RETURN_IF_ERROR(load_moe(c, p + "block_sparse_moe.", w, m.get()));
    L->ffn = std::move(m);
  } else {
    auto m = std::make_unique<DenseMlp>();
    RECUR_RETURN_IF_ERROR(
        load_swiglu(w, p + "mlp.", c.intermediate_size, c.hidden_size, WeightUse::kMatrix, &m->w));
    L->ffn = std::move(m);
  }
  const int64_t H = c.hidden_size;
  RECUR_ASSIGN_OR_RETURN(L->input_norm,
                         w.load(p + "input_layernorm.weight", {H}, WeightUse::kVector));
  RECUR_ASSIGN_OR_RETURN(L->post_norm,
                         w.load(p + "post_attention_layernorm.weight", {H}, WeightUse::kVector));
  return Status();
}

}  // namespace

Result<HybridSpec> build_kimi_linear(const json& config, const json& gen, WeightLoader& w) {
  RECUR_ASSIGN_OR_RETURN(KimiLinearConfig c, KimiLinearConfig::from_json(config, gen));
  const int64_t H = c.hidden_size;
  HybridSpec spec;
  spec.architecture = "kimi_linear";
  spec.vocab_size = c.vocab_size;
  spec.hidden_size = c.hidden_size;
  spec.max_position = c.max_position;
  spec.rms_norm_eps = c.rms_norm_eps;
  spec.norm_offset = 0.0f;  // plain RMSNorm: x̂ · w
  spec.eos_token_ids = c.eos_token_ids;
  RECUR_ASSIGN_OR_RETURN(spec.embed_tokens, w.load("model.embed_tokens.weight", {c.vocab_size, H},
                                                   WeightUse::kEmbedding));
  RECUR_ASSIGN_OR_RETURN(spec.final_norm, w.load("model.norm.weight", {H}, WeightUse::kVector));
  RECUR_RETURN_IF_ERROR(load_lm_head(w, c.vocab_size, H, c.tie_word_embeddings, &spec));
  for (int i = 0; i < c.num_layers; ++i) {
    DecoderLayer L;
    RECUR_RETURN_IF_ERROR(load_layer(c, i, "model.layers." + std::to_string(i) + ".", w, &L));
    spec.layers.push_back(std::move(L));
  }
  return spec;
}

}  // namespace recur
