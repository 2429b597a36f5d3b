// The scheduler's arithmetic over plain numbers, apart from the engine's bookkeeping so that
// tests drive it directly: how a step's prompt tokens are shared among the prompts being
// prefilled, how deep chunks are cut to bound a step's attention work, and the fitted cost of a
// step that says how much attention work fits a time. Nothing here allocates.
#pragma once

#include <cstdint>
#include <span>

namespace recur::sched {

// One prompt being prefilled, as the step's token budget sees it.
struct PromptShare {
  int remaining = 0;     // prompt tokens not yet prefilled (>= 1)
  int64_t position = 0;  // position of its next token (tokens already in its state)
  int priority = 0;      // lower is served first
  uint64_t order = 0;    // admission order, for ties
  int index = 0;         // the caller's
  int tokens = 0;        // out: tokens granted this step
};

// Shares `budget` tokens among `prompts` (reordered). A quarter of the budget is split evenly
// over all prompts whatever their priority, at least one token each while the budget lasts:
// the guaranteed minimum share, so that no admitted prompt stalls. The rest goes to the most
// urgent priority first and, within a priority, max-min fairly: a prompt needing less than an
// even share takes only what it needs and the others share what it leaves. A short prompt is
// thus done in ceil(length / (budget / (4 · prompts))) steps at most, however long the others.
void share_prompt_tokens(std::span<PromptShare> prompts, int budget);

// Σ over n tokens fed from `position` of the positions each attends (its own included).
int64_t attended_positions(int64_t position, int64_t n);

// Cuts the grants so that their attended positions total at most `allowance`, max-min fairly
// (chunks cheaper than an even share keep their grant; deep ones share the rest), each prompt
// keeping at least one token. Returns true when a grant was cut. Reorders `prompts`.
bool cap_prompt_attention(std::span<PromptShare> prompts, double allowance);

// A step's duration fitted online as c + a·tokens + b·attended_positions (least squares,
// recent steps weighted most, coefficients kept >= 0), from the steps that carried prompts.
class StepCostModel {
 public:
  // `forget`: the weight of each older observation relative to the next (window ~1/(1 − f)).
  explicit StepCostModel(double forget = 0.99);
  void observe(double tokens, double attended, double seconds);
  // Attended positions a step of `tokens` tokens may carry to take `target_seconds`: what the
  // target leaves after the rest of the step's work, but never less than half the target's
  // worth (cutting attention cannot speed up a step that the rest alone makes slow). +inf
  // until the fit knows the cost of a position.
  double attention_allowance(double tokens, double target_seconds) const;
  bool fitted() const { return fitted_; }
  // The fit, in seconds: per step, per token, per attended position.
  double per_step() const { return coef_[0]; }
  double per_token() const { return coef_[1] / kTokenScale; }
  double per_position() const { return coef_[2] / kPositionScale; }

 private:
  static constexpr double kTokenScale = 1e3, kPositionScale = 1e6;  // keep the sums conditioned
  void solve();

  double forget_;
  double xx_[3][3] = {};  // Σ w x xᵀ over x = (1, tokens, positions), scaled
  double xy_[3] = {};     // Σ w x · seconds
  double coef_[3] = {};
  int observed_ = 0;
  bool fitted_ = false;
};

}  // namespace recur::sched
