#include "model/blocks.h"

#include <cmath>

namespace recur {

// ---- Gated DeltaNet ----

void GatedDeltaNet::finish_load(Ops& ops) {
  Tensor* ws[] = {&in_proj_qkv, &in_proj_z, &in_proj_b, &in_proj_a, &out_proj};
  ops.retype_weights(ws);
}

void GatedDeltaNet::plan(ModelPlan& plan) {
  state_ = plan.recurrent_state(conv_kernel - 1, conv_dim(), value_heads, dk, dv);
  ScratchNeeds& s = plan.scratch();
  s.conv_channels = std::max(s.conv_channels, conv_dim());
  s.value_dim = std::max(s.value_dim, value_dim());
  s.recurrent_heads = std::max<int64_t>(s.recurrent_heads, value_heads);
  s.decay_dim = std::max<int64_t>(s.decay_dim, value_heads);
  s.delta_scratch_bytes = std::max<int64_t>(
      s.delta_scratch_bytes, int64_t(plan.ops().gated_delta_rule_scratch_bytes(dk, dv)));
}

void GatedDeltaNet::forward(const LayerIo& io) const {
  const int n = io.n;
  Ops& ops = io.ops;
  const Scratch& s = io.s;
  Tensor mixed = s.conv_in.slice_rows(0, n).slice_cols(0, conv_dim());  // [n, C]
  Tensor z = s.z.slice_rows(0, n).slice_cols(0, value_dim());           // [n, Hv·dv]
  Tensor b = s.b.slice_rows(0, n).slice_cols(0, value_heads);           // [n, Hv]
  Tensor a = s.a.slice_rows(0, n).slice_cols(0, value_heads);           // [n, Hv]
  {
    const Tensor ws[] = {in_proj_qkv, in_proj_z, in_proj_b, in_proj_a}, outs[] = {mixed, z, b, a};
    ops.matmul_group(io.x, ws, outs);
  }
  // Causal depthwise conv with SiLU over q, k, v together, continuing each slot's conv state; q
  // and k L2-normalised (q scaled); the decay and beta gates.
  Tensor conv = s.conv_out.slice_rows(0, n).slice_cols(0, conv_dim());
  Tensor g = s.decay.slice_rows(0, n).slice_cols(0, value_heads);    // [n, Hv]
  Tensor beta = s.beta.slice_rows(0, n).slice_cols(0, value_heads);  // [n, Hv]
  {
    GdnInputArgs in;
    in.key_heads = key_heads, in.value_heads = value_heads, in.dk = dk, in.dv = dv;
    in.l2_eps = 1e-6f, in.q_scale = 1.0f / std::sqrt(float(dk));
    in.mixed = mixed, in.a = a, in.b = b;
    in.conv_weight = conv1d, in.a_log = a_log, in.dt_bias = dt_bias;
    in.conv_state = io.state.conv[size_t(state_)];
    in.conv_out = conv, in.g = g, in.beta = beta;
    ops.gdn_inputs(in, io.layout);
  }
  Tensor q = conv.col_heads(0, key_heads, dk), k = conv.col_heads(key_dim(), key_heads, dk);
  Tensor v = conv.col_heads(2 * key_dim(), value_heads, dv);  // [n, Hv, dv]
  // Gated RMSNorm per value head with silu(z) on the delta rule's output (one op: a backend may
  // keep the head's output on chip between the two), then the output projection.
  Tensor core = s.core.slice_rows(0, n).slice_cols(0, value_dim()).reshaped({n, value_heads, dv});
  Tensor normed = s.core_normed.slice_rows(0, n).slice_cols(0, value_dim());
  ops.gated_delta_rule_norm(q, k, v, g, beta, io.state.delta[size_t(state_)], io.layout, core,
                            s.delta, z.reshaped({n, value_heads, dv}), norm, eps,
                            GateActivation::kSilu, normed.reshaped({n, value_heads, dv}));
  ops.matmul(normed, out_proj, io.h, /*accumulate=*/true);  // h += the mixer's output
}

// ---- gated attention ----

void GatedAttention::finish_load(Ops& ops) {
  Tensor* ws[] = {&q_proj, &gate_proj, &k_proj, &v_proj, &o_proj};
  ops.retype_weights(ws);
}

void GatedAttention::plan(ModelPlan& plan) {
  cache_ = plan.attention_cache(kv_heads, head_dim, head_dim);
  ScratchNeeds& s = plan.scratch();
  s.attn_q = std::max<int64_t>(s.attn_q, int64_t(heads) * head_dim);
  s.attn_k = std::max<int64_t>(s.attn_k, int64_t(kv_heads) * head_dim);
  s.attn_v = std::max<int64_t>(s.attn_v, int64_t(kv_heads) * head_dim);
  s.attn_out = std::max<int64_t>(s.attn_out, int64_t(heads) * head_dim);
}

void GatedAttention::forward(const LayerIo& io) const {
  const int n = io.n;
  const int64_t qd = int64_t(heads) * head_dim, kd = int64_t(kv_heads) * head_dim;
  Ops& ops = io.ops;
  const Scratch& s = io.s;
  Tensor q = s.q.slice_rows(0, n).slice_cols(0, qd);        // [n, heads·hd]
  Tensor gate = s.gate.slice_rows(0, n).slice_cols(0, qd);  // [n, heads·hd]
  Tensor k = s.k.slice_rows(0, n).slice_cols(0, kd);        // [n, kv·hd]
  Tensor v = s.v.slice_rows(0, n).slice_cols(0, kd);        // [n, kv·hd]
  {
    const Tensor ws[] = {q_proj, gate_proj, k_proj, v_proj}, outs[] = {q, gate, k, v};
    ops.matmul_group(io.x, ws, outs);
  }
  // RMS norms of q and k per head, rotary embedding, then k and v into the cache.
  const Tensor& kc = io.state.k_cache[size_t(cache_)];
  const Tensor& vc = io.state.v_cache[size_t(cache_)];
  {
    AttentionInputArgs in;
    in.heads = heads, in.kv_heads = kv_heads, in.head_dim = head_dim;
    in.rot_dim = rot_dim, in.rope_theta = rope_theta;
    in.norm_offset = norm_offset, in.eps = eps;
    in.q = q, in.k = k, in.v = v, in.q_norm = q_norm, in.k_norm = k_norm;
    in.k_cache = kc, in.v_cache = vc;
    ops.attention_inputs(in, io.layout);
  }
  Tensor out = s.attn_out.slice_rows(0, n).slice_cols(0, qd);
  ops.paged_attention_gated(q.reshaped({n, heads, head_dim}), kc, vc, io.layout,
                            1.0f / std::sqrt(float(head_dim)), gate, out);
  ops.matmul(out, o_proj, io.h, /*accumulate=*/true);  // h += the mixer's output
}

void GatedAttention::describe(ModelInfo& info) const {
  ++info.attention_layers;
  info.attention_dim = int64_t(heads) * head_dim;
  info.expanded_kv_bytes_per_token += int64_t(kv_heads) * 2 * head_dim * 4;
}

// ---- feed-forward ----

void DenseMlp::finish_load(Ops& ops) {
  Tensor* ws[] = {&w.gate, &w.up, &w.down};
  ops.retype_weights(ws);
}

void DenseMlp::plan(ModelPlan& plan) {
  plan.scratch().ff = std::max(plan.scratch().ff, w.gate.shape[0]);
}

// h += down(silu(gate·x) ⊙ up·x)
void DenseMlp::forward(const LayerIo& io) const {
  const int n = io.n;
  const int64_t ff = w.gate.shape[0];
  Tensor g = io.s.ff_gate.slice_rows(0, n).slice_cols(0, ff);
  Tensor u = io.s.ff_up.slice_rows(0, n).slice_cols(0, ff);
  Tensor hdn = io.s.ff_hidden.slice_rows(0, n).slice_cols(0, ff);
  {
    const Tensor ws[] = {w.gate, w.up}, outs[] = {g, u};
    io.ops.matmul_group(io.x, ws, outs);
  }
  io.ops.swiglu(g, u, hdn);
  io.ops.matmul(hdn, w.down, io.h, /*accumulate=*/true);
}

void SparseMoe::finish_load(Ops& ops) {
  // The router with the shared expert's gate (one group). The experts keep their type: as f16,
  // one token's routed gate/up took 27.2 µs a layer against bf16's 18.4 on the H200 (80B-A3B,
  // bench/results/h200-session29-notes.md), more than their prompt tiles gained.
  Tensor* gates[] = {&router, &shared_gate};
  ops.retype_weights(std::span<Tensor* const>(gates, shared_gate.empty() ? 1 : 2));
}

void SparseMoe::plan(ModelPlan& plan) {
  ScratchNeeds& s = plan.scratch();
  const int64_t E = int64_t(experts.size()), k = routing.k, d = plan.hidden();
  const int64_t ff = experts.front().gate.shape[0];
  s.experts = std::max(s.experts, E);
  s.experts_per_token = std::max(s.experts_per_token, k);
  if (has_shared()) s.ff = std::max(s.ff, shared.gate.shape[0]);
  // One more expert per token than routed: a backend may run the shared expert with them.
  s.moe_scratch_bytes = std::max<int64_t>(
      s.moe_scratch_bytes,
      int64_t(plan.ops().moe_experts_scratch_bytes(int(plan.max_tokens()), int(k) + 1, int(E) + 1,
                                                   int(d), int(ff), experts.front().gate.dtype)));
}

// h += the experts' output for x.
void SparseMoe::forward(const LayerIo& io) const {
  const int n = io.n;
  const int64_t E = int64_t(experts.size()), k = routing.k;
  Ops& ops = io.ops;
  const Scratch& s = io.s;
  Tensor logits = s.router_logits.slice_rows(0, n).slice_cols(0, E);
  Tensor ids = s.expert_ids.slice_rows(0, n).slice_cols(0, k);
  Tensor weights = s.expert_weights.slice_rows(0, n).slice_cols(0, k);
  Tensor out = s.ffn_out.slice_rows(0, n);
  if (!has_shared()) {
    ops.matmul(io.x, router, logits);
    ops.moe_route(logits, routing, ids, weights);
    ops.moe_experts(io.x, experts, ids, weights, out, s.moe);
    ops.add(io.h, out);
    return;
  }
  const int64_t ff = shared.gate.shape[0];
  SharedExpertArgs sh;
  sh.w = shared;
  sh.gate = s.ff_gate.slice_rows(0, n).slice_cols(0, ff);
  sh.up = s.ff_up.slice_rows(0, n).slice_cols(0, ff);
  sh.hidden = s.ff_hidden.slice_rows(0, n).slice_cols(0, ff);
  sh.out = s.shared_out.slice_rows(0, n);
  if (shared_gate.empty()) {
    ops.matmul(io.x, router, logits);
  } else {
    // The router and the shared expert's gate read the same x: one group. The shared expert's
    // output is scaled per token by σ(shared_expert_gate · x).
    sh.score = s.shared_score.slice_rows(0, n);
    const Tensor ws[] = {router, shared_gate}, outs[] = {logits, sh.score};
    ops.matmul_group(io.x, ws, outs);
  }
  ops.moe_route_experts_shared(logits, routing, io.x, experts, ids, weights, sh, out, s.moe, io.h);
}

void SparseMoe::describe(ModelInfo& info) const {
  const ExpertWeights& e = experts.front();
  ++info.moe_layers;
  info.n_experts = int(experts.size());
  info.experts_per_token = routing.k;
  info.expert_weight_bytes = weight_bytes(e.gate.dtype, e.gate.numel()) +
                             weight_bytes(e.up.dtype, e.up.numel()) +
                             weight_bytes(e.down.dtype, e.down.numel());
  info.active_params_per_token +=
      int64_t(routing.k) * (e.gate.numel() + e.up.numel() + e.down.numel());
}

}  // namespace recur
