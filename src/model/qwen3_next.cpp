// Qwen3-Next, top to bottom like its modeling code: embedding; per layer a token mixer (Gated
// DeltaNet or gated attention) and a feed-forward (MoE with a gated shared expert, or a dense
// SwiGLU), each behind a zero-centred RMSNorm and a residual; final norm; LM head. What is its
// own is the checkpoint layout: the Gated DeltaNet projections come interleaved by key head and
// the attention's query by head with its gate, re-packed here into the blocks' layout.

#include <algorithm>

#include "model/blocks.h"
#include "model/config.h"
#include "model/qwen3_next.h"
#include "model/qwen_common.h"

namespace recur {

namespace {

// in_proj_qkvz [Hk·(2dk + 2r·dv), H] holds per key head q, k, r value heads and r z heads;
// in_proj_ba [Hk·2r, H] per key head r b then r a. Re-packed into q | k | v of all heads, z, b, a
// (of a tensor-parallel rank's key heads, and of their value heads that are the rank's).
Status load_gdn_projections(const QwenHybridConfig& c, const std::string& p, WeightLoader& w,
                            GatedDeltaNet* g) {
  const int64_t H = c.hidden_size, hk = c.linear_num_key_heads, hv = c.linear_num_value_heads;
  const int64_t dk = c.linear_key_head_dim, dv = c.linear_value_head_dim, r = hv / hk;
  RECUR_ASSIGN_OR_RETURN(const HeadShard part, gated_deltanet_heads(c, w.shard()));
  const int64_t k0 = part.kv_heads.first, kn = part.kv_heads.count;
  const int64_t v0 = part.heads.first, vn = part.heads.count;
  const int64_t group = 2 * dk + 2 * r * dv;
  const std::vector<int64_t> qkvz_shape = {hk * group, H}, ba_shape = {hk * 2 * r, H};
  const std::string qkvz = p + "in_proj_qkvz.weight", ba = p + "in_proj_ba.weight";
  std::vector<RowPiece> qkv, z, b, a;
  for (int64_t kh = k0; kh < k0 + kn; ++kh) {  // all q heads, then all k heads
    qkv.push_back({qkvz, qkvz_shape, kh * group, dk});
  }
  for (int64_t kh = k0; kh < k0 + kn; ++kh) qkv.push_back({qkvz, qkvz_shape, kh * group + dk, dk});
  for (int64_t kh = k0; kh < k0 + kn; ++kh) {
    // The value heads of key head kh that this rank holds: [j0, j1) of its r.
    const int64_t j0 = std::max(v0, kh * r) - kh * r, j1 = std::min(v0 + vn, (kh + 1) * r) - kh * r;
    qkv.push_back({qkvz, qkvz_shape, kh * group + 2 * dk + j0 * dv, (j1 - j0) * dv});
    z.push_back({qkvz, qkvz_shape, kh * group + 2 * dk + r * dv + j0 * dv, (j1 - j0) * dv});
    b.push_back({ba, ba_shape, kh * 2 * r + j0, j1 - j0});
    a.push_back({ba, ba_shape, kh * 2 * r + r + j0, j1 - j0});
  }
  RECUR_ASSIGN_OR_RETURN(g->in_proj_qkv,
                         w.load_rows(qkv, {2 * kn * dk + vn * dv, H}, WeightUse::kMatrix));
  RECUR_ASSIGN_OR_RETURN(g->in_proj_z, w.load_rows(z, {vn * dv, H}, WeightUse::kMatrix));
  RECUR_ASSIGN_OR_RETURN(g->in_proj_b, w.load_rows(b, {vn, H}, WeightUse::kMatrix));
  RECUR_ASSIGN_OR_RETURN(g->in_proj_a, w.load_rows(a, {vn, H}, WeightUse::kMatrix));
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
