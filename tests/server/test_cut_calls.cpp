// A forced tool call that the output ends before it is whole (max_tokens) comes back as that
// call, cut, in each tool-call format, and never as the forced prefix's markup; its arguments
// are what the model wrote of them, cut, never made-up whole JSON ("{}"). Anthropic's input,
// which must be an object, closes them where what was written is whole (close_json_object).
#include <gtest/gtest.h>

#include "server/output_parser.h"
#include "server/output_test_util.h"

namespace recur::server {
namespace {

std::vector<Segment> parse(const OutputOptions& o, std::string_view text) {
  OutputParser p(o);
  std::vector<Segment> out;
  p.push(text, &out);
  p.finish(&out);
  return out;
}

OutputOptions forced(ToolCallFormat format, std::string_view name) {
  OutputOptions o;
  o.parse_tools = true;
  o.tool_format = format;
  o.forced_prefix = forced_call_prefix(format, name);
  return o;
}

TEST(CloseJsonObject, ClosesWhereTheTextIsWhole) {
  struct Case {
    const char* cut;
    const char* closed;
  };
  for (const Case& c : {
           Case{R"({)", R"({})"},
           Case{R"({"city": "Par)", R"({"city": "Par"})"},
           Case{R"({"city": "Paris", "da)", R"({"city": "Paris"})"},
           Case{R"({"city": "Paris", "days":)", R"({"city": "Paris"})"},
           Case{R"({"days": 3)", R"({})"},  // 3 may go on (30)
           Case{R"({"days": 3, "x)", R"({"days": 3})"},
           Case{R"({"a": [1, 2, {"b": tr)", R"({"a": [1, 2, {}]})"},
           Case{R"({"a": "x\)", R"({"a": "x"})"},  // an escape cut mid-way is left out
           Case{R"({"a": "x\u00)", R"({"a": "x"})"},
           Case{R"({"a": {"b": "c"}}}  trailing)", R"({"a": {"b": "c"}})"},
       }) {
    SCOPED_TRACE(c.cut);
    const auto closed = close_json_object(c.cut);
    ASSERT_TRUE(closed.has_value());
    EXPECT_EQ(*closed, c.closed);
  }
  EXPECT_FALSE(close_json_object("").has_value());
  EXPECT_FALSE(close_json_object("[1, 2]").has_value());
  EXPECT_FALSE(close_json_object("ol\xc3\xa1").has_value());
}

TEST(WrittenJson, TheValueAsWrittenUpToItsEnd) {
  EXPECT_EQ(written_json(R"(  {"a": "}", "b": [1, {"c": "\"]"}]}} trailing)"),
            R"({"a": "}", "b": [1, {"c": "\"]"}]})");
  EXPECT_EQ(written_json("{\n\n\n\"/>"), "{\n\n\n\"/>");  // cut: all of it
  EXPECT_EQ(written_json(R"({"a": "x\)"), R"({"a": "x\)");
  EXPECT_EQ(written_json(R"("s" x)"), R"("s")");
  EXPECT_EQ(written_json("ol\xc3\xa1 }"), "ol\xc3\xa1 }");  // no JSON: as written
  EXPECT_EQ(written_json(" \n"), "");
}

TEST(CutCalls, AForcedJsonCallCutByTheEndIsTheCall) {
  // Named: the prefix wrote the name and the arguments' '{'; the model got this far.
  auto out = parse(forced(ToolCallFormat::kJson, "get_weather"), R"("city": "Par)");
  FlatOutput f = flatten(out);
  ASSERT_EQ(f.calls.size(), 1u);
  EXPECT_EQ(f.calls[0].name, "get_weather");
  EXPECT_EQ(f.calls[0].arguments, R"({"city": "Par)");
  EXPECT_TRUE(f.calls[0].cut);
  EXPECT_EQ(f.content, "");
  // Noise that is no JSON: as written too.
  f = flatten(parse(forced(ToolCallFormat::kJson, "get_weather"), "ol\xc3\xa1 !!"));
  ASSERT_EQ(f.calls.size(), 1u);
  EXPECT_EQ(f.calls[0].arguments, "{ol\xc3\xa1 !!");
  EXPECT_EQ(f.content, "");
  // tool_choice required: the model names the tool; cut once the name is whole.
  f = flatten(parse(forced(ToolCallFormat::kJson, ""), R"({"name": "get_time", "arguments": {"z)"));
  ASSERT_EQ(f.calls.size(), 1u);
  EXPECT_EQ(f.calls[0].name, "get_time");
  EXPECT_EQ(f.calls[0].arguments, R"({"z)");
  // Cut inside a key (found by fuzzing: this was "{}", a whole call with no arguments).
  f = flatten(
      parse(forced(ToolCallFormat::kJson, ""), "{\"name\": \"get\", \"arguments\": {\n\n\n\"/>"));
  ASSERT_EQ(f.calls.size(), 1u);
  EXPECT_EQ(f.calls[0].arguments, "{\n\n\n\"/>");
  // Cut before the arguments: none were written.
  f = flatten(parse(forced(ToolCallFormat::kJson, ""), R"({"name": "get_time", )"));
  ASSERT_EQ(f.calls.size(), 1u);
  EXPECT_EQ(f.calls[0].arguments, "");
  // Garbled after whole arguments: the arguments end where their object does.
  f = flatten(parse(forced(ToolCallFormat::kJson, "f"), "\"a\": 1}} x\n</tool_call>"));
  ASSERT_EQ(f.calls.size(), 1u);
  EXPECT_TRUE(f.calls[0].cut);
  EXPECT_EQ(f.calls[0].arguments, R"({"a": 1})");
  // A whole call is not cut.
  f = flatten(parse(forced(ToolCallFormat::kJson, "f"), "\"a\": 1}}\n</tool_call>"));
  ASSERT_EQ(f.calls.size(), 1u);
  EXPECT_FALSE(f.calls[0].cut);
}

TEST(CutCalls, WhatCannotBeTheCallIsTheModelsTextWithoutTheForcedMarkup) {
  // tool_choice required, and the model wrote no call: its text, without <tool_call>.
  FlatOutput f = flatten(parse(forced(ToolCallFormat::kJson, ""), "ol\xc3\xa1 !!"));
  EXPECT_TRUE(f.calls.empty());
  EXPECT_EQ(f.content, "ol\xc3\xa1 !!");
  f = flatten(parse(forced(ToolCallFormat::kJson, ""), R"({"name": "get_ti)"));
  EXPECT_TRUE(f.calls.empty());
  EXPECT_EQ(f.content, R"({"name": "get_ti)");
  // Split anywhere, the same.
  const std::string text = R"({"name": "get_ti)";
  for (size_t cut = 0; cut <= text.size(); ++cut) {
    OutputParser p(forced(ToolCallFormat::kJson, ""));
    std::vector<Segment> out;
    p.push(std::string_view(text).substr(0, cut), &out);
    p.push(std::string_view(text).substr(cut), &out);
    p.finish(&out);
    EXPECT_EQ(flatten(out).content, text) << cut;
  }
}

TEST(CutCalls, XmlAndKimiCallsCutByTheEnd) {
  FlatOutput f = flatten(parse(forced(ToolCallFormat::kXml, "get_weather"),
                               "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3"));
  ASSERT_EQ(f.calls.size(), 1u);
  EXPECT_EQ(f.calls[0].name, "get_weather");
  EXPECT_EQ(f.calls[0].arguments, R"({"city":"Paris")");  // the whole parameters, left open
  EXPECT_TRUE(f.calls[0].cut);
  EXPECT_EQ(f.content, "");

  f = flatten(parse(forced(ToolCallFormat::kKimi, "get_weather"),
                    R"(0<|tool_call_argument_begin|>{"city": "Par)"));
  ASSERT_EQ(f.calls.size(), 1u);
  EXPECT_EQ(f.calls[0].id, "functions.get_weather:0");
  EXPECT_EQ(f.calls[0].arguments, R"({"city": "Par)");
  // Cut before the call's index: the name is still known; no arguments were written.
  f = flatten(parse(forced(ToolCallFormat::kKimi, "get_weather"), ""));
  ASSERT_EQ(f.calls.size(), 1u);
  EXPECT_EQ(f.calls[0].name, "get_weather");
  EXPECT_EQ(f.calls[0].arguments, "");
}

TEST(CutCalls, OnlyTheForcedCallIsCut) {
  // Without a forced prefix, a call the output cut is the text it was (as before).
  OutputOptions o;
  o.parse_tools = true;
  FlatOutput f = flatten(parse(o, "<tool_call>\n{\"name\": \"f\", \"arguments\": {"));
  EXPECT_TRUE(f.calls.empty());
  EXPECT_EQ(f.content, "<tool_call>\n{\"name\": \"f\", \"arguments\": {");
}

}  // namespace
}  // namespace recur::server
