// The `pre_tokenizer` section of tokenizer.json: Split (regex or literal, PCRE2 with JIT),
// ByteLevel, and Sequence of those. Splits text into the pieces the BPE model encodes one by one.
#pragma once

#include <deque>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/status.h"

namespace recur {

// A non-owning reference to a callable, so per-piece callbacks cost no allocation. The callable
// must outlive the call it is passed to.
template <typename Signature>
class FunctionRef;
template <typename R, typename... Args>
class FunctionRef<R(Args...)> {
 public:
  template <typename F>
  requires(!std::is_same_v<std::decay_t<F>, FunctionRef>) FunctionRef(F&& f)  // NOLINT(implicit)
      : object_(const_cast<void*>(static_cast<const void*>(&f))),
        call_([](void* o, Args... args) -> R {
          return (*static_cast<std::remove_reference_t<F>*>(o))(std::forward<Args>(args)...);
        }) {}
  R operator()(Args... args) const { return call_(object_, std::forward<Args>(args)...); }

 private:
  void* object_;
  R (*call_)(void*, Args...);
};

// Rewrites an Oniguruma (Ruby syntax) pattern, as Hugging Face tokenizers compiles it, into PCRE2
// syntax with the same meaning: \s, \S, \w, \W and \h use Oniguruma's Unicode classes.
Result<std::string> translate_oniguruma_pattern(std::string_view pattern);

// A compiled pattern, immutable and shared between threads and copies.
class Regex {
 public:
  static Result<Regex> compile(std::string_view pcre2_pattern);
  static Result<Regex> compile_oniguruma(std::string_view pattern);
  static Result<Regex> compile_literal(std::string_view literal);

  struct Match {
    size_t start, end;
  };
  // Non-overlapping matches left to right; an empty match right after the previous match is
  // skipped, as Rust's find_iter does. `text` must be valid UTF-8.
  Status for_each_match(std::string_view text,
                        FunctionRef<void(size_t start, size_t end)> on_match) const;
  Status find_all(std::string_view text, std::vector<Match>& matches) const;

 private:
  struct Code;
  std::shared_ptr<const Code> code_;
};

class PreTokenizer {
 public:
  enum class Behavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

  // Accepts null, Split, ByteLevel and Sequence; a ByteLevel step must come last.
  static Result<PreTokenizer> from_json(const nlohmann::json& j);
  // tiktoken's split: the pieces are the matches of `regex`, in order (text that no match
  // covers is dropped, as tiktoken drops it); the model sees them byte-level.
  static PreTokenizer matches_of(Regex regex);

  // Calls `on_piece` for each piece of `text`, in order, as soon as it is found; pieces are
  // views of `text` or of strings kept in `arena`. Empty pieces are dropped.
  Status split(std::string_view text, std::deque<std::string>& arena,
               FunctionRef<void(std::string_view)> on_piece) const;

  // Whether pieces still need the ByteLevel byte-to-unicode mapping before the model sees them.
  bool byte_level() const { return byte_level_; }

 private:
  struct Step {
    enum Kind { kSplit, kPrefixSpace } kind = kSplit;
    Regex regex;
    Behavior behavior = Behavior::kIsolated;
    bool invert = false;
  };
  Status append_steps(const nlohmann::json& j);
  Status apply(const Step& step, std::string_view text, std::deque<std::string>& arena,
               FunctionRef<void(std::string_view)> out) const;
  Status run_from(size_t step, std::string_view text, std::deque<std::string>& arena,
                  FunctionRef<void(std::string_view)> on_piece) const;

  std::vector<Step> steps_;
  bool byte_level_ = false;
};

}  // namespace recur
