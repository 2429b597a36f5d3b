// Reasoning and tool-call parsing, whole and streamed: any split of the output into pieces
// gives the same segments as the whole text.
#include <gtest/gtest.h>

#include <random>

#include "server/output_parser.h"

namespace recur::server {
namespace {

struct Flat {
  std::string content, reasoning;
  std::vector<ToolCall> calls;
};

Flat flatten(const std::vector<Segment>& segs) {
  Flat f;
  for (const auto& s : segs) {
    if (s.kind == Segment::Kind::kContent) f.content += s.text;
    if (s.kind == Segment::Kind::kReasoning) f.reasoning += s.text;
    if (s.kind == Segment::Kind::kToolCall) f.calls.push_back(s.call);
  }
  return f;
}

Flat parse_whole(const OutputOptions& o, std::string_view text) {
  OutputParser p(o);
  std::vector<Segment> out;
  p.push(text, &out);
  p.finish(&out);
  return flatten(out);
}

Flat parse_pieces(const OutputOptions& o, std::string_view text, const std::vector<size_t>& cuts) {
  OutputParser p(o);
  std::vector<Segment> out;
  size_t at = 0;
  for (size_t c : cuts) {
    p.push(text.substr(at, c - at), &out);
    at = c;
  }
  p.push(text.substr(at), &out);
  p.finish(&out);
  return flatten(out);
}

OutputOptions chat_opts(bool reasoning, bool tools) {
  OutputOptions o;
  o.parse_reasoning = reasoning;
  o.parse_tools = tools;
  return o;
}

void expect_same(const Flat& a, const Flat& b) {
  EXPECT_EQ(a.content, b.content);
  EXPECT_EQ(a.reasoning, b.reasoning);
  ASSERT_EQ(a.calls.size(), b.calls.size());
  for (size_t i = 0; i < a.calls.size(); ++i) {
    EXPECT_EQ(a.calls[i].name, b.calls[i].name);
    EXPECT_EQ(a.calls[i].arguments, b.calls[i].arguments);
  }
}

TEST(OutputParser, PlainContentPassesThrough) {
  Flat f = parse_whole(chat_opts(true, true), "Hello <b>world</b> <tool");
  EXPECT_EQ(f.content, "Hello <b>world</b> <tool");
  EXPECT_TRUE(f.reasoning.empty());
  EXPECT_TRUE(f.calls.empty());
}

TEST(OutputParser, ThinkBlockBecomesReasoning) {
  Flat f =
      parse_whole(chat_opts(true, false), "<think>\nLet me see.\n</think>\n\nThe answer is 4.");
  EXPECT_EQ(f.reasoning, "Let me see.");
  EXPECT_EQ(f.content, "The answer is 4.");
}

TEST(OutputParser, TemplateOpenedThinkMeansReasoningUntilClose) {
  OutputOptions o = chat_opts(true, false);
  o.start_in_reasoning = true;
  Flat f = parse_whole(o, "pondering</think>\n\ndone");
  EXPECT_EQ(f.reasoning, "pondering");
  EXPECT_EQ(f.content, "done");
  // Cut off while still thinking: all of it is reasoning.
  f = parse_whole(o, "still pondering");
  EXPECT_EQ(f.reasoning, "still pondering");
  EXPECT_EQ(f.content, "");
}

TEST(OutputParser, ThinkOnlyRecognisedAtTheStart) {
  Flat f = parse_whole(chat_opts(true, false), "Answer: <think>x</think>");
  EXPECT_EQ(f.content, "Answer: <think>x</think>");
  EXPECT_TRUE(f.reasoning.empty());
}

TEST(OutputParser, ReasoningOffKeepsTagsInContent) {
  Flat f = parse_whole(chat_opts(false, false), "<think>a</think>b");
  EXPECT_EQ(f.content, "<think>a</think>b");
}

TEST(OutputParser, ToolCallsAreParsed) {
  const std::string text =
      "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
      "\"Paris\", \"unit\": \"c\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", "
      "\"arguments\": {}}\n</tool_call>";
  Flat f = parse_whole(chat_opts(true, true), text);
  EXPECT_EQ(f.content, "Let me check.\n");
  ASSERT_EQ(f.calls.size(), 2u);
  EXPECT_EQ(f.calls[0].name, "get_weather");
  EXPECT_EQ(f.calls[0].arguments, R"({"city":"Paris","unit":"c"})");  // key order kept
  EXPECT_EQ(f.calls[1].name, "get_time");
  EXPECT_EQ(f.calls[1].arguments, "{}");
  EXPECT_EQ(f.calls[0].id.rfind("call_", 0), 0u);
  EXPECT_NE(f.calls[0].id, f.calls[1].id);
}

TEST(OutputParser, ArgumentsGivenAsAStringStayThatString) {
  Flat f =
      parse_whole(chat_opts(false, true),
                  "<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}</tool_call>");
  ASSERT_EQ(f.calls.size(), 1u);
  EXPECT_EQ(f.calls[0].arguments, "{\"a\": 1}");
}

TEST(OutputParser, InvalidToolCallIsContent) {
  Flat f = parse_whole(chat_opts(false, true), "x<tool_call>not json</tool_call>y");
  EXPECT_EQ(f.content, "x<tool_call>not json</tool_call>y");
  EXPECT_TRUE(f.calls.empty());
  f = parse_whole(chat_opts(false, true), "<tool_call>{\"arguments\": {}}</tool_call>");
  EXPECT_TRUE(f.calls.empty());  // no name
}

TEST(OutputParser, UnterminatedToolCallAtTheEnd) {
  Flat f = parse_whole(chat_opts(false, true),
                       "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 2}}\n");
  ASSERT_EQ(f.calls.size(), 1u);
  EXPECT_EQ(f.calls[0].arguments, R"({"x":2})");
  f = parse_whole(chat_opts(false, true), "<tool_call>\n{\"name\": \"f\", \"argu");
  EXPECT_TRUE(f.calls.empty());
  EXPECT_EQ(f.content, "<tool_call>\n{\"name\": \"f\", \"argu");
}

TEST(OutputParser, ToolsOffLeavesTagsInContent) {
  Flat f = parse_whole(chat_opts(true, false), "<tool_call>{\"name\": \"f\"}</tool_call>");
  EXPECT_TRUE(f.calls.empty());
  EXPECT_EQ(f.content, "<tool_call>{\"name\": \"f\"}</tool_call>");
}

TEST(OutputParser, NoParallelCallsKeepsTheFirst) {
  OutputOptions o = chat_opts(false, true);
  o.parallel_tool_calls = false;
  Flat f = parse_whole(
      o, "<tool_call>{\"name\": \"a\"}</tool_call><tool_call>{\"name\": \"b\"}</tool_call>");
  ASSERT_EQ(f.calls.size(), 1u);
  EXPECT_EQ(f.calls[0].name, "a");
}

TEST(OutputParser, ForcedPrefixIsReadButNotEmitted) {
  OutputOptions o = chat_opts(true, true);
  o.forced_prefix = "<tool_call>\n{\"name\": \"f\", \"arguments\": {";
  Flat f = parse_whole(o, "\"q\": 1}}\n</tool_call>");
  ASSERT_EQ(f.calls.size(), 1u);
  EXPECT_EQ(f.calls[0].name, "f");
  EXPECT_EQ(f.calls[0].arguments, R"({"q":1})");
  EXPECT_EQ(f.content, "");
  // A template that opened <think>: the prefix closes it first.
  o.start_in_reasoning = true;
  o.forced_prefix = "\n</think>\n\n<tool_call>\n";
  f = parse_whole(o, "{\"name\": \"g\", \"arguments\": {}}</tool_call>");
  ASSERT_EQ(f.calls.size(), 1u);
  EXPECT_EQ(f.calls[0].name, "g");
  EXPECT_EQ(f.reasoning, "");
}

TEST(OutputParser, ReasoningThenToolCall) {
  Flat f = parse_whole(chat_opts(true, true),
                       "<think>need weather</think>\n\n<tool_call>\n{\"name\": \"w\", "
                       "\"arguments\": {\"c\": \"X\"}}\n</tool_call>");
  EXPECT_EQ(f.reasoning, "need weather");
  EXPECT_EQ(f.content, "");
  ASSERT_EQ(f.calls.size(), 1u);
}

TEST(OutputParser, StreamingHoldsBackPartialMarkers) {
  OutputParser p(chat_opts(true, true));
  std::vector<Segment> out;
  p.push("<thi", &out);
  EXPECT_TRUE(out.empty());
  p.push("nk>abc</thi", &out);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].kind, Segment::Kind::kReasoning);
  EXPECT_EQ(out[0].text, "abc");
  out.clear();
  p.push("nk>Hi <tool_", &out);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].text, "Hi ");
  out.clear();
  p.push("call>{\"name\": \"f\"}", &out);
  EXPECT_TRUE(out.empty());  // a call is released whole
  p.push("</tool_call>", &out);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].kind, Segment::Kind::kToolCall);
  EXPECT_EQ(out[0].call.arguments, "{}");
}

TEST(OutputParser, AnySplitGivesTheWholeResult) {
  const std::vector<std::string> texts = {
      "<think>\nplan: call\n</think>\n\nSure.\n<tool_call>\n{\"name\": \"a\", \"arguments\": "
      "{\"k\": [1, 2]}}\n</tool_call>\n<tool_call>\n{\"name\": \"b\", \"arguments\": {}}\n"
      "</tool_call>",
      "no markers at all, just text < > </ <t",
      "<think>unfinished thought",
      "  <think>x</think>y<tool_call>bad</tool_call>z",
      "text <tool_call>{\"name\": \"c\", \"arguments\": {\"s\": \"</tool\"}}</tool_call> tail",
      "\n\n<think>\n\n</think>\n\n\n",
  };
  std::mt19937 rng(7);
  for (bool start_in : {false, true}) {
    OutputOptions o = chat_opts(true, true);
    o.start_in_reasoning = start_in;
    for (const auto& text : texts) {
      const Flat whole = parse_whole(o, text);
      // Every single cut, then random multi-cuts.
      for (size_t c = 0; c <= text.size(); ++c) expect_same(whole, parse_pieces(o, text, {c}));
      for (int trial = 0; trial < 200; ++trial) {
        std::vector<size_t> cuts;
        for (size_t c = 1; c < text.size(); ++c) {
          if (rng() % 3 == 0) cuts.push_back(c);
        }
        expect_same(whole, parse_pieces(o, text, cuts));
      }
    }
  }
}

TEST(MatchedStop, TheStopThatCompletesFirst) {
  EXPECT_EQ(matched_stop("hello world", {"xyz", "wor", "o w"}), "o w");
  EXPECT_EQ(matched_stop("abc", {"abc", "ab"}), "ab");
  EXPECT_EQ(matched_stop("abc", {"zz"}), "");
  EXPECT_EQ(matched_stop("abc", {}), "");
}

}  // namespace
}  // namespace recur::server
