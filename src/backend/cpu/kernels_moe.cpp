// Mixture of experts on the CPU: routing by f32 scores (softmax or sigmoid), then tokens grouped
// by expert so that each chosen expert's weights are read once per step, whatever the number of
// tokens.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/kernels.h"

namespace recur {

using namespace cpu;

namespace {

constexpr int kMaxRouteGroups = 256;

// Group-limited choice: the values of experts outside the topk_group best groups (a group
// scores the sum of its two highest values) become -inf.  choose [E], in place.
void mask_groups(const MoeRouting& routing, int64_t E, float* choose) {
  const int n_group = routing.n_group;
  const int64_t size = E / n_group;
  double group_score[kMaxRouteGroups];
  for (int g = 0; g < n_group; ++g) {
    float first = -INFINITY, second = -INFINITY;
    for (int64_t e = g * size; e < (g + 1) * size; ++e) {
      if (choose[e] > first) {
        second = first, first = choose[e];
      } else if (choose[e] > second) {
        second = choose[e];
      }
    }
    group_score[g] = double(first) + (size > 1 ? double(second) : 0.0);
  }
  bool kept[kMaxRouteGroups] = {};
  for (int j = 0; j < routing.topk_group;
       ++j) {  // the best group not yet kept, lower index on ties
    int best = -1;
    for (int g = 0; g < n_group; ++g) {
      if (!kept[g] && (best < 0 || group_score[g] > group_score[best])) best = g;
    }
    kept[best] = true;
  }
  for (int64_t e = 0; e < E; ++e) {
    if (!kept[e / size]) choose[e] = -INFINITY;
  }
}

}  // namespace

void CpuOps::moe_route(const Tensor& logits, const MoeRouting& routing, Tensor ids,
                       Tensor weights) {
  const int64_t n = logits.shape[0], E = logits.shape[1];
  const int k = routing.k;
  const bool biased = !routing.selection_bias.empty();
  RECUR_CHECK(k >= 1 && k <= E && E <= kMaxRouteExperts && k <= kMaxRouteTopK);
  RECUR_CHECK(logits.dtype == DType::F32 && logits.stride[1] == 1 && ids.shape[1] >= k &&
              weights.shape[1] >= k);
  RECUR_CHECK(!biased || routing.selection_bias.numel() == E);
  // The per-expert bias once per call (E ≤ 4096: 16 KB of stack).
  float bias[kMaxRouteExperts];
  for (int64_t e = 0; e < E; ++e) bias[e] = biased ? weight_at(routing.selection_bias, e) : 0.0f;
  const bool softmax = routing.score == MoeRouting::Score::kSoftmax;
  const bool grouped = routing.grouped();
  RECUR_CHECK(!grouped || (E % routing.n_group == 0 && routing.n_group <= kMaxRouteGroups &&
                           routing.topk_group >= 1));
  for (int64_t t = 0; t < n; ++t) {
    const float* l = logits.row<float>(t);
    // Scores in double, held in f32 (as the reference holds them, so that equal scores tie
    // alike); the values that choose are score + bias in f32.
    float score[kMaxRouteExperts];
    if (softmax) {
      double mx = l[0];
      for (int64_t e = 1; e < E; ++e) mx = std::max(mx, double(l[e]));
      double ex[kMaxRouteExperts];
      double sum = 0.0;
      for (int64_t e = 0; e < E; ++e) {
        ex[e] = std::exp(double(l[e]) - mx);
        sum += ex[e];
      }
      for (int64_t e = 0; e < E; ++e) score[e] = float(ex[e] / sum);
    } else {
      for (int64_t e = 0; e < E; ++e) score[e] = float(1.0 / (1.0 + std::exp(-double(l[e]))));
    }
    const float* choose = score;
    float biased_score[kMaxRouteExperts];
    if (biased || grouped) {
      for (int64_t e = 0; e < E; ++e) biased_score[e] = score[e] + bias[e];
      choose = biased_score;
    }
    if (grouped) mask_groups(routing, E, biased_score);
    // Top-k by insertion; an expert goes after those that choose at least as high, so ties
    // go to the lower expert index.
    int32_t top[kMaxRouteTopK];
    int n_top = 0;
    for (int64_t e = 0; e < E; ++e) {
      int pos = n_top;
      while (pos > 0 && choose[top[pos - 1]] < choose[e]) --pos;
      if (pos >= k) continue;
      for (int j = std::min(n_top, k - 1); j > pos; --j) top[j] = top[j - 1];
      top[pos] = int32_t(e);
      n_top = std::min(n_top + 1, k);
    }
    int32_t* id_row = ids.row<int32_t>(t);
    float* w_row = weights.row<float>(t);
    double kept = 0.0;
    for (int j = 0; j < k; ++j) kept += score[top[j]];
    const double norm = routing.renormalize ? kept : 1.0;
    for (int j = 0; j < k; ++j) {
      id_row[j] = top[j];
      w_row[j] = float(double(score[top[j]]) / norm * routing.scale);
    }
  }
}

size_t CpuOps::moe_experts_scratch_bytes(int n_tokens, int k, int n_experts, int d, int d_ff,
                                         DType /*expert_dtype*/) const {
  const size_t pairs = size_t(n_tokens) * size_t(k);
  // x rows, gate/up/hidden rows and down rows per (token, expert) pair; index arrays.
  return (pairs * (size_t(d) * 2 + size_t(d_ff) * 3) + pairs * 2 + size_t(n_experts) + 1) * 4 + 256;
}

void CpuOps::moe_experts(const Tensor& x, std::span<const ExpertWeights> experts, const Tensor& ids,
                         const Tensor& weights, Tensor out, Tensor scratch) {
  moe_experts_pass(x, experts, ids, weights, nullptr, out, scratch);
}

void CpuOps::moe_experts_shared(const Tensor& x, std::span<const ExpertWeights> experts,
                                const Tensor& ids, const Tensor& weights,
                                const SharedExpertArgs& shared, Tensor out, Tensor scratch) {
  moe_experts_pass(x, experts, ids, weights, &shared, out, scratch);
  if (shared.score.empty()) {
    add(out, shared.out);
  } else {
    add_scaled_sigmoid(out, shared.out, shared.score);
  }
}

void CpuOps::moe_experts_pass(const Tensor& x, std::span<const ExpertWeights> experts,
                              const Tensor& ids, const Tensor& weights,
                              const SharedExpertArgs* shared, Tensor out, Tensor scratch) {
  const int64_t n = x.shape[0], d = x.row_size(), k = ids.shape[1];
  const int64_t E = int64_t(experts.size());
  const int64_t d_ff = experts[0].gate.shape[0];
  const int64_t pairs = n * k;
  float* p = scratch.ptr<float>();
  float* xs = p;  // [pairs, d]: x rows sorted by expert
  p += pairs * d;
  float* gs = p;  // [pairs, d_ff]
  p += pairs * d_ff;
  float* us = p;  // [pairs, d_ff]
  p += pairs * d_ff;
  float* hs = p;  // [pairs, d_ff]
  p += pairs * d_ff;
  float* ys = p;  // [pairs, d]
  p += pairs * d;
  int32_t* token_of = reinterpret_cast<int32_t*>(p);            // [pairs]
  float* weight_of = p + pairs;                                 // [pairs]
  int32_t* offset = reinterpret_cast<int32_t*>(p + 2 * pairs);  // [E + 1]

  // Counting sort of (token, expert) pairs by expert.
  std::fill(offset, offset + E + 1, 0);
  for (int64_t i = 0; i < pairs; ++i) {
    const int32_t e = ids.row<int32_t>(i / k)[i % k];
    RECUR_CHECK(e >= 0 && e < E);
    ++offset[e + 1];
  }
  for (int64_t e = 0; e < E; ++e) offset[e + 1] += offset[e];
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = ids.row<int32_t>(t)[j];
      const int32_t dst = offset[e]++;
      token_of[dst] = int32_t(t);
      weight_of[dst] = weights.row<float>(t)[j];
      std::memcpy(xs + dst * d, x.row<float>(t), size_t(d) * 4);
    }
  }
  for (int64_t e = E; e > 0; --e) offset[e] = offset[e - 1];
  offset[0] = 0;

  // Two passes, each over every chosen expert (and the shared one) at once: gate and up, then
  // down; jobs go in batches of up to kMaxPassJobs.
  MatmulJob jobs[kMaxPassJobs];
  int n_jobs = 0;
  auto queue = [&](const Tensor& in, const Tensor& w, const Tensor& result) {
    if (n_jobs == kMaxPassJobs) {
      matmul_pass(std::span<const MatmulJob>(jobs, size_t(n_jobs)));
      n_jobs = 0;
    }
    jobs[n_jobs++] = {in, w, result, false};
  };
  auto flush = [&] {
    matmul_pass(std::span<const MatmulJob>(jobs, size_t(n_jobs)));
    n_jobs = 0;
  };
  auto rows = [](float* base, int64_t first, int64_t count, int64_t width) {
    return Tensor::contiguous(base + first * width, DType::F32, {count, width});
  };
  if (shared != nullptr) {
    queue(x, shared->w.gate, shared->gate);
    queue(x, shared->w.up, shared->up);
  }
  for (int64_t e = 0; e < E; ++e) {
    const int64_t b = offset[e], m = offset[e + 1] - b;
    if (m == 0) continue;
    queue(rows(xs, b, m, d), experts[size_t(e)].gate, rows(gs, b, m, d_ff));
    queue(rows(xs, b, m, d), experts[size_t(e)].up, rows(us, b, m, d_ff));
  }
  flush();
  swiglu(rows(gs, 0, pairs, d_ff), rows(us, 0, pairs, d_ff), rows(hs, 0, pairs, d_ff));
  if (shared != nullptr) {
    swiglu(shared->gate, shared->up, shared->hidden);
    queue(shared->hidden, shared->w.down, shared->out);
  }
  for (int64_t e = 0; e < E; ++e) {
    const int64_t b = offset[e], m = offset[e + 1] - b;
    if (m == 0) continue;
    queue(rows(hs, b, m, d_ff), experts[size_t(e)].down, rows(ys, b, m, d));
  }
  flush();
  for (int64_t t = 0; t < n; ++t) std::fill(out.row<float>(t), out.row<float>(t) + d, 0.0f);
  for (int64_t i = 0; i < pairs; ++i) {
    float* o = out.row<float>(token_of[i]);
    const float w = weight_of[i];
    const float* y = ys + i * d;
    for (int64_t j = 0; j < d; ++j) o[j] += w * y[j];
  }
}

}  // namespace recur
