// Added tokens of tokenizer.json (special tokens like <|im_start|> and extras like <think>):
// found in the text before the model sees it, with Hugging Face's lstrip / rstrip / single_word
// / normalized rules.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/status.h"
#include "tokenizer/normalizer.h"
#include "tokenizer/pretokenizer.h"

namespace recur {

struct AddedToken {
  std::string content;
  int32_t id = -1;
  bool special = false;
  bool lstrip = false;
  bool rstrip = false;
  bool single_word = false;
  bool normalized = false;  // matched in normalized text rather than in the raw input
};

class AddedVocabulary {
 public:
  // `origin` names the file in errors.
  static Result<AddedVocabulary> from_json(const nlohmann::json& added_tokens,
                                           const Normalizer& normalizer,
                                           std::string_view origin = "tokenizer.json");

  const std::vector<AddedToken>& tokens() const { return tokens_; }

  // A run of text to tokenize (id < 0) or one added token (its text includes stripped spaces).
  struct Segment {
    std::string_view text;
    int32_t id;
  };
  // Where special tokens may not match: they stay the text they spell where their match
  // overlaps one of `ranges` (sorted, disjoint byte ranges of the text split() is given, moved
  // by `offset`: ranges are of a whole prompt, split() may see a piece of it), or anywhere.
  struct Literal {
    std::span<const std::pair<size_t, size_t>> ranges;
    size_t offset = 0;  // where the text given to split() begins in the text ranges index
    bool everywhere = false;
    bool overlaps(size_t begin, size_t end) const;  // bytes of the text given to split()
  };
  // Splits `text` on the tokens whose `normalized` flag equals `normalized_tokens`, matching
  // leftmost-longest. Empty text runs are dropped. A special token skipped for `literal` is
  // skipped as Hugging Face skips it for split_special_tokens: the search resumes after it.
  void split(std::string_view text, bool normalized_tokens, std::vector<Segment>& out,
             const Literal& literal) const;

  bool has_normalized_tokens() const { return !normalized_.empty(); }

 private:
  // Byte trie over token contents, searched for the leftmost, then longest, match.
  class Matcher {
   public:
    void add(std::string_view pattern, int32_t token_index);
    bool empty() const { return nodes_.size() <= 1; }
    struct Hit {
      size_t start, end;
      int32_t token_index;
    };
    bool find(std::string_view text, size_t from, Hit& hit) const;

   private:
    struct Node {
      std::vector<std::pair<uint8_t, int32_t>> children;
      int32_t token_index = -1;
    };
    int32_t child(int32_t node, uint8_t byte) const;
    std::vector<Node> nodes_{Node{}};
    bool first_byte_[256] = {};
  };

  bool is_word_boundary_ok(std::string_view text, size_t start, size_t end) const;

  std::vector<AddedToken> tokens_;
  Matcher raw_;
  Matcher normalized_;
  Regex word_char_;
};

}  // namespace recur
