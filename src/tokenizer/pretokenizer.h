// The `pre_tokenizer` section of tokenizer.json: Split (regex or literal, PCRE2 with JIT),
// ByteLevel, and Sequence of those. Splits text into the pieces the BPE model encodes one by one.
#pragma once

#include <deque>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace recur {

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

  // Appends the pieces of `text` to `pieces` as views of `text` or of strings kept in `arena`.
  // Empty pieces are dropped.
  Status split(std::string_view text, std::vector<std::string_view>& pieces,
               std::deque<std::string>& arena) const;

  // Whether pieces still need the ByteLevel byte-to-unicode mapping before the model sees them.
  bool byte_level() const { return byte_level_; }

 private:
  struct Step {
    enum Kind { kSplit, kPrefixSpace } kind = kSplit;
    Regex regex;
    Behavior behavior = Behavior::kIsolated;
    bool invert = false;
  };
  Status append_steps(const nlohmann::json& j, bool inside_sequence);
  Status apply(const Step& step, std::string_view text, std::vector<std::string_view>& out,
               std::deque<std::string>& arena, std::vector<Regex::Match>& scratch) const;

  std::vector<Step> steps_;
  bool byte_level_ = false;
};

}  // namespace recur
