// The Qwen3-Next forward pass, top to bottom like the reference modeling code: embedding;
// per layer a token mixer (Gated DeltaNet or gated attention) and a feed-forward (MoE or dense
// SwiGLU), each behind a zero-centred RMSNorm and a residual; final norm; LM head.
#include "model/qwen3_next.h"

#include <cmath>
#include <cstring>
#include <functional>

namespace recur {

namespace {

struct GatedDeltaNetWeights {
  Tensor in_proj_qkvz;  // [Hk·(2dk + 2·(Hv/Hk)·dv), hidden], grouped by key head
  Tensor in_proj_ba;    // [Hk·2·(Hv/Hk), hidden], grouped by key head
  Tensor conv1d;        // [conv_dim, 1, K]
  Tensor dt_bias;       // [Hv]
  Tensor a_log;         // [Hv]
  Tensor norm;          // [dv] (gated RMSNorm, not zero-centred)
  Tensor out_proj;      // [hidden, Hv·dv]
};

struct AttentionWeights {
  Tensor q_proj;  // [heads·2·hd, hidden]: per head, query then gate
  Tensor k_proj;  // [kv_heads·hd, hidden]
  Tensor v_proj;  // [kv_heads·hd, hidden]
  Tensor o_proj;  // [hidden, heads·hd]
  Tensor q_norm;  // [hd]
  Tensor k_norm;  // [hd]
};

struct MoeWeights {
  Tensor router;                       // [E, hidden]
  std::vector<ExpertWeights> experts;  // E × {[ff, hidden], [ff, hidden], [hidden, ff]}
  ExpertWeights shared;                // shared expert
  Tensor shared_gate;                  // [1, hidden]
  bool has_shared = false;
};

struct Layer {
  LayerKind kind;
  bool moe;
  int state_index;    // index among layers of the same kind (state pools)
  Tensor input_norm;  // [hidden]
  Tensor post_norm;   // [hidden]
  GatedDeltaNetWeights gdn;
  AttentionWeights attn;
  MoeWeights moe_w;
  ExpertWeights mlp;  // dense SwiGLU
};

// f32 activations for up to max_tokens tokens, allocated once at load.
struct Workspace {
  std::vector<Buffer> buffers;
  Tensor h, x, ffn_out;                                    // [T, hidden]
  Tensor qkvz, ba, mixed_qkv, z, conv_out, a, b, g, beta;  // Gated DeltaNet
  Tensor core_out, core_normed;                            // [T, Hv·dv]
  Tensor qg, q, gate, k, v, attn_out;                      // attention
  Tensor router_logits, expert_ids, expert_weights;        // [T, E], [T, k], [T, k]
  Tensor ff_gate, ff_up, ff_hidden, shared_out, shared_score;
  Tensor moe_scratch, gdn_scratch;
  Tensor final_h;  // [R, hidden]

  Status add(Allocator& alloc, Tensor* t, DType dt, std::initializer_list<int64_t> shape,
             const char* what) {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    RECUR_ASSIGN_OR_RETURN(Buffer buf, alloc.allocate(size_t(n) * dtype_size(dt), what));
    *t = Tensor::contiguous(buf.data(), dt, shape, alloc.device());
    buffers.push_back(std::move(buf));
    return Status();
  }
};

// Recurrent state per slot and the paged attention cache, allocated once.
struct StatePools {
  std::vector<Buffer> buffers;
  std::vector<Tensor> conv;     // per Gated DeltaNet layer: [slots, K-1, conv_dim] f32
  std::vector<Tensor> delta;    // per Gated DeltaNet layer: [slots, Hv, dk, dv] f32
  std::vector<Tensor> k_cache;  // per attention layer: [blocks, kv_heads, hd, block_size] f32
  std::vector<Tensor> v_cache;  // per attention layer: [blocks, kv_heads, block_size, hd] f32
};

class Qwen3Next final : public Model {
 public:
  Qwen3Next(Qwen3NextConfig cfg, Ops& ops, const LoadOptions& opt)
      : cfg_(std::move(cfg)), ops_(ops), opt_(opt) {}

  // Reads every weight through get_weight (a checkpoint, or random values for benchmarks).
  using WeightGetter =
      std::function<Result<Tensor>(const std::string& name, const std::vector<int64_t>& shape)>;
  Status load(const WeightGetter& get_weight, const nlohmann::json& generation_config);
  // Buffers of weights the model made itself (random weights).
  std::vector<Buffer>& owned_weights() { return owned_weights_; }
  Status allocate();
  void keep_checkpoint(std::unique_ptr<Checkpoint> c) { checkpoint_ = std::move(c); }

  const ModelInfo& info() const override { return info_; }
  int max_batch_tokens() const override { return opt_.max_batch_tokens; }
  int max_logit_rows() const override { return opt_.max_logit_rows; }
  const StateConfig& state_config() const override { return opt_.state; }
  Ops& ops() override { return ops_; }
  void reset_slot(int slot) override;
  Status forward(const Batch& batch, Tensor logits) override;

 private:
  Status validate(const Batch& batch, const Tensor& logits) const;
  void gated_delta_net(const Layer& layer, const SeqLayout& sl, int n);
  void attention(const Layer& layer, const SeqLayout& sl, int n);
  void sparse_moe(const Layer& layer, int n);
  void dense_mlp(const ExpertWeights& w, const Tensor& x, Tensor h, int n);

  // Derived sizes.
  int key_dim() const { return cfg_.linear_num_key_heads * cfg_.linear_key_head_dim; }
  int value_dim() const { return cfg_.linear_num_value_heads * cfg_.linear_value_head_dim; }
  int conv_dim() const { return 2 * key_dim() + value_dim(); }

  Qwen3NextConfig cfg_;
  Ops& ops_;
  LoadOptions opt_;
  ModelInfo info_;
  Tensor embed_tokens_;  // [vocab, hidden]
  Tensor final_norm_;    // [hidden]
  Tensor lm_head_;       // [vocab, hidden]; the embedding when tied
  std::vector<Layer> layers_;
  Workspace ws_;
  StatePools state_;
  std::unique_ptr<Checkpoint> checkpoint_;  // owns the mapped weights
  std::vector<Buffer> owned_weights_;
};

// ---- loading ----

Status Qwen3Next::load(const WeightGetter& get_weight, const nlohmann::json& gen) {
  const int64_t H = cfg_.hidden_size;
  info_.vocab_size = cfg_.vocab_size;
  info_.max_position = opt_.max_context;
  info_.eos_token_ids = cfg_.eos_token_ids;
  auto num = [&](const char* key, auto* out) {
    if (gen.contains(key) && gen[key].is_number())
      *out = gen[key].get<std::remove_pointer_t<decltype(out)>>();
  };
  if (gen.contains("do_sample") && gen["do_sample"].is_boolean()) {
    info_.generation.do_sample = gen["do_sample"].get<bool>();
  }
  num("temperature", &info_.generation.temperature);
  num("top_k", &info_.generation.top_k);
  num("top_p", &info_.generation.top_p);
  num("min_p", &info_.generation.min_p);
  num("repetition_penalty", &info_.generation.repetition_penalty);
  auto get = [&](const std::string& name, std::vector<int64_t> shape, Tensor* out) -> Status {
    RECUR_ASSIGN_OR_RETURN(*out, get_weight(name, shape));
    const int64_t bytes = out->numel() * int64_t(dtype_size(out->dtype));
    info_.weight_bytes += bytes;
    const bool routed = name.find(".mlp.experts.") != std::string::npos;
    if (!routed && name != "model.embed_tokens.weight") {
      info_.dense_weight_bytes += bytes;
      if (shape.size() == 2) info_.active_params_per_token += out->numel();
    }
    return Status();
  };
  auto get_mlp = [&](const std::string& prefix, int64_t ff, ExpertWeights* w) -> Status {
    RECUR_RETURN_IF_ERROR(get(prefix + ".gate_proj.weight", {ff, H}, &w->gate));
    RECUR_RETURN_IF_ERROR(get(prefix + ".up_proj.weight", {ff, H}, &w->up));
    return get(prefix + ".down_proj.weight", {H, ff}, &w->down);
  };

  RECUR_RETURN_IF_ERROR(get("model.embed_tokens.weight", {cfg_.vocab_size, H}, &embed_tokens_));
  RECUR_RETURN_IF_ERROR(get("model.norm.weight", {H}, &final_norm_));
  if (cfg_.tie_word_embeddings) {
    lm_head_ = embed_tokens_;
  } else {
    RECUR_RETURN_IF_ERROR(get("lm_head.weight", {cfg_.vocab_size, H}, &lm_head_));
  }

  const int64_t hk = cfg_.linear_num_key_heads, hv = cfg_.linear_num_value_heads;
  const int64_t dv = cfg_.linear_value_head_dim;
  const int64_t heads = cfg_.num_heads, kv_heads = cfg_.num_kv_heads, hd = cfg_.head_dim;
  int n_linear = 0, n_full = 0;
  for (int i = 0; i < cfg_.num_layers; ++i) {
    Layer L;
    L.kind = cfg_.layer_types[size_t(i)];
    L.moe = cfg_.layer_is_moe(i);
    const std::string p = "model.layers." + std::to_string(i);
    RECUR_RETURN_IF_ERROR(get(p + ".input_layernorm.weight", {H}, &L.input_norm));
    RECUR_RETURN_IF_ERROR(get(p + ".post_attention_layernorm.weight", {H}, &L.post_norm));
    if (L.kind == LayerKind::kLinearAttention) {
      L.state_index = n_linear++;
      const std::string a = p + ".linear_attn";
      RECUR_RETURN_IF_ERROR(get(a + ".in_proj_qkvz.weight", {2 * key_dim() + 2 * value_dim(), H},
                                &L.gdn.in_proj_qkvz));
      RECUR_RETURN_IF_ERROR(get(a + ".in_proj_ba.weight", {2 * hv, H}, &L.gdn.in_proj_ba));
      RECUR_RETURN_IF_ERROR(
          get(a + ".conv1d.weight", {conv_dim(), 1, cfg_.linear_conv_kernel}, &L.gdn.conv1d));
      RECUR_RETURN_IF_ERROR(get(a + ".dt_bias", {hv}, &L.gdn.dt_bias));
      RECUR_RETURN_IF_ERROR(get(a + ".A_log", {hv}, &L.gdn.a_log));
      RECUR_RETURN_IF_ERROR(get(a + ".norm.weight", {dv}, &L.gdn.norm));
      RECUR_RETURN_IF_ERROR(get(a + ".out_proj.weight", {H, hv * dv}, &L.gdn.out_proj));
      (void)hk;
    } else {
      L.state_index = n_full++;
      const std::string a = p + ".self_attn";
      RECUR_RETURN_IF_ERROR(get(a + ".q_proj.weight", {heads * hd * 2, H}, &L.attn.q_proj));
      RECUR_RETURN_IF_ERROR(get(a + ".k_proj.weight", {kv_heads * hd, H}, &L.attn.k_proj));
      RECUR_RETURN_IF_ERROR(get(a + ".v_proj.weight", {kv_heads * hd, H}, &L.attn.v_proj));
      RECUR_RETURN_IF_ERROR(get(a + ".o_proj.weight", {H, heads * hd}, &L.attn.o_proj));
      RECUR_RETURN_IF_ERROR(get(a + ".q_norm.weight", {hd}, &L.attn.q_norm));
      RECUR_RETURN_IF_ERROR(get(a + ".k_norm.weight", {hd}, &L.attn.k_norm));
    }
    if (L.moe) {
      const std::string m = p + ".mlp";
      RECUR_RETURN_IF_ERROR(get(m + ".gate.weight", {cfg_.num_experts, H}, &L.moe_w.router));
      L.moe_w.experts.resize(size_t(cfg_.num_experts));
      for (int e = 0; e < cfg_.num_experts; ++e) {
        RECUR_RETURN_IF_ERROR(get_mlp(m + ".experts." + std::to_string(e),
                                      cfg_.moe_intermediate_size, &L.moe_w.experts[size_t(e)]));
      }
      if (cfg_.shared_expert_intermediate_size > 0) {
        L.moe_w.has_shared = true;
        RECUR_RETURN_IF_ERROR(
            get_mlp(m + ".shared_expert", cfg_.shared_expert_intermediate_size, &L.moe_w.shared));
        RECUR_RETURN_IF_ERROR(get(m + ".shared_expert_gate.weight", {1, H}, &L.moe_w.shared_gate));
      }
    } else {
      RECUR_RETURN_IF_ERROR(get_mlp(p + ".mlp", cfg_.intermediate_size, &L.mlp));
    }
    layers_.push_back(std::move(L));
  }
  if (cfg_.tie_word_embeddings) {  // the tied table is read as the LM head every step
    info_.dense_weight_bytes += embed_tokens_.numel() * int64_t(dtype_size(embed_tokens_.dtype));
    info_.active_params_per_token += embed_tokens_.numel();
  }
  for (const Layer& L : layers_) {
    if (!L.moe) continue;
    ++info_.moe_layers;
    const ExpertWeights& e = L.moe_w.experts[0];
    info_.expert_weight_bytes =
        (e.gate.numel() + e.up.numel() + e.down.numel()) * int64_t(dtype_size(e.gate.dtype));
  }
  info_.n_experts = cfg_.num_experts;
  info_.experts_per_token = cfg_.num_experts_per_tok;
  info_.active_params_per_token += int64_t(info_.moe_layers) * cfg_.num_experts_per_tok * 3 *
                                   cfg_.moe_intermediate_size * cfg_.hidden_size;
  info_.attention_dim = int64_t(cfg_.num_heads) * cfg_.head_dim;
  return Status();
}

Status Qwen3Next::allocate() {
  Allocator& A = ops_.allocator();
  const int64_t T = opt_.max_batch_tokens, H = cfg_.hidden_size;
  const int64_t hv = cfg_.linear_num_value_heads;
  const int64_t heads = cfg_.num_heads, kv = cfg_.num_kv_heads, hd = cfg_.head_dim;
  const int64_t topk = std::max(cfg_.num_experts_per_tok, 1);
  const int64_t ff = std::max({cfg_.intermediate_size, cfg_.shared_expert_intermediate_size, 1});
  Workspace& w = ws_;
  const DType f32 = DType::F32;
  for (Tensor* t : {&w.h, &w.x, &w.ffn_out, &w.shared_out}) {
    RECUR_RETURN_IF_ERROR(w.add(A, t, f32, {T, H}, "activations"));
  }
  RECUR_RETURN_IF_ERROR(w.add(A, &w.qkvz, f32, {T, 2 * key_dim() + 2 * value_dim()}, "qkvz"));
  RECUR_RETURN_IF_ERROR(w.add(A, &w.ba, f32, {T, 2 * hv}, "ba"));
  RECUR_RETURN_IF_ERROR(w.add(A, &w.mixed_qkv, f32, {T, conv_dim()}, "mixed qkv"));
  RECUR_RETURN_IF_ERROR(w.add(A, &w.conv_out, f32, {T, conv_dim()}, "conv out"));
  RECUR_RETURN_IF_ERROR(w.add(A, &w.z, f32, {T, value_dim()}, "z"));
  for (Tensor* t : {&w.a, &w.b, &w.g, &w.beta}) {
    RECUR_RETURN_IF_ERROR(w.add(A, t, f32, {T, hv}, "gates"));
  }
  RECUR_RETURN_IF_ERROR(w.add(A, &w.core_out, f32, {T, value_dim()}, "delta rule out"));
  RECUR_RETURN_IF_ERROR(w.add(A, &w.core_normed, f32, {T, value_dim()}, "delta rule normed"));
  RECUR_RETURN_IF_ERROR(w.add(A, &w.qg, f32, {T, heads * hd * 2}, "query and gate"));
  RECUR_RETURN_IF_ERROR(w.add(A, &w.q, f32, {T, heads * hd}, "query"));
  RECUR_RETURN_IF_ERROR(w.add(A, &w.gate, f32, {T, heads * hd}, "attention gate"));
  RECUR_RETURN_IF_ERROR(w.add(A, &w.attn_out, f32, {T, heads * hd}, "attention out"));
  RECUR_RETURN_IF_ERROR(w.add(A, &w.k, f32, {T, kv * hd}, "keys"));
  RECUR_RETURN_IF_ERROR(w.add(A, &w.v, f32, {T, kv * hd}, "values"));
  RECUR_RETURN_IF_ERROR(
      w.add(A, &w.router_logits, f32, {T, std::max(cfg_.num_experts, 1)}, "router logits"));
  RECUR_RETURN_IF_ERROR(w.add(A, &w.expert_ids, DType::I32, {T, topk}, "expert ids"));
  RECUR_RETURN_IF_ERROR(w.add(A, &w.expert_weights, f32, {T, topk}, "expert weights"));
  for (Tensor* t : {&w.ff_gate, &w.ff_up, &w.ff_hidden}) {
    RECUR_RETURN_IF_ERROR(w.add(A, t, f32, {T, ff}, "feed-forward"));
  }
  RECUR_RETURN_IF_ERROR(w.add(A, &w.shared_score, f32, {T, 1}, "shared expert gate"));
  // One more expert per token than routed: a backend may run the shared expert with them.
  size_t moe_bytes =
      ops_.moe_experts_scratch_bytes(int(T), int(topk) + 1, std::max(cfg_.num_experts, 1) + 1,
                                     int(H), std::max(cfg_.moe_intermediate_size, 1));
  RECUR_RETURN_IF_ERROR(w.add(A, &w.moe_scratch, DType::U8, {int64_t(moe_bytes)}, "moe scratch"));
  size_t gdn_bytes =
      ops_.gated_delta_rule_scratch_bytes(cfg_.linear_key_head_dim, cfg_.linear_value_head_dim);
  RECUR_RETURN_IF_ERROR(w.add(A, &w.gdn_scratch, DType::U8, {int64_t(gdn_bytes)}, "gdn scratch"));
  RECUR_RETURN_IF_ERROR(w.add(A, &w.final_h, f32, {opt_.max_logit_rows, H}, "final rows"));

  // State pools. Without an explicit block count, the cache takes the budget, but never more
  // than every slot filled to the context length needs.
  StateConfig& sc = opt_.state;
  if (sc.n_blocks <= 0) {
    int64_t per_block = 0;
    for (const Layer& L : layers_) {
      if (L.kind == LayerKind::kFullAttention)
        per_block += 2 * int64_t(sc.block_size) * kv * hd * 4;
    }
    const int64_t needed =
        int64_t(sc.n_slots) * ((opt_.max_context + sc.block_size - 1) / sc.block_size);
    sc.n_blocks = int(std::max<int64_t>(
        1, per_block ? std::min(needed, opt_.kv_cache_budget_bytes / per_block) : 1));
  }
  // Sequences of one forward hold distinct slots and distinct blocks.
  ForwardLimits limits;
  limits.max_tokens = opt_.max_batch_tokens;
  limits.max_seqs = sc.n_slots;
  limits.max_blocks = sc.n_blocks;
  limits.max_logit_rows = opt_.max_logit_rows;
  limits.max_context = opt_.max_context;
  RECUR_RETURN_IF_ERROR(ops_.reserve(limits));
  const int64_t K1 = cfg_.linear_conv_kernel - 1;
  const int64_t dk = cfg_.linear_key_head_dim, dv = cfg_.linear_value_head_dim;
  for (const Layer& L : layers_) {
    // Recurrent state starts at zero; the cache needs no clearing (positions are written
    // before they are read), so its pages stay untouched until used.
    auto add_state = [&](std::vector<Tensor>& list, std::initializer_list<int64_t> shape,
                         const char* what, bool zero = true) -> Status {
      Tensor t;
      Workspace tmp;
      RECUR_RETURN_IF_ERROR(tmp.add(A, &t, f32, shape, what));
      if (zero) ops_.fill_zero(t);
      list.push_back(t);
      state_.buffers.push_back(std::move(tmp.buffers[0]));
      return Status();
    };
    if (L.kind == LayerKind::kLinearAttention) {
      RECUR_RETURN_IF_ERROR(add_state(state_.conv, {sc.n_slots, K1, conv_dim()}, "conv state"));
      RECUR_RETURN_IF_ERROR(add_state(state_.delta, {sc.n_slots, hv, dk, dv}, "delta state"));
      info_.state_bytes_per_slot += (K1 * conv_dim() + hv * dk * dv) * 4;
    } else {
      RECUR_RETURN_IF_ERROR(
          add_state(state_.k_cache, {sc.n_blocks, kv, hd, sc.block_size}, "k cache", false));
      RECUR_RETURN_IF_ERROR(
          add_state(state_.v_cache, {sc.n_blocks, kv, sc.block_size, hd}, "v cache", false));
      info_.cache_bytes_per_block += 2 * sc.block_size * kv * hd * 4;
      info_.kv_bytes_per_token += 2 * kv * hd * 4;
      ++info_.attention_layers;
    }
  }
  return Status();
}

void Qwen3Next::reset_slot(int slot) {
  for (size_t i = 0; i < state_.conv.size(); ++i) {
    ops_.fill_zero(state_.conv[i].slice_rows(slot, slot + 1));
    ops_.fill_zero(state_.delta[i].slice_rows(slot, slot + 1));
  }
}

// ---- forward ----

Status Qwen3Next::validate(const Batch& batch, const Tensor& logits) const {
  const int n = batch.n_tokens();
  if (n > opt_.max_batch_tokens) {
    return make_error(ErrorCode::kInvalidArgument, "batch of {} tokens exceeds the {} per step", n,
                      opt_.max_batch_tokens);
  }
  if (int(batch.logit_rows.size()) > opt_.max_logit_rows ||
      logits.rows() < int64_t(batch.logit_rows.size())) {
    return make_error(ErrorCode::kInvalidArgument, "{} logit rows exceed the {} per step",
                      batch.logit_rows.size(), opt_.max_logit_rows);
  }
  for (int32_t t : batch.tokens) {
    if (t < 0 || t >= cfg_.vocab_size) {
      return make_error(ErrorCode::kInvalidArgument,
                        "token id {} is outside the vocabulary [0, {})", t, cfg_.vocab_size);
    }
  }
  for (int s = 0; s < batch.n_seqs(); ++s) {
    if (batch.slot[size_t(s)] < 0 || batch.slot[size_t(s)] >= opt_.state.n_slots) {
      return make_error(ErrorCode::kInvalidArgument, "state slot {} out of range",
                        batch.slot[size_t(s)]);
    }
    const int32_t end = batch.seq_start[size_t(s) + 1];
    if (end == batch.seq_start[size_t(s)]) continue;
    const int32_t last_pos = batch.positions[size_t(end) - 1];
    const int32_t n_blocks = batch.block_start[size_t(s) + 1] - batch.block_start[size_t(s)];
    if (!state_.k_cache.empty() && last_pos / opt_.state.block_size >= n_blocks) {
      return make_error(ErrorCode::kOutOfResources,
                        "sequence {} at position {} has only {} cache blocks", s, last_pos,
                        n_blocks);
    }
    for (int32_t b = batch.block_start[size_t(s)]; b < batch.block_start[size_t(s) + 1]; ++b) {
      if (batch.block_ids[size_t(b)] < 0 || batch.block_ids[size_t(b)] >= opt_.state.n_blocks) {
        return make_error(ErrorCode::kInvalidArgument, "cache block {} out of range",
                          batch.block_ids[size_t(b)]);
      }
    }
  }
  return Status();
}

Status Qwen3Next::forward(const Batch& batch, Tensor logits) {
  RECUR_RETURN_IF_ERROR(validate(batch, logits));
  const int n = batch.n_tokens();
  if (n == 0) return Status();
  const SeqLayout sl = batch.layout(opt_.state.block_size);
  ops_.begin_forward(sl, batch.tokens, batch.logit_rows, logits.data, batch.device_tokens);
  const int32_t* tokens = batch.device_tokens ? batch.device_tokens : batch.tokens.data();
  const float eps = cfg_.rms_norm_eps;
  Tensor h = ws_.h.slice_rows(0, n), x = ws_.x.slice_rows(0, n);

  // The residual stream h: each layer's mixer and feed-forward add their outputs to it (their
  // last projection accumulates into h), and each norm reads it whole into x.
  if (layers_.empty()) {
    ops_.embedding(tokens, n, embed_tokens_, h);
  } else {
    ops_.embedding_rms_norm(tokens, n, embed_tokens_, h, layers_.front().input_norm, 1.0f, eps, x);
  }
  for (size_t i = 0; i < layers_.size(); ++i) {
    const Layer& L = layers_[i];
    if (i > 0) ops_.rms_norm(h, L.input_norm, 1.0f, eps, x);
    if (L.kind == LayerKind::kLinearAttention) {
      gated_delta_net(L, sl, n);
    } else {
      attention(L, sl, n);
    }
    ops_.rms_norm(h, L.post_norm, 1.0f, eps, x);
    if (L.moe) {
      sparse_moe(L, n);
    } else {
      dense_mlp(L.mlp, x, h, n);
    }
  }
  // Only the rows whose logits are wanted go through the final norm and the LM head.
  const int r = int(batch.logit_rows.size());
  bool all_rows = r > 0 && r == n;
  for (int i = 0; all_rows && i < r; ++i) all_rows = batch.logit_rows[size_t(i)] == i;
  Tensor fh = ws_.final_h.slice_rows(0, r);
  if (all_rows) {
    ops_.rms_norm(h, final_norm_, 1.0f, eps, fh);
  } else {
    if (r == 0) return Status();
    ops_.gather_rows(h, batch.logit_rows.data(), r, fh);
    ops_.rms_norm(fh, final_norm_, 1.0f, eps, fh);
  }
  ops_.matmul(fh, lm_head_, logits.slice_rows(0, r));
  return Status();
}

void Qwen3Next::gated_delta_net(const Layer& L, const SeqLayout& sl, int n) {
  const GatedDeltaNetWeights& w = L.gdn;
  const int hk = cfg_.linear_num_key_heads, hv = cfg_.linear_num_value_heads;
  const int dk = cfg_.linear_key_head_dim, dv = cfg_.linear_value_head_dim;
  const Tensor x = ws_.x.slice_rows(0, n);
  Tensor h = ws_.h.slice_rows(0, n);

  // Projections come grouped by key head: [q, k, v (r heads), z (r heads)] and [b (r), a (r)].
  Tensor qkvz = ws_.qkvz.slice_rows(0, n), ba = ws_.ba.slice_rows(0, n);
  {
    const Tensor ws[] = {w.in_proj_qkvz, w.in_proj_ba}, outs[] = {qkvz, ba};
    ops_.matmul_group(x, ws, outs);
  }
  // Split into q|k|v and z, b and a; causal depthwise conv with SiLU over q, k, v together,
  // continuing each slot's conv state; q and k L2-normalised (q scaled); the decay and beta gates.
  Tensor conv = ws_.conv_out.slice_rows(0, n);  // [n, q all heads | k all heads | v all heads]
  Tensor z = ws_.z.slice_rows(0, n);            // [n, Hv·dv]
  Tensor g = ws_.g.slice_rows(0, n), beta = ws_.beta.slice_rows(0, n);  // [n, Hv]
  {
    GdnInputArgs in;
    in.key_heads = hk, in.value_heads = hv, in.dk = dk, in.dv = dv;
    in.l2_eps = 1e-6f, in.q_scale = 1.0f / std::sqrt(float(dk));
    in.qkvz = qkvz, in.ba = ba;
    in.conv_weight = w.conv1d, in.a_log = w.a_log, in.dt_bias = w.dt_bias;
    in.conv_state = state_.conv[size_t(L.state_index)];
    in.mixed = ws_.mixed_qkv.slice_rows(0, n);
    in.a = ws_.a.slice_rows(0, n), in.b = ws_.b.slice_rows(0, n);
    in.conv_out = conv, in.z = z, in.g = g, in.beta = beta;
    ops_.gdn_inputs(in, sl);
  }
  Tensor q = conv.col_heads(0, hk, dk), k = conv.col_heads(key_dim(), hk, dk);  // [n, Hk, dk]
  Tensor v = conv.col_heads(2 * key_dim(), hv, dv);                             // [n, Hv, dv]
  // Gated RMSNorm per value head with silu(z) on the delta rule's output (one op: a backend
  // may keep the head's output on chip between the two), then the output projection.
  Tensor core = ws_.core_out.slice_rows(0, n).reshaped({n, hv, dv});
  Tensor normed = ws_.core_normed.slice_rows(0, n);
  ops_.gated_delta_rule_norm(q, k, v, g, beta, state_.delta[size_t(L.state_index)], sl, core,
                             ws_.gdn_scratch, z.reshaped({n, hv, dv}), w.norm, cfg_.rms_norm_eps,
                             normed.reshaped({n, hv, dv}));
  ops_.matmul(normed, w.out_proj, h, /*accumulate=*/true);  // h += the mixer's output
}

void Qwen3Next::attention(const Layer& L, const SeqLayout& sl, int n) {
  const AttentionWeights& w = L.attn;
  const int heads = cfg_.num_heads, kv = cfg_.num_kv_heads, hd = cfg_.head_dim;
  const Tensor x = ws_.x.slice_rows(0, n);
  Tensor h = ws_.h.slice_rows(0, n);

  // q_proj yields, per head, the query and then the output gate.
  Tensor qg = ws_.qg.slice_rows(0, n);
  Tensor k = ws_.k.slice_rows(0, n), v = ws_.v.slice_rows(0, n);
  {
    const Tensor ws[] = {w.q_proj, w.k_proj, w.v_proj}, outs[] = {qg, k, v};
    ops_.matmul_group(x, ws, outs);
  }
  // Per head: the query and the output gate apart, RMS norms of q and k, rotary embedding,
  // then k and v into the cache.
  Tensor q = ws_.q.slice_rows(0, n), gate = ws_.gate.slice_rows(0, n);
  Tensor& kc = state_.k_cache[size_t(L.state_index)];
  Tensor& vc = state_.v_cache[size_t(L.state_index)];
  {
    AttentionInputArgs in;
    in.heads = heads, in.kv_heads = kv, in.head_dim = hd;
    in.rot_dim = cfg_.rotary_dim(), in.rope_theta = cfg_.rope_theta;
    in.norm_offset = 1.0f, in.eps = cfg_.rms_norm_eps;
    in.qg = qg, in.k = k, in.v = v, in.q_norm = w.q_norm, in.k_norm = w.k_norm;
    in.q = q, in.gate = gate, in.k_cache = kc, in.v_cache = vc;
    ops_.attention_inputs(in, sl);
  }
  Tensor q3 = q.reshaped({n, heads, hd});
  Tensor out = ws_.attn_out.slice_rows(0, n);
  ops_.paged_attention_gated(q3, kc, vc, sl, 1.0f / std::sqrt(float(hd)), gate, out);
  ops_.matmul(out, w.o_proj, h, /*accumulate=*/true);  // h += the mixer's output
}

// h += down(silu(gate·x) ⊙ up·x)
void Qwen3Next::dense_mlp(const ExpertWeights& w, const Tensor& x, Tensor h, int n) {
  const int64_t ff = w.gate.shape[0];
  Tensor g = ws_.ff_gate.slice_rows(0, n).slice_cols(0, ff);
  Tensor u = ws_.ff_up.slice_rows(0, n).slice_cols(0, ff);
  Tensor hdn = ws_.ff_hidden.slice_rows(0, n).slice_cols(0, ff);
  ops_.matmul(x, w.gate, g);
  ops_.matmul(x, w.up, u);
  ops_.swiglu(g, u, hdn);
  ops_.matmul(hdn, w.down, h, /*accumulate=*/true);
}

// h += the experts' output for x.
void Qwen3Next::sparse_moe(const Layer& L, int n) {
  const MoeWeights& w = L.moe_w;
  const Tensor x = ws_.x.slice_rows(0, n);
  Tensor h = ws_.h.slice_rows(0, n);
  Tensor logits = ws_.router_logits.slice_rows(0, n);
  Tensor ids = ws_.expert_ids.slice_rows(0, n), weights = ws_.expert_weights.slice_rows(0, n);
  Tensor out = ws_.ffn_out.slice_rows(0, n);
  if (!w.has_shared) {
    ops_.matmul(x, w.router, logits);
    ops_.moe_route(logits, cfg_.num_experts_per_tok, cfg_.norm_topk_prob, ids, weights);
    ops_.moe_experts(x, w.experts, ids, weights, out, ws_.moe_scratch);
    ops_.add(h, out);
    return;
  }
  // The router and the shared expert's score projection read the same x: one group. The
  // shared expert's output is scaled per token by sigmoid(shared_expert_gate · x).
  const int64_t ff = w.shared.gate.shape[0];
  SharedExpertArgs shared;
  shared.w = w.shared;
  shared.score = ws_.shared_score.slice_rows(0, n);
  shared.gate = ws_.ff_gate.slice_rows(0, n).slice_cols(0, ff);
  shared.up = ws_.ff_up.slice_rows(0, n).slice_cols(0, ff);
  shared.hidden = ws_.ff_hidden.slice_rows(0, n).slice_cols(0, ff);
  shared.out = ws_.shared_out.slice_rows(0, n);
  {
    const Tensor ws[] = {w.router, w.shared_gate};
    const Tensor outs[] = {logits, shared.score};
    ops_.matmul_group(x, ws, outs);
  }
  ops_.moe_route_experts_shared(logits, cfg_.num_experts_per_tok, cfg_.norm_topk_prob, x, w.experts,
                                ids, weights, shared, out, ws_.moe_scratch, h);
}

}  // namespace

Result<std::unique_ptr<Model>> load_qwen3_next(std::unique_ptr<Checkpoint> ckpt, Ops& ops,
                                               const LoadOptions& options) {
  RECUR_ASSIGN_OR_RETURN(Qwen3NextConfig cfg,
                         Qwen3NextConfig::from_json(ckpt->config(), ckpt->generation_config()));
  LoadOptions opt = options;
  if (opt.max_logit_rows <= 0) opt.max_logit_rows = opt.max_batch_tokens;
  if (opt.max_context <= 0 || opt.max_context > cfg.max_position_embeddings) {
    opt.max_context = cfg.max_position_embeddings;
  }
  if (opt.max_batch_tokens < 1 || opt.state.n_slots < 1 || opt.state.n_blocks < 0 ||
      opt.state.block_size < 1) {
    return make_error(ErrorCode::kInvalidArgument, "batch tokens, slots and blocks must be >= 1");
  }
  auto model = std::make_unique<Qwen3Next>(cfg, ops, opt);
  Qwen3Next* m = model.get();
  Checkpoint& c = *ckpt;
  RECUR_RETURN_IF_ERROR(model->load(
      [&](const std::string& name, const std::vector<int64_t>& shape) -> Result<Tensor> {
        RECUR_ASSIGN_OR_RETURN(Tensor host, c.get(name, shape));
        // Every 2-D weight but the embedding table is only ever matmul's w.
        if (shape.size() == 2 && name != "model.embed_tokens.weight") {
          return ops.adopt_matmul_weight(host, &m->owned_weights());
        }
        return ops.adopt_weight(host);
      },
      c.generation_config()));
  // Multi-token-prediction weights are not used for plain decoding.
  std::vector<std::string> extra = c.unused({"mtp."});
  if (!extra.empty()) {
    return make_error(ErrorCode::kCorrupt, "{}: unexpected tensor '{}'{}", c.dir(), extra[0],
                      extra.size() > 1 ? fmt::format(" (and {} more)", extra.size() - 1) : "");
  }
  RECUR_RETURN_IF_ERROR(model->allocate());
  model->keep_checkpoint(std::move(ckpt));
  return std::unique_ptr<Model>(std::move(model));
}

namespace {
// Uniform ranges for random weights, by role, so that a deep random network stays finite and
// roughly as well conditioned as a trained one.
std::pair<float, float> random_range(const std::string& name, const std::vector<int64_t>& shape,
                                     int n_layers) {
  auto ends_with = [&](const char* s) {
    const size_t n = std::strlen(s);
    return name.size() >= n && name.compare(name.size() - n, n, s) == 0;
  };
  if (ends_with("linear_attn.norm.weight")) return {0.9f, 1.1f};
  if (ends_with("norm.weight") || ends_with("layernorm.weight")) return {-0.1f, 0.1f};
  if (ends_with("A_log")) return {0.0f, 2.77f};
  if (ends_with("dt_bias")) return {0.5f, 1.5f};
  if (ends_with("embed_tokens.weight")) return {-1.7f, 1.7f};
  float a = std::sqrt(3.0f / float(shape.back()));
  if (ends_with("o_proj.weight") || ends_with("out_proj.weight") || ends_with("down_proj.weight")) {
    a /= std::sqrt(2.0f * float(n_layers));
  }
  return {-a, a};
}
}  // namespace

Result<std::unique_ptr<Model>> load_random_model(const nlohmann::json& config, Ops& ops,
                                                 const LoadOptions& options, DType dtype,
                                                 uint64_t seed) {
  RECUR_ASSIGN_OR_RETURN(Qwen3NextConfig cfg,
                         Qwen3NextConfig::from_json(config, nlohmann::json::object()));
  if (dtype != DType::F32 && dtype != DType::BF16 && dtype != DType::F16) {
    return make_error(ErrorCode::kUnsupported, "random weights: dtype must be F32, BF16 or F16");
  }
  LoadOptions opt = options;
  if (opt.max_logit_rows <= 0) opt.max_logit_rows = opt.max_batch_tokens;
  if (opt.max_context <= 0 || opt.max_context > cfg.max_position_embeddings) {
    opt.max_context = cfg.max_position_embeddings;
  }
  auto model = std::make_unique<Qwen3Next>(cfg, ops, opt);
  Qwen3Next* m = model.get();
  uint64_t index = 0;
  RECUR_RETURN_IF_ERROR(model->load(
      [&](const std::string& name, const std::vector<int64_t>& shape) -> Result<Tensor> {
        int64_t n = 1;
        for (int64_t d : shape) n *= d;
        // 1-D parameters stay f32, as checkpoints often keep them.
        const DType dt = shape.size() == 1 ? DType::F32 : dtype;
        RECUR_ASSIGN_OR_RETURN(Buffer buf,
                               ops.allocator().allocate(size_t(n) * dtype_size(dt), name.c_str()));
        Tensor t = Tensor::contiguous(buf.data(), dt, {n}, buf.device());
        const auto [lo, hi] = random_range(name, shape, cfg.num_layers);
        ops.fill_random_uniform(t, seed + 0x1000 * ++index, lo, hi);
        t.ndim = int(shape.size());
        int64_t st = 1;
        for (int d = t.ndim - 1; d >= 0; --d) {
          t.shape[d] = shape[size_t(d)];
          t.stride[d] = st;
          st *= shape[size_t(d)];
        }
        m->owned_weights().push_back(std::move(buf));
        return t;
      },
      nlohmann::json::object()));
  RECUR_RETURN_IF_ERROR(model->allocate());
  return std::unique_ptr<Model>(std::move(model));
}

nlohmann::json cut_layers(nlohmann::json config, int layers) {
  if (layers <= 0) return config;
  if (config.contains("num_hidden_layers") && config["num_hidden_layers"].is_number_integer() &&
      config["num_hidden_layers"].get<int>() > layers) {
    config["num_hidden_layers"] = layers;
    if (config.contains("layer_types") && config["layer_types"].is_array() &&
        int(config["layer_types"].size()) > layers) {
      config["layer_types"].erase(config["layer_types"].begin() + layers,
                                  config["layer_types"].end());
    }
  }
  return config;
}

Result<std::unique_ptr<Model>> load_model(const std::string& dir, Ops& ops,
                                          const LoadOptions& options) {
  RECUR_ASSIGN_OR_RETURN(Checkpoint ckpt, Checkpoint::open(dir));
  const auto& cfg = ckpt.config();
  const std::string type = cfg.contains("model_type") && cfg["model_type"].is_string()
                               ? cfg["model_type"].get<std::string>()
                               : "";
  if (type == "qwen3_next") {
    return load_qwen3_next(std::make_unique<Checkpoint>(std::move(ckpt)), ops, options);
  }
  return make_error(ErrorCode::kUnsupported,
                    "{}/config.json: model_type '{}' is not supported (supported: qwen3_next)", dir,
                    type);
}

}  // namespace recur
