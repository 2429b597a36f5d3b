// Qwen3.5 and Qwen3.5-MoE (text), top to bottom like their modeling code: the Qwen3-Next
// decoder with Gated DeltaNet projections as four tensors (in_proj_qkv with rows of all q heads,
// all k heads, then all v heads grouped by key head; in_proj_z, in_proj_b, in_proj_a), a dense
// SwiGLU in every layer (qwen3_5) or MoE in every layer (qwen3_5_moe), and interleaved
// multimodal rotary, which for text is the 1-D partial rotary. Published checkpoints carry a
// vision tower and a multi-token-prediction head; the text path skips both.
#include "model/blocks.h"
#include "model/config.h"
#include "model/qwen3_next.h"
#include "model/qwen_common.h"

namespace recur {

namespace {

// The checkpoint name prefix of the text model's weights: "model.language_model." (multimodal
// releases) or "model." (text-only fine-tunes), whichever the checkpoint holds; holding neither
// embedding, the form the config's nesting suggests.
std::string text_weights_prefix(const WeightLoader& weights, bool nested_default) {
  if (weights.has("model.language_model.embed_tokens.weight")) return "model.language_model.";
  if (weights.has("model.embed_tokens.weight")) return "model.";
  return nested_default ? "model.language_model." : "model.";
}

// in_proj_qkv rows: all q heads, all k heads, all v heads; of a tensor-parallel rank, its key
// heads' q and k rows and its value heads' v rows.
Status load_gdn_projections(const QwenHybridConfig& c, const std::string& p, WeightLoader& w,
                            GatedDeltaNet* g) {
  const int64_t H = c.hidden_size, hv = c.linear_num_value_heads;
  const int64_t dk = c.linear_key_head_dim, dv = c.linear_value_head_dim;
  const int64_t key_dim = int64_t(c.linear_num_key_heads) * dk, value_dim = hv * dv;
  RECUR_ASSIGN_OR_RETURN(const HeadShard part, gated_deltanet_heads(c, w.shard()));
  const int64_t k0 = part.kv_heads.first, kn = part.kv_heads.count;
  const int64_t v0 = part.heads.first, vn = part.heads.count;
  const std::string qkv_name = p + "in_proj_qkv.weight";
  const std::vector<int64_t> qkv_shape = {2 * key_dim + value_dim, H};
  const RowPiece qkv[] = {{qkv_name, qkv_shape, k0 * dk, kn * dk},
                          {qkv_name, qkv_shape, key_dim + k0 * dk, kn * dk},
                          {qkv_name, qkv_shape, 2 * key_dim + v0 * dv, vn * dv}};
  const RowPiece z{p + "in_proj_z.weight", {value_dim, H}, v0 * dv, vn * dv};
  const RowPiece b{p + "in_proj_b.weight", {hv, H}, v0, vn};
  const RowPiece a{p + "in_proj_a.weight", {hv, H}, v0, vn};
  if (w.shard().world == 1) {  // one piece: used in place
    RECUR_ASSIGN_OR_RETURN(g->in_proj_qkv,
                           w.load(qkv_name, {2 * key_dim + value_dim, H}, WeightUse::kMatrix));
  } else {
    RECUR_ASSIGN_OR_RETURN(g->in_proj_qkv,
                           w.load_rows(qkv, {2 * kn * dk + vn * dv, H}, WeightUse::kMatrix));
  }
  RECUR_ASSIGN_OR_RETURN(g->in_proj_z, w.load_rows({&z, 1}, {vn * dv, H}, WeightUse::kMatrix));
  RECUR_ASSIGN_OR_RETURN(g->in_proj_b, w.load_rows({&b, 1}, {vn, H}, WeightUse::kMatrix));
  RECUR_ASSIGN_OR_RETURN(g->in_proj_a, w.load_rows({&a, 1}, {vn, H}, WeightUse::kMatrix));
  return Status();
}

// Experts as the bf16 releases store them, fused per layer (gate_up_proj [E, 2I, H] with each
// expert's gate rows first, down_proj [E, H, I], no .weight suffix), or one tensor per expert
// (fine-tunes, FP8 releases). Each expert's matrices are contiguous rows of the fused tensors,
// used in place.
Status load_experts(const QwenHybridConfig& c, const std::string& p, WeightLoader& w,
                    SparseMoe* m) {
  const int64_t E = c.num_experts, I = c.moe_intermediate_size, H = c.hidden_size;
  m->experts.resize(size_t(E));
  const std::string gate_up = p + "experts.gate_up_proj", down = p + "experts.down_proj";
  if (!w.has(gate_up)) return load_experts_per_tensor(c, p, w, m);
  const std::vector<int64_t> gate_up_shape = {E, 2 * I, H}, down_shape = {E, H, I};
  // A tensor-parallel rank's columns f of each expert's hidden layer.
  RECUR_ASSIGN_OR_RETURN(const ShardRange f, column_part(w.shard(), I, "an expert"));
  for (int64_t e = 0; e < E; ++e) {
    ExpertWeights& x = m->experts[size_t(e)];
    const RowPiece g{gate_up, gate_up_shape, e * 2 * I + f.first, f.count},
        u{gate_up, gate_up_shape, e * 2 * I + I + f.first, f.count};
    const RowPiece d{down, down_shape, e * H, H, f.first, f.count};
    RECUR_ASSIGN_OR_RETURN(x.gate, w.load_rows({&g, 1}, {f.count, H}, WeightUse::kExpert));
    RECUR_ASSIGN_OR_RETURN(x.up, w.load_rows({&u, 1}, {f.count, H}, WeightUse::kExpert));
    RECUR_ASSIGN_OR_RETURN(x.down, w.load_rows({&d, 1}, {H, f.count}, WeightUse::kExpert));
  }
  return Status();
}

}  // namespace

Result<HybridSpec> build_qwen3_5(const nlohmann::json& config, const nlohmann::json& gen,
                                 WeightLoader& w) {
  RECUR_ASSIGN_OR_RETURN(QwenHybridConfig c, QwenHybridConfig::from_json(config, gen));
  if (c.family == QwenFamily::kQwen3Next) {
    return make_error(ErrorCode::kInternal, "build_qwen3_5: model_type '{}'", c.model_type);
  }
  const std::string prefix = text_weights_prefix(w, c.nested);
  HybridSpec spec;
  RECUR_RETURN_IF_ERROR(begin_qwen_spec(c, prefix, w, &spec));
  for (int i = 0; i < c.num_layers; ++i) {
    DecoderLayer L;
    RECUR_RETURN_IF_ERROR(load_qwen_layer(c, i, prefix + "layers." + std::to_string(i) + ".", w,
                                          {load_gdn_projections, load_experts}, &L));
    spec.layers.push_back(std::move(L));
  }
  spec.skipped_prefixes.push_back({"model.visual.", "the vision tower"});
  spec.skipped_prefixes.push_back({"mtp.", "the multi-token-prediction head"});
  return spec;
}

}  // namespace recur
