// Plain double-precision host references for the math the CUDA tests check that the CPU's
// scalar references (backend/cpu/reference.h) do not cover in this form: the routing the CUDA
// kernels implement, and moe_experts_shared. It follows ops.h's definition directly, with no
// attempt at speed.
#pragma once

#include <span>

#include "ops/ops.h"

namespace recur::testing::host_ref {

// The routing the CUDA kernels implement (MoeRouting on host tensors): scores in double
// (softmax over the row or σ); experts chosen by (key desc, index asc), the key being the
// logit without a selection bias (the scores' order) and f32(score) + bias with one; weights
// the chosen scores, divided by their sum when renormalising, times scale.
//   logits [n, E]; routing.selection_bias host [E] or empty; ids [n, k] I32; weights [n, k]
void moe_route(const Tensor& logits, const MoeRouting& routing, Tensor ids, Tensor weights);

// testing::reference_moe_shared (ops/op_test_util.h): ref::moe_experts, then the shared expert
// added in, scaled by σ(score) unless score is empty. x [n, d]; score [n, 1] or empty;
// out [n, d].
void moe_experts_shared(const Tensor& x, std::span<const ExpertWeights> experts, const Tensor& ids,
                        const Tensor& weights, const ExpertWeights& shared, const Tensor& score,
                        Tensor out);

}  // namespace recur::testing::host_ref
