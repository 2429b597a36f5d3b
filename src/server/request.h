// Validation of API requests (OpenAI chat and completions, Anthropic messages) into what the
// engine runs: prompts as token ids, sampling and stop conditions, and how to shape the output.
// Pure functions of the body and the serving context, so every rule is unit-testable.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/engine.h"
#include "server/api_error.h"
#include "server/json_constraint.h"
#include "server/json_fields.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace recur::server {

enum class Endpoint { kChat, kCompletions, kMessages, kResponses };

// How the model writes tool calls, as its chat template asks (detect_tool_call_format).
enum class ToolCallFormat {
  kJson,  // Hermes / Qwen3: <tool_call>{"name": …, "arguments": {…}}</tool_call>
  kXml,   // Qwen3.5 / Qwen3-Coder: <tool_call><function=NAME><parameter=ARG>…
  kKimi,  // Kimi: <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0…
};

// What a request is validated against.
struct ServingContext {
  std::string model_name;  // the one name requests may give in "model"
  int vocab_size = 0;
  int max_context = 0;  // prompt plus generated tokens of one sequence
  GenerationDefaults generation;
  std::vector<int32_t> eos_token_ids;
  const Tokenizer* tokenizer = nullptr;                // null: token-id prompts only
  const ChatTemplate* chat_template = nullptr;         // null: no chat endpoints
  ToolCallFormat tool_format = ToolCallFormat::kJson;  // from the chat template, at start
  std::string chat_template_error;  // why a template the directory has did not load
  // The tokenizer's tokens as bytes, for structured outputs (null: response_format other than
  // text is refused).
  std::shared_ptr<const VocabularyBytes> vocab_bytes;
  // The same as forced Kimi calls read it (kimi_call_vocabulary; null: not Kimi's form, or its
  // markers are not tokens, and such calls are forced by their prefix alone).
  std::shared_ptr<const VocabularyBytes> kimi_vocab_bytes;
  bool allow_unknown_fields = false;  // else a top-level field not known is a 400
};

// How generated text is split into reasoning, content and tool calls (chat and messages).
struct OutputOptions {
  bool parse_reasoning = false;     // <think>…</think>
  bool start_in_reasoning = false;  // the prompt left <think> open
  bool parse_tools = false;         // <tool_call>…</tool_call> (Kimi: its call section)
  ToolCallFormat tool_format = ToolCallFormat::kJson;
  std::shared_ptr<const ojson> tools;  // the request's tools (OpenAI shape): XML argument types
  bool parallel_tool_calls = true;     // false: only the first call is reported
  std::string forced_prefix;           // appended to the prompt; the parser reads it first
};

struct ParsedRequest {
  Endpoint endpoint = Endpoint::kChat;
  std::vector<std::vector<int32_t>> prompts;  // completions may carry several
  std::vector<std::string> prompt_texts;      // for echo
  int n = 1;                                  // choices per prompt
  Request engine;                             // sampling, stop, skip_special_tokens
  bool max_tokens_given = false;              // else: up to the context length
  bool stream = false;
  bool include_usage = false;
  bool continuous_usage = false;  // usage on every chunk (stream_options.continuous_usage_stats)
  bool echo = false;
  std::string chat_echo;  // chat echo: the final assistant message, before the new text
  // include_stop_str_in_output: whether the text of the token that stopped generation (EOS, a
  // stop_token_ids entry) and a matched stop string stay in the output.
  bool keep_stop_token_text = false;
  bool keep_stop_string = false;
  bool return_token_ids = false;
  bool chat_logprobs = false;  // chat: logprobs=true (top-n in engine.sampling.logprobs)
  OutputOptions output;
  // Structured outputs: the schema the content must follow (parse_structured_outputs; the
  // Responses API's text.format; Anthropic's output_config.format), the field it came from, for
  // errors, and the format as given, for the Responses API's echo.
  std::shared_ptr<const CompiledSchema> json_schema;
  std::string json_schema_field;
  ojson response_format;
  // A call tool_choice forces (JSON call format): what the model writes after the forced prefix,
  // for constrained decoding (null: none forced, or a format left unconstrained).
  std::shared_ptr<const ToolCallGrammar> forced_call;
  std::shared_ptr<const XmlCallGrammar> forced_xml_call;    // the same, XML call format
  std::shared_ptr<const KimiCallGrammar> forced_kimi_call;  // the same, Kimi's call format
  ojson response_echo;  // responses: the request fields its response object repeats
};

ApiResult<ParsedRequest> parse_chat_request(const ojson& body, const ServingContext& ctx);
ApiResult<ParsedRequest> parse_completion_request(const ojson& body, const ServingContext& ctx);
ApiResult<ParsedRequest> parse_messages_request(const ojson& body, const ServingContext& ctx);
// OpenAI Responses API (/v1/responses): input items and function tools, rendered as a chat.
ApiResult<ParsedRequest> parse_responses_request(const ojson& body, const ServingContext& ctx);
// Anthropic /v1/messages/count_tokens: the prompt tokens the same messages request would use.
ApiResult<int64_t> count_message_tokens(const ojson& body, const ServingContext& ctx);

// vLLM's /tokenize: {"prompt": text} or a chat ({"messages", "tools", "add_generation_prompt",
// "continue_final_message", "chat_template_kwargs"}, refused as /v1/chat/completions refuses
// it), and whether the tokens' strings are asked for.
struct TokenizeRequest {
  std::vector<int32_t> ids;
  bool token_strs = false;
};
ApiResult<TokenizeRequest> parse_tokenize_request(const ojson& body, const ServingContext& ctx);
// vLLM's /detokenize: {"tokens": [ids]} to their text.
ApiResult<std::string> parse_detokenize_request(const ojson& body, const ServingContext& ctx);

// Shared steps, exposed for the Anthropic and Responses translations and for tests.
// Top-level fields outside these lists are a 400 naming the first one (and the known name it
// is closest to), unless ctx.allow_unknown_fields.
ApiResult<bool> check_fields(const ojson& body,
                             std::initializer_list<std::initializer_list<std::string_view>> known,
                             const ServingContext& ctx);
// The fields parse_sampling reads.
extern const std::initializer_list<std::string_view> kSamplingFields;
// "model": absent, or the served name (else 404 model_not_found).
ApiResult<bool> check_model(const ojson& body, const ServingContext& ctx);
// Reads sampling, stop and extension fields common to all endpoints (priority included) into
// req->engine.
ApiResult<bool> parse_sampling(const ojson& body, const ServingContext& ctx, ParsedRequest* req);
// How the conversation ends in the prompt: a new assistant turn opened (the default), nothing
// added after the last message, or the last message left open for the model to continue
// (vLLM's continue_final_message; Anthropic's prefill).
struct ChatEnding {
  bool add_generation_prompt = true;
  bool continue_final_message = false;
};
// Renders {messages, tools, chat_template_kwargs} and tokenizes; sets output options.
// tool_choice: "none", "auto", "required" or a function name (named:NAME); with "none" the
// tools are still rendered (as vLLM does), only no calls are parsed.
ApiResult<bool> render_chat(const ojson& messages, const ojson* tools, const ojson* kwargs,
                            const std::string& tool_choice, const ServingContext& ctx,
                            ParsedRequest* req, const ChatEnding& ending = {});
// A text of `bytes` bytes that surely makes more tokens than the context holds (bytes over the
// tokenizer's longest token): a context_length_exceeded error for `param`, before any
// tokenizing. True when it may fit.
ApiResult<bool> check_text_fits(size_t bytes, const ServingContext& ctx, const std::string& param);
// A tool_choice mode ("none", "auto", "required", "named:NAME") against the request's tools
// (chat's shape; null when absent): a call asked for needs tools, a named one must be there.
ApiResult<bool> check_tool_choice(const std::string& mode, const ojson* tools);
// Another API's function tool at `where` in chat's shape ({"type": "function", "function":
// {name, description, parameters}}): its JSON schema under schema_key, an object ({} if absent).
ApiResult<ojson> chat_function_tool(const ojson& tool, const std::string& where,
                                    const std::string& name,
                                    const std::optional<std::string>& description,
                                    const char* schema_key);
// Prompt length and max_tokens against the context.
ApiResult<bool> check_lengths(const ServingContext& ctx, ParsedRequest* req);
// response_format and the other servers' spellings of a JSON schema (vLLM's guided_json and
// structured_outputs.json, llama.cpp's json_schema) into req->json_schema; parse_sampling's.
ApiResult<bool> parse_structured_outputs(const ojson& body, ParsedRequest* req);
// A response format at `where`: {"type": "text"}, {"type": "json_object"}, or {"type":
// "json_schema"} with the schema under "json_schema" (chat completions) or beside "type" (the
// Responses API's text.format); compiled into req->json_schema.
ApiResult<bool> parse_response_format(const ojson& format, const std::string& where,
                                      ParsedRequest* req);
// After rendering: the engine request's constraint for req->json_schema, which starts after
// the reasoning when the prompt leaves the model thinking; refused beside tools the model may
// call (their calls are not JSON of the schema). Else the forced call's (req->forced_call,
// req->forced_xml_call or req->forced_kimi_call).
ApiResult<bool> attach_constraint(const ServingContext& ctx, ParsedRequest* req);

}  // namespace recur::server
