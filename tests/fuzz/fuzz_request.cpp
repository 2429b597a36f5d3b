// Request bodies through every endpoint's parser, as the server runs them: a body is either
// refused with a client error (4xx) that says why, or becomes prompts the engine can run.
#include <string>
#include <string_view>

#include "fuzz_targets.h"
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
const ServingContext& context(int which, int max_context) {
  static const auto make = [](const std::string& dir, std::vector<int32_t> eos) {
    const server::ChatFixture& f = server::chat_fixture(dir);
    ServingContext c = server::tiny_context(f);
    c.eos_token_ids = std::move(eos);
    c.vocab_size = f.tok.vocab_size();
    c.tool_format = server::detect_tool_call_format(f.tmpl.source());
    return c;
  };
  static ServingContext contexts[3] = {
      make(server::kRealVocabModel, {151645, 151643}),
      make(std::string(RECUR_SOURCE_DIR) + "/tests/data/qwen3_5-chat-tiny", {151645, 151643}),
      make(std::string(RECUR_SOURCE_DIR) + "/tests/data/kimi-tokenizer-tiny", {1026}),
  };
  ServingContext& c = contexts[which];
  c.max_context = max_context;
  return c;
}

void check_error(const ApiError& e) {
  if (e.status >= 500) std::fprintf(stderr, "%d: %s\n", e.status, e.message.c_str());
  FUZZ_CHECK(e.status >= 400 && e.status < 500);
  FUZZ_CHECK(!e.message.empty());
}

}  // namespace

int fuzz_request(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const int selector = data[0];
  const std::string_view body(reinterpret_cast<const char*>(data + 1), size - 1);
  // A small context, so that length limits are reached too.
  ServingContext ctx = context(selector % 3, (selector & 0x40) ? 64 : 4096);
  ctx.allow_unknown_fields = (selector & 0x80) != 0;

  auto json = server::parse_body(body);
  if (!json.ok()) {
    check_error(json.error());
    return 0;
  }
  const int endpoint = (selector / 3) % 5;
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
