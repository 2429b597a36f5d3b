// MoE routing kernels (MoeRouting): softmax or sigmoid scores in double, rounded to f32; top-k
// by (key desc, index asc), the key being the logit (the scores' order) or, with a selection
// bias, the f32 score plus the bias. A warp per token takes every option; a block per token
// takes 128, 256 or 512 experts and k ≤ 32 by a threshold filter (moe_route.cuh, which the
// expert kernels also use when they route one token themselves), and without a bias other
// counts up to 512 by k selection rounds.
#include <type_traits>

#include "backend/cuda/cuda_internal.cuh"
#include "backend/cuda/moe_route.cuh"

namespace recur {

using namespace cuda;

namespace {

// One warp per token of logits [n, E]: ids, weights [n, k]. With PL > 0 each lane keeps its
// experts' keys (e = lane + 32·i, E ≤ 32·PL) in registers across the k selection rounds;
// PL = 0 re-reads the logits from memory (large E).
template <int PL>
__global__ void moe_route_kernel(const float* logits, int64_t ld, int n, int E, int k,
                                 RouteScoring sc, int32_t* ids, int64_t ld_ids, float* weights,
                                 int64_t ld_w) {
  grid_dependency_sync();
  const int t = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (t >= n) return;
  const float* l = logits + int64_t(t) * ld;
  float reg[PL > 0 ? PL : 1];
#pragma unroll
  for (int i = 0; i < PL; ++i) {
    const int e = lane + 32 * i;
    reg[i] = e < E ? l[e] : -INFINITY;
  }
  // for_each(fn): fn(e, logit) over this lane's experts.
  auto for_each = [&](auto&& fn) {
    if constexpr (PL > 0) {
#pragma unroll
      for (int i = 0; i < PL; ++i) {
        if (lane + 32 * i < E) fn(lane + 32 * i, reg[i]);
      }
    } else {
      for (int e = lane; e < E; e += 32) fn(e, l[e]);
    }
  };
  float mx = -INFINITY;
  for_each([&](int, float v) { mx = fmaxf(mx, v); });
  mx = warp_max(mx);
  double sum = 0.0;
  for_each([&](int, float v) { sum += exp(double(v) - double(mx)); });
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  // With a selection bias the registers hold the keys from here on (the logits stay in memory).
  if constexpr (PL > 0) {
    if (sc.bias) {
#pragma unroll
      for (int i = 0; i < PL; ++i) {
        const int e = lane + 32 * i;
        if (e < E) reg[i] = route_key(sc, e, reg[i], mx, sum);
      }
    }
  }
  // for_each_key(fn): fn(e, key) over this lane's experts.
  auto for_each_key = [&](auto&& fn) {
    if constexpr (PL > 0) {
      for_each(fn);
    } else {
      for (int e = lane; e < E; e += 32) fn(e, route_key(sc, e, l[e], mx, sum));
    }
  };
  // The j-th pick is the largest (value desc, index asc) strictly after the (j-1)-th.
  float prev_v = INFINITY;
  int prev_i = -1;
  // Moves (prev_v, prev_i) to the next pick; every lane of the warp agrees on it.
  auto next_pick = [&]() {
    float best_v = -INFINITY;
    int best_i = E;
    for_each_key([&](int e, float v) {
      const bool after = v < prev_v || (v == prev_v && e > prev_i);
      if (after && (v > best_v || (v == best_v && e < best_i))) best_v = v, best_i = e;
    });
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, best_v, o);
      const int oi = __shfl_xor_sync(0xffffffffu, best_i, o);
      if (ov > best_v || (ov == best_v && oi < best_i)) best_v = ov, best_i = oi;
    }
    prev_v = best_v, prev_i = best_i;
  };
  int32_t* id_row = ids + int64_t(t) * ld_ids;
  float* w_row = weights + int64_t(t) * ld_w;
  if (k <= 32) {
    // Lane j keeps the j-th pick; the k probabilities (double exp and divide) are then
    // computed side by side rather than one per selection round, with the same formulas,
    // and summed on lane 0 in pick order.
    float my_v = -INFINITY;
    int my_i = E;
    for (int j = 0; j < k; ++j) {
      next_pick();
      if (lane == j) my_v = prev_v, my_i = prev_i;
    }
    // The pick's logit: its key, or from memory (a key with a bias is not the logit).
    if (sc.bias && lane < k) my_v = my_i < E ? l[my_i] : -INFINITY;
    store_picks(lane, k, my_v, my_i, mx, sum, sc, id_row, w_row);
    return;
  }
  double kept = 0.0;
  for (int j = 0; j < k; ++j) {
    next_pick();
    const float v = sc.bias ? (prev_i < E ? l[prev_i] : -INFINITY) : prev_v;
    const double p = route_score(sc, v, mx, sum);
    kept += p;
    if (lane == 0) {
      id_row[j] = prev_i;
      w_row[j] = float(p);
    }
  }
  if (lane == 0) {
    for (int j = 0; j < k; ++j) {
      float w = w_row[j];
      if (sc.renormalize) w = float(double(w) / kept);
      w_row[j] = w * sc.scale;
    }
  }
}

// One block per token of logits [n, E ≤ kRouteThreads·PL], k ≤ 32, no selection bias: the
// same selection and formulas as moe_route_kernel with the experts spread over four warps
// (thread e % 128 keeps expert e's logit): each round every warp finds its best remaining
// expert with two integer reductions (value, then the lowest index holding it) and the four
// meet in shared memory. The softmax denominator is summed per thread, per warp, then over
// the warps in order.
template <int PL>
__global__ void __launch_bounds__(kRouteThreads)
    moe_route_block_kernel(const float* logits, int64_t ld, int n, int E, int k, RouteScoring sc,
                           int32_t* ids, int64_t ld_ids, float* weights, int64_t ld_w) {
  grid_dependency_sync();
  constexpr int kWarps = kRouteThreads / 32;
  __shared__ float red_max[kWarps];
  __shared__ double red_sum[kWarps];
  __shared__ unsigned cand_key[2][kWarps];
  __shared__ int cand_idx[2][kWarps];
  __shared__ float pick_v[32];
  __shared__ int pick_i[32];
  const int t = blockIdx.x, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const float* l = logits + int64_t(t) * ld;
  float reg[PL];
#pragma unroll
  for (int i = 0; i < PL; ++i) {
    const int e = tid + kRouteThreads * i;
    // -0 as +0: they compare equal, and the reductions below order by bits.
    reg[i] = e < E ? l[e] + 0.0f : -INFINITY;
  }
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < PL; ++i) mx = fmaxf(mx, reg[i]);
  mx = warp_max(mx);
  if (lane == 0) red_max[warp] = mx;
  __syncthreads();
  mx = red_max[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) mx = fmaxf(mx, red_max[w]);
  double sum = 0.0;
#pragma unroll
  for (int i = 0; i < PL; ++i) {
    if (tid + kRouteThreads * i < E) sum += exp(double(reg[i]) - double(mx));
  }
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  if (lane == 0) red_sum[warp] = sum;  // read after the selection rounds' barriers
  float prev_v = INFINITY;
  int prev_i = -1;
  for (int j = 0; j < k; ++j) {
    float best_v = -INFINITY;
    int best_i = E;
#pragma unroll
    for (int i = 0; i < PL; ++i) {
      const int e = tid + kRouteThreads * i;
      const float v = reg[i];
      const bool after = v < prev_v || (v == prev_v && e > prev_i);
      if (e < E && after && (v > best_v || (v == best_v && e < best_i))) best_v = v, best_i = e;
    }
    const unsigned key = __reduce_max_sync(0xffffffffu, ordered_bits(best_v));
    const int idx = int(__reduce_min_sync(
        0xffffffffu, ordered_bits(best_v) == key ? unsigned(best_i) : 0xffffffffu));
    if (lane == 0) cand_key[j & 1][warp] = key, cand_idx[j & 1][warp] = idx;
    __syncthreads();
    unsigned bk = cand_key[j & 1][0];
    int bi = cand_idx[j & 1][0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) {
      const unsigned ck = cand_key[j & 1][w];
      const int ci = cand_idx[j & 1][w];
      if (ck > bk || (ck == bk && ci < bi)) bk = ck, bi = ci;
    }
    prev_v = from_ordered_bits(bk), prev_i = bi;
    if (tid == 0) pick_v[j] = prev_v, pick_i[j] = prev_i;
  }
  __syncthreads();
  if (warp != 0) return;
  sum = red_sum[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) sum += red_sum[w];
  store_picks(lane, k, pick_v[lane], pick_i[lane], mx, sum, sc, ids + int64_t(t) * ld_ids,
              weights + int64_t(t) * ld_w);
}

// One block per token of logits [n, E], E == kRouteThreads·PL exactly, k ≤ 32, choosing with
// a selection bias (kBiased: sc.bias set) or not: the picks and weights of moe_route_kernel
// without its k rounds (route_filter_block). ids, weights [n, k].
template <int PL, bool kBiased>
__global__ void __launch_bounds__(kRouteThreads)
    moe_route_filter_kernel(const float* logits, int64_t ld, int /*n: the grid*/, int /*E*/, int k,
                            RouteScoring sc, int32_t* ids, int64_t ld_ids, float* weights,
                            int64_t ld_w) {
  grid_dependency_sync();
  __shared__ RouteFilterShared<PL> s;
  const int t = blockIdx.x;
  const float* l = logits + int64_t(t) * ld;
  float mx = 0.0f;
  double sum = 0.0;
  route_filter_block<PL, kBiased>(l, k, s, sc, true, &mx, &sum);
  if (threadIdx.x >= 32) return;
  store_pick_keys<kBiased>(int(threadIdx.x), k, s.pick, l, mx, sum, sc, ids + int64_t(t) * ld_ids,
                           weights + int64_t(t) * ld_w);
}

// Group-limited routing (MoeRouting::grouped), one block per token: the threads form each
// expert's choosing value (its f32 score plus the bias) in shared memory, then thread 0 keeps
// the topk_group best groups and picks the k as the CPU does (value desc, index asc). Serial
// in the picks: published group-limited routers (Kimi, DeepSeek-V3) route once per token and
// layer, a few thousand steps on one thread.
// logits [n_tokens, E] (row stride ld); ids, weights [n_tokens, k] (row strides ld_ids, ld_w)
__global__ void __launch_bounds__(kRouteThreads)
    moe_route_grouped_kernel(const float* logits, int64_t ld, int E, int k, int n_group,
                             int topk_group, RouteScoring sc, int32_t* ids, int64_t ld_ids,
                             float* weights, int64_t ld_w) {
  grid_dependency_sync();
  extern __shared__ float choose[];  // [E]
  __shared__ float red_max[kRouteThreads / 32];
  __shared__ double red_sum[kRouteThreads / 32];
  const int t = blockIdx.x, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const float* l = logits + int64_t(t) * ld;
  float mx = -INFINITY;
  for (int e = tid; e < E; e += kRouteThreads) mx = fmaxf(mx, l[e]);
  mx = warp_max(mx);
  if (lane == 0) red_max[warp] = mx;
  __syncthreads();
  mx = red_max[0];
  for (int w = 1; w < kRouteThreads / 32; ++w) mx = fmaxf(mx, red_max[w]);
  double sum = 0.0;
  if (!sc.sigmoid) {
    for (int e = tid; e < E; e += kRouteThreads) sum += exp(double(l[e]) - double(mx));
  }
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  if (lane == 0) red_sum[warp] = sum;
  __syncthreads();
  sum = red_sum[0];
  for (int w = 1; w < kRouteThreads / 32; ++w) sum += red_sum[w];
  for (int e = tid; e < E; e += kRouteThreads) {
    choose[e] = float(route_score(sc, l[e], mx, sum)) + (sc.bias ? sc.bias[e] : 0.0f);
  }
  __syncthreads();
  if (tid != 0) return;
  const int size = E / n_group;
  unsigned long long kept = 0;  // bit g: group g may be chosen (n_group ≤ 64)
  for (int j = 0; j < topk_group; ++j) {
    int best = -1;
    double best_score = -INFINITY;
    for (int g = 0; g < n_group; ++g) {
      if (kept >> g & 1) continue;
      float first = -INFINITY, second = -INFINITY;
      for (int e = g * size; e < (g + 1) * size; ++e) {
        const float v = choose[e];
        if (v > first) {
          second = first, first = v;
        } else if (v > second) {
          second = v;
        }
      }
      const double score = double(first) + (size > 1 ? double(second) : 0.0);
      if (best < 0 || score > best_score) best = g, best_score = score;
    }
    kept |= 1ull << best;
  }
  int32_t* id_row = ids + int64_t(t) * ld_ids;
  float* w_row = weights + int64_t(t) * ld_w;
  float prev_v = INFINITY;
  int prev_i = -1;
  double total = 0.0;
  for (int j = 0; j < k; ++j) {  // the next expert after the previous pick in (value, index)
    float best_v = -INFINITY;
    int best_i = -1;
    for (int e = 0; e < E; ++e) {
      if (!(kept >> (e / size) & 1)) continue;
      const float v = choose[e];
      const bool after = v < prev_v || (v == prev_v && e > prev_i);
      if (after && (best_i < 0 || v > best_v)) best_v = v, best_i = e;
    }
    prev_v = best_v, prev_i = best_i;
    id_row[j] = best_i;
    const float score = float(route_score(sc, l[best_i], mx, sum));
    w_row[j] = score;
    total += double(score);
  }
  for (int j = 0; j < k; ++j) {
    const float wf = sc.renormalize ? float(double(w_row[j]) / total) : w_row[j];
    w_row[j] = wf * sc.scale;
  }
}

}  // namespace

void CudaOps::moe_route(const Tensor& logits, const MoeRouting& routing, Tensor ids,
                        Tensor weights) {
  if (impl_->replaying()) return;  // the decode graph does this op's work
  const int64_t n = logits.shape[0], E = logits.shape[1];
  const int k = routing.k;
  RECUR_CHECK(k >= 1 && k <= E && E <= 4096 && k <= 64 && logits.stride[1] == 1 &&
              logits.dtype == DType::F32);
  RECUR_CHECK(ids.dtype == DType::I32 && ids.shape[0] == n && ids.shape[1] == k &&
              weights.shape[0] == n && weights.shape[1] == k && ids.stride[1] == 1 &&
              weights.stride[1] == 1);
  RECUR_CHECK(routing.selection_bias.empty() ||
              (routing.selection_bias.dtype == DType::F32 && routing.selection_bias.numel() == E &&
               routing.selection_bias.is_contiguous()));
  if (n == 0) return;
  Impl& s = *impl_;
  const RouteScoring sc = route_scoring(routing);
  auto launch = [&](auto kernel) {
    launch_kernel(kernel, blocks_for(n, 4), 128, 0, s.stream, logits.ptr<float>(), logits.stride[0],
                  int(n), int(E), k, sc, ids.ptr<int32_t>(), ids.stride[0], weights.ptr<float>(),
                  weights.stride[0]);
  };
  auto launch_block = [&](auto kernel) {
    launch_kernel(kernel, unsigned(n), kRouteThreads, 0, s.stream, logits.ptr<float>(),
                  logits.stride[0], int(n), int(E), k, sc, ids.ptr<int32_t>(), ids.stride[0],
                  weights.ptr<float>(), weights.stride[0]);
  };
  // The filter kernels choose by either key; the round-based block kernel by logit only.
  const bool filter =
      k <= 32 && (E == kRouteThreads || E == 2 * kRouteThreads || E == 4 * kRouteThreads);
  const bool block = k <= 32 && !sc.bias;
  // The filter kernel for E, with or without the bias (biased: std::true_type or false_type).
  auto launch_filter = [&](auto biased) {
    constexpr bool kBiased = decltype(biased)::value;
    if (E == kRouteThreads) {
      launch_block(moe_route_filter_kernel<1, kBiased>);
    } else if (E == 2 * kRouteThreads) {
      launch_block(moe_route_filter_kernel<2, kBiased>);
    } else {
      launch_block(moe_route_filter_kernel<4, kBiased>);
    }
  };
  if (routing.grouped()) {
    RECUR_CHECK(E % routing.n_group == 0 && routing.n_group <= 64 && routing.topk_group >= 1 &&
                int64_t(routing.topk_group) * (E / routing.n_group) >= k);
    launch_kernel(moe_route_grouped_kernel, unsigned(n), kRouteThreads, size_t(E) * 4, s.stream,
                  logits.ptr<float>(), logits.stride[0], int(E), k, routing.n_group,
                  routing.topk_group, sc, ids.ptr<int32_t>(), ids.stride[0], weights.ptr<float>(),
                  weights.stride[0]);
  } else if (filter && sc.bias) {
    launch_filter(std::true_type{});
  } else if (filter) {
    launch_filter(std::false_type{});
  } else if (block && E <= kRouteThreads) {
    launch_block(moe_route_block_kernel<1>);
  } else if (block && E <= 2 * kRouteThreads) {
    launch_block(moe_route_block_kernel<2>);
  } else if (block && E <= 4 * kRouteThreads) {
    launch_block(moe_route_block_kernel<4>);
  } else if (E <= 128) {
    launch(moe_route_kernel<4>);
  } else if (E <= 512) {
    launch(moe_route_kernel<16>);
  } else if (E <= 1024) {
    launch(moe_route_kernel<32>);
  } else {
    launch(moe_route_kernel<0>);
  }
  s.launched("moe_route");
}

}  // namespace recur
