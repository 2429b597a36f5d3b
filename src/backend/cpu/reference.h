// Plain scalar references for the CPU kernels: the definitions, in double precision, with no
// attempt at speed. Tests compare every backend's kernels against these at awkward sizes.
#pragma once

#include <span>

#include "ops/ops.h"

namespace recur::ref {

// Each function is the op of the same name in ops/ops.h, with its shapes and meaning.

// ---- row-wise ----
// out [n, d] = table [vocab, d] rows ids[0..n)
void embedding(const int32_t* ids, int n, const Tensor& table, Tensor out);
// out [n, d] = x [rows, d] rows rows[0..n)
void gather_rows(const Tensor& x, const int32_t* rows, int n, Tensor out);
// out [n, m] = x [n, k] · w [m, k]^T
void matmul(const Tensor& x, const Tensor& w, Tensor out);
// x [n, H, k], w [H, m, k], out [n, H, m], any row and head strides.
void matmul_heads(const Tensor& x, const Tensor& w, Tensor out);
// x, out [..., d]; w [d]
void rms_norm(const Tensor& x, const Tensor& w, float weight_offset, float eps, Tensor out);
// x, gate, out [..., d]; w [d]
void rms_norm_gated(const Tensor& x, const Tensor& gate, const Tensor& w, float eps,
                    GateActivation act, Tensor out);
// x [..., d], in place
void l2_norm(Tensor x, float eps, float scale);
// x [n, heads, head_dim], in place; positions [n]
void rope(Tensor x, const int32_t* positions, int rot_dim, double theta);

// ---- elementwise, [n, d] ----
void swiglu(const Tensor& gate, const Tensor& up, Tensor out);        // silu(gate) · up
void mul_sigmoid(Tensor x, const Tensor& gate);                       // x ·= σ(gate)
void add(Tensor x, const Tensor& y);                                  // x += y
void add_scaled_sigmoid(Tensor x, const Tensor& y, const Tensor& s);  // x += σ(s [n, 1]) · y

// ---- Gated DeltaNet / Kimi Delta Attention ----
// a, b, g, beta [n, Hv]; a_log, dt_bias [Hv]
void gdn_gates(const Tensor& a, const Tensor& b, const Tensor& a_log, const Tensor& dt_bias,
               Tensor g, Tensor beta);
// x, out [n, C]; weight [C, 1, K]; conv_state [slots, K-1, C]
void conv1d_causal_silu(const Tensor& x, const Tensor& weight, Tensor conv_state,
                        const SeqLayout& layout, Tensor out);
// q, k [n, Hk, dk]; v, out [n, Hv, dv]; g [n, Hv] (per head) or [n, Hv, dk] (per key channel);
// beta [n, Hv]; state [slots, Hv, dk, dv]
void gated_delta_rule(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                      const Tensor& beta, Tensor state, const SeqLayout& layout, Tensor out);

// ---- attention over the paged cache ----
// k [n, kv_heads, hd], v [n, kv_heads, dv] into the caches' blocks, as Ops::kv_cache_write
void kv_cache_write(const Tensor& k, const Tensor& v, Tensor k_cache, Tensor v_cache,
                    const SeqLayout& layout);
// q [n, heads, hd], out [n, heads, dv]
void paged_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                     const SeqLayout& layout, float scale, Tensor out);

// ---- mixture of experts ----
// logits [n, E]; ids [n, k] i32, weights [n, k]
void moe_route(const Tensor& logits, const MoeRouting& routing, Tensor ids, Tensor weights);
// x, out [n, d]; ids, weights [n, k]
void moe_experts(const Tensor& x, std::span<const ExpertWeights> experts, const Tensor& ids,
                 const Tensor& weights, Tensor out);

}  // namespace recur::ref
