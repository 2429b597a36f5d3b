// The operands of attention over the paged cache (kernels_attention.cu), and its tensor-core
// prompt kernel (kernels_attention_mma.cu), to which the dispatch sends forwards too long for
// the decode kernel.
#pragma once

#include <cstdint>

#include "backend/cuda/cuda_internal.cuh"
#include "ops/ops.h"

namespace recur {
namespace cuda {

struct AttnArgs {
  const float* q;  // [n, heads, hd]
  int64_t q_s0, q_s1;
  const float* kc;  // [blocks, kv_heads, hd, bs]
  int64_t kc_s0, kc_s1, kc_s2;
  const float* vc;  // [blocks, kv_heads, bs, dv]
  int64_t vc_s0, vc_s1, vc_s2;
  int64_t vc_sd;  // value channel stride: 1, or the key cache's when values are keys' channels
  float* out;     // [n, heads, dv]
  int64_t o_s0, o_s1;
  const float* gate;  // [n, heads·dv] rows g_s0 apart, or null: out = attention · σ(gate)
  int64_t g_s0;
  float* part_o;   // [n, heads, n_splits, dv] unnormalised sums (n_splits > 1)
  float* part_ml;  // [n, heads, n_splits, 2] running max and denominator
  const int32_t *seq_start, *positions, *block_start, *block_ids;
  int n_seqs, heads, group, hd, dv, bs, n_splits;
  float scale;
};

// paged_attention of every token of the layout, as `a` describes it (its split fields unused),
// on tensor cores, when the kernel takes these heads (hd a multiple of 16, dv of 8, both ≤ 256,
// a query group of at most 64 heads) and caches (blocks of a multiple of 4 positions, 16-byte
// aligned with strides in multiples of 4 elements, channels contiguous); false, having done
// nothing, otherwise.
bool paged_attention_mma(CudaOps::Impl& s, const AttnArgs& a, const Tensor& k_cache,
                         const Tensor& v_cache, const SeqLayout& layout, int kv_heads);

// Multiply-adds of causal attention over the layout's tokens (scores and values, 2 flops
// each), for the profile.
double attention_flops(const SeqLayout& layout, int64_t heads, int64_t hd, int64_t dv);

}  // namespace cuda
}  // namespace recur
