// Generated text through the reasoning and tool-call parser, in each chat format: the text cut
// into pieces (as tokens stream) splits as the whole text does, and what a client receives is
// valid UTF-8 and JSON whenever the model's text was valid UTF-8.
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_targets.h"
#include "server/json_fields.h"
#include "server/output_parser.h"
#include "server/output_test_util.h"

namespace recur::fuzz {

namespace {

using server::Segment;

// Parameters of every type a schema can give an XML argument.
const char* kTools = R"([{"type": "function", "function": {"name": "f", "parameters": {
  "type": "object", "properties": {"s": {"type": "string"}, "i": {"type": "integer"},
  "n": {"type": "number"}, "b": {"type": "boolean"}, "o": {"type": "object"},
  "a": {"type": "array"}, "u": {"type": ["integer", "null"]},
  "e": {"enum": ["x", "y"]}, "any": {"anyOf": [{"type": "number"}, {"type": "string"}]}}}}}])";

using Flat = server::FlatOutput;

Flat parse(const server::OutputOptions& o, std::string_view text, size_t piece) {
  server::OutputParser p(o);
  std::vector<Segment> out;
  for (size_t at = 0; at < text.size(); at += piece) p.push(text.substr(at, piece), &out);
  p.finish(&out);
  return server::flatten(out);
}

// Prints both sides of a mismatch before the check aborts.
bool same(const std::string& whole, const std::string& split, const char* what) {
  if (whole == split) return true;
  std::fprintf(stderr, "%s, whole text: [%s]\n%s, in pieces: [%s]\n", what, whole.c_str(), what,
               split.c_str());
  return false;
}

}  // namespace

int fuzz_output(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const uint8_t flags = data[0];
  const size_t piece = 1 + data[1] % 16;
  const std::string_view text(reinterpret_cast<const char*>(data + 2), size - 2);

  static const auto tools = std::make_shared<const server::ojson>(server::ojson::parse(kTools));
  server::OutputOptions o;
  o.tool_format = flags % 3 == 0   ? server::ToolCallFormat::kJson
                  : flags % 3 == 1 ? server::ToolCallFormat::kXml
                                   : server::ToolCallFormat::kKimi;
  o.parse_reasoning = flags & 0x04;
  o.start_in_reasoning = o.parse_reasoning && (flags & 0x08);
  o.parse_tools = flags & 0x10;
  o.parallel_tool_calls = !(flags & 0x20);
  if (flags & 0x40) o.tools = tools;
  if (flags & 0x80) o.forced_prefix = server::forced_call_prefix(o.tool_format, "f");

  const Flat whole = parse(o, text, text.size() + 1);
  const Flat split = parse(o, text, piece);
  FUZZ_CHECK(same(whole.content, split.content, "content"));
  FUZZ_CHECK(same(whole.reasoning, split.reasoning, "reasoning"));
  FUZZ_CHECK(whole.calls.size() == split.calls.size());
  for (size_t i = 0; i < whole.calls.size(); ++i) {
    FUZZ_CHECK(same(whole.calls[i].name, split.calls[i].name, "name"));
    FUZZ_CHECK(same(whole.calls[i].arguments, split.calls[i].arguments, "arguments"));
    // Kimi's ids are the model's; the others are drawn at random.
    if (o.tool_format == server::ToolCallFormat::kKimi) {
      FUZZ_CHECK(whole.calls[i].id == split.calls[i].id);
    }
  }
  if (!o.parallel_tool_calls) FUZZ_CHECK(whole.calls.size() <= 1);
  for (const server::ToolCall& c : whole.calls) {
    FUZZ_CHECK(!c.id.empty());
    // Clients JSON.parse the arguments.
    FUZZ_CHECK(!server::ojson::parse(c.arguments, nullptr, false).is_discarded());
  }
  if (valid_utf8(text)) {
    FUZZ_CHECK(valid_utf8(whole.content) && valid_utf8(whole.reasoning));
    for (const server::ToolCall& c : whole.calls) {
      FUZZ_CHECK(valid_utf8(c.id) && valid_utf8(c.name) && valid_utf8(c.arguments));
    }
  }
  return 0;
}

}  // namespace recur::fuzz
