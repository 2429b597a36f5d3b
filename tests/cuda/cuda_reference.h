// Plain double-precision host references for the math the CUDA tests check that the CPU's
// scalar references (backend/cpu/reference.h) do not cover in this form: gated norms with
// either activation, the delta rule with a decay per head or per key channel, MoeRouting, and
// attention whose value heads differ in size from its key heads. Each follows ops.h's
// definition directly, with no attempt at speed.
#pragma once

#include <span>

#include "ops/ops.h"

namespace recur::testing::host_ref {

// Rows of x, gate [..., d] (2-D or 3-D, last dimension contiguous): out = x ·
// rsqrt(mean(x²) + eps) · w · act(gate); w [d] (any weight dtype).
void rms_norm_gated(const Tensor& x, const Tensor& gate, const Tensor& w, float eps,
                    GateActivation act, Tensor out);

// S ← diag(exp(g))·S; S ← S + k ⊗ β(v − Sᵀk); o = Sᵀq per sequence and value head, from and
// into state[slot]. g [n, Hv] (per head) or [n, Hv, dk] (per key channel); the rest as
// Ops::gated_delta_rule, all contiguous.
void gated_delta_rule(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                      const Tensor& beta, Tensor state, const SeqLayout& layout, Tensor out);

// The routing the CUDA kernels implement (MoeRouting on host tensors): scores in double
// (softmax over the row or σ); experts chosen by (key desc, index asc), the key being the
// logit without a selection bias (the scores' order) and f32(score) + bias with one; weights
// the chosen scores, divided by their sum when renormalising, times scale.
//   logits [n, E]; routing.selection_bias host [E] or empty; ids [n, k] I32; weights [n, k]
void moe_route(const Tensor& logits, const MoeRouting& routing, Tensor ids, Tensor weights);

// The caches as ops.h lays them out, with value heads of their own size:
// k [n, kv, hd] → k_cache [blocks, kv, hd, bs]; v [n, kv, dv] → v_cache [blocks, kv, bs, dv].
void kv_cache_write(const Tensor& k, const Tensor& v, Tensor k_cache, Tensor v_cache,
                    const SeqLayout& layout);
// Causal attention over those caches: q [n, heads, hd], out [n, heads, dv].
void paged_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                     const SeqLayout& layout, float scale, Tensor out);

// moe_experts_shared from the references: ref::moe_experts, then the shared expert (gate and up
// by ref::matmul, SwiGLU in double, down by ref::matmul) added in, scaled by σ(score) unless
// score is empty. x [n, d]; score [n, 1] or empty; out [n, d].
void moe_experts_shared(const Tensor& x, std::span<const ExpertWeights> experts, const Tensor& ids,
                        const Tensor& weights, const ExpertWeights& shared, const Tensor& score,
                        Tensor out);

}  // namespace recur::testing::host_ref
