// Qwen3.5-style chat (tests/data/qwen3_5-chat-tiny): the template renders tools, XML tool calls,
// tool results and the thinking switch; the server reads the XML form off that template, forces
// calls in it, and parses back exactly the calls the template writes.
#include <gtest/gtest.h>

#include "request_test_util.h"
#include "server/output_parser.h"
#include "server/request.h"

namespace recur::server {
namespace {

const std::string kXmlModel = std::string(RECUR_SOURCE_DIR) + "/tests/data/qwen3_5-chat-tiny";
const ChatFixture& fx() {
  return chat_fixture(kXmlModel);
}

ServingContext ctx() {
  ServingContext c = tiny_context(fx());
  c.tool_format = detect_tool_call_format(fx().tmpl.source());
  return c;
}

const char* kTools = R"([{"type": "function", "function": {"name": "get_weather",
  "description": "Weather for a city", "parameters": {"type": "object", "properties": {
  "city": {"type": "string"}, "days": {"type": "integer"}, "hourly": {"type": "boolean"},
  "units": {"type": "object"}}}}}])";

std::string render(const ojson& request) {
  auto text = fx().tmpl.render(request);
  EXPECT_TRUE(text.ok()) << text.error().to_string();
  return text.ok() ? *text : std::string();
}

TEST(ChatXmlTools, FormatIsReadOffTheTemplate) {
  EXPECT_EQ(detect_tool_call_format(fx().tmpl.source()), ToolCallFormat::kXml);
  auto json_template = ChatTemplate::load(kRealVocabModel);
  ASSERT_TRUE(json_template.ok());
  EXPECT_EQ(detect_tool_call_format(json_template->source()), ToolCallFormat::kJson);
}

TEST(ChatXmlTools, TemplateRendersToolsCallsResultsAndThinking) {
  ojson req = ojson::parse(R"({"messages": [
      {"role": "system", "content": "Be brief."},
      {"role": "user", "content": "Weather in Paris?"},
      {"role": "assistant", "content": "", "reasoning_content": "Ask the tool.",
       "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather",
         "arguments": {"city": "Paris", "days": 2, "units": {"temp": "C"}}}}]},
      {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
      {"role": "tool", "tool_call_id": "c2", "content": "22 C"}],
    "add_generation_prompt": true})");
  req["tools"] = ojson::parse(kTools);
  const std::string text = render(req);
  EXPECT_EQ(text.rfind("<|im_start|>system\nBe brief.\n\n# Tools\n", 0), 0u) << text;
  EXPECT_NE(text.find("\n<tools>\n{\"name\": \"get_weather\", \"description\": "),
            std::string::npos);
  EXPECT_NE(text.find("<|im_start|>assistant\n<think>\nAsk the tool.\n</think>\n\n"
                      "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                      "<parameter=days>\n2\n</parameter>\n<parameter=units>\n{\"temp\": \"C\"}\n"
                      "</parameter>\n</function>\n</tool_call><|im_end|>\n"),
            std::string::npos)
      << text;
  // Results of one round of calls share one user turn.
  EXPECT_NE(text.find("<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
                      "<tool_response>\n22 C\n</tool_response><|im_end|>\n"),
            std::string::npos)
      << text;
  // Thinking on by default: the generation prompt opens <think>; off: an empty one.
  EXPECT_TRUE(text.ends_with("<|im_start|>assistant\n<think>\n")) << text;
  req["chat_template_kwargs"] = {{"enable_thinking", false}};
  EXPECT_TRUE(render(req).ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
  // Without tools: no tool section; reasoning of turns before the last user message is dropped.
  ojson plain = ojson::parse(R"({"messages": [
      {"role": "user", "content": "a"},
      {"role": "assistant", "content": "<think>old thoughts</think>b"},
      {"role": "user", "content": "c"}], "add_generation_prompt": false})");
  EXPECT_EQ(render(plain),
            "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nb<|im_end|>\n"
            "<|im_start|>user\nc<|im_end|>\n");
}

TEST(ChatXmlTools, ParserReadsBackTheCallsTheTemplateWrites) {
  const ojson args = ojson::parse(
      R"({"city": "New York\nNY", "days": 3, "hourly": false, "units": {"temp": "F"}})");
  ojson req = ojson::parse(R"({"messages": [{"role": "user", "content": "q"}],
                               "add_generation_prompt": false})");
  req["messages"].push_back(
      {{"role", "assistant"},
       {"content", ""},
       {"tool_calls",
        {{{"type", "function"}, {"function", {{"name", "get_weather"}, {"arguments", args}}}},
         {{"type", "function"}, {"function", {{"name", "get_weather"}, {"arguments", args}}}}}}});
  const std::string text = render(req);
  const size_t start = text.find("<tool_call>");
  const size_t end = text.rfind("</tool_call>");
  ASSERT_NE(start, std::string::npos) << text;
  OutputOptions o;
  o.parse_tools = true;
  o.tool_format = ToolCallFormat::kXml;
  o.tools = std::make_shared<const ojson>(ojson::parse(kTools));
  OutputParser p(o);
  std::vector<Segment> out;
  p.push(std::string_view(text).substr(start, end + 12 - start), &out);
  p.finish(&out);
  ASSERT_EQ(out.size(), 2u);
  for (const Segment& s : out) {
    ASSERT_EQ(s.kind, Segment::Kind::kToolCall);
    EXPECT_EQ(s.call.name, "get_weather");
    EXPECT_EQ(ojson::parse(s.call.arguments), args);
  }
}

TEST(ChatXmlTools, ForcedCallsUseTheXmlForm) {
  auto body = [](const std::string& extra) {
    return ojson::parse(R"({"messages": [{"role": "user", "content": "hi"}], "tools": )" +
                        std::string(kTools) + extra + "}");
  };
  auto r = parse_chat_request(body(""), ctx());
  ASSERT_TRUE(r.ok()) << r.error().message;
  EXPECT_TRUE(r->output.parse_tools);
  EXPECT_EQ(r->output.tool_format, ToolCallFormat::kXml);
  EXPECT_TRUE(r->output.start_in_reasoning);
  ASSERT_TRUE(r->output.tools);
  EXPECT_EQ((*r->output.tools)[0]["function"]["name"], "get_weather");
  EXPECT_TRUE(r->output.forced_prefix.empty());

  // The template opened <think>: the forced call closes it first.
  r = parse_chat_request(
      body(R"(, "tool_choice": {"type": "function", "function": {"name": "get_weather"}})"), ctx());
  ASSERT_TRUE(r.ok()) << r.error().message;
  EXPECT_EQ(r->output.forced_prefix, "\n</think>\n\n<tool_call>\n<function=get_weather>\n");
  EXPECT_TRUE(fx().tok.decode(r->prompts[0])
                  .ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n"
                             "<function=get_weather>\n"));
  r = parse_chat_request(body(R"(, "tool_choice": "required",
                                   "chat_template_kwargs": {"enable_thinking": false})"),
                         ctx());
  ASSERT_TRUE(r.ok()) << r.error().message;
  EXPECT_FALSE(r->output.start_in_reasoning);
  EXPECT_EQ(r->output.forced_prefix, "<tool_call>\n<function=");

  // Anthropic: tools arrive as input_schema, and are typed the same way.
  auto m = parse_messages_request(ojson::parse(R"({"model": "tiny", "max_tokens": 5,
      "messages": [{"role": "user", "content": "hi"}],
      "tools": [{"name": "get_weather", "input_schema": {"type": "object",
                 "properties": {"days": {"type": "integer"}}}}],
      "tool_choice": {"type": "tool", "name": "get_weather"}})"),
                                  ctx());
  ASSERT_TRUE(m.ok()) << m.error().message;
  EXPECT_EQ(m->output.forced_prefix, "\n</think>\n\n<tool_call>\n<function=get_weather>\n");
  OutputParser p(m->output, "toolu_");
  std::vector<Segment> out;
  p.push("<parameter=days>\n4\n</parameter>\n</function>\n</tool_call>", &out);
  p.finish(&out);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].call.arguments, R"({"days":4})");
  EXPECT_EQ(out[0].call.id.rfind("toolu_", 0), 0u);
}

}  // namespace
}  // namespace recur::server
