// Request bodies through every endpoint's parser, as the server runs them: a body is either
// refused with a client error (4xx) that says why, or becomes prompts the engine can run.
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_targets.h"
#include "json_edits.h"
#include "server/json_fields.h"
#include "server/output_parser.h"
#include "server/request.h"
#include "server/request_test_util.h"

namespace recur::fuzz {

namespace {

using server::ApiError;
using server::ServingContext;

// Qwen3 (JSON tool calls), Qwen3.5 (XML tool calls) and Kimi (tiktoken vocabulary, call
// sections): the three chat formats the server speaks.
const ServingContext& context(int which) {
  static const auto make = [](const std::string& dir, std::vector<int32_t> eos) {
    const server::ChatFixture& f = server::chat_fixture(dir);
    ServingContext c = server::tiny_context(f);
    c.eos_token_ids = std::move(eos);
    c.vocab_size = f.tok.vocab_size();
    c.tool_format = server::detect_tool_call_format(f.tmpl.source());
    return c;
  };
  static const ServingContext contexts[3] = {
      make(server::kRealVocabModel, {151645, 151643}),
      make(std::string(RECUR_SOURCE_DIR) + "/tests/data/qwen3_5-chat-tiny", {151645, 151643}),
      make(std::string(RECUR_SOURCE_DIR) + "/tests/data/kimi-tokenizer-tiny", {1026}),
  };
  return contexts[which];
}

void check_error(const ApiError& e) {
  if (e.status >= 500) std::fprintf(stderr, "%d: %s\n", e.status, e.message.c_str());
  FUZZ_CHECK(e.status >= 400 && e.status < 500);
  FUZZ_CHECK(!e.message.empty());
}

// Valid bodies of each endpoint (chat, completions, messages, responses, count_tokens), for
// inputs that edit them instead of spelling JSON.
const char* kBodies[] = {
    R"({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function",
         "function": {"name": "t", "arguments": "{}"}}]}, {"role": "tool", "tool_call_id": "c",
         "content": "r"}],
        "tools": [{"type": "function", "function": {"name": "t", "parameters": {"type": "object",
         "properties": {"a": {"type": "string"}}}}}], "tool_choice": "auto", "max_tokens": 8,
        "temperature": 0.7, "top_p": 0.9, "stop": ["x"], "logprobs": true, "top_logprobs": 2,
        "n": 2, "stream": true, "stream_options": {"include_usage": true}, "seed": 1})",
    R"({"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 4, "echo": true, "seed": 3,
        "logit_bias": {"5": -100}, "stop": "z", "top_k": 5, "min_p": 0.1})",
    R"({"model": "tiny", "max_tokens": 16, "system": [{"type": "text", "text": "s"}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "u", "name": "t",
         "input": {"a": 1}}]}, {"role": "user", "content": [{"type": "tool_result",
         "tool_use_id": "u", "content": "r"}]}],
        "tools": [{"name": "t", "input_schema": {"type": "object"}}], "stop_sequences": ["q"],
        "thinking": {"type": "enabled", "budget_tokens": 1024}, "tool_choice": {"type": "auto"}})",
    R"({"input": [{"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c",
        "name": "t", "arguments": "{}"}, {"type": "function_call_output", "call_id": "c",
        "output": "r"}], "instructions": "be brief", "max_output_tokens": 9,
        "tools": [{"type": "function", "name": "t", "parameters": {}}], "reasoning": {}})",
    R"({"messages": [{"role": "user", "content": "count"}], "system": "s",
        "tools": [{"name": "t", "input_schema": {"type": "object"}}]})",
};

// Fields an edit may add: what the endpoints read, and some they do not.
const char* kFields[] = {"max_tokens",
                         "max_completion_tokens",
                         "max_output_tokens",
                         "temperature",
                         "top_p",
                         "top_k",
                         "min_p",
                         "n",
                         "stop",
                         "stop_sequences",
                         "seed",
                         "logprobs",
                         "top_logprobs",
                         "logit_bias",
                         "presence_penalty",
                         "frequency_penalty",
                         "repetition_penalty",
                         "stream",
                         "stream_options",
                         "tools",
                         "tool_choice",
                         "response_format",
                         "messages",
                         "prompt",
                         "system",
                         "input",
                         "instructions",
                         "thinking",
                         "echo",
                         "priority",
                         "chat_template_kwargs",
                         "ignore_eos",
                         "skip_special_tokens",
                         "parallel_tool_calls",
                         "min_tokens",
                         "return_token_ids",
                         "user",
                         "content",
                         "role",
                         "type",
                         "name",
                         "arguments",
                         "text",
                         "id"};

std::string edited_body(int endpoint, std::span<const uint8_t> edits) {
  ojson body = ojson::parse(kBodies[endpoint]);
  apply_edits(body, edits, kFields);
  return body.dump();
}

}  // namespace

int fuzz_request(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const int selector = data[0];
  const int endpoint = (selector / 3) % 5;
  std::string_view body(reinterpret_cast<const char*>(data + 1), size - 1);
  // A body that starts with a NUL byte is a list of edits of a valid body.
  std::string edited;
  if (!body.empty() && body[0] == '\0') {
    edited = edited_body(endpoint, std::span(data + 2, size - 2));
    body = edited;
  }
  // A small context, so that length limits are reached too.
  ServingContext ctx = context(selector % 3);
  ctx.max_context = (selector & 0x40) ? 64 : 4096;
  ctx.allow_unknown_fields = (selector & 0x80) != 0;

  auto json = server::parse_body(body);
  if (!json.ok()) {
    check_error(json.error());
    return 0;
  }
  if (endpoint == 4) {
    auto n = server::count_message_tokens(*json, ctx);
    if (!n.ok()) check_error(n.error());
    return 0;
  }
  auto parsed = endpoint == 0   ? server::parse_chat_request(*json, ctx)
                : endpoint == 1 ? server::parse_completion_request(*json, ctx)
                : endpoint == 2 ? server::parse_messages_request(*json, ctx)
                                : server::parse_responses_request(*json, ctx);
  if (!parsed.ok()) {
    check_error(parsed.error());
    return 0;
  }
  // Accepted: what the engine is given is within its limits.
  const server::ParsedRequest& r = *parsed;
  FUZZ_CHECK(!r.prompts.empty() && r.n >= 1);
  for (const auto& p : r.prompts) {
    FUZZ_CHECK(!p.empty() && int64_t(p.size()) < ctx.max_context);
    for (int32_t id : p) FUZZ_CHECK(id >= 0 && id < ctx.vocab_size);
  }
  FUZZ_CHECK(r.engine.max_tokens >= 1);
  FUZZ_CHECK(r.engine.sampling.validate(ctx.vocab_size).ok());
  return 0;
}

}  // namespace recur::fuzz
