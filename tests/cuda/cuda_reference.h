// Plain double-precision host references for the math the CUDA tests check that the CPU's
// scalar references (backend/cpu/reference.h) do not cover in this form: the routing the CUDA
// kernels implement. It follows ops.h's definition directly, with no attempt at speed.
#pragma once

#include "ops/ops.h"

namespace recur::testing::host_ref {

// The routing the CUDA kernels implement (MoeRouting on host tensors): scores in double
// (softmax over the row or σ); experts chosen by (key desc, index asc), the key being the
// logit without a selection bias (the scores' order) and f32(score) + bias with one; weights
// the chosen scores, divided by their sum when renormalising, times scale.
//   logits [n, E]; routing.selection_bias host [E] or empty; ids [n, k] I32; weights [n, k]
void moe_route(const Tensor& logits, const MoeRouting& routing, Tensor ids, Tensor weights);

}  // namespace recur::testing::host_ref
