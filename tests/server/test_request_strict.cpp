// Strict request input: unknown top-level fields (and the switch that accepts them), numbers
// out of range named as such, chat-template failures as the model directory's 5xx; and the
// translations of the OpenAI Responses API and Anthropic count_tokens, checked against the chat
// requests they must equal. Uses the shipped model's real tokenizer and chat template.
#include <gtest/gtest.h>

#include "request_test_util.h"
#include "server/request.h"

namespace recur::server {
namespace {

const ChatFixture& fx() {
  return chat_fixture(kRealVocabModel);
}

ServingContext ctx() {
  return tiny_context(fx());
}

TEST(Strict, UnknownTopLevelFieldsAreRefusedByName) {
  const ServingContext c = ctx();
  auto chat = parse_chat_request(
      J(R"({"messages": [{"role": "user", "content": "x"}], "max_token": 2})"), c);
  ASSERT_FALSE(chat.ok());
  EXPECT_EQ(chat.error().status, 400);
  EXPECT_EQ(chat.error().param, "max_token");
  EXPECT_EQ(chat.error().code, "unknown_parameter");
  EXPECT_NE(chat.error().message.find("did you mean 'max_tokens'?"), std::string::npos)
      << chat.error().message;
  auto far = parse_completion_request(J(R"({"prompt": "x", "frobnicate": true})"), c);
  ASSERT_FALSE(far.ok());
  EXPECT_EQ(far.error().param, "frobnicate");
  EXPECT_EQ(far.error().message.find("did you mean"), std::string::npos);  // nothing near
  auto messages = parse_messages_request(
      J(R"({"max_tokens": 2, "messages": [{"role": "user", "content": "x"}], "stop": ["a"]})"), c);
  ASSERT_FALSE(messages.ok());
  EXPECT_EQ(messages.error().param, "stop");  // Anthropic's is stop_sequences
  auto responses = parse_responses_request(J(R"({"input": "x", "max_tokens": 2})"), c);
  ASSERT_FALSE(responses.ok());
  EXPECT_EQ(responses.error().param, "max_tokens");  // the Responses API's is max_output_tokens
  auto count = count_message_tokens(
      J(R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 5})"), c);
  ASSERT_FALSE(count.ok());
  EXPECT_EQ(count.error().param, "max_tokens");

  // Fields every endpoint knows pass: sampling extensions, priority, metadata fields.
  EXPECT_TRUE(parse_chat_request(J(R"({"messages": [{"role": "user", "content": "x"}],
      "user": "u", "store": false, "metadata": {}, "priority": 0, "min_p": 0.1, "top_k": 5})"),
                                 c)
                  .ok());

  ServingContext lax = ctx();
  lax.allow_unknown_fields = true;
  EXPECT_TRUE(parse_chat_request(
                  J(R"({"messages": [{"role": "user", "content": "x"}], "max_token": 2})"), lax)
                  .ok());
}

TEST(Strict, OutOfRangeNumbersSaySo) {
  const ServingContext c = ctx();
  for (const char* body :
       {R"({"prompt": "x", "max_tokens": 1e20})",
        R"({"prompt": "x", "max_tokens": 18446744073709551616})",
        R"({"prompt": "x", "max_tokens": 0})", R"({"prompt": "x", "temperature": 101})",
        R"({"prompt": "x", "top_p": 2})"}) {
    auto r = parse_completion_request(J(body), c);
    ASSERT_FALSE(r.ok()) << body;
    EXPECT_NE(r.error().message.find("is out of range"), std::string::npos)
        << body << ": " << r.error().message;
  }
  auto frac = parse_completion_request(J(R"({"prompt": "x", "max_tokens": 1.5})"), c);
  ASSERT_FALSE(frac.ok());
  EXPECT_NE(frac.error().message.find("must be an integer"), std::string::npos);
}

TEST(Strict, ATemplateThatFailsIsTheModelDirectorysFault) {
  auto broken =
      ChatTemplate::from_string("{% for m in messages %}{{ m.content + 1 }}{% endfor %}", "", "");
  ASSERT_TRUE(broken.ok());
  ServingContext c = ctx();
  c.chat_template = &*broken;
  const ojson body = J(R"({"messages": [{"role": "user", "content": "x"}]})");
  auto r = parse_chat_request(body, c);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().status, 500);
  EXPECT_EQ(r.error().type, "server_error");
  EXPECT_EQ(r.error().code, "chat_template_error");
  EXPECT_NE(r.error().message.find("fault of the model directory"), std::string::npos)
      << r.error().message;

  // raise_exception() speaks to the caller: still a 400.
  auto raising = ChatTemplate::from_string("{{ raise_exception('only one message') }}", "", "");
  ASSERT_TRUE(raising.ok());
  c.chat_template = &*raising;
  r = parse_chat_request(body, c);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().status, 400);
  EXPECT_EQ(r.error().message, "only one message");

  // A template that did not even load.
  c.chat_template = nullptr;
  c.chat_template_error = "unsupported: chat template line 1: the filter 'x' is not supported";
  r = parse_chat_request(body, c);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().status, 500);
  EXPECT_EQ(r.error().code, "chat_template_error");
  EXPECT_NE(r.error().message.find("the filter 'x'"), std::string::npos);
  c.chat_template_error.clear();  // no template at all: use /v1/completions (400)
  EXPECT_EQ(parse_chat_request(body, c).error().status, 400);
}

TEST(Strict, ReasoningEffortSwitchesThinking) {
  const ServingContext c = ctx();
  auto off = parse_chat_request(
      J(R"({"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "none"})"), c);
  auto kwargs = parse_chat_request(J(R"({"messages": [{"role": "user", "content": "x"}],
      "chat_template_kwargs": {"enable_thinking": false}})"),
                                   c);
  ASSERT_TRUE(off.ok() && kwargs.ok());
  EXPECT_EQ(off->prompts[0], kwargs->prompts[0]);
  EXPECT_FALSE(parse_chat_request(J(R"({"messages": [{"role": "user", "content": "x"}],
      "reasoning_effort": "max"})"),
                                  c)
                   .ok());
}

TEST(Responses, InputItemsRenderAsTheEquivalentChat) {
  const ServingContext c = ctx();
  auto resp = parse_responses_request(J(R"({
      "instructions": "Be brief.", "max_output_tokens": 7, "temperature": 0.5,
      "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
      "input": [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Call the tool."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "21 C"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Thanks"}]}
      ]})"),
                                      c);
  ASSERT_TRUE(resp.ok()) << resp.error().message;
  auto chat = parse_chat_request(J(R"({
      "max_tokens": 7, "temperature": 0.5,
      "tools": [{"type": "function", "function": {"name": "get_weather",
                                                  "parameters": {"type": "object"}}}],
      "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Call the tool.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
        {"role": "user", "content": "Thanks"}
      ]})"),
                                 c);
  ASSERT_TRUE(chat.ok()) << chat.error().message;
  EXPECT_EQ(resp->prompts[0], chat->prompts[0]);
  EXPECT_EQ(resp->engine.max_tokens, 7);
  EXPECT_FLOAT_EQ(resp->engine.sampling.temperature, 0.5f);
  EXPECT_TRUE(resp->output.parse_tools);
  EXPECT_EQ(resp->response_echo["instructions"], "Be brief.");
  EXPECT_EQ(resp->response_echo["tools"][0]["name"], "get_weather");
  EXPECT_EQ(resp->response_echo["temperature"], 0.5);

  for (const char* bad : {R"({"input": "x", "previous_response_id": "resp_1"})",
                          R"({"input": [{"type": "item_reference", "id": "msg_1"}]})",
                          R"({"input": [{"role": "user", "content": [{"type": "input_image"}]}]})",
                          R"({"input": "x", "tools": [{"type": "web_search"}]})",
                          R"({"input": "x", "text": {"format": {"type": "json_schema"}}})",
                          R"({"input": "x", "tool_choice": "required"})", R"({"input": []})",
                          R"({})", R"({"input": "x", "background": true})"}) {
    auto r = parse_responses_request(J(bad), c);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.error().status, 400) << bad;
  }
}

// A function tool in each API's shape (description and schema included) renders as the chat
// tool; a schema that is not an object, and a tool_choice its tools cannot satisfy, are 400s
// naming the field, alike in chat, Responses and Messages.
TEST(Tools, EveryApisFunctionToolIsTheChatTool) {
  const ServingContext c = ctx();
  const char* messages = R"("messages": [{"role": "user", "content": "Weather?"}])";
  auto chat = parse_chat_request(J(fmt::format(R"({{"max_tokens": 5, {}, "tools": [
      {{"type": "function", "function": {{"name": "get_weather",
        "description": "Weather for a city", "parameters": {{"type": "object"}}}}}}]}})",
                                               messages)
                                       .c_str()),
                                 c);
  ASSERT_TRUE(chat.ok()) << chat.error().message;
  EXPECT_NE(fx().tok.decode(chat->prompts[0]).find("Weather for a city"), std::string::npos);
  auto resp = parse_responses_request(J(R"({"max_output_tokens": 5, "input": "Weather?",
      "tools": [{"type": "function", "name": "get_weather", "description": "Weather for a city",
                 "parameters": {"type": "object"}}]})"),
                                      c);
  ASSERT_TRUE(resp.ok()) << resp.error().message;
  EXPECT_EQ(resp->prompts[0], chat->prompts[0]);
  auto anthropic = parse_messages_request(
      J(fmt::format(R"({{"model": "tiny", "max_tokens": 5, {}, "tools": [{{"name": "get_weather",
        "description": "Weather for a city", "input_schema": {{"type": "object"}}}}]}})",
                    messages)
            .c_str()),
      c);
  ASSERT_TRUE(anthropic.ok()) << anthropic.error().message;
  EXPECT_NE(fx().tok.decode(anthropic->prompts[0]).find("Weather for a city"), std::string::npos);

  auto resp_bad = parse_responses_request(
      J(R"({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": 3}]})"), c);
  ASSERT_FALSE(resp_bad.ok());
  EXPECT_EQ(resp_bad.error().param, "tools[0].parameters");
  EXPECT_EQ(resp_bad.error().message, "'tools[0].parameters' must be an object");
  auto anthropic_bad = parse_messages_request(
      J(R"({"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
            "tools": [{"name": "f", "input_schema": []}]})"),
      c);
  ASSERT_FALSE(anthropic_bad.ok());
  EXPECT_EQ(anthropic_bad.error().param, "tools[0].input_schema");
  EXPECT_EQ(anthropic_bad.error().message, "'tools[0].input_schema' must be an object");

  struct Bad {
    const char* chat_choice;
    const char* responses_choice;
    const char* messages_choice;
    const char* message;
  };
  for (const Bad& b :
       {Bad{R"({"type": "function", "function": {"name": "nope"}})",
            R"({"type": "function", "name": "nope"})", R"({"type": "tool", "name": "nope"})",
            "'tool_choice' names \"nope\", which is not in 'tools'"},
        Bad{R"("required")", R"("required")", R"({"type": "any"})",
            "'tool_choice' asks for a tool call but 'tools' is empty"}}) {
    const bool with_tools = std::string_view(b.message).find("nope") != std::string_view::npos;
    const std::string chat_tools =
        with_tools ? R"(, "tools": [{"type": "function", "function": {"name": "f"}}])" : "";
    const std::string resp_tools =
        with_tools ? R"(, "tools": [{"type": "function", "name": "f"}])" : "";
    const std::string messages_tools = with_tools ? R"(, "tools": [{"name": "f"}])" : "";
    auto r = parse_chat_request(
        J(fmt::format(R"({{{}{}, "tool_choice": {}}})", messages, chat_tools, b.chat_choice)
              .c_str()),
        c);
    ASSERT_FALSE(r.ok()) << b.message;
    EXPECT_EQ(r.error().param, "tool_choice");
    EXPECT_EQ(r.error().message, b.message);
    r = parse_responses_request(
        J(fmt::format(R"({{"input": "x"{}, "tool_choice": {}}})", resp_tools, b.responses_choice)
              .c_str()),
        c);
    ASSERT_FALSE(r.ok()) << b.message;
    EXPECT_EQ(r.error().param, "tool_choice");
    EXPECT_EQ(r.error().message, b.message);
    r = parse_messages_request(
        J(fmt::format(R"({{"model": "tiny", "max_tokens": 5, {}{}, "tool_choice": {}}})", messages,
                      messages_tools, b.messages_choice)
              .c_str()),
        c);
    ASSERT_FALSE(r.ok()) << b.message;
    EXPECT_EQ(r.error().param, "tool_choice");
    EXPECT_EQ(r.error().message, b.message);
  }
}

TEST(CountTokens, EqualsThePromptOfTheMessagesRequest) {
  const ServingContext c = ctx();
  const char* prompt = R"("model": "tiny", "system": "Be brief.",
      "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
      "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
      "tool_choice": {"type": "tool", "name": "get_weather"})";
  auto n = count_message_tokens(J(fmt::format("{{{}}}", prompt).c_str()), c);
  auto full =
      parse_messages_request(J(fmt::format(R"({{"max_tokens": 5, {}}})", prompt).c_str()), c);
  ASSERT_TRUE(n.ok()) << n.error().message;
  ASSERT_TRUE(full.ok()) << full.error().message;
  EXPECT_EQ(*n, int64_t(full->prompts[0].size()));
  EXPECT_GT(*n, 20);
}

}  // namespace
}  // namespace recur::server
