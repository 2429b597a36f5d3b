// Kimi's tool-call sections, whole and streamed: calls keep the model's id
// (functions.NAME:INDEX), several calls share one section, calls may come while thinking, and
// any malformed section comes back as the text it was, with nothing lost or reordered.
#include <gtest/gtest.h>

#include <random>

#include "server/output_parser.h"
#include "server/output_test_util.h"

namespace recur::server {
namespace {

constexpr std::string_view kOpen = "<|tool_calls_section_begin|>";
constexpr std::string_view kClose = "<|tool_calls_section_end|>";

std::string call(std::string_view id, std::string_view args) {
  return "<|tool_call_begin|>" + std::string(id) + "<|tool_call_argument_begin|>" +
         std::string(args) + "<|tool_call_end|>";
}

std::string section(std::initializer_list<std::string> calls) {
  std::string s(kOpen);
  for (const std::string& c : calls) s += c;
  return s + std::string(kClose);
}

OutputOptions kimi(bool reasoning = false) {
  OutputOptions o;
  o.parse_tools = true;
  o.parse_reasoning = reasoning;
  o.tool_format = ToolCallFormat::kKimi;
  return o;
}

// Kimi's call ids are the model's: they take part in the comparison.
struct Flat : FlatOutput {
  bool operator==(const Flat& o) const {
    if (content != o.content || reasoning != o.reasoning || calls.size() != o.calls.size()) {
      return false;
    }
    for (size_t i = 0; i < calls.size(); ++i) {
      if (calls[i].id != o.calls[i].id || calls[i].name != o.calls[i].name ||
          calls[i].arguments != o.calls[i].arguments) {
        return false;
      }
    }
    return true;
  }
};

// The text pushed in pieces cut at `cuts` (none: whole).
Flat parse(const OutputOptions& o, std::string_view text, const std::vector<size_t>& cuts = {}) {
  OutputParser p(o);
  std::vector<Segment> out;
  size_t at = 0;
  for (size_t c : cuts) {
    p.push(text.substr(at, c - at), &out);
    at = c;
  }
  p.push(text.substr(at), &out);
  p.finish(&out);
  return Flat{flatten(out)};
}

// Whole, every single cut, and random multi-cut splits give the same result.
Flat parse_all_ways(const OutputOptions& o, std::string_view text) {
  const Flat whole = parse(o, text);
  for (size_t c = 1; c < text.size(); ++c) {
    EXPECT_TRUE(parse(o, text, {c}) == whole) << "cut at " << c << " of " << text;
  }
  std::mt19937 rng(7);
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<size_t> cuts;
    for (size_t c = 1; c < text.size(); ++c) {
      if (rng() % 5 == 0) cuts.push_back(c);
    }
    EXPECT_TRUE(parse(o, text, cuts) == whole) << "trial " << trial << " of " << text;
  }
  return whole;
}

TEST(OutputParserKimi, SectionBecomesCallsWithTheModelsIds) {
  std::string text = "Checking both.\n";
  text += section({call("functions.get_weather:0", R"({"city": "Paris", "days": 2})"),
                   std::string("\n").append(call("functions.get_time:1", "{}"))});
  text += "\n";
  const Flat f = parse_all_ways(kimi(), text);
  EXPECT_EQ(f.content, "Checking both.\n");
  ASSERT_EQ(f.calls.size(), 2u);
  EXPECT_EQ(f.calls[0].id, "functions.get_weather:0");
  EXPECT_EQ(f.calls[0].name, "get_weather");
  EXPECT_EQ(f.calls[0].arguments, R"({"city":"Paris","days":2})");
  EXPECT_EQ(f.calls[1].id, "functions.get_time:1");
  EXPECT_EQ(f.calls[1].name, "get_time");
  EXPECT_EQ(f.calls[1].arguments, "{}");
}

TEST(OutputParserKimi, IdsWithoutThePrefixAndNamesWithDots) {
  const Flat f = parse_all_ways(
      kimi(), section({call("search:3", R"({"q": "x"})"), call("functions.mcp.fetch:12", "{}")}));
  ASSERT_EQ(f.calls.size(), 2u);
  EXPECT_EQ(f.calls[0].name, "search");
  EXPECT_EQ(f.calls[1].name, "mcp.fetch");
  EXPECT_EQ(f.calls[1].id, "functions.mcp.fetch:12");
}

TEST(OutputParserKimi, OnlyTheFirstCallWithoutParallelCalls) {
  OutputOptions o = kimi();
  o.parallel_tool_calls = false;
  const Flat f =
      parse(o, section({call("functions.a:0", "{}"), call("functions.b:1", R"({"x": 1})")}));
  ASSERT_EQ(f.calls.size(), 1u);
  EXPECT_EQ(f.calls[0].name, "a");
}

TEST(OutputParserKimi, CallsWhileThinkingAndReasoningAround) {
  const std::string text =
      std::string("<think>I need the weather.\n")
          .append(section({call("functions.get_weather:0", R"({"city": "Oslo"})")}))
          .append("</think>It is raining.");
  const Flat f = parse_all_ways(kimi(true), text);
  EXPECT_EQ(f.reasoning, "I need the weather.\n");  // as before a <tool_call> of Qwen's
  EXPECT_EQ(f.content, "It is raining.");
  ASSERT_EQ(f.calls.size(), 1u);
  EXPECT_EQ(f.calls[0].arguments, R"({"city":"Oslo"})");
}

TEST(OutputParserKimi, CutOffAfterCompleteCallsStillGivesThem) {
  // max_tokens or a stop ended the output before <|tool_calls_section_end|>.
  Flat f = parse_all_ways(kimi(), std::string(kOpen) + call("functions.f:0", R"({"a": 1})"));
  ASSERT_EQ(f.calls.size(), 1u);
  EXPECT_EQ(f.content, "");
}

TEST(OutputParserKimi, MalformedSectionsComeBackAsText) {
  const std::vector<std::string> bad = {
      // Arguments not JSON, or JSON but not an object.
      section({call("functions.f:0", "{not json")}),
      section({call("functions.f:0", "[1, 2]")}),
      // No argument marker, no index, an empty name, a name with a space.
      std::string(kOpen) + "<|tool_call_begin|>functions.f:0{}<|tool_call_end|>" +
          std::string(kClose),
      section({call("functions.f", "{}")}),
      section({call("functions.:0", "{}")}),
      section({call("functions.a b:0", "{}")}),
      // Text where a call should begin, text after the calls, an empty section.
      std::string(kOpen) + "hello" + std::string(kClose),
      section({call("functions.f:0", "{}"), "trailing words"}),
      section({}),
      // Cut off inside a call.
      std::string(kOpen) + "<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{\"a\"",
      // Nested too deep to be handled.
      section({call("functions.f:0", std::string(5000, '[') + std::string(5000, ']'))}),
  };
  for (const std::string& body : bad) {
    const std::string text = std::string("before ").append(body).append(" after");
    const Flat f = parse_all_ways(kimi(), text);
    EXPECT_TRUE(f.calls.empty()) << text.substr(0, 200);
    EXPECT_EQ(f.content, text) << text.substr(0, 200);
  }
}

TEST(OutputParserKimi, OtherFormatsMarkersAreText) {
  // A Kimi model writing <tool_call>: text; a Qwen model writing Kimi's section: text.
  const std::string qwen = R"(<tool_call>{"name": "f", "arguments": {}}</tool_call>)";
  EXPECT_EQ(parse(kimi(), qwen).content, qwen);
  OutputOptions json;
  json.parse_tools = true;
  const std::string kimi_text = section({call("functions.f:0", "{}")});
  EXPECT_EQ(parse(json, kimi_text).content, kimi_text);
}

TEST(OutputParserKimi, FormatAndForcedPrefixesComeFromTheTemplate) {
  EXPECT_EQ(detect_tool_call_format("{{ '<|tool_calls_section_begin|>' }}<|tool_call_begin|>"),
            ToolCallFormat::kKimi);
  EXPECT_EQ(detect_tool_call_format("<tool_call>"), ToolCallFormat::kJson);
  EXPECT_EQ(forced_call_prefix(ToolCallFormat::kKimi, "get_weather"),
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:");
  EXPECT_EQ(forced_call_prefix(ToolCallFormat::kKimi, ""),
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.");
  // The model finishes a forced call: its index, then the arguments.
  OutputOptions o = kimi();
  o.forced_prefix = forced_call_prefix(ToolCallFormat::kKimi, "get_weather");
  const Flat f = parse(o, R"(0<|tool_call_argument_begin|>{"city": "Rome"}<|tool_call_end|>)"
                          "<|tool_calls_section_end|>");
  ASSERT_EQ(f.calls.size(), 1u);
  EXPECT_EQ(f.calls[0].id, "functions.get_weather:0");
  EXPECT_EQ(f.calls[0].arguments, R"({"city":"Rome"})");
  EXPECT_EQ(f.content, "");
}

}  // namespace
}  // namespace recur::server
