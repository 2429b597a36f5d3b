// Reasoning and tool-call parsing, whole and streamed: any split of the output into pieces
// gives the same segments as the whole text.
#include <gtest/gtest.h>

#include <memory>
#include <random>

#include "server/output_parser.h"
#include "server/output_test_util.h"

namespace recur::server {
namespace {

using Flat = FlatOutput;

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
  // Clients parse the arguments: a string that holds no JSON is no call (found by fuzz_output),
  // an empty one is a call without arguments.
  const std::string no_json =
      "<tool_call>{\"name\": \"f\", \"arguments\": \"city=Oslo\"}</tool_call>";
  f = parse_whole(chat_opts(false, true), no_json);
  EXPECT_TRUE(f.calls.empty());
  EXPECT_EQ(f.content, no_json);
  f = parse_whole(chat_opts(false, true),
                  "<tool_call>{\"name\": \"f\", \"arguments\": \" \"}</tool_call>");
  ASSERT_EQ(f.calls.size(), 1u);
  EXPECT_EQ(f.calls[0].arguments, "{}");
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

// Whitespace is dropped between calls only: text after a call, or a tag that opens none,
// keeps what follows it, whether it arrives with the tag or on its own (found by fuzz_output).
TEST(OutputParser, TextAfterACallKeepsItsWhitespace) {
  const std::string call = "<tool_call>{\"name\": \"f\"}</tool_call>";
  for (const std::string& tail : {std::string("x<tool_call>\n"), std::string("\n<tool_call> \n")}) {
    const std::string text = call + tail;
    const Flat whole = parse_whole(chat_opts(false, true), text);
    ASSERT_EQ(whole.calls.size(), 1u) << tail;
    EXPECT_EQ(whole.content, tail.substr(tail.find_first_not_of('\n'))) << tail;
    for (size_t cut = call.size(); cut < text.size(); ++cut) {
      expect_same(whole, parse_pieces(chat_opts(false, true), text, {cut}));
    }
  }
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
      "<think>a <tool_call> b</think> <tool_call>\n[1]</tool_call><tool_call> {\"name\": \"x\"}",
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

// ---- Qwen3.5's XML form ----

OutputOptions xml_opts(bool reasoning = true) {
  OutputOptions o = chat_opts(reasoning, true);
  o.tool_format = ToolCallFormat::kXml;
  o.tools = std::make_shared<const ojson>(ojson::parse(R"([
    {"type": "function", "function": {"name": "book", "parameters": {"type": "object",
      "properties": {
        "city": {"type": "string"}, "nights": {"type": "integer"}, "budget": {"type": "number"},
        "pets": {"type": "boolean"}, "note": {"type": ["string", "null"]},
        "rooms": {"type": "array", "items": {"type": "object"}}, "prefs": {"type": "object"},
        "code": {"type": "string"}, "maybe": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        "level": {"enum": ["low", "high"]}}}}},
    {"type": "function", "function": {"name": "ping"}}
  ])"));
  return o;
}

// <tool_call><function=NAME><parameter=K>\nV\n</parameter>…</function></tool_call>
std::string xml_call(const std::string& name,
                     const std::vector<std::pair<std::string, std::string>>& params) {
  std::string s = "<tool_call>\n<function=" + name + ">\n";
  for (const auto& [k, v] : params) s += "<parameter=" + k + ">\n" + v + "\n</parameter>\n";
  return s + "</function>\n</tool_call>";
}

TEST(OutputParserXml, ArgumentsAreTypedFromTheToolSchema) {
  const std::string text = "Booking.\n" + xml_call("book", {{"city", "Paris"},
                                                            {"nights", "3"},
                                                            {"budget", "120.5"},
                                                            {"pets", "true"},
                                                            {"note", "null"},
                                                            {"rooms", "[{\"beds\": 2}]"},
                                                            {"prefs", "{\"floor\": \"high\"}"},
                                                            {"maybe", "7"},
                                                            {"level", "high"},
                                                            {"code", "true"}});
  Flat f = parse_whole(xml_opts(), text);
  EXPECT_EQ(f.content, "Booking.\n");
  ASSERT_EQ(f.calls.size(), 1u);
  EXPECT_EQ(f.calls[0].name, "book");
  EXPECT_EQ(f.calls[0].arguments,
            R"({"city":"Paris","nights":3,"budget":120.5,"pets":true,"note":null,)"
            R"("rooms":[{"beds":2}],"prefs":{"floor":"high"},"maybe":7,"level":"high",)"
            R"("code":"true"})");
  EXPECT_EQ(f.calls[0].id.rfind("call_", 0), 0u);
}

TEST(OutputParserXml, StringValuesAreVerbatim) {
  // Only the newline after <parameter=…> and the one before </parameter> are markup: spaces,
  // further newlines, digits, JSON-looking text and the markers themselves are the value.
  const std::string code = "\n  def f():\n    return \"</tool_call>\" + '<function=x>'\n\n";
  Flat f = parse_whole(xml_opts(), xml_call("book", {{"city", " 42 "},
                                                     {"code", code},
                                                     {"note", "{\"a\": 1}"},
                                                     {"level", "\"quoted\""}}));
  ASSERT_EQ(f.calls.size(), 1u) << f.content;
  const ojson args = ojson::parse(f.calls[0].arguments);
  EXPECT_EQ(args["city"], " 42 ");
  EXPECT_EQ(args["code"], code);
  EXPECT_EQ(args["note"], "{\"a\": 1}");  // string-or-null: a string
  EXPECT_EQ(args["level"], "quoted");     // no type given: JSON when it parses
  EXPECT_EQ(f.content, "");
  // An empty value, and one made of newlines.
  f = parse_whole(xml_opts(),
                  "<tool_call>\n<function=book>\n<parameter=city>\n</parameter>\n"
                  "<parameter=code>\n\n\n\n</parameter>\n</function>\n</tool_call>");
  ASSERT_EQ(f.calls.size(), 1u);
  EXPECT_EQ(f.calls[0].arguments, R"({"city":"","code":"\n\n"})");
}

TEST(OutputParserXml, ValuesThatDoNotFitTheirTypeStayStrings) {
  Flat f = parse_whole(xml_opts(), xml_call("book", {{"nights", "three"},
                                                     {"budget", "12 euros"},
                                                     {"pets", "yes"},
                                                     {"rooms", "{\"beds\": 2}"},
                                                     {"prefs", "not json"},
                                                     {"maybe", "2.5"}}));
  ASSERT_EQ(f.calls.size(), 1u);
  EXPECT_EQ(f.calls[0].arguments,
            R"({"nights":"three","budget":"12 euros","pets":"yes","rooms":"{\"beds\": 2}",)"
            R"("prefs":"not json","maybe":"2.5"})");
  // Around the value, space is not part of a number; 5.0 is an integer; True is a boolean.
  f = parse_whole(
      xml_opts(),
      xml_call("book",
               {{"nights", " 5.0 "}, {"pets", "True"}, {"budget", "-1e3"}, {"maybe", "null"}}));
  ASSERT_EQ(f.calls.size(), 1u);
  EXPECT_EQ(f.calls[0].arguments, R"({"nights":5,"pets":true,"budget":-1000.0,"maybe":null})");
}

TEST(OutputParserXml, UnknownParametersAndToolsWithoutSchemaTakeJsonIfItParses) {
  Flat f = parse_whole(
      xml_opts(),
      xml_call("book", {{"extra", "42"}, {"words", "two words"}}) +
          xml_call("ping",
                   {{"n", "1.5"}, {"flag", "false"}, {"obj", "{\"k\": [1]}"}, {"s", "hi"}}) +
          xml_call("nowhere", {{"x", "null"}}));
  ASSERT_EQ(f.calls.size(), 3u);
  EXPECT_EQ(f.calls[0].arguments, R"({"extra":42,"words":"two words"})");
  EXPECT_EQ(f.calls[1].arguments, R"({"n":1.5,"flag":false,"obj":{"k":[1]},"s":"hi"})");
  EXPECT_EQ(f.calls[2].name, "nowhere");
  EXPECT_EQ(f.calls[2].arguments, R"({"x":null})");
  // No tools at all in the options (a caller that has none to give).
  OutputOptions bare = xml_opts();
  bare.tools = nullptr;
  f = parse_whole(bare, xml_call("book", {{"nights", "2"}, {"city", "Rome"}}));
  ASSERT_EQ(f.calls.size(), 1u);
  EXPECT_EQ(f.calls[0].arguments, R"({"nights":2,"city":"Rome"})");
}

TEST(OutputParserXml, SeveralCallsAndNoArguments) {
  const std::string text = "Two things.\n\n" + xml_call("ping", {}) + "\n\n" +
                           xml_call("book", {{"city", "Oslo"}}) + "\n" +
                           // Two functions in one block, as models sometimes write them.
                           "<tool_call>\n<function=ping>\n</function>\n<function=ping>\n"
                           "<parameter=n>\n2\n</parameter>\n</function>\n</tool_call>\n";
  Flat f = parse_whole(xml_opts(), text);
  EXPECT_EQ(f.content, "Two things.\n\n");
  ASSERT_EQ(f.calls.size(), 4u);
  EXPECT_EQ(f.calls[0].name, "ping");
  EXPECT_EQ(f.calls[0].arguments, "{}");
  EXPECT_EQ(f.calls[1].arguments, R"({"city":"Oslo"})");
  EXPECT_EQ(f.calls[2].arguments, "{}");
  EXPECT_EQ(f.calls[3].arguments, R"({"n":2})");
  for (size_t i = 1; i < f.calls.size(); ++i) EXPECT_NE(f.calls[i].id, f.calls[0].id);
  OutputOptions one = xml_opts();
  one.parallel_tool_calls = false;
  f = parse_whole(one, text);
  ASSERT_EQ(f.calls.size(), 1u);
  EXPECT_EQ(f.calls[0].name, "ping");
  // Lenient where nothing is lost: </function> left out of a closed block.
  f = parse_whole(xml_opts(),
                  "<tool_call><function=ping><parameter=n>\n3\n</parameter></tool_call>");
  ASSERT_EQ(f.calls.size(), 1u);
  EXPECT_EQ(f.calls[0].arguments, R"({"n":3})");
}

TEST(OutputParserXml, CallsInsideThinkAreCalls) {
  const std::string text = "<think>\nI need a room.\n" + xml_call("book", {{"nights", "2"}}) +
                           "\nThen answer.\n</think>\n\nBooked.";
  Flat f = parse_whole(xml_opts(), text);
  EXPECT_EQ(f.reasoning, "I need a room.\nThen answer.");
  EXPECT_EQ(f.content, "Booked.");
  ASSERT_EQ(f.calls.size(), 1u);
  EXPECT_EQ(f.calls[0].arguments, R"({"nights":2})");
  // The prompt opened <think>: same, without the tag; reasoning may end on the call.
  OutputOptions opened = xml_opts();
  opened.start_in_reasoning = true;
  f = parse_whole(opened, "I need a room.\n" + xml_call("book", {{"nights", "2"}}));
  EXPECT_EQ(f.reasoning, "I need a room.\n");
  EXPECT_EQ(f.content, "");
  ASSERT_EQ(f.calls.size(), 1u);
  // A malformed block inside think stays in the reasoning.
  f = parse_whole(opened, "hm <tool_call>oops</tool_call> ok</think>done");
  EXPECT_EQ(f.reasoning, "hm <tool_call>oops</tool_call> ok");
  EXPECT_EQ(f.content, "done");
  EXPECT_TRUE(f.calls.empty());
  // The JSON form too.
  f = parse_whole(chat_opts(true, true),
                  "<think>a\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n"
                  "</tool_call>\nb</think>c");
  EXPECT_EQ(f.reasoning, "a\nb");
  EXPECT_EQ(f.content, "c");
  ASSERT_EQ(f.calls.size(), 1u);
  EXPECT_EQ(f.calls[0].arguments, R"({"x":1})");
}

TEST(OutputParserXml, ThinkOpenedByThePromptOrByTheModel) {
  OutputOptions opened = xml_opts();
  opened.start_in_reasoning = true;
  // The template opened <think>: output starts inside it...
  Flat f = parse_whole(opened, "\nweighing\n</think>\n\nanswer");
  EXPECT_EQ(f.reasoning, "weighing");
  EXPECT_EQ(f.content, "answer");
  // ...and a model that opens it once more is not shown the tag.
  f = parse_whole(opened, "<think>\nweighing\n</think>\n\nanswer");
  EXPECT_EQ(f.reasoning, "weighing");
  EXPECT_EQ(f.content, "answer");
  // Thinking off (the prompt holds <think>\n\n</think>): the model may still open it.
  f = parse_whole(xml_opts(), "<think>x</think>y");
  EXPECT_EQ(f.reasoning, "x");
  EXPECT_EQ(f.content, "y");
}

TEST(OutputParserXml, MalformedCallsAreContentAndParsingGoesOn) {
  const std::vector<std::string> bad = {
      "<tool_call>\n{\"name\": \"book\"}\n</tool_call>",                      // JSON, not XML
      "<tool_call>\n<function=>\n</function>\n</tool_call>",                  // no name
      "<tool_call>\n<function=bo\nok>\n</function>\n</tool_call>",            // name on two lines
      "<tool_call>\n<function=book>\nstray text\n</function>\n</tool_call>",  // text between
      "<tool_call>\n<function=book>\n<parameter=>\nx\n</parameter>\n</function>\n</tool_call>",
      "<tool_call>\n<function=book>\n<parameter=" + std::string(300, 'a') +
          ">\nx\n</parameter>\n</function>\n</tool_call>",  // name too long
      "<tool_call>\n<function=a>\n</function>\n junk</tool_call>",
      "<tool_call></tool_call>",
  };
  for (const std::string& b : bad) {
    const std::string text = "A " + b + " B " + xml_call("ping", {{"n", "1"}}) + " C";
    Flat f = parse_whole(xml_opts(), text);
    EXPECT_EQ(f.content, "A " + b + " B C") << b;
    ASSERT_EQ(f.calls.size(), 1u) << b;
    EXPECT_EQ(f.calls[0].arguments, R"({"n":1})");
  }
}

TEST(OutputParserXml, ATagThatDoesNotOpenACallIsTextAtOnce) {
  // Not held until a </tool_call> that never comes: the thinking ends, the answer follows.
  Flat f = parse_whole(xml_opts(), "<think>I write <tool_call> tags.</think>\n\nAnswer");
  EXPECT_EQ(f.reasoning, "I write <tool_call> tags.");
  EXPECT_EQ(f.content, "Answer");
  EXPECT_TRUE(f.calls.empty());
  OutputParser p(xml_opts(false));
  std::vector<Segment> out;
  p.push("Use <tool_call> tags", &out);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].text, "Use <tool_call> tags");
  // The JSON form: a call's body is an object.
  f = parse_whole(chat_opts(true, true), "<think>a <tool_call> b</think>c <tool_call>[1]");
  EXPECT_EQ(f.reasoning, "a <tool_call> b");
  EXPECT_EQ(f.content, "c <tool_call>[1]");
}

TEST(OutputParserXml, OnlyTheCloseTagEndsAValue) {
  // A value may hold "</tool_call>" (code, say); so a parameter left open runs on to the next
  // </parameter>, and with none the block is text.
  Flat f = parse_whole(xml_opts(),
                       "A <tool_call>\n<function=book>\n<parameter=city>\nParis\n"
                       "</tool_call> B");
  EXPECT_TRUE(f.calls.empty());
  EXPECT_EQ(f.content, "A <tool_call>\n<function=book>\n<parameter=city>\nParis\n</tool_call> B");
  f = parse_whole(xml_opts(),
                  "<tool_call>\n<function=book>\n<parameter=city>\nParis\n"
                  "</tool_call> B <parameter=x>\n</parameter>\n</function>");
  ASSERT_EQ(f.calls.size(), 1u);
  EXPECT_EQ(f.calls[0].arguments, R"({"city":"Paris\n</tool_call> B <parameter=x>"})");
}

TEST(OutputParserXml, UnterminatedCallAtTheEnd) {
  // Complete up to </function>: the call stands without </tool_call>.
  Flat f = parse_whole(xml_opts(),
                       "<tool_call>\n<function=book>\n<parameter=nights>\n4\n"
                       "</parameter>\n</function>\n");
  ASSERT_EQ(f.calls.size(), 1u);
  EXPECT_EQ(f.calls[0].arguments, R"({"nights":4})");
  EXPECT_EQ(f.content, "");
  // Cut off before </function> (max_tokens, say): the text comes back as it was.
  for (const std::string& cut :
       {std::string("<tool_call>\n<function=book>\n<parameter=nights>\n4\n</parameter>\n"),
        std::string("<tool_call>\n<function=book>\n<parameter=nights>\n4"),
        std::string("<tool_call>\n<function=book>\n<parameter=nig"),
        std::string("<tool_call>\n<function=bo"), std::string("<tool_call>")}) {
    f = parse_whole(xml_opts(), "x " + cut);
    EXPECT_TRUE(f.calls.empty()) << cut;
    EXPECT_EQ(f.content, "x " + cut);
  }
  // Inside a think the prompt opened, it goes back to the reasoning.
  OutputOptions opened = xml_opts();
  opened.start_in_reasoning = true;
  f = parse_whole(opened, "r <tool_call>\n<function=book>\n<parameter=nights>\n4");
  EXPECT_EQ(f.reasoning, "r <tool_call>\n<function=book>\n<parameter=nights>\n4");
  EXPECT_TRUE(f.calls.empty());
}

TEST(OutputParserXml, DeepNestingIsNotParsed) {
  // Serializing and templating recurse on nesting: a value nested too deep stays a string.
  const std::string deep = std::string(5000, '[') + std::string(5000, ']');
  Flat f = parse_whole(xml_opts(), xml_call("book", {{"rooms", deep}, {"extra", deep}}));
  ASSERT_EQ(f.calls.size(), 1u);
  const ojson args = ojson::parse(f.calls[0].arguments);
  EXPECT_EQ(args["rooms"], deep);
  EXPECT_EQ(args["extra"], deep);
  // The JSON form: such a call is not a call.
  f = parse_whole(chat_opts(false, true),
                  "<tool_call>{\"name\": \"f\", \"arguments\": " + deep + "}</tool_call>");
  EXPECT_TRUE(f.calls.empty());
}

TEST(OutputParserXml, ForcedPrefixStartsTheCall) {
  EXPECT_EQ(forced_call_prefix(ToolCallFormat::kXml, "book"), "<tool_call>\n<function=book>\n");
  EXPECT_EQ(forced_call_prefix(ToolCallFormat::kXml, ""), "<tool_call>\n<function=");
  EXPECT_EQ(forced_call_prefix(ToolCallFormat::kJson, "f"),
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {");
  EXPECT_EQ(forced_call_prefix(ToolCallFormat::kJson, ""), "<tool_call>\n");
  OutputOptions o = xml_opts();
  o.forced_prefix = forced_call_prefix(ToolCallFormat::kXml, "book");
  Flat f = parse_whole(o, "<parameter=nights>\n1\n</parameter>\n</function>\n</tool_call>");
  ASSERT_EQ(f.calls.size(), 1u);
  EXPECT_EQ(f.calls[0].name, "book");
  EXPECT_EQ(f.calls[0].arguments, R"({"nights":1})");
  EXPECT_EQ(f.content, "");
  // "required": the model names the function; the prompt left <think> open.
  o.start_in_reasoning = true;
  o.forced_prefix = "\n</think>\n\n" + forced_call_prefix(ToolCallFormat::kXml, "");
  f = parse_whole(o, "ping>\n</function>\n</tool_call>");
  ASSERT_EQ(f.calls.size(), 1u);
  EXPECT_EQ(f.calls[0].name, "ping");
  EXPECT_EQ(f.reasoning, "");
}

TEST(OutputParserXml, DetectedFromTheChatTemplate) {
  EXPECT_EQ(detect_tool_call_format("{{ '<tool_call>\\n<function=' + name + '>\\n' }}"
                                    "{{ '<parameter=' + k + '>\\n' }}"),
            ToolCallFormat::kXml);
  EXPECT_EQ(detect_tool_call_format("<tool_call>\n{\"name\": <function-name>, \"arguments\": "
                                    "<args-json-object>}\n</tool_call>"),
            ToolCallFormat::kJson);
  // <function=NAME>{json} alone is another form (Llama's), not this one.
  EXPECT_EQ(detect_tool_call_format("<function=example>{\"a\": 1}</function>"),
            ToolCallFormat::kJson);
  EXPECT_EQ(detect_tool_call_format(""), ToolCallFormat::kJson);
}

TEST(OutputParserXml, AnySplitGivesTheWholeResult) {
  const std::vector<std::string> texts = {
      "<think>\nplan\n" + xml_call("book", {{"nights", "2"}}) + "\nmore\n</think>\n\nSure.\n" +
          xml_call("book", {{"city", "Lyon"}, {"code", "a </tool_call> b\n</parameter"}}) + "\n" +
          xml_call("ping", {}) + "\ntail",
      "plain <tool <function= </parameter> text",
      "x <tool_call>\n<function=book>\n<parameter=city>\nRo",
      "<tool_call>\n<function=ping>\n</function>\n",
      "a <tool_call><function=b\nc></function></tool_call> d " + xml_call("ping", {{"n", "{}"}}),
      "<tool_call>\n<function=book>\n<parameter=" + std::string(300, 'p') + "</tool_call> e",
      "\n\n<think>\n\n</think>\n\n\n" + xml_call("ping", {}) + "\n\n",
      "<think>a <tool_call> b\n</think>\n<tool_call>\n <tool_call><function=ping></function>",
  };
  std::mt19937 rng(11);
  for (bool start_in : {false, true}) {
    OutputOptions o = xml_opts();
    o.start_in_reasoning = start_in;
    for (const auto& text : texts) {
      const Flat whole = parse_whole(o, text);
      // One byte at a time, every single cut, then random multi-cuts.
      std::vector<size_t> bytes;
      for (size_t c = 1; c < text.size(); ++c) bytes.push_back(c);
      expect_same(whole, parse_pieces(o, text, bytes));
      for (size_t c = 0; c <= text.size(); ++c) expect_same(whole, parse_pieces(o, text, {c}));
      for (int trial = 0; trial < 100; ++trial) {
        std::vector<size_t> cuts;
        for (size_t c = 1; c < text.size(); ++c) {
          if (rng() % 4 == 0) cuts.push_back(c);
        }
        expect_same(whole, parse_pieces(o, text, cuts));
      }
    }
  }
  // The first text's split, for the record: the streamed ones must equal it, and it is right.
  const Flat f = parse_whole(xml_opts(), texts[0]);
  EXPECT_EQ(f.reasoning, "plan\nmore");
  EXPECT_EQ(f.content, "Sure.\ntail");
  ASSERT_EQ(f.calls.size(), 3u);
  EXPECT_EQ(f.calls[1].arguments, R"({"city":"Lyon","code":"a </tool_call> b\n</parameter"})");
}

TEST(OutputParserXml, StreamingReleasesACallWhole) {
  OutputParser p(xml_opts(false));
  std::vector<Segment> out;
  p.push("Hi <tool_", &out);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].text, "Hi ");
  out.clear();
  p.push("call>\n<function=ping>\n<parameter=n>\n1\n</parameter>\n</function>\n", &out);
  EXPECT_TRUE(out.empty());
  p.push("</tool_call>", &out);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].kind, Segment::Kind::kToolCall);
  EXPECT_EQ(out[0].call.arguments, R"({"n":1})");
  EXPECT_EQ(p.tool_calls(), 1);
}

}  // namespace
}  // namespace recur::server
