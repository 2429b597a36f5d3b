#include "cuda/cuda_reference.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "ops/op_test_util.h"

namespace recur::testing::host_ref {

namespace {

double sigmoid(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}

}  // namespace

void moe_route(const Tensor& logits, const MoeRouting& routing, Tensor ids, Tensor weights) {
  const int64_t n = logits.shape[0], E = logits.shape[1];
  const int k = routing.k;
  const bool sig = routing.score == MoeRouting::Score::kSigmoid;
  const float* bias =
      routing.selection_bias.empty() ? nullptr : routing.selection_bias.ptr<float>();
  for (int64_t t = 0; t < n; ++t) {
    const float* l = logits.row<float>(t);
    std::vector<double> p(static_cast<size_t>(E));
    double mx = -INFINITY, sum = 0;
    for (int64_t e = 0; e < E; ++e) mx = std::max(mx, double(l[e]));
    for (int64_t e = 0; e < E; ++e) sum += std::exp(double(l[e]) - mx);
    for (int64_t e = 0; e < E; ++e) {
      p[size_t(e)] = sig ? sigmoid(l[e]) : std::exp(double(l[e]) - mx) / sum;
    }
    std::vector<float> key(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) key[size_t(e)] = bias ? float(p[size_t(e)]) + bias[e] : l[e];
    std::vector<int> order(static_cast<size_t>(E));
    std::iota(order.begin(), order.end(), 0);
    // Key descending (NaN last), index ascending.
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
      const float ka = key[size_t(a)], kb = key[size_t(b)];
      if (std::isnan(kb)) return !std::isnan(ka);
      return ka > kb;
    });
    double kept = 0;
    for (int j = 0; j < k; ++j) kept += p[size_t(order[size_t(j)])];
    for (int j = 0; j < k; ++j) {
      const double pj = p[size_t(order[size_t(j)])];
      ids.row<int32_t>(t)[j] = order[size_t(j)];
      weights.row<float>(t)[j] = float((routing.renormalize ? pj / kept : pj) * routing.scale);
    }
  }
}

}  // namespace recur::testing::host_ref
