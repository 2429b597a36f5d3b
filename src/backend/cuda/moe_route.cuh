// Routing pieces shared by the routing kernels (kernels_moe_route.cu) and the expert kernels
// that route one token themselves (moe_gemv.cu): key order, the pick weights, and the
// threshold-filter selection of one row of logits by one block.
#pragma once

#include "backend/cuda/cuda_internal.cuh"

namespace recur::cuda {

constexpr int kRouteThreads = 128;

// MoeRouting as the kernels read it (k apart).
struct RouteScoring {
  bool sigmoid = false;         // scores σ(logit), else the softmax over the row
  const float* bias = nullptr;  // [E] added to the scores (rounded to f32) to choose, or null
  bool renormalize = true;      // the k picks' scores divided by their sum
  float scale = 1.0f;           // on every weight, last
};
inline RouteScoring route_scoring(const MoeRouting& r) {
  RouteScoring s;
  s.sigmoid = r.score == MoeRouting::Score::kSigmoid;
  s.bias = r.selection_bias.empty() ? nullptr : r.selection_bias.ptr<float>();
  s.renormalize = r.renormalize;
  s.scale = r.scale;
  return s;
}

// The score of logit v in double: σ(v), or exp(v − mx) / sum (mx and sum the row's max and
// Σ exp(l − mx)).
__device__ __forceinline__ double route_score(const RouteScoring& sc, float v, float mx,
                                              double sum) {
  return sc.sigmoid ? 1.0 / (1.0 + exp(-double(v))) : exp(double(v) - double(mx)) / sum;
}

// The key an expert is chosen by: its logit (the scores' order) without a selection bias,
// else its score rounded to f32 plus the bias.
__device__ __forceinline__ float route_key(const RouteScoring& sc, int e, float v, float mx,
                                           double sum) {
  return sc.bias ? float(route_score(sc, v, mx, sum)) + sc.bias[e] : v;
}

// Float bits mapped to unsigned integers of the same order (−inf lowest), and back.
__device__ __forceinline__ unsigned ordered_bits(float v) {
  const unsigned b = __float_as_uint(v);
  return b & 0x80000000u ? ~b : b | 0x80000000u;
}
__device__ __forceinline__ float from_ordered_bits(unsigned u) {
  return __uint_as_float(u & 0x80000000u ? u & 0x7fffffffu : ~u);
}

// A routing key orders experts as the picks do (key desc, index asc): route_key's ordered bits
// (NaN as 0, lowest) above the inverted index. Without a selection bias the key is the logit.
__device__ __forceinline__ float logit_of_key(unsigned long long key) {
  return from_ordered_bits(unsigned(key >> 32));
}
__device__ __forceinline__ int32_t expert_of_key(unsigned long long key) {
  return int32_t(~unsigned(key));
}

// Lane j < k of the calling warp holds the j-th pick's logit v: returns its weight, the score
// (in double, rounded to f32), renormalised over the k picks (summed in pick order) when asked,
// then scaled; lanes ≥ k only take part in the shuffles (and get 0).
__device__ __forceinline__ float pick_weight(int lane, int k, float v, float mx, double sum,
                                             const RouteScoring& sc) {
  const double p = lane < k ? route_score(sc, v, mx, sum) : 0.0;
  double kept = 0.0;
  for (int j = 0; j < k; ++j) kept += __shfl_sync(0xffffffffu, p, j);
  float wf = float(p);
  if (sc.renormalize && lane < k) wf = float(double(wf) / kept);
  return wf * sc.scale;
}

// pick_weight, stored with the pick's id: id_row, w_row [k].
__device__ __forceinline__ void store_picks(int lane, int k, float v, int32_t id, float mx,
                                            double sum, const RouteScoring& sc, int32_t* id_row,
                                            float* w_row) {
  const float wf = pick_weight(lane, k, v, mx, sum, sc);
  if (lane < k) {
    id_row[lane] = id;
    w_row[lane] = wf;
  }
}

// store_picks for picks given as routing keys (route_filter_block's s.pick) of row l [E]: lane
// j < k stores pick j. A bias-free key holds the logit; with a selection bias (kBiased) it holds
// the biased score, and the pick's logit is read from l again.
template <bool kBiased>
__device__ __forceinline__ void store_pick_keys(int lane, int k, const unsigned long long* keys,
                                                const float* l, float mx, double sum,
                                                const RouteScoring& sc, int32_t* id_row,
                                                float* w_row) {
  const unsigned long long key = lane < k ? keys[lane] : 0ull;
  const int32_t e = expert_of_key(key);
  float v = logit_of_key(key);
  if constexpr (kBiased) v = lane < k ? __ldcg(l + e) : 0.0f;
  store_picks(lane, k, v, e, mx, sum, sc, id_row, w_row);
}

// Shared memory of route_filter_block for rows of kRouteThreads·PL experts.
template <int PL>
struct RouteFilterShared {
  static constexpr int kWarps = kRouteThreads / 32;
  float red_max[kWarps];
  unsigned red_threshold[kWarps];
  double red_sum[kWarps];
  unsigned long long cand[kRouteThreads * PL];
  unsigned long long pick[32];  // [k] the picks' keys, in pick order
  int n_cand;
};

// The row's softmax max and Σ exp(l − max) of route_filter_block with a selection bias, whose
// keys need them before the selection: summed as the bias-free path sums (double, per thread,
// per warp, then over the warps in order). Two block barriers.
template <int PL>
__device__ __forceinline__ void route_softmax_stats(const float (&reg)[PL],
                                                    RouteFilterShared<PL>& s, float& mx,
                                                    double& sum) {
  constexpr int kWarps = RouteFilterShared<PL>::kWarps;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < PL; ++i) mx = fmaxf(mx, reg[i]);
  mx = warp_max(mx);
  if (lane == 0) s.red_max[warp] = mx;
  __syncthreads();
  mx = s.red_max[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) mx = fmaxf(mx, s.red_max[w]);
  sum = 0.0;
#pragma unroll
  for (int i = 0; i < PL; ++i) sum += exp(double(reg[i]) - double(mx));
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  if (lane == 0) s.red_sum[warp] = sum;
  __syncthreads();
  sum = s.red_sum[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) sum += s.red_sum[w];
}

// The top k ≤ 32 of one row l [kRouteThreads·PL] (thread t holds experts t + 128·i) by
// route_key (the logit, or with kBiased (sc.bias set) the f32 score plus the bias), run by a
// whole block of kRouteThreads threads (it has block barriers). Each warp finds the k-th
// largest of its lanes' largest keys (counting, per lane, the lanes above it); the largest
// of the four is a threshold at least k experts reach, and only experts at or above it
// (usually a little over k) are candidates. Each candidate's pick position is the number of
// candidates above it: three block barriers instead of k + 2 rounds (two more for softmax
// with a bias, whose keys need the row's sums first). On return every thread sees s.pick; with
// softmax scores, when `weights` (the same for the whole block) or kBiased, also *mx and *sum,
// the row's max and Σ exp(l − max) (double, per thread, per warp, then over the warps in
// order). NaN ranks lowest (a row with fewer than k numbers picks NaN experts last). l may
// have been written by an earlier kernel of this forward that has completed: it is read
// through L2.
template <int PL, bool kBiased>
__device__ __forceinline__ void route_filter_block(const float* l, int k, RouteFilterShared<PL>& s,
                                                   const RouteScoring& sc, bool weights,
                                                   float* mx_out, double* sum_out) {
  constexpr int kWarps = RouteFilterShared<PL>::kWarps;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  // The bias-free path sums the softmax alongside the selection, for the weights only.
  const bool softmax = !kBiased && weights && !sc.sigmoid;
  float reg[PL];
  unsigned bits[PL];
  unsigned lane_top = 0;
  if constexpr (kBiased) {
    float bias[PL];
#pragma unroll
    for (int i = 0; i < PL; ++i) {
      reg[i] = __ldcg(l + tid + kRouteThreads * i);
      bias[i] = __ldg(sc.bias + tid + kRouteThreads * i);
    }
    float mx = 0.0f;
    double sum = 0.0;
    if (!sc.sigmoid) {
      route_softmax_stats<PL>(reg, s, mx, sum);
      *mx_out = mx, *sum_out = sum;
    }
#pragma unroll
    for (int i = 0; i < PL; ++i) {
      // As route_key; a score is never -0, so neither is a key.
      const float key = float(route_score(sc, reg[i], mx, sum)) + bias[i];
      bits[i] = key != key ? 0u : ordered_bits(key);
      lane_top = max(lane_top, bits[i]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < PL; ++i) {
      reg[i] = __ldcg(l + tid + kRouteThreads * i);
      const float v = reg[i] + 0.0f;  // -0 as +0: they compare equal
      bits[i] = v != v ? 0u : ordered_bits(v);
      lane_top = max(lane_top, bits[i]);
    }
  }
  if (tid == 0) s.n_cand = 0;
  // This warp's k-th largest lane maximum (with repeats): the smallest value held by a lane
  // with fewer than k lanes above it.
  int above = 0;
#pragma unroll
  for (int j = 0; j < 32; ++j) above += __shfl_sync(0xffffffffu, lane_top, j) > lane_top;
  const unsigned warp_kth = __reduce_min_sync(0xffffffffu, above < k ? lane_top : 0xffffffffu);
  float mx = -INFINITY;
  if (softmax) {
#pragma unroll
    for (int i = 0; i < PL; ++i) mx = fmaxf(mx, reg[i]);
    mx = warp_max(mx);
    if (lane == 0) s.red_max[warp] = mx;
  }
  if (lane == 0) s.red_threshold[warp] = warp_kth;
  __syncthreads();
  unsigned threshold = s.red_threshold[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) threshold = max(threshold, s.red_threshold[w]);
#pragma unroll
  for (int i = 0; i < PL; ++i) {
    if (bits[i] >= threshold) {
      const unsigned e = unsigned(tid + kRouteThreads * i);
      s.cand[atomicAdd(&s.n_cand, 1)] = (static_cast<unsigned long long>(bits[i]) << 32) | ~e;
    }
  }
  if (softmax) {
    mx = s.red_max[0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) mx = fmaxf(mx, s.red_max[w]);
    double sum = 0.0;
#pragma unroll
    for (int i = 0; i < PL; ++i) sum += exp(double(reg[i]) - double(mx));
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) s.red_sum[warp] = sum;
  }
  __syncthreads();
  const int nc = s.n_cand;
  for (int c = tid; c < nc; c += kRouteThreads) {
    const unsigned long long key = s.cand[c];
    int rank = 0;
    for (int j = 0; j < nc; ++j) rank += s.cand[j] > key;
    if (rank < k) s.pick[rank] = key;
  }
  __syncthreads();
  if (softmax) {
    double sum = s.red_sum[0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) sum += s.red_sum[w];
    *mx_out = mx;
    *sum_out = sum;
  }
}

}  // namespace recur::cuda
