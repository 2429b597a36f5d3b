// The RMS norm of one row as every CUDA norm kernel computes it (kernels_rowwise.cu, and the
// fused delta rule + gated norm in kernels_gdn.cu), so their results agree bit for bit.
#pragma once

#include "backend/cuda/cuda_internal.cuh"

namespace recur::cuda {

// Elements per lane kept in registers when one warp normalises a row.
constexpr int kWarpNormPer = 8;

// The first kPer weights of the elements a thread handles (first, first + stride, ...), as
// rms_norm_row reads them; a kernel may load them before its PDL wait (weights). v [kPer].
// Also any row of values loaded early that way (a gate row: W float).
template <int kPer>
struct NormWeights {
  float v[kPer];
  bool loaded = false;
};
template <int kPer, typename W>
__device__ __forceinline__ NormWeights<kPer> load_norm_weights(const W* w, int64_t d, int first,
                                                               int stride) {
  NormWeights<kPer> nw;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int64_t j = first + int64_t(i) * stride;
    nw.v[i] = j < d ? to_f32(w[j]) : 0.0f;
  }
  nw.loaded = true;
  return nw;
}

// The gate of a gated norm: none (a plain norm), silu or sigmoid (GateActivation).
enum class NormGate { kNone, kSilu, kSigmoid };
template <NormGate kGate>
__device__ __forceinline__ float norm_gate(float g) {
  if constexpr (kGate == NormGate::kSilu) {
    return silu(g);
  } else {
    return sigmoid(g);
  }
}

// One row r of x [rows, d]: out = x · rsqrt(mean(x²) + eps) · (w + offset), or with a gate
// x · rsqrt(mean(x²) + eps) · w · act(gate) (rows of gate [rows, d]).
// This thread handles elements first, first + stride, ...; reduce(partial) returns the row's sum
// of squares. Each thread rewrites only what it read, so out may alias x. The first kPer
// elements (x, w, gate) are loaded before anything is stored, so their loads are in flight
// together; the sum of squares runs in the plain loop's order.
// pre: the first kPer weights from load_norm_weights, or not loaded (read here); pre_gate
// likewise the first kPer gate values (gated), loaded by the caller as soon as it could.
// finish(o): sees the first kPer outputs of this thread just before they are stored, and may
// change them (a rotation of pairs this thread holds).
template <int kPer, typename W, NormGate kGate, typename Reduce,
          typename Finish = void (*)(float (&)[kPer])>
__device__ __forceinline__ void rms_norm_row(
    const Rows& x, const Rows& gate, const Rows& out, const W* w, float offset, float eps,
    int64_t r, int first, int stride, Reduce reduce, const NormWeights<kPer>& pre = {},
    const NormWeights<kPer>& pre_gate = {}, Finish finish = [](float (&)[kPer]) {}) {
  constexpr bool kGated = kGate != NormGate::kNone;
  const int64_t d = x.d;
  float* xr = x.row(r);
  const float* gr = kGated ? gate.row(r) : nullptr;
  float v[kPer], wv[kPer], gv[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int64_t j = first + int64_t(i) * stride;
    v[i] = 0.0f;
    gv[i] = pre_gate.loaded ? pre_gate.v[i] : 0.0f;
    wv[i] = pre.loaded ? pre.v[i] : 0.0f;
    if (j < d) {
      v[i] = xr[j];
      if (!pre.loaded) wv[i] = to_f32(w[j]);
      if constexpr (kGated) {
        if (!pre_gate.loaded) gv[i] = gr[j];
      }
    }
  }
  float ss = 0.0f;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int64_t j = first + int64_t(i) * stride;
    if (j < d) ss += v[i] * v[i];
  }
  // Rows wider than kPer · stride: the rest, element by element.
  for (int64_t j = first + int64_t(kPer) * stride; j < d; j += stride) {
    const float e = xr[j];
    ss += e * e;
  }
  const float inv = 1.0f / sqrtf(reduce(ss) / float(d) + eps);
  float* orow = out.row(r);
  float o[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    if constexpr (kGated) {
      o[i] = v[i] * inv * wv[i] * norm_gate<kGate>(gv[i]);
    } else {
      o[i] = v[i] * inv * (wv[i] + offset);
    }
  }
  finish(o);
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int64_t j = first + int64_t(i) * stride;
    if (j < d) orow[j] = o[i];
  }
  for (int64_t j = first + int64_t(kPer) * stride; j < d; j += stride) {
    if constexpr (kGated) {
      orow[j] = xr[j] * inv * to_f32(w[j]) * norm_gate<kGate>(gr[j]);
    } else {
      orow[j] = xr[j] * inv * (to_f32(w[j]) + offset);
    }
  }
}

}  // namespace recur::cuda
