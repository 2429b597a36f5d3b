// Structured outputs: a rule on which tokens may come next (a JSON schema, in the server). The
// engine starts one per sequence from its request's spec and its sampler draws only tokens the
// rule allows; the rule follows the tokens generated.
#pragma once

#include <cstdint>
#include <memory>
#include <span>

namespace recur {

class TokenConstraint {
 public:
  virtual ~TokenConstraint() = default;
  // Whether `token` may come next.
  virtual bool allows(int32_t token) = 0;
  // Sets to -inf the logits of every token that may not come next; at least one stays.
  // logits [vocab]
  virtual void mask(std::span<float> logits) = 0;
  // `token` was generated.
  virtual void accept(int32_t token) = 0;
};

// What a request carries: shared by its sequences, each of which starts its own rule at
// submission (allocation there, none per token).
class ConstraintSpec {
 public:
  virtual ~ConstraintSpec() = default;
  virtual std::unique_ptr<TokenConstraint> start() const = 0;
};

}  // namespace recur
