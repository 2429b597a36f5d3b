// Structured outputs: a JSON schema compiled into nodes, and a matcher that follows generated
// text byte by byte and says whether it can still become a JSON value the schema accepts.
// The matcher's state is a few small stacks in fixed arrays: feeding a byte, copying the
// state and asking whether it may end never allocate.
#pragma once

#include <array>
#include <climits>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "server/api_error.h"
#include "server/json_fields.h"

namespace recur::server {

struct SchemaNode {
  enum class Kind : uint8_t { kObject, kArray, kString, kNumber, kInteger, kLiterals, kAnyOf };
  Kind kind = Kind::kLiterals;
  // kObject: its properties (names as JSON string text between the quotes), the bit of each
  // required one, and the node of any other name (-1: none allowed).
  std::vector<std::string> names;
  std::vector<int> props;
  uint64_t required = 0;
  int additional = -1;
  // kArray: the node of its items and their number.
  int items = -1;
  int min_items = 0, max_items = INT_MAX;
  // kString: its length in characters (an escape counts as one).
  int min_length = 0, max_length = INT_MAX;
  // kLiterals: the JSON texts it may be (enum, const, true, false, null), compact.
  std::vector<std::string> literals;
  // kAnyOf: the nodes it may be, none of them an anyOf (nested ones are listed through).
  std::vector<int> options;
  // The fewest objects and arrays a value of it nests, itself included (JsonMatcher::kMaxDepth
  // + 1: more, or no finite value at all): the matcher starts no value that could not end.
  int min_depth = 0;
  // Objects: the largest min_depth of a property's or another name's value (the matcher checks
  // each property's fit only where this one would not).
  int deepest_value = 0;
};

struct CompiledSchema {
  std::vector<SchemaNode> nodes;
  int root = 0;
};

// The limits a schema must keep (a 400 names the one it breaks).
inline constexpr int kMaxSchemaNodes = 4096;
inline constexpr int kMaxSchemaProperties = 64;  // per object
inline constexpr int kMaxSchemaLiterals = 64;    // per enum
inline constexpr int kMaxLiteralBytes = 256;
// The options a value may start as, counted through nested anyOfs and $refs.
inline constexpr int kMaxSchemaAlternatives = 256;

// Compiles `schema` (type, properties, required, additionalProperties, items, minItems,
// maxItems, minLength, maxLength, enum, const, anyOf, oneOf (as anyOf), $ref to #/$defs or
// #/definitions; annotations such as title, description, default, examples and format are
// ignored). A keyword that constrains values in a way not listed is refused by name rather
// than ignored, and so is a schema whose values all nest deeper than JsonMatcher::kMaxDepth.
// `field` names the request field for errors.
ApiResult<std::shared_ptr<const CompiledSchema>> compile_json_schema(const ojson& schema,
                                                                     const std::string& field);

// The values an enum or const schema allows: every keyword applies, so only const's when it has
// both, and of its type when it names one ({"type": "string", "enum": [1, "a"]}: "a"). Empty
// when none is, or the schema has neither keyword.
ojson allowed_values(const ojson& schema);
// Any JSON object (response_format {"type": "json_object"}).
std::shared_ptr<const CompiledSchema> any_json_object_schema();

// Follows text byte by byte against a compiled schema: one JSON value, with whitespace before,
// between its tokens (at most kMaxGap bytes in a row) and after it.
class JsonMatcher {
 public:
  // All alternatives' stacks together (start_ indexes them in a byte).
  static constexpr int kMaxFrames = 240;
  // Ways an anyOf is still open: a discriminated union's shapes all are until its tag is written.
  static constexpr int kMaxAlternatives = 32;
  static constexpr int kMaxDepth = 32;        // nesting of objects and arrays
  static constexpr int kMaxGap = 20;          // whitespace bytes in a row
  static constexpr int kMaxNumberBytes = 40;  // and two exponent digits

  explicit JsonMatcher(const CompiledSchema* schema);
  // Starts over, before any text, against `schema` (no allocation).
  void reset(const CompiledSchema* schema);
  // False (and the state unchanged) when no text that continues with `b` can match.
  bool feed(uint8_t b);
  bool feed(std::string_view bytes);  // false at the first byte refused (state then partial)
  // Whether the text so far is a whole value the schema accepts.
  bool can_end() const;
  // When every alternative is inside a string between characters (a value string, or an
  // object key that may be any name): how many characters more any of them takes (INT_MAX
  // without a limit), which any text free of '"', '\\', control characters and partial UTF-8
  // of at most that many characters continues; else -1.
  int free_string_room() const;
  void copy_from(const JsonMatcher& other);  // copies only the frames in use

  struct Frame {
    uint16_t node = 0;
    uint8_t kind = 0;   // FrameKind
    uint8_t phase = 0;  // per kind
    uint8_t gap = 0;    // whitespace bytes in the current gap
    uint8_t esc = 0;    // strings: 1 after '\', 2-5 hex digits of \u left + 1
    uint8_t lo = 0x80;  // strings: the range of the next UTF-8 continuation byte
    uint8_t hi = 0xBF;  //   (utf8_left > 0)
    uint8_t utf8_left = 0;
    bool low_next = false;  // strings: a \u escape of a high surrogate wants its low half next
    uint16_t hex = 0;       // strings: the \u escape's digits so far
    bool free_key = false;  // object keys: a name outside the properties may be typed
    int16_t key = -1;       // objects: the property whose value comes next (-1: another)
    uint16_t pos = 0;       // literals and keys: bytes matched
    uint32_t count = 0;     // arrays: items; strings: characters; numbers: bytes
    uint64_t cand = 0;      // literals / keys: candidates still matching
    uint64_t seen = 0;      // objects: properties given
  };

 private:
  struct Stack;
  // Feeds b to one alternative's stack, passing each stack it becomes to emit (an anyOf may
  // make several; a refused byte none).
  void apply(Stack& s, uint8_t b);
  void emit(const Stack& s);

  const CompiledSchema* schema_;
  // The alternatives' stacks, one after another: stack i is frames_[start_[i], start_[i+1]).
  std::array<Frame, kMaxFrames> frames_;
  std::array<uint8_t, kMaxAlternatives + 1> start_{};
  int n_alt_ = 0;
  // The next state while a byte is fed.
  std::array<Frame, kMaxFrames> next_frames_;
  std::array<uint8_t, kMaxAlternatives + 1> next_start_{};
  int next_alt_ = 0;
};

}  // namespace recur::server
