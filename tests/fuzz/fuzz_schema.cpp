// Structured outputs: a JSON schema (or one of a few fixed ones) and text fed to the matcher
// byte by byte. Compiling refuses with a 400 or gives a schema; feeding never crashes or
// recurses without bound; and text the matcher takes whole parses as JSON (a client's
// JSON.parse never fails on a constrained completion). With the selector's high bit, the text
// goes as Qwen's tokens through the constraint, whose mask must then keep exactly the tokens
// its allows() admits (its fast paths against the matcher), sampled.
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_targets.h"
#include "server/json_constraint.h"
#include "server/json_schema.h"
#include "server/request_test_util.h"

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

// The text as tokens through a constraint of the schema, then its mask against allows().
void check_mask(const std::shared_ptr<const server::CompiledSchema>& schema, std::string_view text,
                uint32_t seed) {
  const server::ChatFixture& fx = server::chat_fixture(server::kRealVocabModel);
  const Tokenizer* tok = &fx.tok;
  const int32_t eos = 151645;  // <|im_end|>
  auto con = server::json_constraint(schema, fx.vocab, {eos}, "")->start();
  auto ids = tok->encode(text);
  if (!ids.ok()) return;
  for (int32_t id : *ids) {
    if (!con->allows(id)) return;
    con->accept(id);
  }
  const int V = tok->vocab_size();
  std::vector<float> logits(static_cast<size_t>(V), 0.0f);
  con->mask(logits);
  size_t kept = 0;
  for (float l : logits) kept += l == 0.0f;
  FUZZ_CHECK(kept > 0);  // a way on, or the end
  // Tokens spread over the vocabulary, and the last ones (the special tokens).
  for (int i = 0; i < 400; ++i) {
    seed = seed * 1664525u + 1013904223u;
    const int32_t id = i < 64 ? V - 64 + i : int32_t(seed % uint32_t(V));
    FUZZ_CHECK((logits[size_t(id)] == 0.0f) == con->allows(id));
  }
}

}  // namespace

int fuzz_schema(const uint8_t* data, size_t size) {
  std::span<const uint8_t> rest(data, size);
  if (rest.empty()) return 0;
  const uint8_t selector = rest[0] & 0x7F;
  const bool mask = rest[0] & 0x80;
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
  const std::string_view text(reinterpret_cast<const char*>(rest.data()), rest.size());
  if (mask) check_mask(*compiled, text, uint32_t(size) * 2654435761u);
  server::JsonMatcher m(compiled->get());
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
