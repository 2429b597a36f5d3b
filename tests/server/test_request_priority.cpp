// The scheduling priority (vLLM's `priority`: lower first, default 0) is read by every
// endpoint's parser into the engine request, and range-checked with an error naming it.
#include <gtest/gtest.h>

#include "server/request.h"

namespace recur::server {
namespace {

ServingContext token_ids_context() {
  ServingContext c;
  c.model_name = "tiny";
  c.vocab_size = 256;
  c.max_context = 4096;
  return c;
}

TEST(RequestPriority, ParsedIntoTheEngineRequestAndRangeChecked) {
  const ServingContext ctx = token_ids_context();
  auto parse = [&](const char* body) { return parse_completion_request(ojson::parse(body), ctx); };
  auto absent = parse(R"({"prompt": [1, 2, 3]})");
  ASSERT_TRUE(absent.ok());
  EXPECT_EQ(absent->engine.priority, 0);
  auto urgent = parse(R"({"prompt": [1, 2, 3], "priority": -7})");
  ASSERT_TRUE(urgent.ok());
  EXPECT_EQ(urgent->engine.priority, -7);
  auto late = parse(R"({"prompt": [1, 2, 3], "priority": 2147483647})");
  ASSERT_TRUE(late.ok());
  EXPECT_EQ(late->engine.priority, 2147483647);
  for (const char* bad :
       {R"({"prompt": [1], "priority": 2147483648})", R"({"prompt": [1], "priority": 1.5})",
        R"({"prompt": [1], "priority": "high"})"}) {
    auto r = parse(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.error().status, 400) << bad;
    EXPECT_EQ(r.error().param, "priority") << bad;
    EXPECT_NE(r.error().message.find("'priority'"), std::string::npos) << r.error().message;
  }
}

// Chat and Anthropic messages go through the same reader: shown on their parsers too (they need
// a chat template; the shipped real-vocabulary model has one).
TEST(RequestPriority, ChatAndMessagesCarryIt) {
  const std::string dir = std::string(RECUR_SOURCE_DIR) + "/models/qwen3next-tiny-realvocab";
  auto tok = Tokenizer::load(dir);
  auto tmpl = ChatTemplate::load(dir);
  ASSERT_TRUE(tok.ok() && tmpl.ok());
  ServingContext ctx = token_ids_context();
  ctx.vocab_size = 151936;
  ctx.tokenizer = &*tok;
  ctx.chat_template = &*tmpl;
  auto chat = parse_chat_request(
      ojson::parse(R"({"messages": [{"role": "user", "content": "hi"}], "priority": 3})"), ctx);
  ASSERT_TRUE(chat.ok()) << chat.error().message;
  EXPECT_EQ(chat->engine.priority, 3);
  auto msgs = parse_messages_request(
      ojson::parse(
          R"({"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "priority": -2})"),
      ctx);
  ASSERT_TRUE(msgs.ok()) << msgs.error().message;
  EXPECT_EQ(msgs->engine.priority, -2);
  auto bad = parse_messages_request(
      ojson::parse(
          R"({"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "priority": 1e10})"),
      ctx);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.error().param, "priority");
}

}  // namespace
}  // namespace recur::server
