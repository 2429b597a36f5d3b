// The blocks hybrid models are made of, with their weights in the layout the ops want (an
// architecture file re-packs its checkpoint layout into these at load) and their forward over a
// ragged batch. Each adds its output to the residual stream.
#pragma once

#include <vector>

#include "model/hybrid.h"
#include "ops/ops.h"

namespace recur {

// Gated DeltaNet (Qwen3-Next, Qwen3.5): projections, causal depthwise conv with SiLU over
// q | k | v, L2-normalised q and k, the gated delta rule with a per-head decay, a gated RMSNorm
// with silu(z), the output projection.
class GatedDeltaNet final : public TokenMixer {
 public:
  int key_heads = 0, value_heads = 0, dk = 0, dv = 0, conv_kernel = 0;  // value head h reads
                                                                        // key head h / (Hv/Hk)
  float eps = 1e-6f;                                                    // of the gated norm
  Tensor in_proj_qkv;  // [C, hidden]: all q heads | all k heads | all v heads
  Tensor in_proj_z;    // [Hv·dv, hidden]
  Tensor in_proj_b;    // [Hv, hidden]
  Tensor in_proj_a;    // [Hv, hidden]
  Tensor conv1d;       // [C, K] (checkpoints store [C, 1, K])
  Tensor dt_bias;      // [Hv]
  Tensor a_log;        // [Hv]
  Tensor norm;         // [dv] (gated RMSNorm, not zero-centred)
  Tensor out_proj;     // [hidden, Hv·dv]

  int64_t key_dim() const { return int64_t(key_heads) * dk; }
  int64_t value_dim() const { return int64_t(value_heads) * dv; }
  int64_t conv_dim() const { return 2 * key_dim() + value_dim(); }

  void finish_load(Ops& ops) override;
  void plan(ModelPlan& plan) override;
  void forward(const LayerIo& io) const override;

 private:
  int state_ = -1;
};

// Gated full attention (Qwen3-Next, Qwen3.5): q, its output gate, k and v projections; per-head
// RMS norms of q and k; partial rotary; paged causal attention; σ(gate); the output projection.
class GatedAttention final : public TokenMixer {
 public:
  int heads = 0, kv_heads = 0, head_dim = 0;
  int rot_dim = 0;
  double rope_theta = 10000.0;
  float norm_offset = 0.0f, eps = 1e-6f;  // of the q and k norms
  Tensor q_proj;                          // [heads·hd, hidden]
  Tensor gate_proj;                       // [heads·hd, hidden]: the output gate
  Tensor k_proj;                          // [kv_heads·hd, hidden]
  Tensor v_proj;                          // [kv_heads·hd, hidden]
  Tensor o_proj;                          // [hidden, heads·hd]
  Tensor q_norm;                          // [hd]
  Tensor k_norm;                          // [hd]

  void finish_load(Ops& ops) override;
  void plan(ModelPlan& plan) override;
  void forward(const LayerIo& io) const override;
  void describe(ModelInfo& info) const override;

 private:
  int cache_ = -1;
};

// SwiGLU: down(silu(gate·x) ⊙ up·x).
class DenseMlp final : public FeedForward {
 public:
  ExpertWeights w;  // gate, up [ff, hidden]; down [hidden, ff]

  void finish_load(Ops& ops) override;
  void plan(ModelPlan& plan) override;
  void forward(const LayerIo& io) const override;
};

// Routed SwiGLU experts with an optional shared expert (σ-gated or not).
class SparseMoe final : public FeedForward {
 public:
  MoeRouting routing;
  Tensor router;                       // [E, hidden]
  std::vector<ExpertWeights> experts;  // E × {[ff, hidden], [ff, hidden], [hidden, ff]}
  ExpertWeights shared;  // [sff, hidden], [sff, hidden], [hidden, sff], or empty: none
  Tensor shared_gate;    // [1, hidden], or empty: the shared expert is ungated

  bool has_shared() const { return !shared.gate.empty(); }

  void finish_load(Ops& ops) override;
  void plan(ModelPlan& plan) override;
  void forward(const LayerIo& io) const override;
  void describe(ModelInfo& info) const override;
};

}  // namespace recur
