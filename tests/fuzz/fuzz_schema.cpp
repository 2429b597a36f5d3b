// Structured outputs: a JSON schema (or one of a few fixed ones) and text fed to the matcher
// byte by byte. Compiling refuses with a 400 or gives a schema; feeding never crashes or
// recurses without bound; and text the matcher takes whole parses as JSON (a client's
// JSON.parse never fails on a constrained completion).
#include <string>
#include <string_view>

#include "fuzz_targets.h"
#include "server/json_schema.h"

namespace recur::fuzz {

namespace {

const char* kSchemas[] = {
    R"({"type": "object"})",
    R"({"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
        "n": {"type": "integer"}, "tags": {"type": "array", "items": {"enum": ["a", 1, null]},
        "maxItems": 2}}, "required": ["name"], "additionalProperties": false})",
    R"({"anyOf": [{"type": "number"}, {"type": "string", "minLength": 1}, {"type": "null"}]})",
    R"({"$ref": "#/$defs/t", "$defs": {"t": {"type": "object", "properties": {
        "kids": {"type": "array", "items": {"$ref": "#/$defs/t"}}}}}})",
};

}  // namespace

int fuzz_schema(const uint8_t* data, size_t size) {
  std::span<const uint8_t> rest(data, size);
  if (rest.empty()) return 0;
  const uint8_t selector = rest[0];
  rest = rest.subspan(1);
  std::string schema_text;
  if (selector < std::size(kSchemas)) {
    schema_text = kSchemas[selector];
  } else {  // the schema from the input, then the text after a NUL
    const std::span<const uint8_t> piece = take_piece(&rest, 0);
    schema_text.assign(piece.begin(), piece.end());
  }
  const auto schema = server::ojson::parse(schema_text, nullptr, false);
  if (schema.is_discarded()) return 0;
  auto compiled = server::compile_json_schema(schema, "response_format");
  if (!compiled.ok()) {
    FUZZ_CHECK(compiled.error().status == 400 && !compiled.error().message.empty());
    return 0;
  }
  server::JsonMatcher m(compiled->get());
  const std::string_view text(reinterpret_cast<const char*>(rest.data()), rest.size());
  for (size_t i = 0; i < text.size(); ++i) {
    if (!m.feed(uint8_t(text[i]))) return 0;
  }
  if (m.can_end()) {
    FUZZ_CHECK(valid_utf8(text));
    FUZZ_CHECK(!server::ojson::parse(text, nullptr, false).is_discarded());
  }
  return 0;
}

}  // namespace recur::fuzz
