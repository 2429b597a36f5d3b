// Loading shared by the Qwen hybrid architectures (Qwen3-Next and Qwen3.5 name and shape most of
// their weights alike): the model's ends, the gated attention, the Gated DeltaNet's conv, gates,
// norm and output, SwiGLU matrices, the router and the shared expert.
#pragma once

#include <string>

#include "model/blocks.h"
#include "model/config.h"
#include "model/weights.h"

namespace recur {

// Embedding, final norm, LM head (tied or not) and the model-wide settings, for weights under
// `prefix` ("model." or "model.language_model.").
Status begin_qwen_spec(const QwenHybridConfig& c, const std::string& prefix, WeightLoader& w,
                       HybridSpec* spec);

// The LM head (lm_head.weight [vocab, hidden], or spec->embed_tokens when tied); of a
// tensor-parallel rank (w.shard()), its vocabulary rows when they divide evenly.
Status load_lm_head(WeightLoader& w, int64_t vocab, int64_t hidden, bool tied, HybridSpec* spec);

// input_layernorm and post_attention_layernorm of the layer at `p` ("...layers.N.").
Status load_layer_norms(const QwenHybridConfig& c, const std::string& p, WeightLoader& w,
                        DecoderLayer* L);

// q_proj [heads·2·hd, H] holds per head the query, then its output gate: re-packed into q_proj
// and gate_proj of all heads. k, v, o projections and the q / k norms as stored.
Status load_gated_attention(const QwenHybridConfig& c, const std::string& p, WeightLoader& w,
                            GatedAttention* a);

// The Gated DeltaNet's value heads of a tensor-parallel rank (w.shard()) and the key heads
// they read (all of them at world 1).
Result<HeadShard> gated_deltanet_heads(const QwenHybridConfig& c, const Shard& s);

// The Gated DeltaNet's sizes and its weights after the input projections: conv1d, dt_bias,
// A_log (f32 in released checkpoints: used as stored), the gated norm and out_proj.
Status load_gated_deltanet_rest(const QwenHybridConfig& c, const std::string& p, WeightLoader& w,
                                GatedDeltaNet* g);

// gate_proj, up_proj [ff, H] and down_proj [H, ff] under `p`.
Status load_swiglu(WeightLoader& w, const std::string& p, int64_t ff, int64_t hidden, WeightUse use,
                   ExpertWeights* e);

// The routed experts as one tensor per expert (experts.N.gate_proj, ...) under `p`.
Status load_experts_per_tensor(const QwenHybridConfig& c, const std::string& p, WeightLoader& w,
                               SparseMoe* m);

// The router (`gate`), its routing rule, and the σ-gated shared expert when the config has one.
Status load_router_and_shared(const QwenHybridConfig& c, const std::string& p, WeightLoader& w,
                              SparseMoe* m);

// What an architecture of the family stores its own way: the Gated DeltaNet's input projections
// (under p = "...linear_attn.") and the routed experts (under p = "...mlp.").
struct QwenLayout {
  Status (*gdn_projections)(const QwenHybridConfig& c, const std::string& p, WeightLoader& w,
                            GatedDeltaNet* g);
  Status (*experts)(const QwenHybridConfig& c, const std::string& p, WeightLoader& w, SparseMoe* m);
};

// Decoder layer `i` under p = "...layers.N.": its token mixer (Gated DeltaNet or gated
// attention, as layer_types says), its feed-forward (MoE or a dense SwiGLU) and its two norms.
Status load_qwen_layer(const QwenHybridConfig& c, int i, const std::string& p, WeightLoader& w,
                       const QwenLayout& layout, DecoderLayer* L);

}  // namespace recur
