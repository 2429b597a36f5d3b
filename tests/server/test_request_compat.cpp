// Request fields and rules that vLLM's and Anthropic's servers have: a final message continued
// (continue_final_message, add_generation_prompt, Anthropic's prefill), consecutive turns of a
// role merged, include_stop_str_in_output, continuous usage, chat echo, and prompts refused
// for their size before they are tokenized.
#include <gtest/gtest.h>

#include "request_test_util.h"
#include "server/request.h"

namespace recur::server {
namespace {

const ChatFixture& fx() {
  return chat_fixture(kRealVocabModel);
}

std::string prompt_text(const ParsedRequest& r) {
  return fx().tok.decode(r.prompts.at(0));
}

TEST(ChatEnding, ContinueFinalMessageAndAddGenerationPrompt) {
  const ServingContext c = tiny_context(fx());
  const char* turns = R"("messages": [{"role": "user", "content": "Pick one"},
      {"role": "assistant", "content": "The answer is ("}])";
  auto closed = parse_chat_request(J(fmt::format(R"({{{}}})", turns).c_str()), c);
  ASSERT_TRUE(closed.ok()) << closed.error().message;
  EXPECT_TRUE(prompt_text(*closed).ends_with("The answer is (<|im_end|>\n<|im_start|>assistant\n"));
  auto no_prompt = parse_chat_request(
      J(fmt::format(R"({{{}, "add_generation_prompt": false}})", turns).c_str()), c);
  ASSERT_TRUE(no_prompt.ok()) << no_prompt.error().message;
  EXPECT_TRUE(prompt_text(*no_prompt).ends_with("The answer is (<|im_end|>\n"));
  auto open = parse_chat_request(
      J(fmt::format(R"({{{}, "add_generation_prompt": false, "continue_final_message": true,
                        "echo": true}})",
                    turns)
            .c_str()),
      c);
  ASSERT_TRUE(open.ok()) << open.error().message;
  // The closed rendering without its end: the turn goes on after the text.
  const std::string closed_turn = prompt_text(*no_prompt);
  EXPECT_EQ(prompt_text(*open), closed_turn.substr(0, closed_turn.size() - 11));
  EXPECT_EQ(open->chat_echo, "The answer is (");
  // As vLLM: continuing needs the generation prompt off.
  auto both = parse_chat_request(
      J(fmt::format(R"({{{}, "continue_final_message": true}})", turns).c_str()), c);
  ASSERT_FALSE(both.ok());
  EXPECT_EQ(both.error().param, "continue_final_message");
}

TEST(ChatEnding, AnthropicPrefillIsContinued) {
  const ServingContext c = tiny_context(fx());
  auto prefill = count_message_tokens(J(R"({"model": "tiny", "messages": [
      {"role": "user", "content": "Pick one"},
      {"role": "assistant", "content": [{"type": "text", "text": "The answer is ("}]}]})"),
                                      c);
  auto chat = parse_chat_request(J(R"({"messages": [{"role": "user", "content": "Pick one"},
      {"role": "assistant", "content": "The answer is ("}], "add_generation_prompt": false,
      "continue_final_message": true})"),
                                 c);
  ASSERT_TRUE(prefill.ok()) << prefill.error().message;
  ASSERT_TRUE(chat.ok()) << chat.error().message;
  EXPECT_EQ(*prefill, int64_t(chat->prompts[0].size()));
  // An empty final assistant message opens a fresh turn.
  auto empty = parse_messages_request(J(R"({"model": "tiny", "max_tokens": 4, "messages": [
      {"role": "user", "content": "Pick one"}, {"role": "assistant", "content": ""}]})"),
                                      c);
  auto plain = parse_messages_request(
      J(R"({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "Pick one"}]})"),
      c);
  ASSERT_TRUE(empty.ok()) << empty.error().message;
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(empty->prompts[0], plain->prompts[0]);
}

TEST(AnthropicTurns, ConsecutiveMessagesOfARoleAreOneTurn) {
  const ServingContext c = tiny_context(fx());
  auto split = count_message_tokens(J(R"({"model": "tiny", "messages": [
      {"role": "user", "content": "Hello."},
      {"role": "user", "content": [{"type": "text", "text": "How are you?"}]},
      {"role": "assistant", "content": "Fine."},
      {"role": "assistant", "content": "And you?"},
      {"role": "user", "content": "Good."}]})"),
                                    c);
  auto joined = count_message_tokens(J(R"({"model": "tiny", "messages": [
      {"role": "user", "content": "Hello.\nHow are you?"},
      {"role": "assistant", "content": "Fine.\nAnd you?"},
      {"role": "user", "content": "Good."}]})"),
                                     c);
  ASSERT_TRUE(split.ok()) << split.error().message;
  ASSERT_TRUE(joined.ok()) << joined.error().message;
  EXPECT_EQ(*split, *joined);
}

TEST(StopStrings, IncludeStopStrInOutput) {
  const ServingContext c = tiny_context(fx());
  auto r = parse_completion_request(J(R"({"prompt": "x"})"), c);
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->keep_stop_token_text);
  EXPECT_FALSE(r->keep_stop_string);
  r = parse_chat_request(
      J(R"({"messages": [{"role": "user", "content": "x"}], "include_stop_str_in_output": true})"),
      c);
  ASSERT_TRUE(r.ok()) << r.error().message;
  EXPECT_TRUE(r->keep_stop_token_text);
  EXPECT_TRUE(r->keep_stop_string);
  // An Anthropic turn keeps a stop token's text, never a stop sequence, unless told.
  r = parse_messages_request(
      J(R"({"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})"),
      c);
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->keep_stop_token_text);
  EXPECT_FALSE(r->keep_stop_string);
  r = parse_completion_request(J(R"({"prompt": "x", "include_stop_str_in_output": 1})"), c);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().param, "include_stop_str_in_output");
}

TEST(StreamOptions, ContinuousUsageStatsWithIncludeUsage) {
  const ServingContext c = tiny_context(fx());
  auto r = parse_completion_request(J(R"({"prompt": "x", "stream": true, "stream_options":
      {"include_usage": true, "continuous_usage_stats": true}})"),
                                    c);
  ASSERT_TRUE(r.ok()) << r.error().message;
  EXPECT_TRUE(r->continuous_usage);
  r = parse_completion_request(
      J(R"({"prompt": "x", "stream": true, "stream_options": {"continuous_usage_stats": true}})"),
      c);
  ASSERT_TRUE(r.ok()) << r.error().message;
  EXPECT_FALSE(r->continuous_usage);  // as vLLM: only with include_usage
}

TEST(PromptSize, RefusedBeforeTokenizingWhenSurelyTooLong) {
  const ServingContext c = tiny_context(fx(), 64);
  const size_t longest = fx().tok.max_token_bytes();
  // Fits the bound (the prompt is then tokenized and counted exactly).
  auto r = parse_completion_request(J(R"({"prompt": "hello"})"), c);
  ASSERT_TRUE(r.ok()) << r.error().message;
  // More bytes than 64 tokens of the longest kind can hold: refused without tokenizing,
  // which the message (a lower bound, not a count) tells.
  const std::string big(longest * 64 + 1, 'a');
  for (const auto& body :
       {ojson{{"prompt", big}}, ojson{{"messages", {{{"role", "user"}, {"content", big}}}}}}) {
    auto refused =
        body.contains("prompt") ? parse_completion_request(body, c) : parse_chat_request(body, c);
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.error().code, "context_length_exceeded");
    EXPECT_NE(refused.error().message.find("at least"), std::string::npos)
        << refused.error().message;
  }
  auto count = count_message_tokens(
      ojson{{"model", "tiny"}, {"messages", {{{"role", "user"}, {"content", big}}}}}, c);
  ASSERT_FALSE(count.ok());
  EXPECT_EQ(count.error().code, "context_length_exceeded");
  // Just under the bound: tokenized, then refused by its count.
  const std::string under(longest * 62, 'a');
  auto counted = parse_completion_request(ojson{{"prompt", under}}, c);
  ASSERT_FALSE(counted.ok());
  EXPECT_EQ(counted.error().message.find("at least"), std::string::npos);
}

}  // namespace
}  // namespace recur::server
