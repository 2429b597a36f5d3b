// The one-token Gated DeltaNet input stage's pieces, shared by its own kernel
// (gdn_inputs_decode_kernel, kernels_gdn_inputs.cu) and the kernel that runs it with the delta
// rule and the gated norm (gdn_decode_core_kernel, kernels_gdn.cu).
#pragma once

#include <cstdint>

#include "backend/cuda/cuda_internal.cuh"
#include "ops/ops.h"

namespace recur::cuda {

// The decay is per value head (a, g [n, Hv], dt_bias [Hv]) or per key channel (a, g [n, Hv·dk],
// dt_bias [Hv·dk]; channel j of value head j / dk), as the kernel's template flag says.
struct GdnDecodeArgs {
  const float* mixed;  // [n, C]: q heads | k heads | v heads
  const float *a, *b;  // [n, Hv] or [n, Hv·dk]; [n, Hv]
  int64_t ld_mixed, ld_a, ld_b;
  const void *conv_w, *a_log, *dt_bias;  // [C, K]; [Hv]; [Hv] or [Hv·dk]
  DType conv_dt, gate_dt;
  float* state;                // [slots, K-1, C]
  float *conv_out, *g, *beta;  // [n, C]; [n, Hv] or [n, Hv·dk] (may be a); [n, Hv]
  int64_t ld_out, ld_g, ld_beta;
  int64_t C, key_dim;
  int dk, r, rdv;
  float eps, q_scale;
  const int32_t *seq_start, *slot;
};

constexpr int kGdnInputThreads = 256;
constexpr int kGdnMaxDkPerLane = 8;        // dk ≤ 256: a head's q or k in one warp's registers
constexpr int kGdnMaxVPerThread = 2;       // r·dv ≤ 512
constexpr int kGdnMaxDecaysPerThread = 2;  // a decay per key channel: r·dk ≤ 512

// A weight element widened to f32, its dtype known only at run time (uniform across the grid).
__device__ __forceinline__ float weight_f32(const void* p, DType dt, int64_t i) {
  if (dt == DType::BF16) return to_f32(static_cast<const __nv_bfloat16*>(p)[i]);
  if (dt == DType::F16) return to_f32(static_cast<const __half*>(p)[i]);
  return static_cast<const float*>(p)[i];
}

// One conv channel's inputs for a one-token step: the state's K-1 values, the weights, x.
template <int K>
struct ConvIn {
  float in[K - 1], w[K], x;
};
// The state and weights of channel c (x is read later, once the projections are done).
template <int K>
__device__ __forceinline__ ConvIn<K> conv_load(const GdnDecodeArgs& a, const float* st, int64_t c) {
  ConvIn<K> v;
#pragma unroll
  for (int j = 0; j < K - 1; ++j) v.in[j] = st[j * a.C + c];
#pragma unroll
  for (int j = 0; j < K; ++j) v.w[j] = weight_f32(a.conv_w, a.conv_dt, c * K + j);
  v.x = 0.0f;
  return v;
}
// silu(Σ_j w[j] · input_j): conv1d_decode_kernel's arithmetic.
template <int K>
__device__ __forceinline__ float conv_output(const ConvIn<K>& v) {
  float acc = 0.0f;
#pragma unroll
  for (int j = 0; j < K; ++j) acc += v.w[j] * (j == K - 1 ? v.x : v.in[j]);
  return silu(acc);
}
// The channel's state shifted by one, x last.
template <int K>
__device__ __forceinline__ void conv_store(const GdnDecodeArgs& a, float* st, int64_t c,
                                           const ConvIn<K>& v) {
#pragma unroll
  for (int j = 0; j < K - 1; ++j) st[j * a.C + c] = j + 1 < K - 1 ? v.in[j + 1] : v.x;
}
template <int K>
__device__ __forceinline__ float conv_finish(const GdnDecodeArgs& a, float* st, int64_t c,
                                             const ConvIn<K>& v) {
  const float out = conv_output<K>(v);
  conv_store<K>(a, st, c, v);
  return out;
}

// The one-token kernels' view of `in`: false (a untouched) unless every sequence of the layout
// brings one token and the shapes and dtypes suit those kernels; per_channel: a decay per key
// channel. The caller sets seq_start and slot.
bool gdn_decode_args(const GdnInputArgs& in, const SeqLayout& layout, GdnDecodeArgs& a,
                     bool& per_channel);

}  // namespace recur::cuda
