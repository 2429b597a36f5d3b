#include "engine/schedule.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace recur::sched {

namespace {

// Max-min fair split of `capacity` over prompts[i].tokens + extra demand `demand(p)`: in order
// of demand, each takes the smaller of its demand and an even share of what is left. Returns
// what is left.
template <typename Demand>
int64_t fill_fairly(std::span<PromptShare> prompts, int64_t capacity, Demand demand) {
  std::sort(prompts.begin(), prompts.end(), [&](const PromptShare& a, const PromptShare& b) {
    const int64_t da = demand(a), db = demand(b);
    return da != db ? da < db : a.order < b.order;
  });
  const int64_t n = int64_t(prompts.size());
  for (int64_t k = 0; k < n && capacity > 0; ++k) {
    const int64_t give = std::min(demand(prompts[size_t(k)]), capacity / (n - k));
    prompts[size_t(k)].tokens += int(give);
    capacity -= give;
  }
  return capacity;
}

}  // namespace

void share_prompt_tokens(std::span<PromptShare> prompts, int budget) {
  if (prompts.empty()) return;
  std::sort(prompts.begin(), prompts.end(), [](const PromptShare& a, const PromptShare& b) {
    return a.priority != b.priority ? a.priority < b.priority : a.order < b.order;
  });
  const int n = int(prompts.size());
  const int floor_share = std::max(1, budget / (4 * n));
  int64_t left = budget;
  for (PromptShare& p : prompts) {
    p.tokens = int(std::min<int64_t>({p.remaining, floor_share, left}));
    left -= p.tokens;
  }
  // What is left, one priority level after the other.
  for (int i = 0; i < n && left > 0;) {
    int j = i;
    while (j < n && prompts[size_t(j)].priority == prompts[size_t(i)].priority) ++j;
    left = fill_fairly(prompts.subspan(size_t(i), size_t(j - i)), left,
                       [](const PromptShare& p) { return int64_t(p.remaining - p.tokens); });
    i = j;
  }
}

int64_t attended_positions(int64_t position, int64_t n) {
  return n * position + n * (n + 1) / 2;
}

namespace {

// The most tokens from `position` on, at most `limit`, attending at most `allowance` positions.
int64_t tokens_within(int64_t position, int64_t limit, double allowance) {
  const double b = double(2 * position + 1);
  int64_t n = int64_t((std::sqrt(b * b + 8.0 * std::max(0.0, allowance)) - b) / 2.0);
  n = std::clamp<int64_t>(n, 0, limit);
  while (n > 0 && double(attended_positions(position, n)) > allowance) --n;
  while (n < limit && double(attended_positions(position, n + 1)) <= allowance) ++n;
  return n;
}

}  // namespace

bool cap_prompt_attention(std::span<PromptShare> prompts, double allowance) {
  double total = 0;
  for (const PromptShare& p : prompts) total += double(attended_positions(p.position, p.tokens));
  if (total <= allowance) return false;
  // Max-min over each chunk's attended positions, cheapest chunks first.
  std::sort(prompts.begin(), prompts.end(), [](const PromptShare& a, const PromptShare& b) {
    const int64_t ca = attended_positions(a.position, a.tokens);
    const int64_t cb = attended_positions(b.position, b.tokens);
    return ca != cb ? ca < cb : a.order < b.order;
  });
  bool cut = false;
  double left = allowance;
  const size_t n = prompts.size();
  for (size_t k = 0; k < n; ++k) {
    PromptShare& p = prompts[k];
    if (p.tokens == 0) continue;
    const double share = std::max(0.0, left) / double(n - k);
    const int64_t keep = std::max<int64_t>(1, tokens_within(p.position, p.tokens, share));
    cut = cut || keep < p.tokens;
    p.tokens = int(keep);
    left -= double(attended_positions(p.position, keep));
  }
  return cut;
}

namespace {
constexpr double kRidge = 1e-3;  // against sums of ~1/(1 - forget) unit-scale observations
}  // namespace

StepCostModel::StepCostModel(double forget) : forget_(forget) {}

void StepCostModel::observe(double tokens, double attended, double seconds) {
  const double x[3] = {1.0, tokens / kTokenScale, attended / kPositionScale};
  for (int i = 0; i < 3; ++i) {
    for (int j = 0; j < 3; ++j) xx_[i][j] = forget_ * xx_[i][j] + x[i] * x[j];
    xy_[i] = forget_ * xy_[i] + x[i] * seconds;
  }
  ++observed_;
  solve();
}

void StepCostModel::solve() {
  // Least squares over the coefficients still free; one that comes out negative is fixed at 0
  // and the rest solved again (a step never gets faster with more work). A small ridge toward
  // the previous fit keeps what recent steps do not tell: once chunks are cut, steps look
  // alike (tokens and positions move together) and say little about a position's cost alone.
  bool active[3] = {true, true, true};
  double c[3] = {0, 0, 0};
  for (int round = 0; round < 3; ++round) {
    int idx[3], m = 0;
    for (int i = 0; i < 3; ++i) {
      if (active[i]) idx[m++] = i;
    }
    double a[3][4] = {};
    for (int r = 0; r < m; ++r) {
      for (int k = 0; k < m; ++k) a[r][k] = xx_[idx[r]][idx[k]];
      a[r][r] += kRidge;
      a[r][m] = xy_[idx[r]] + kRidge * coef_[idx[r]];
    }
    for (int col = 0; col < m; ++col) {  // Gaussian elimination, partial pivoting
      int piv = col;
      for (int r = col + 1; r < m; ++r) {
        if (std::fabs(a[r][col]) > std::fabs(a[piv][col])) piv = r;
      }
      for (int k = 0; k <= m; ++k) std::swap(a[col][k], a[piv][k]);
      if (a[col][col] == 0) return;
      for (int r = 0; r < m; ++r) {
        if (r == col) continue;
        const double f = a[r][col] / a[col][col];
        for (int k = col; k <= m; ++k) a[r][k] -= f * a[col][k];
      }
    }
    bool negative = false;
    for (int i = 0; i < 3; ++i) c[i] = 0;
    for (int r = 0; r < m; ++r) {
      c[idx[r]] = a[r][m] / a[r][r];
      if (c[idx[r]] < 0) {
        active[idx[r]] = false;
        negative = true;
      }
    }
    if (!negative) break;
    for (int i = 0; i < 3; ++i) c[i] = std::max(0.0, c[i]);
  }
  // The cost of a position is known once a few steps came in. A solve that finds none (the
  // steps of late looked alike) is not news; one step moves it by at most a factor of 2, so
  // that a stalled step cannot swing the next chunk's size by more.
  if (!(c[2] > 0)) return;
  if (fitted_) c[2] = std::clamp(c[2], 0.5 * coef_[2], 2.0 * coef_[2]);
  for (int i = 0; i < 3; ++i) coef_[i] = std::max(0.0, c[i]);
  fitted_ = fitted_ || observed_ >= 3;
}

double StepCostModel::attention_allowance(double tokens, double target_seconds) const {
  if (!fitted_) return std::numeric_limits<double>::infinity();
  const double rest = per_step() + per_token() * tokens;
  const double for_attention = std::max(target_seconds - rest, 0.5 * target_seconds);
  return for_attention / per_position();
}

}  // namespace recur::sched
