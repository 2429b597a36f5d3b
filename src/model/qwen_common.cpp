#include "model/qwen_common.h"

namespace recur {

Status begin_qwen_spec(const QwenHybridConfig& c, const std::string& prefix, WeightLoader& w,
                       HybridSpec* spec) {
  const int64_t H = c.hidden_size;
  spec->architecture = c.model_type;
  spec->vocab_size = c.vocab_size;
  spec->hidden_size = c.hidden_size;
  spec->max_position = c.max_position_embeddings;
  spec->rms_norm_eps = c.rms_norm_eps;
  spec->norm_offset = 1.0f;  // zero-centred RMSNorm: x · (1 + w)
  spec->eos_token_ids = c.eos_token_ids;
  spec->refused_token_ids = c.vision_token_ids;
  spec->refused_tokens_reason = "image and video inputs are not supported yet (text only)";
  RECUR_ASSIGN_OR_RETURN(spec->embed_tokens, w.load(prefix + "embed_tokens.weight",
                                                    {c.vocab_size, H}, WeightUse::kEmbedding));
  RECUR_ASSIGN_OR_RETURN(spec->final_norm, w.load(prefix + "norm.weight", {H}, WeightUse::kVector));
  spec->tied_lm_head = c.tie_word_embeddings;
  if (c.tie_word_embeddings) {
    spec->lm_head = spec->embed_tokens;
    // transformers ties over a stored lm_head.weight; so does this.
    spec->skipped_prefixes.push_back({"lm_head.weight", "the LM head (tied to the embedding)"});
  } else {
    RECUR_ASSIGN_OR_RETURN(spec->lm_head,
                           w.load("lm_head.weight", {c.vocab_size, H}, WeightUse::kMatrix));
  }
  return Status();
}

Status load_layer_norms(const QwenHybridConfig& c, const std::string& p, WeightLoader& w,
                        DecoderLayer* L) {
  const int64_t H = c.hidden_size;
  RECUR_ASSIGN_OR_RETURN(L->input_norm,
                         w.load(p + "input_layernorm.weight", {H}, WeightUse::kVector));
  RECUR_ASSIGN_OR_RETURN(L->post_norm,
                         w.load(p + "post_attention_layernorm.weight", {H}, WeightUse::kVector));
  return Status();
}

Status load_gated_attention(const QwenHybridConfig& c, const std::string& p, WeightLoader& w,
                            GatedAttention* a) {
  const int64_t H = c.hidden_size, heads = c.num_heads, kv = c.num_kv_heads, hd = c.head_dim;
  a->heads = c.num_heads, a->kv_heads = c.num_kv_heads, a->head_dim = c.head_dim;
  a->rot_dim = c.rotary_dim(), a->rope_theta = c.rope_theta;
  a->norm_offset = 1.0f, a->eps = c.rms_norm_eps;
  const std::string q = p + "q_proj.weight";
  const std::vector<int64_t> q_shape = {heads * 2 * hd, H};
  std::vector<RowPiece> query, gate;
  for (int64_t h = 0; h < heads; ++h) {
    query.push_back({q, q_shape, h * 2 * hd, hd});
    gate.push_back({q, q_shape, h * 2 * hd + hd, hd});
  }
  RECUR_ASSIGN_OR_RETURN(a->q_proj, w.load_rows(query, {heads * hd, H}, WeightUse::kMatrix));
  RECUR_ASSIGN_OR_RETURN(a->gate_proj, w.load_rows(gate, {heads * hd, H}, WeightUse::kMatrix));
  RECUR_ASSIGN_OR_RETURN(a->k_proj, w.load(p + "k_proj.weight", {kv * hd, H}, WeightUse::kMatrix));
  RECUR_ASSIGN_OR_RETURN(a->v_proj, w.load(p + "v_proj.weight", {kv * hd, H}, WeightUse::kMatrix));
  RECUR_ASSIGN_OR_RETURN(a->o_proj,
                         w.load(p + "o_proj.weight", {H, heads * hd}, WeightUse::kMatrix));
  RECUR_ASSIGN_OR_RETURN(a->q_norm, w.load(p + "q_norm.weight", {hd}, WeightUse::kVector));
  RECUR_ASSIGN_OR_RETURN(a->k_norm, w.load(p + "k_norm.weight", {hd}, WeightUse::kVector));
  return Status();
}

Status load_gated_deltanet_rest(const QwenHybridConfig& c, const std::string& p, WeightLoader& w,
                                GatedDeltaNet* g) {
  g->key_heads = c.linear_num_key_heads, g->value_heads = c.linear_num_value_heads;
  g->dk = c.linear_key_head_dim, g->dv = c.linear_value_head_dim;
  g->conv_kernel = c.linear_conv_kernel, g->eps = c.rms_norm_eps;
  const int64_t H = c.hidden_size, hv = g->value_heads;
  RECUR_ASSIGN_OR_RETURN(g->conv1d, w.load(p + "conv1d.weight", {g->conv_dim(), 1, g->conv_kernel},
                                           WeightUse::kVector));
  RECUR_ASSIGN_OR_RETURN(g->dt_bias, w.load(p + "dt_bias", {hv}, WeightUse::kVector));
  RECUR_ASSIGN_OR_RETURN(g->a_log, w.load(p + "A_log", {hv}, WeightUse::kVector));
  RECUR_ASSIGN_OR_RETURN(g->norm, w.load(p + "norm.weight", {g->dv}, WeightUse::kVector));
  RECUR_ASSIGN_OR_RETURN(g->out_proj,
                         w.load(p + "out_proj.weight", {H, g->value_dim()}, WeightUse::kMatrix));
  return Status();
}

Status load_swiglu(WeightLoader& w, const std::string& p, int64_t ff, int64_t hidden, WeightUse use,
                   ExpertWeights* e) {
  RECUR_ASSIGN_OR_RETURN(e->gate, w.load(p + "gate_proj.weight", {ff, hidden}, use));
  RECUR_ASSIGN_OR_RETURN(e->up, w.load(p + "up_proj.weight", {ff, hidden}, use));
  RECUR_ASSIGN_OR_RETURN(e->down, w.load(p + "down_proj.weight", {hidden, ff}, use));
  return Status();
}

Status load_experts_per_tensor(const QwenHybridConfig& c, const std::string& p, WeightLoader& w,
                               SparseMoe* m) {
  m->experts.resize(size_t(c.num_experts));
  for (int e = 0; e < c.num_experts; ++e) {
    RECUR_RETURN_IF_ERROR(load_swiglu(w, p + "experts." + std::to_string(e) + ".",
                                      c.moe_intermediate_size, c.hidden_size, WeightUse::kExpert,
                                      &m->experts[size_t(e)]));
  }
  return Status();
}

Status load_router_and_shared(const QwenHybridConfig& c, const std::string& p, WeightLoader& w,
                              SparseMoe* m) {
  const int64_t H = c.hidden_size;
  // softmax over the experts, top k (the config keeps Qwen3.5's renormalisation on).
  m->routing.score = MoeRouting::Score::kSoftmax;
  m->routing.k = c.num_experts_per_tok;
  m->routing.renormalize = c.norm_topk_prob;
  RECUR_ASSIGN_OR_RETURN(m->router,
                         w.load(p + "gate.weight", {c.num_experts, H}, WeightUse::kMatrix));
  if (c.shared_expert_intermediate_size > 0) {
    RECUR_RETURN_IF_ERROR(load_swiglu(w, p + "shared_expert.", c.shared_expert_intermediate_size, H,
                                      WeightUse::kMatrix, &m->shared));
    RECUR_ASSIGN_OR_RETURN(m->shared_gate,
                           w.load(p + "shared_expert_gate.weight", {1, H}, WeightUse::kMatrix));
  }
  return Status();
}

Status load_qwen_layer(const QwenHybridConfig& c, int i, const std::string& p, WeightLoader& w,
                       const QwenLayout& layout, DecoderLayer* L) {
  if (c.layer_types[size_t(i)] == LayerKind::kLinearAttention) {
    auto g = std::make_unique<GatedDeltaNet>();
    RECUR_RETURN_IF_ERROR(layout.gdn_projections(c, p + "linear_attn.", w, g.get()));
    RECUR_RETURN_IF_ERROR(load_gated_deltanet_rest(c, p + "linear_attn.", w, g.get()));
    L->mixer = std::move(g);
  } else {
    auto a = std::make_unique<GatedAttention>();
    RECUR_RETURN_IF_ERROR(load_gated_attention(c, p + "self_attn.", w, a.get()));
    L->mixer = std::move(a);
  }
  if (c.layer_is_moe(i)) {
    auto m = std::make_unique<SparseMoe>();
    RECUR_RETURN_IF_ERROR(load_router_and_shared(c, p + "mlp.", w, m.get()));
    RECUR_RETURN_IF_ERROR(layout.experts(c, p + "mlp.", w, m.get()));
    L->ffn = std::move(m);
  } else {
    auto m = std::make_unique<DenseMlp>();
    RECUR_RETURN_IF_ERROR(
        load_swiglu(w, p + "mlp.", c.intermediate_size, c.hidden_size, WeightUse::kMatrix, &m->w));
    L->ffn = std::move(m);
  }
  return load_layer_norms(c, p, w, L);
}

}  // namespace recur
