// Prompt attention over the paged cache on tensor cores (kernels_attention_mma.cu); the
// dispatch in kernels_attention.cu sends forwards too long for the decode kernel here.
#pragma once

#include <cstdint>

#include "backend/cuda/cuda_internal.cuh"
#include "ops/ops.h"

namespace recur {
namespace cuda {

// paged_attention (times σ(gate) when gate is set, gate [n, heads·dv]) of every token of the
// layout on tensor cores, when the kernel takes these heads (hd a multiple of 16, dv of 8, both
// ≤ 256, a query group of at most 64 heads) and caches (blocks of a multiple of 4 positions,
// 16-byte aligned with strides in multiples of 4 elements); false, having done nothing,
// otherwise.
bool paged_attention_mma(CudaOps::Impl& s, const Tensor& q, const Tensor& k_cache,
                         const Tensor& v_cache, const SeqLayout& layout, float scale, Tensor out,
                         const Tensor* gate);

// Multiply-adds of causal attention over the layout's tokens (scores and values, 2 flops
// each), for the profile.
double attention_flops(const SeqLayout& layout, int64_t heads, int64_t hd, int64_t dv);

}  // namespace cuda
}  // namespace recur
