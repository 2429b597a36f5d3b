// Plain scalar references for the CPU kernels: the definitions, in double precision, with no
// attempt at speed. Tests compare every backend's kernels against these at awkward sizes.
#pragma once

#include <span>

#include "ops/ops.h"

namespace recur::ref {

void matmul(const Tensor& x, const Tensor& w, Tensor out);
// As Ops::matmul_heads: x [n, H, k], w [H, m, k], out [n, H, m], any row and head strides.
void matmul_heads(const Tensor& x, const Tensor& w, Tensor out);
void rms_norm(const Tensor& x, const Tensor& w, float weight_offset, float eps, Tensor out);
void rms_norm_gated(const Tensor& x, const Tensor& gate, const Tensor& w, float eps,
                    GateActivation act, Tensor out);
void l2_norm(Tensor x, float eps, float scale);
void gdn_gates(const Tensor& a, const Tensor& b, const Tensor& a_log, const Tensor& dt_bias,
               Tensor g, Tensor beta);
void rope(Tensor x, const int32_t* positions, int rot_dim, double theta);
void conv1d_causal_silu(const Tensor& x, const Tensor& weight, Tensor conv_state,
                        const SeqLayout& layout, Tensor out);
// g [n, Hv] (per head) or [n, Hv, dk] (per key channel), as Ops::gated_delta_rule.
void gated_delta_rule(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                      const Tensor& beta, Tensor state, const SeqLayout& layout, Tensor out);
void kv_cache_write(const Tensor& k, const Tensor& v, Tensor k_cache, Tensor v_cache,
                    const SeqLayout& layout);
void paged_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                     const SeqLayout& layout, float scale, Tensor out);
void moe_route(const Tensor& logits, const MoeRouting& routing, Tensor ids, Tensor weights);
void moe_experts(const Tensor& x, std::span<const ExpertWeights> experts, const Tensor& ids,
                 const Tensor& weights, Tensor out);

}  // namespace recur::ref
