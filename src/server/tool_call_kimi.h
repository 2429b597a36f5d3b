// Forced tool calls (tool_choice "required" or a named function) in Kimi's call-section format
// as a grammar that a matcher follows byte by byte, so that constrained decoding
// (json_constraint.h) makes every forced call one the output parser reads as a call of a tool,
// its arguments a JSON object the tool's parameters schema accepts.
//
// Kimi's markers (<|tool_call_begin|>, …) are tokens of their own, special or not. The matcher
// reads each as one reserved byte (kMarkerByte + its Marker), which no UTF-8 text holds, and
// the constraint's vocabulary (kimi_call_vocabulary) gives each marker token that byte: so a
// marker comes only where the grammar has one, and only as a token, never spelt out in text.
//
// What the model writes after the forced prefix's
// "<|tool_calls_section_begin|><|tool_call_begin|>functions.":
//   HEAD    one function's `NAME:` (a named call's is in the prefix: `primed`)
//   INDEX   a decimal number without leading zeros: the first call's any (the id
//           functions.NAME:INDEX is the model's own, kept as the call's id), each later one's
//           the one before plus one, as Kimi counts its calls, so no two ids of a turn are equal
//   <|tool_call_argument_begin|> then `{` and the rest of a JSON value of the tool's schema,
//           never holding `forbidden` (the start of every marker's text: the parser finds
//           markers in the text, so a value holding one would end the call there)
//   <|tool_call_end|>, then, when more calls may follow, possibly
//           <|tool_call_begin|>functions. and another HEAD INDEX … <|tool_call_end|>
//   <|tool_calls_section_end|>
// then the end tokens.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "server/json_schema.h"

namespace recur::server {

struct KimiCallGrammar {
  enum Marker : uint8_t { kSectionBegin, kSectionEnd, kCallBegin, kArgsBegin, kCallEnd };
  // Their texts, by Marker (the chat template's and the output parser's).
  static constexpr std::array<std::string_view, 5> kMarkers = {
      "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
      "<|tool_call_argument_begin|>", "<|tool_call_end|>"};
  static constexpr std::string_view kMarkerStart = "<|tool_call";  // every marker's
  static constexpr uint8_t kMarkerByte = 0xF8;  // 0xF8-0xFC: never a byte of UTF-8 text
  static constexpr uint8_t byte(Marker m) { return uint8_t(kMarkerByte + m); }

  struct Branch {
    std::string head;  // `NAME:`
    std::shared_ptr<const CompiledSchema> schema;
  };
  // Sorted by head, distinct; none a prefix of another (no name holds ':').
  std::vector<Branch> branches;
  std::string primed;                   // the text before generation (in the prompt)
  std::string call_lead;                // after <|tool_call_begin|>: "functions."
  bool more_calls = false;              // <|tool_call_begin|> may open another call
  std::string forbidden{kMarkerStart};  // what no value holds
};

// The grammar of a forced call among `tools` (chat's shape, validated): `name` the function
// named by tool_choice, or empty for "required" (any of them; with `more_calls`, several). Each
// tool's arguments follow arguments_schema (tool_call_grammar.h). Tools whose name the id cannot
// carry (the parser's rules: no ':', space, '<' or '>'; at most kMaxName bytes) are left out;
// null when none is left.
std::shared_ptr<const KimiCallGrammar> kimi_call_grammar(const ojson& tools, std::string_view name,
                                                         bool more_calls);

// Follows generated text (markers as their bytes) against a KimiCallGrammar, with JsonMatcher's
// interface (json_constraint masks with either). Fixed size: feeding a byte and copying never
// allocate.
class KimiCallMatcher {
 public:
  static constexpr uint32_t kMaxName = 256;       // bytes, so an id stays under the parser's 512
  static constexpr uint32_t kMaxIndexDigits = 6;  // an index below a million

  explicit KimiCallMatcher(const KimiCallGrammar* grammar);  // `primed` fed
  // False (and the state unchanged) when no text that continues with `b` can match.
  bool feed(uint8_t b);
  bool feed(std::string_view bytes);  // false at the first byte refused (state then partial)
  // Whether the text so far is whole calls and the section's close (the end tokens may come).
  bool can_end() const;
  // Inside the arguments, JsonMatcher::free_string_room; else -1. A string-safe token holding
  // `forbidden` whole is not covered: the constraint checks those apart.
  int free_string_room() const;
  void copy_from(const KimiCallMatcher& other);

 private:
  enum class Phase : uint8_t {
    kHead,       // a function's head: branches [lo_, hi_) share its first pos_ bytes
    kIndex,      // pos_ digits of the index
    kArgsOpen,   // after <|tool_call_argument_begin|>: the arguments' '{'
    kValue,      // the arguments (value_)
    kAfterCall,  // after <|tool_call_end|>: the section's close, or another call
    kLead,       // after <|tool_call_begin|>: call_lead, pos_ bytes matched
    kDone,       // after <|tool_calls_section_end|>
  };
  // Sets want_ to the index after index_; false when it has too many digits.
  bool next_index();

  const KimiCallGrammar* grammar_;
  Phase phase_ = Phase::kHead;
  uint32_t lo_ = 0, hi_ = 0, pos_ = 0;
  uint32_t fn_ = 0;     // the branch whose head is whole
  bool zero_ = false;   // kIndex: the index is 0 (no digit may follow)
  uint32_t index_ = 0;  // kIndex: the index so far; after it, the call's
  // The index a later call must have, in decimal (want_len_ 0: any).
  std::array<char, kMaxIndexDigits> want_{};
  uint32_t want_len_ = 0;
  uint32_t forbidden_at_ = 0;  // kValue: bytes of `forbidden` the value ends with
  JsonMatcher value_;          // kValue: the arguments so far
};

}  // namespace recur::server
