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
  return load_lm_head(w, c.vocab_size, H, c.tie_word_embeddings, spec);
}

Status load_lm_head(WeightLoader& w, int64_t vocab, int64_t hidden, bool tied, HybridSpec* spec) {
  spec->tied_lm_head = tied;
  // Tensor parallel: the embedding is whole on every rank; the LM head is split by vocabulary
  // rows when they divide evenly (the ranks' logits then gathered), whole otherwise.
  const Shard& shard = w.shard();
  spec->vocab_split = shard.world > 1 && vocab % shard.world == 0;
  const int64_t v0 = spec->vocab_split ? vocab / shard.world * shard.rank : 0;
  const int64_t vn = spec->vocab_split ? vocab / shard.world : vocab;
  if (tied) {
    spec->lm_head = spec->embed_tokens.slice_rows(v0, v0 + vn);
    // transformers ties over a stored lm_head.weight; so does this.
    spec->skipped_prefixes.push_back({"lm_head.weight", "the LM head (tied to the embedding)"});
  } else {
    const RowPiece rows{"lm_head.weight", {vocab, hidden}, v0, vn};
    RECUR_ASSIGN_OR_RETURN(spec->lm_head,
                           w.load_rows({&rows, 1}, {vn, hidden}, WeightUse::kMatrix));
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
  // A tensor-parallel rank's query heads with the kv heads they read (all of them at world 1).
  RECUR_ASSIGN_OR_RETURN(const HeadShard part, split_heads(w.shard(), heads, kv, "the attention",
                                                           "query heads", "kv heads"));
  const int64_t h0 = part.heads.first, hn = part.heads.count;
  const int64_t kv0 = part.kv_heads.first, kvn = part.kv_heads.count;
  a->heads = int(hn), a->kv_heads = int(kvn), a->head_dim = c.head_dim;
  a->rot_dim = c.rotary_dim(), a->rope_theta = c.rope_theta;
  a->norm_offset = 1.0f, a->eps = c.rms_norm_eps;
  const std::string q = p + "q_proj.weight";
  const std::vector<int64_t> q_shape = {heads * 2 * hd, H};
  std::vector<RowPiece> query, gate;
  for (int64_t h = h0; h < h0 + hn; ++h) {
    query.push_back({q, q_shape, h * 2 * hd, hd});
    gate.push_back({q, q_shape, h * 2 * hd + hd, hd});
  }
  RECUR_ASSIGN_OR_RETURN(a->q_proj, w.load_rows(query, {hn * hd, H}, WeightUse::kMatrix));
  RECUR_ASSIGN_OR_RETURN(a->gate_proj, w.load_rows(gate, {hn * hd, H}, WeightUse::kMatrix));
  const RowPiece k{p + "k_proj.weight", {kv * hd, H}, kv0 * hd, kvn * hd};
  const RowPiece v{p + "v_proj.weight", {kv * hd, H}, kv0 * hd, kvn * hd};
  const RowPiece o{p + "o_proj.weight", {H, heads * hd}, 0, H, h0 * hd, hn * hd};
  RECUR_ASSIGN_OR_RETURN(a->k_proj, w.load_rows({&k, 1}, {kvn * hd, H}, WeightUse::kMatrix));
  RECUR_ASSIGN_OR_RETURN(a->v_proj, w.load_rows({&v, 1}, {kvn * hd, H}, WeightUse::kMatrix));
  RECUR_ASSIGN_OR_RETURN(a->o_proj, w.load_rows({&o, 1}, {H, hn * hd}, WeightUse::kMatrix));
  RECUR_ASSIGN_OR_RETURN(a->q_norm, w.load(p + "q_norm.weight", {hd}, WeightUse::kVector));
  RECUR_ASSIGN_OR_RETURN(a->k_norm, w.load(p + "k_norm.weight", {hd}, WeightUse::kVector));
  return Status();
}

Result<HeadShard> gated_deltanet_heads(const QwenHybridConfig& c, const Shard& s) {
  return split_heads(s, c.linear_num_value_heads, c.linear_num_key_heads, "the Gated DeltaNet",
                     "value heads", "key heads");
}

Status load_gated_deltanet_rest(const QwenHybridConfig& c, const std::string& p, WeightLoader& w,
                                GatedDeltaNet* g) {
  RECUR_ASSIGN_OR_RETURN(const HeadShard part, gated_deltanet_heads(c, w.shard()));
  g->key_heads = int(part.kv_heads.count), g->value_heads = int(part.heads.count);
  g->dk = c.linear_key_head_dim, g->dv = c.linear_value_head_dim;
  g->conv_kernel = c.linear_conv_kernel, g->eps = c.rms_norm_eps;
  const int64_t H = c.hidden_size, hv = c.linear_num_value_heads, K = c.linear_conv_kernel;
  const int64_t dk = g->dk, dv = g->dv, key_dim = int64_t(c.linear_num_key_heads) * dk;
  const int64_t k0 = part.kv_heads.first, v0 = part.heads.first, vn = part.heads.count;
  // The conv's channels of this rank's q, k and v heads.
  const std::vector<int64_t> conv_shape = {2 * key_dim + hv * dv, 1, K};
  const std::string conv = p + "conv1d.weight";
  const RowPiece channels[] = {{conv, conv_shape, k0 * dk, g->key_dim()},
                               {conv, conv_shape, key_dim + k0 * dk, g->key_dim()},
                               {conv, conv_shape, 2 * key_dim + v0 * dv, g->value_dim()}};
  RECUR_ASSIGN_OR_RETURN(g->conv1d,
                         w.load_rows(channels, {g->conv_dim(), 1, K}, WeightUse::kVector));
  g->conv1d = g->conv1d.reshaped({g->conv_dim(), K});
  const RowPiece dt{p + "dt_bias", {hv}, 0, 1, v0, vn}, a{p + "A_log", {hv}, 0, 1, v0, vn};
  RECUR_ASSIGN_OR_RETURN(g->dt_bias, w.load_rows({&dt, 1}, {vn}, WeightUse::kVector));
  RECUR_ASSIGN_OR_RETURN(g->a_log, w.load_rows({&a, 1}, {vn}, WeightUse::kVector));
  RECUR_ASSIGN_OR_RETURN(g->norm, w.load(p + "norm.weight", {g->dv}, WeightUse::kVector));
  const RowPiece out{p + "out_proj.weight", {H, hv * dv}, 0, H, v0 * dv, vn * dv};
  RECUR_ASSIGN_OR_RETURN(g->out_proj,
                         w.load_rows({&out, 1}, {H, g->value_dim()}, WeightUse::kMatrix));
  return Status();
}

Status load_swiglu(WeightLoader& w, const std::string& p, int64_t ff, int64_t hidden, WeightUse use,
                   ExpertWeights* e) {
  // A tensor-parallel rank's columns of the hidden layer: gate and up rows, down columns.
  RECUR_ASSIGN_OR_RETURN(const ShardRange f, column_part(w.shard(), ff, "a feed-forward"));
  const RowPiece gate{p + "gate_proj.weight", {ff, hidden}, f.first, f.count};
  const RowPiece up{p + "up_proj.weight", {ff, hidden}, f.first, f.count};
  const RowPiece down{p + "down_proj.weight", {hidden, ff}, 0, hidden, f.first, f.count};
  RECUR_ASSIGN_OR_RETURN(e->gate, w.load_rows({&gate, 1}, {f.count, hidden}, use));
  RECUR_ASSIGN_OR_RETURN(e->up, w.load_rows({&up, 1}, {f.count, hidden}, use));
  RECUR_ASSIGN_OR_RETURN(e->down, w.load_rows({&down, 1}, {hidden, f.count}, use));
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
