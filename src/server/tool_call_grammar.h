// Forced tool calls (tool_choice "required" or a named function) in the JSON call format
// (Hermes / Qwen3: <tool_call>\n{"name": "NAME", "arguments": {…}}\n</tool_call>) as a grammar
// that a matcher follows byte by byte, so that constrained decoding (json_constraint.h) makes
// every forced call parse, its name one of the tools' and its arguments a JSON object the
// tool's parameters schema accepts.
//
// What the model writes after the forced prefix's "<tool_call>\n":
//   HEAD         one branch's `{"name": "NAME", "arguments": {` (the value's '{' ends it, so
//                the arguments are an object whatever the schema's root would allow)
//   VALUE        the rest of the arguments, a JSON value of the branch's schema
//   TAIL         `}\n</tool_call>`: the first byte the whole value does not take starts it,
//                so one token may end the value and begin the tail (`}}`, `}\n`)
//   [REPEAT HEAD VALUE TAIL]…   `\n<tool_call>\n` and another call, when more may follow
// then the end tokens. The part the prompt already holds (a named call's head) is `primed`.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "server/json_schema.h"

namespace recur::server {

// Sorts a grammar's alternatives by head, so that those a head's first bytes leave are a run;
// of equal heads the first stays (a name given twice is its first tool's).
template <class Alternative>
void sort_heads_keep_first(std::vector<Alternative>* v) {
  std::stable_sort(v->begin(), v->end(),
                   [](const auto& a, const auto& b) { return a.head < b.head; });
  v->erase(std::unique(v->begin(), v->end(),
                       [](const auto& a, const auto& b) { return a.head == b.head; }),
           v->end());
}

// A tool's function object (chat's shape), its name in *name; null when it has no named one.
const ojson* named_function(const ojson& tool, const std::string** name);

// A matcher's bytes one by one: false at the first byte refused (the state then partial).
template <class Matcher>
bool feed_each(Matcher& m, std::string_view bytes) {
  for (char c : bytes) {
    if (!m.feed(uint8_t(c))) return false;
  }
  return true;
}

struct ToolCallGrammar {
  struct Branch {
    std::string head;  // ends with '{', the arguments' first byte
    std::shared_ptr<const CompiledSchema> schema;
  };
  // Sorted by head; distinct, and none a prefix of another (the name is a whole JSON string).
  std::vector<Branch> branches;
  std::string primed;     // the text before generation (in the prompt), matched at the start
  std::string tail;       // closes the call
  std::string repeat;     // opens another call; empty: one call only
  std::string forbidden;  // text no value may hold (the close tag, where the parser ends a call)
};

// The grammar of a forced call among `tools` (chat's shape, validated): `name` the function
// named by tool_choice, or empty for "required" (any of them; with `more_calls`, several). Each
// tool's arguments follow its parameters schema when the compiler takes it and it describes an
// object; otherwise (no parameters, or keywords the compiler refuses, such as "minimum" or
// "pattern") any JSON object: the call still parses, the request is not refused.
std::shared_ptr<const ToolCallGrammar> json_call_grammar(const ojson& tools, std::string_view name,
                                                         bool more_calls);

// The schema a tool's arguments follow (`function` the tool's "function" object): its parameters
// when the compiler takes them and they describe an object (a value of them may start with '{'),
// else any JSON object.
std::shared_ptr<const CompiledSchema> arguments_schema(const ojson& function);

// How many bytes of `text` the bytes so far end with after one more, `b` (the longest prefix of
// `text` that is a suffix), given that they ended with `at` of them.
uint32_t advance_match(std::string_view text, uint32_t at, uint8_t b);

// Follows generated text against a ToolCallGrammar, with JsonMatcher's interface (json_constraint
// masks with either). Fixed size: feeding a byte and copying never allocate.
class ToolCallMatcher {
 public:
  explicit ToolCallMatcher(const ToolCallGrammar* grammar);  // `primed` fed
  // False (and the state unchanged) when no text that continues with `b` can match.
  bool feed(uint8_t b);
  bool feed(std::string_view bytes);  // false at the first byte refused (state then partial)
  // Whether the text so far is whole calls (the end tokens may come).
  bool can_end() const;
  // Inside the arguments, JsonMatcher::free_string_room; else -1. A string-safe token holding
  // `forbidden` whole is not covered: the constraint checks those apart.
  int free_string_room() const;
  void copy_from(const ToolCallMatcher& other);

 private:
  enum class Phase : uint8_t { kHead, kValue, kTail, kRepeat };
  const ToolCallGrammar* grammar_;
  Phase phase_ = Phase::kHead;
  uint32_t lo_ = 0, hi_ = 0;   // kHead: the branches whose head starts with the text so far
  uint32_t pos_ = 0;           // kHead, kTail, kRepeat: bytes of it matched
  uint32_t forbidden_at_ = 0;  // kValue: bytes of `forbidden` the value ends with
  JsonMatcher value_;          // kValue: the arguments so far
};

}  // namespace recur::server
