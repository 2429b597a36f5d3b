// The scaffolding every hybrid model shares: embedding, a stack of pre-norm residual decoder
// layers (a token mixer and a feed-forward, each adding its output to the residual stream), a
// final norm and the LM head; the state pools (recurrent slots and paged attention blocks) and
// scratch sized once at load; the forward limits and the batch validation. An architecture file
// builds a HybridSpec from its checkpoint layout and config; the blocks it composes are in
// model/blocks.h.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "io/checkpoint.h"
#include "model/model.h"
#include "model/registry.h"
#include "model/weights.h"
#include "ops/comm.h"

namespace recur {

// Recurrent state per slot and the paged attention cache, allocated once.
struct StatePools {
  std::vector<Buffer> buffers;
  std::vector<Tensor> conv;   // per recurrent layer: [slots, K-1, C] f32
  std::vector<Tensor> delta;  // per recurrent layer: [slots, H, dk, dv] f32
  // Attention caches, of LoadOptions::kv_cache_dtype (F32, BF16, F16 or F8_E4M3).
  std::vector<Tensor> k_cache;  // per attention layer: [blocks, kv_heads, hd, block_size]
  std::vector<Tensor> v_cache;  // per attention layer: [blocks, kv_heads, block_size, dv]
                                //   (a view of k_cache's first dv channels for a latent cache)
  std::vector<Tensor> block_tensors;    // the caches that hold memory: what a block's bytes are
  std::vector<Tensor> conv_snapshots;   // per recurrent layer: [snapshots, K-1, C] f32
  std::vector<Tensor> delta_snapshots;  // per recurrent layer: [snapshots, H, dk, dv] f32
};

// The largest scratch any block of the model needs, declared at load (columns per token).
struct ScratchNeeds {
  int64_t conv_channels = 0;  // recurrent mixers: channels through the causal conv
  int64_t value_dim = 0;      // recurrent mixers: value heads × value head size
  int64_t recurrent_heads = 0;
  int64_t decay_dim = 0;  // per-head decay: heads; per-channel: heads × key head size
  int64_t delta_scratch_bytes = 0;
  int64_t attn_q = 0, attn_k = 0, attn_v = 0, attn_out = 0;  // heads·hd, kv·hd, kv·dv, heads·dv
  int64_t experts = 0, experts_per_token = 0, moe_scratch_bytes = 0;
  int64_t ff = 0;        // dense and shared-expert hidden size
  int64_t low_rank = 0;  // low-rank projections' inner width (Kimi Delta Attention's gates)
};

// Activations of up to max_batch_tokens tokens, shared by every layer (f32 unless noted).
struct Scratch {
  std::vector<Buffer> buffers;
  Tensor conv_in, conv_out;           // [T, conv_channels]
  Tensor z, core, core_normed;        // [T, value_dim]
  Tensor a, b, beta;                  // [T, recurrent_heads]
  Tensor decay;                       // [T, decay_dim]
  Tensor delta;                       // U8 [delta_scratch_bytes]
  Tensor q, gate, attn_out;           // [T, attn_q], [T, attn_out], [T, attn_out]
  Tensor k, v;                        // [T, attn_k], [T, attn_v]
  Tensor router_logits;               // [T, experts]
  Tensor expert_ids, expert_weights;  // [T, k] I32, f32
  Tensor ff_gate, ff_up, ff_hidden;   // [T, ff]
  Tensor shared_score;                // [T, 1]
  Tensor ffn_out, shared_out;         // [T, hidden]
  Tensor moe;                         // U8 [moe_scratch_bytes]
  Tensor low_rank;                    // [T, low_rank]
};

// What a block sees in one forward.
struct LayerIo {
  Ops& ops;
  const SeqLayout& layout;
  int n;     // tokens of the batch
  Tensor h;  // [n, hidden]: the residual stream; each block adds its output to it (a
             //   tensor-parallel rank's block adds its part, and the model sums the parts)
  Tensor x;  // [n, hidden]: the block's normed input
  const Scratch& s;
  const StatePools& state;
};

// What blocks declare at load, before anything is allocated.
class ModelPlan {
 public:
  ModelPlan(Ops& ops, int64_t hidden, int64_t max_tokens)
      : ops_(ops), hidden_(hidden), max_tokens_(max_tokens) {}
  // A recurrent state per slot: conv rows [K-1, channels] and a delta-rule state [H, dk, dv].
  // Returns its index in StatePools::conv / delta.
  int recurrent_state(int64_t conv_rows, int64_t conv_channels, int64_t heads, int64_t dk,
                      int64_t dv);
  // A paged attention cache with kv_heads heads of key size hd and value size dv. Returns its
  // index in StatePools::k_cache / v_cache. values_in_keys: the values are the keys' first dv
  // channels (latent attention caches its latent once), v_cache is a view of k_cache.
  int attention_cache(int64_t kv_heads, int64_t hd, int64_t dv, bool values_in_keys = false);
  ScratchNeeds& scratch() { return scratch_; }
  const ScratchNeeds& scratch() const { return scratch_; }
  Ops& ops() const { return ops_; }  // for the scratch sizes its ops need
  int64_t hidden() const { return hidden_; }
  int64_t max_tokens() const { return max_tokens_; }

  struct Recurrent {
    int64_t conv_rows, conv_channels, heads, dk, dv;
  };
  struct Cache {
    int64_t kv_heads, hd, dv;
    bool values_in_keys;
    // elements of one token's keys and values (in the cache's type)
    int64_t floats_per_token() const { return kv_heads * (hd + (values_in_keys ? 0 : dv)); }
  };
  std::vector<Recurrent> recurrent;
  std::vector<Cache> caches;

 private:
  Ops& ops_;
  int64_t hidden_, max_tokens_;
  ScratchNeeds scratch_;
};

class TokenMixer {
 public:
  virtual ~TokenMixer() = default;
  virtual void plan(ModelPlan& plan) = 0;             // declares its state and scratch
  virtual void forward(const LayerIo& io) const = 0;  // io.h += the mixer's output for io.x
  virtual void describe(ModelInfo& info) const {}     // its share of the benchmark figures
  // Once its weights are loaded, before plan: offers them to the backend (Ops::retype_weights).
  virtual void finish_load(Ops& ops) {}
};

class FeedForward {
 public:
  virtual ~FeedForward() = default;
  virtual void plan(ModelPlan& plan) = 0;
  virtual void forward(const LayerIo& io) const = 0;  // io.h += the feed-forward of io.x
  virtual void describe(ModelInfo& info) const {}
  // Once its weights are loaded, before plan: offers them to the backend (Ops::retype_weights).
  virtual void finish_load(Ops& ops) {}
};

struct DecoderLayer {
  Tensor input_norm;  // [hidden], before the mixer
  Tensor post_norm;   // [hidden], before the feed-forward
  std::unique_ptr<TokenMixer> mixer;
  std::unique_ptr<FeedForward> ffn;
};

// What an architecture file hands the scaffolding.
struct HybridSpec {
  std::string architecture;  // e.g. "qwen3_5_moe"
  int vocab_size = 0, hidden_size = 0;
  int max_position = 0;  // the model's own context limit
  float rms_norm_eps = 1e-6f;
  float norm_offset = 0.0f;  // the decoder's RMSNorms scale by (w + offset): 1 when zero-centred
  Tensor embed_tokens;       // [vocab, hidden]
  Tensor final_norm;         // [hidden]
  Tensor lm_head;            // [vocab, hidden]; the embedding table when tied
  bool tied_lm_head = false;
  // Tensor parallel: lm_head is this rank's [vocab / world, hidden] rows, whose logits the
  // ranks gather (otherwise every rank holds it whole).
  bool vocab_split = false;
  std::vector<DecoderLayer> layers;
  std::vector<int32_t> eos_token_ids;
  std::vector<int32_t> refused_token_ids;  // inputs the model cannot take yet (images, video)
  std::string refused_tokens_reason;
  // Checkpoint tensors the text model does not use, by prefix and what they are
  // ({"mtp.", "multi-token prediction"}): skipped and reported.
  std::vector<std::pair<std::string, std::string>> skipped_prefixes;
};

// Builds the model: sizes the pools and scratch from the plan and `options`, announces the forward
// limits to the backend. The model keeps the loader's buffers and the checkpoint (mapped weights).
// comm: for one rank of a tensor-parallel model (its weights loaded for comm->rank() of
// comm->world()), the collectives its forward joins the other ranks' with; null for a whole model.
Result<std::unique_ptr<Model>> build_hybrid_model(HybridSpec spec, WeightLoader& weights,
                                                  std::unique_ptr<Checkpoint> checkpoint,
                                                  const nlohmann::json& generation_config, Ops& ops,
                                                  const LoadOptions& options,
                                                  Communicator* comm = nullptr);

}  // namespace recur
