// Qwen3-Next, top to bottom like its modeling code: embedding; per layer a token mixer (Gated
// DeltaNet or gated attention) and a feed-forward (MoE with a gated shared expert, or a dense
// SwiGLU), each behind a zero-centred RMSNorm and a residual; final norm; LM head. What is its
// own is the checkpoint layout: the Gated DeltaNet projections come interleaved by key head and
// the attention's query by head with its gate, re-packed here into the blocks' layout.

#include "model/qwen3_next.h"
#include "model/blocks.h"
#include "model/config.h"
#include "model/qwen_common.h"

namespace recur {

namespace {

// in_proj_qkvz [Hk·(2dk + 2r·dv), H] holds per key head q, k, r value heads and r z heads;
// in_proj_ba [Hk·2r, H] per key head r b then r a. Re-packed into q | k | v of all heads, z, b, a.
Status load_gdn_projections(const QwenHybridConfig& c, const std::string& p, WeightLoader& w,
                            GatedDeltaNet* g) {
  const int64_t H = c.hidden_size, hk = c.linear_num_key_heads, hv = c.linear_num_value_heads;
  const int64_t dk = c.linear_key_head_dim, dv = c.linear_value_head_dim, r = hv / hk;
  const int64_t group = 2 * dk + 2 * r * dv;
  const std::vector<int64_t> qkvz_shape = {hk * group, H}, ba_shape = {hk * 2 * r, H};
  const std::string qkvz = p + "in_proj_qkvz.weight", ba = p + "in_proj_ba.weight";
  std::vector<RowPiece> qkv, z, b, a;
  for (int part = 0; part < 3; ++part) {  // all q heads, then all k heads, then all v heads
    for (int64_t kh = 0; kh < hk; ++kh) {
      const int64_t first = kh * group + (part == 0 ? 0 : part == 1 ? dk : 2 * dk);
      qkv.push_back({qkvz, qkvz_shape, first, part < 2 ? dk : r * dv});
    }
  }
  for (int64_t kh = 0; kh < hk; ++kh) {
    z.push_back({qkvz, qkvz_shape, kh * group + 2 * dk + r * dv, r * dv});
    b.push_back({ba, ba_shape, kh * 2 * r, r});
    a.push_back({ba, ba_shape, kh * 2 * r + r, r});
  }
  RECUR_ASSIGN_OR_RETURN(g->in_proj_qkv,
                         w.load_rows(qkv, {2 * hk * dk + hv * dv, H}, WeightUse::kMatrix));
  RECUR_ASSIGN_OR_RETURN(g->in_proj_z, w.load_rows(z, {hv * dv, H}, WeightUse::kMatrix));
  RECUR_ASSIGN_OR_RETURN(g->in_proj_b, w.load_rows(b, {hv, H}, WeightUse::kMatrix));
  RECUR_ASSIGN_OR_RETURN(g->in_proj_a, w.load_rows(a, {hv, H}, WeightUse::kMatrix));
  return Status();
}

}  // namespace

Result<HybridSpec> build_qwen3_next(const nlohmann::json& config, const nlohmann::json& gen,
                                    WeightLoader& w) {
  RECUR_ASSIGN_OR_RETURN(QwenHybridConfig c, QwenHybridConfig::from_json(config, gen));
  if (c.family != QwenFamily::kQwen3Next) {
    return make_error(ErrorCode::kInternal, "build_qwen3_next: model_type '{}'", c.model_type);
  }
  HybridSpec spec;
  RECUR_RETURN_IF_ERROR(begin_qwen_spec(c, "model.", w, &spec));
  for (int i = 0; i < c.num_layers; ++i) {
    DecoderLayer L;
    RECUR_RETURN_IF_ERROR(load_qwen_layer(c, i, "model.layers." + std::to_string(i) + ".", w,
                                          {load_gdn_projections, load_experts_per_tensor}, &L));
    spec.layers.push_back(std::move(L));
  }
  // Multi-token-prediction weights are not used for plain decoding.
  spec.skipped_prefixes.push_back({"mtp.", "the multi-token-prediction head"});
  return spec;
}

}  // namespace recur
