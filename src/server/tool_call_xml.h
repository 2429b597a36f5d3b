// Forced tool calls (tool_choice "required" or a named function) in Qwen3.5's XML call format
// as a grammar that a matcher follows byte by byte, so that constrained decoding
// (json_constraint.h) makes every forced call one the output parser reads as a call of a tool,
// its parameters the tool's and typed as its schema says.
//
// What the model writes after the forced prefix's "<tool_call>\n<function=", as the template
// writes it:
//   HEAD         one function's `NAME>\n`
//   PARAMETER*   `<parameter=PNAME>\n` VALUE `\n</parameter>\n`: PNAME a property of the tool's
//                parameters schema (any name when it lists none), each at most once
//   CLOSE        `</function>\n</tool_call>`, once every required property is given
//   [REPEAT HEAD PARAMETER* CLOSE]…   `\n<tool_call>\n<function=` and another call, when more
//                may follow
// then the end tokens. A VALUE is what the parser types back to a value of the property's
// schema: one of its enum/const texts; JSON of the schema when none of its values is a string
// (numbers, booleans, objects, arrays; no space around it, a number alone at most
// kMaxNumberBytes); else free text (within minLength/maxLength) without `</parameter>`, where
// the parser ends a value. The part the prompt holds (a named call's head) is `primed`.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "server/json_schema.h"

namespace recur::server {

struct XmlCallGrammar {
  // What a parameter's value may be.
  struct Value {
    enum class Kind : uint8_t { kText, kJson, kChoice };
    Kind kind = Kind::kText;
    uint32_t min_chars = 0, max_chars = UINT32_MAX;  // kText: characters, as minLength counts
    std::shared_ptr<const CompiledSchema> schema;    // kJson
    std::vector<std::string> choices;                // kChoice: sorted, distinct, without '\n'
  };
  struct Param {
    std::string head;  // `PNAME>\n`
    Value value;
  };
  struct Function {
    std::string head;  // `NAME>\n`
    // Sorted by head, distinct (at most kMaxParams); empty with free_names.
    std::vector<Param> params;
    bool free_names = false;  // the schema lists no properties: any name goes
    uint64_t required = 0;    // bits of params
  };
  static constexpr size_t kMaxParams = 64;  // a tool with more listed takes any names

  std::vector<Function> functions;             // sorted by head, distinct
  std::string primed;                          // the text before generation (in the prompt)
  std::string repeat;                          // opens another call; empty: one call only
  std::string forbidden = "</parameter>";      // what no value holds
  std::shared_ptr<const CompiledSchema> idle;  // the JSON matcher's schema between JSON values
};

// The grammar of a forced call among `tools` (chat's shape, validated): `name` the function
// named by tool_choice, or empty for "required" (any of them; with `more_calls`, several). Tools
// whose name, and properties whose name, the XML form cannot carry (a '<', '>' or newline,
// space at either end) are left out; null when no tool is left.
std::shared_ptr<const XmlCallGrammar> xml_call_grammar(const ojson& tools, std::string_view name,
                                                       bool more_calls);

// Follows generated text against an XmlCallGrammar, with JsonMatcher's interface
// (json_constraint masks with either). Fixed size: feeding a byte and copying never allocate.
class XmlCallMatcher {
 public:
  static constexpr int kMaxFreeNames = 32;   // parameters of a tool that takes any names
  static constexpr uint32_t kMaxName = 256;  // bytes of a free name (the parser's limit)
  // Bytes of a JSON value that is a number alone: an integer of 19 fits 64 bits, as the parser
  // needs to read it back as an integer.
  static constexpr uint32_t kMaxNumberBytes = 19;

  explicit XmlCallMatcher(const XmlCallGrammar* grammar);  // `primed` fed
  // False (and the state unchanged) when no text that continues with `b` can match.
  bool feed(uint8_t b);
  bool feed(std::string_view bytes);  // false at the first byte refused (state then partial)
  // Whether the text so far is whole calls (the end tokens may come).
  bool can_end() const;
  // In free text, the characters it may still take (INT_MAX: no limit); in a JSON value,
  // JsonMatcher::free_string_room; else -1. A string-safe token holding `forbidden` whole is
  // not covered: the constraint checks those apart.
  int free_string_room() const;
  void copy_from(const XmlCallMatcher& other);

 private:
  enum class Phase : uint8_t {
    kFunction,    // a function's head: functions [lo_, hi_) share its first pos_ bytes
    kTag,         // `<parameter=` or `</function>…`, pos_ bytes of their common '<' matched
    kKeyword,     // `<parameter=`, pos_ bytes matched
    kName,        // a listed parameter's head: params [lo_, hi_) share its first pos_ bytes
    kFreeName,    // a name of pos_ bytes so far (name_hash_)
    kFreeNameNl,  // after a free name's '>'
    kText,        // a free text value
    kJson,        // a JSON value (value_)
    kChoice,      // one of the choices [lo_, hi_), pos_ bytes matched
    kParamClose,  // `\n</parameter>\n`, pos_ bytes matched
    kClose,       // `</function>\n</tool_call>`, pos_ bytes matched
    kRepeat,      // `repeat`, pos_ bytes matched
  };
  const XmlCallGrammar::Function& function() const { return grammar_->functions[fn_]; }
  bool param_may_come() const;
  bool close_may_come() const;
  void begin_value(const XmlCallGrammar::Value* value);  // null: free text without limits
  bool text_byte(uint8_t b);

  const XmlCallGrammar* grammar_;
  Phase phase_ = Phase::kFunction;
  uint32_t lo_ = 0, hi_ = 0, pos_ = 0;
  uint32_t fn_ = 0;                                    // the function whose head is whole
  uint64_t given_ = 0;                                 // its listed parameters given
  const XmlCallGrammar::Value* value_spec_ = nullptr;  // kText, kJson, kChoice
  // kText: characters so far (kJson: bytes); bytes of `forbidden` they end with; whether the
  // last byte was a newline, and whether one came before that match (the template's, ahead of
  // `</parameter>`).
  uint32_t chars_ = 0, forbidden_at_ = 0;
  bool last_nl_ = false, match_nl_ = false;
  bool root_number_ = false;                                 // kJson: the value is a number alone
  uint8_t utf8_left_ = 0, utf8_lo_ = 0x80, utf8_hi_ = 0xBF;  // kText, kFreeName
  uint64_t name_hash_ = 0;                                   // kFreeName
  int n_seen_ = 0;                                           // free names given
  std::array<uint64_t, kMaxFreeNames> seen_{};               // their hashes
  JsonMatcher value_;                                        // kJson
};

}  // namespace recur::server
