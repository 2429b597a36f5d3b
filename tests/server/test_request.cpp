// Request validation: every field's type and range, prompts in all their shapes, context
// limits, defaults from generation_config.json, chat rendering with tools and thinking, and the
// Anthropic translation. Uses the shipped model's real tokenizer and chat template.
#include <gtest/gtest.h>

#include "request_test_util.h"
#include "server/request.h"

namespace recur::server {
namespace {

const ChatFixture& fx() {
  return chat_fixture(kRealVocabModel);
}

ServingContext ctx(int max_context = 4096) {
  ServingContext c = tiny_context(fx(), max_context);
  c.generation.do_sample = true;
  c.generation.temperature = 0.7f;
  c.generation.top_k = 20;
  c.generation.top_p = 0.8f;
  return c;
}

// The status and param of a rejected request.
void expect_error(const ApiResult<ParsedRequest>& r, int status, const std::string& param) {
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().status, status) << r.error().message;
  EXPECT_EQ(r.error().param, param) << r.error().message;
  EXPECT_FALSE(r.error().message.empty());
}

TEST(ParseBody, RejectsWhatIsNotAJsonObject) {
  EXPECT_FALSE(parse_body("").ok());
  EXPECT_FALSE(parse_body("{").ok());
  EXPECT_FALSE(parse_body("[1, 2]").ok());
  EXPECT_FALSE(parse_body("\"text\"").ok());
  EXPECT_FALSE(parse_body("{\"a\": \"\xff\xfe\"}").ok());      // invalid UTF-8
  EXPECT_FALSE(parse_body("{\"a\": \"\xed\xa0\x80\"}").ok());  // a UTF-16 surrogate
  EXPECT_FALSE(parse_body("{\"a\": 1} trailing").ok());
  EXPECT_EQ(parse_body("{").error().status, 400);
  std::string deep = "{\"a\": " + std::string(100, '[') + std::string(100, ']') + "}";
  EXPECT_FALSE(parse_body(deep).ok());
  // Brackets inside strings are text, not nesting.
  std::string in_string = "{\"a\": \"" + std::string(1000, '[') + "\"}";
  EXPECT_TRUE(parse_body(in_string).ok());
  EXPECT_TRUE(parse_body("{\"a\": [[[1]]]}").ok());
}

TEST(Completions, DefaultsComeFromGenerationConfig) {
  auto r = parse_completion_request(J(R"({"prompt": "Hello there"})"), ctx());
  ASSERT_TRUE(r.ok()) << r.error().message;
  EXPECT_FLOAT_EQ(r->engine.sampling.temperature, 0.7f);
  EXPECT_EQ(r->engine.sampling.top_k, 20);
  EXPECT_FLOAT_EQ(r->engine.sampling.top_p, 0.8f);
  EXPECT_FALSE(r->max_tokens_given);
  EXPECT_FALSE(r->stream);
  EXPECT_EQ(r->n, 1);
  ASSERT_EQ(r->prompts.size(), 1u);
  EXPECT_EQ(r->prompts[0], fx().tok.encode("Hello there").value());
  EXPECT_EQ(r->engine.sampling.logprobs, -1);

  ServingContext greedy = ctx();
  greedy.generation.do_sample = false;
  r = parse_completion_request(J(R"({"prompt": "x"})"), greedy);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->engine.sampling.temperature, 0.0f);
}

TEST(Completions, RequestFieldsOverrideDefaults) {
  auto r = parse_completion_request(
      J(R"({"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 5, "temperature": 0,
            "top_p": 0.5, "top_k": 3, "min_p": 0.1, "presence_penalty": 1.5,
            "frequency_penalty": -1, "repetition_penalty": 1.2, "seed": -7,
            "logit_bias": {"42": 100, "7": -100}, "stop": ["a", "", "bc"], "n": 3,
            "logprobs": 5, "stream": true, "stream_options": {"include_usage": true},
            "ignore_eos": true, "stop_token_ids": [9], "return_token_ids": true, "user": "u"})"),
      ctx());
  ASSERT_TRUE(r.ok()) << r.error().message;
  const SamplingParams& s = r->engine.sampling;
  EXPECT_EQ(s.temperature, 0.0f);
  EXPECT_FLOAT_EQ(s.top_p, 0.5f);
  EXPECT_EQ(s.top_k, 3);
  EXPECT_FLOAT_EQ(s.min_p, 0.1f);
  EXPECT_FLOAT_EQ(s.presence_penalty, 1.5f);
  EXPECT_FLOAT_EQ(s.frequency_penalty, -1.0f);
  EXPECT_FLOAT_EQ(s.repetition_penalty, 1.2f);
  EXPECT_EQ(s.seed, uint64_t(int64_t(-7)));
  ASSERT_EQ(s.logit_bias.size(), 2u);
  EXPECT_EQ(s.logprobs, 5);
  EXPECT_EQ(r->engine.stop.stop_strings, (std::vector<std::string>{"a", "bc"}));
  EXPECT_EQ(r->engine.stop.stop_token_ids, (std::vector<int32_t>{9}));
  EXPECT_TRUE(r->engine.stop.ignore_eos);
  EXPECT_EQ(r->engine.max_tokens, 5);
  EXPECT_TRUE(r->max_tokens_given);
  EXPECT_EQ(r->n, 3);
  EXPECT_TRUE(r->stream);
  EXPECT_TRUE(r->include_usage);
  EXPECT_TRUE(r->return_token_ids);
  EXPECT_EQ(r->prompts[0], (std::vector<int32_t>{1, 2, 3}));
}

TEST(Completions, PromptShapes) {
  auto r = parse_completion_request(J(R"({"prompt": ["a", "b c"]})"), ctx());
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->prompts.size(), 2u);
  r = parse_completion_request(J(R"({"prompt": [[1, 2], [3]], "n": 2})"), ctx());
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->prompts.size(), 2u);
  EXPECT_EQ(r->prompts[1], (std::vector<int32_t>{3}));
  EXPECT_EQ(r->prompt_texts[0], fx().tok.decode(std::vector<int32_t>{1, 2}));
  r = parse_completion_request(J(R"({"prompt": "x", "stop": "\n\n"})"), ctx());
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->engine.stop.stop_strings, (std::vector<std::string>{"\n\n"}));
}

TEST(Completions, BadFieldsAreRejectedWithTheirName) {
  struct Case {
    const char* body;
    int status;
    const char* param;
  };
  const Case cases[] = {
      {R"({})", 400, "prompt"},
      {R"({"prompt": 5})", 400, "prompt"},
      {R"({"prompt": ""})", 400, "prompt"},
      {R"({"prompt": []})", 400, "prompt"},
      {R"({"prompt": [1, "a"]})", 400, "prompt"},
      {R"({"prompt": [[1], "a"]})", 400, "prompt"},
      {R"({"prompt": [[]]})", 400, "prompt"},
      {R"({"prompt": [-1]})", 400, "prompt"},
      {R"({"prompt": [151936]})", 400, "prompt"},
      {R"({"prompt": [1.5]})", 400, "prompt"},
      {R"({"prompt": [1], "model": "other"})", 404, "model"},
      {R"({"prompt": [1], "model": 3})", 400, "model"},
      {R"({"prompt": [1], "max_tokens": 0})", 400, "max_tokens"},
      {R"({"prompt": [1], "max_tokens": -5})", 400, "max_tokens"},
      {R"({"prompt": [1], "max_tokens": 1e12})", 400, "max_tokens"},
      {R"({"prompt": [1], "max_tokens": 2.5})", 400, "max_tokens"},
      {R"({"prompt": [1], "max_tokens": "10"})", 400, "max_tokens"},
      {R"({"prompt": [1], "max_tokens": 4096})", 400, "max_tokens"},
      {R"({"prompt": [1], "temperature": -0.1})", 400, "temperature"},
      {R"({"prompt": [1], "temperature": "hot"})", 400, "temperature"},
      {R"({"prompt": [1], "temperature": 1000})", 400, "temperature"},
      {R"({"prompt": [1], "top_p": 0})", 400, "top_p"},
      {R"({"prompt": [1], "top_p": 1.5})", 400, "top_p"},
      {R"({"prompt": [1], "top_k": -2})", 400, "top_k"},
      {R"({"prompt": [1], "top_k": 0.5})", 400, "top_k"},
      {R"({"prompt": [1], "min_p": 2})", 400, "min_p"},
      {R"({"prompt": [1], "presence_penalty": 3})", 400, "presence_penalty"},
      {R"({"prompt": [1], "frequency_penalty": -2.5})", 400, "frequency_penalty"},
      {R"({"prompt": [1], "repetition_penalty": 0})", 400, "repetition_penalty"},
      {R"({"prompt": [1], "logit_bias": [1]})", 400, "logit_bias"},
      {R"({"prompt": [1], "logit_bias": {"x": 1}})", 400, "logit_bias"},
      {R"({"prompt": [1], "logit_bias": {"-1": 1}})", 400, "logit_bias"},
      {R"({"prompt": [1], "logit_bias": {"999999": 1}})", 400, "logit_bias"},
      {R"({"prompt": [1], "logit_bias": {"5": 101}})", 400, "logit_bias"},
      {R"({"prompt": [1], "logit_bias": {"5": "1"}})", 400, "logit_bias"},
      {R"({"prompt": [1], "seed": "1"})", 400, "seed"},
      {R"({"prompt": [1], "seed": 1.5})", 400, "seed"},
      {R"({"prompt": [1], "stop": 5})", 400, "stop"},
      {R"({"prompt": [1], "stop": [1]})", 400, "stop"},
      {R"({"prompt": [1], "n": 0})", 400, "n"},
      {R"({"prompt": [1], "n": 1000})", 400, "n"},
      {R"({"prompt": [1], "best_of": 3})", 400, "best_of"},
      {R"({"prompt": [1], "logprobs": 21})", 400, "logprobs"},
      {R"({"prompt": [1], "logprobs": true})", 400, "logprobs"},
      {R"({"prompt": [1], "echo": true, "logprobs": 1})", 400, "echo"},
      {R"({"prompt": [1], "suffix": "x"})", 400, "suffix"},
      {R"({"prompt": [1], "stream": "yes"})", 400, "stream"},
      {R"({"prompt": [1], "stream_options": {"include_usage": true}})", 400, "stream_options"},
      {R"({"prompt": [1], "stream": true, "stream_options": {"include_usage": 1}})", 400,
       "stream_options.include_usage"},
      {R"({"prompt": [1], "stop_token_ids": [1, -1]})", 400, "stop_token_ids"},
      {R"({"prompt": [1], "ignore_eos": 1})", 400, "ignore_eos"},
      {R"({"prompt": [1], "min_tokens": 3})", 400, "min_tokens"},
      {R"({"prompt": [1], "response_format": {"type": "json"}})", 400, "response_format.type"},
      {R"({"prompt": [1], "response_format": {"type": "json_schema"}})", 400,
       "response_format.json_schema"},
      {R"({"prompt": [1], "response_format": {"type": "json_schema", "json_schema":
          {"name": "x", "schema": {"type": "string", "pattern": "a+"}}}})",
       400, "response_format.json_schema.schema"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.body);
    expect_error(parse_completion_request(J(c.body), ctx()), c.status, c.param);
  }
}

TEST(Completions, ContextLimits) {
  ServingContext small = ctx(16);
  std::vector<int32_t> ids(16, 5);
  ojson body = {{"prompt", ids}};
  auto r = parse_completion_request(body, small);
  expect_error(r, 400, "prompt");
  EXPECT_EQ(r.error().code, "context_length_exceeded");
  ids.resize(15);
  body = {{"prompt", ids}};
  EXPECT_TRUE(parse_completion_request(body, small).ok());  // one token of room
  body = {{"prompt", ids}, {"max_tokens", 2}};
  r = parse_completion_request(body, small);
  expect_error(r, 400, "max_tokens");
  EXPECT_EQ(r.error().code, "context_length_exceeded");
}

// A Responses request's limits name its own fields (it has no "messages" or "max_tokens").
TEST(Responses, ContextLimitsNameItsFields) {
  ServingContext small = ctx(16);
  std::string words;
  for (int i = 0; i < 40; ++i) words += "hello ";
  auto r = parse_responses_request(ojson{{"input", words}}, small);
  expect_error(r, 400, "input");
  EXPECT_EQ(r.error().code, "context_length_exceeded");
  r = parse_responses_request(ojson{{"input", "hi"}, {"max_output_tokens", 100}}, small);
  expect_error(r, 400, "max_output_tokens");
  EXPECT_EQ(r.error().code, "context_length_exceeded");
  // Chat keeps its own names.
  r = parse_chat_request(ojson{{"messages", {{{"role", "user"}, {"content", words}}}}}, small);
  expect_error(r, 400, "messages");
}

TEST(Chat, RendersWithTheModelsTemplate) {
  auto r = parse_chat_request(J(R"({"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
            "max_completion_tokens": 7, "logprobs": true, "top_logprobs": 3})"),
                              ctx());
  ASSERT_TRUE(r.ok()) << r.error().message;
  const std::string text = fx().tok.decode(r->prompts[0]);
  EXPECT_EQ(text,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\n");
  EXPECT_EQ(r->engine.max_tokens, 7);
  EXPECT_TRUE(r->chat_logprobs);
  EXPECT_EQ(r->engine.sampling.logprobs, 3);
  EXPECT_TRUE(r->output.parse_reasoning);  // the vocabulary has </think>
  EXPECT_FALSE(r->output.start_in_reasoning);
  EXPECT_FALSE(r->output.parse_tools);
}

TEST(Chat, DeveloperRoleAndAssistantToolCalls) {
  auto r = parse_chat_request(J(R"({"messages": [
      {"role": "developer", "content": "Rules."},
      {"role": "user", "content": "Weather?"},
      {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
      {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]})"),
                              ctx());
  ASSERT_TRUE(r.ok()) << r.error().message;
  const std::string text = fx().tok.decode(r->prompts[0]);
  EXPECT_NE(text.find("<|im_start|>system\nRules."), std::string::npos);
  EXPECT_NE(
      text.find("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}"),
      std::string::npos)
      << text;
  EXPECT_NE(text.find("<tool_response>\nsunny\n</tool_response>"), std::string::npos);
}

TEST(Chat, ToolsAndToolChoice) {
  const char* tools = R"([{"type": "function", "function": {"name": "get_weather",
      "description": "Weather", "parameters": {"type": "object", "properties": {"city":
      {"type": "string"}}}}}])";
  auto body = [&](const std::string& extra) {
    return J(("{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"tools\": " +
              std::string(tools) + extra + "}")
                 .c_str());
  };
  auto r = parse_chat_request(body(""), ctx());
  ASSERT_TRUE(r.ok()) << r.error().message;
  EXPECT_TRUE(r->output.parse_tools);
  EXPECT_TRUE(r->output.forced_prefix.empty());
  EXPECT_NE(fx().tok.decode(r->prompts[0]).find("# Tools"), std::string::npos);

  // "none" keeps the tools in the prompt, as vLLM does; only no calls are parsed.
  const std::vector<int32_t> with_tools = r->prompts[0];
  r = parse_chat_request(body(R"(, "tool_choice": "none")"), ctx());
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->output.parse_tools);
  EXPECT_EQ(r->prompts[0], with_tools);

  r = parse_chat_request(body(R"(, "tool_choice": "required")"), ctx());
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->output.forced_prefix, "<tool_call>\n");
  EXPECT_TRUE(fx().tok.decode(r->prompts[0]).ends_with("<|im_start|>assistant\n<tool_call>\n"));

  r = parse_chat_request(
      body(R"(, "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
              "parallel_tool_calls": false)"),
      ctx());
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->output.forced_prefix, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {");
  EXPECT_FALSE(r->output.parallel_tool_calls);

  expect_error(
      parse_chat_request(
          body(R"(, "tool_choice": {"type": "function", "function": {"name": "nope"}})"), ctx()),
      400, "tool_choice");
  expect_error(parse_chat_request(body(R"(, "tool_choice": "sometimes")"), ctx()), 400,
               "tool_choice");
  expect_error(parse_chat_request(J(R"({"messages": [{"role": "user", "content": "x"}],
                                       "tool_choice": "required"})"),
                                  ctx()),
               400, "tool_choice");
  expect_error(parse_chat_request(J(R"({"messages": [{"role": "user", "content": "x"}],
                                       "tools": [{"type": "function"}]})"),
                                  ctx()),
               400, "tools[0]");
  expect_error(parse_chat_request(J(R"({"messages": [{"role": "user", "content": "x"}],
                                       "tools": [{"type": "function", "function": {"name": ""}}]})"),
                                  ctx()),
               400, "tools[0].function.name");
}

TEST(Chat, ThinkingSwitchAndTemplatesThatOpenThink) {
  auto r = parse_chat_request(J(R"({"messages": [{"role": "user", "content": "x"}],
                                    "chat_template_kwargs": {"enable_thinking": false}})"),
                              ctx());
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(fx().tok.decode(r->prompts[0]).ends_with("<think>\n\n</think>\n\n"));
  EXPECT_FALSE(r->output.start_in_reasoning);

  auto opens = ChatTemplate::from_string(
      "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
      "<|im_start|>assistant\n<think>\n",
      "", "");
  ASSERT_TRUE(opens.ok());
  ServingContext c = ctx();
  c.chat_template = &*opens;
  r = parse_chat_request(J(R"({"messages": [{"role": "user", "content": "x"}]})"), c);
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->output.start_in_reasoning);
  r = parse_chat_request(J(R"({"messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"})"),
                         c);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->output.forced_prefix, "\n</think>\n\n<tool_call>\n");
}

TEST(Chat, BadMessagesAreRejected) {
  struct Case {
    const char* body;
    const char* param;
  };
  const Case cases[] = {
      {R"({})", "messages"},
      {R"({"messages": []})", "messages"},
      {R"({"messages": {}})", "messages"},
      {R"({"messages": ["hi"]})", "messages[0]"},
      {R"({"messages": [{"content": "hi"}]})", "messages[0].role"},
      {R"({"messages": [{"role": "robot", "content": "hi"}]})", "messages[0].role"},
      {R"({"messages": [{"role": "user"}]})", "messages[0].content"},
      {R"({"messages": [{"role": "user", "content": 5}]})", "messages[0].content"},
      {R"({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})",
       "messages[0].content[0].type"},
      {R"({"messages": [{"role": "user", "content": [{"type": "text"}]}]})",
       "messages[0].content[0].text"},
      {R"({"messages": [{"role": "user", "content": "x", "tool_calls": []}]})",
       "messages[0].tool_calls"},
      {R"({"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"function": {}}]}]})",
       "messages[0].tool_calls[0].function.name"},
      {R"({"messages": [{"role": "user", "content": "x"}], "logprobs": 1})", "logprobs"},
      {R"({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})", "top_logprobs"},
      {R"({"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 30})",
       "top_logprobs"},
      {R"({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": 3})",
       "chat_template_kwargs"},
      {R"({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1})",
       "max_completion_tokens"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.body);
    expect_error(parse_chat_request(J(c.body), ctx()), 400, c.param);
  }
  // A prompt longer than the context.
  ojson long_msg = {{"messages", {{{"role", "user"}, {"content", std::string(200, 'a') + " b"}}}}};
  auto r = parse_chat_request(long_msg, ctx(20));
  expect_error(r, 400, "messages");
  EXPECT_EQ(r.error().code, "context_length_exceeded");
}

TEST(Messages, TranslatesToTheChatTemplate) {
  auto r = parse_messages_request(J(R"({"model": "tiny", "max_tokens": 32, "system": "Sys.",
      "stop_sequences": ["END"], "temperature": 0.3, "top_k": 5,
      "tools": [{"name": "lookup", "description": "d", "input_schema": {"type": "object"}}],
      "messages": [
        {"role": "user", "content": "find x"},
        {"role": "assistant", "content": [{"type": "text", "text": "ok"},
          {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"q": "x"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
          "content": [{"type": "text", "text": "found"}]}]}]})"),
                                  ctx());
  ASSERT_TRUE(r.ok()) << r.error().message;
  const std::string text = fx().tok.decode(r->prompts[0]);
  EXPECT_TRUE(text.starts_with("<|im_start|>system\nSys.\n\n# Tools")) << text;
  EXPECT_NE(text.find("ok\n<tool_call>\n{\"name\": \"lookup\", \"arguments\": {\"q\": \"x\"}}"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("<tool_response>\nfound\n</tool_response>"), std::string::npos);
  EXPECT_EQ(r->engine.max_tokens, 32);
  EXPECT_EQ(r->engine.stop.stop_strings, (std::vector<std::string>{"END"}));
  EXPECT_FLOAT_EQ(r->engine.sampling.temperature, 0.3f);
  EXPECT_EQ(r->engine.sampling.top_k, 5);
  EXPECT_TRUE(r->output.parse_tools);
}

TEST(Messages, ToolChoiceAndThinking) {
  const char* base =
      R"("model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}],
      "tools": [{"name": "f", "input_schema": {"type": "object"}}])";
  auto r = parse_messages_request(
      J((std::string("{") + base + R"(, "tool_choice": {"type": "any"}})").c_str()), ctx());
  ASSERT_TRUE(r.ok()) << r.error().message;
  EXPECT_EQ(r->output.forced_prefix, "<tool_call>\n");
  r = parse_messages_request(
      J((std::string("{") + base + R"(, "tool_choice": {"type": "tool", "name": "f"}})").c_str()),
      ctx());
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->output.forced_prefix, "<tool_call>\n{\"name\": \"f\", \"arguments\": {");
  r = parse_messages_request(
      J((std::string("{") + base + R"(, "thinking": {"type": "disabled"}})").c_str()), ctx());
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(fx().tok.decode(r->prompts[0]).ends_with("<think>\n\n</think>\n\n"));
  // Every thinking type of the Messages API: adaptive thinks, between_tools does not.
  for (const auto& [type, thinks] : {std::pair{"adaptive", true}, std::pair{"between_tools", false},
                                     std::pair{"enabled", true}}) {
    r = parse_messages_request(J((std::string("{") + base + R"(, "thinking": {"type": ")" + type +
                                  R"(", "display": "omitted"}})")
                                     .c_str()),
                               ctx());
    ASSERT_TRUE(r.ok()) << type << ": " << r.error().message;
    EXPECT_EQ(fx().tok.decode(r->prompts[0]).ends_with("<think>\n\n</think>\n\n"), !thinks) << type;
  }
}

TEST(Messages, BadRequestsAreRejected) {
  struct Case {
    const char* body;
    const char* param;
  };
  const Case cases[] = {
      {R"({"model": "tiny", "messages": [{"role": "user", "content": "x"}]})", "max_tokens"},
      {R"({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]})", "model"},
      {R"({"model": "tiny", "max_tokens": 5})", "messages"},
      {R"({"model": "tiny", "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]})",
       "messages[0].role"},
      {R"({"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]})",
       "messages[0].content[0].type"},
      {R"({"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "system": 3})",
       "system"},
      {R"({"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "stop_sequences": "x"})",
       "stop_sequences"},
      {R"({"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tools": [{}]})",
       "tools[0].name"},
      {R"({"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"})",
       "tool_choice"},
      {R"({"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
           "thinking": {"type": "maybe"}})",
       "thinking"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.body);
    expect_error(parse_messages_request(J(c.body), ctx()), 400, c.param);
  }
}

}  // namespace
}  // namespace recur::server
