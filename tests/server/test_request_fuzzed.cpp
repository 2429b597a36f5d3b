// Requests that fuzzing found accepted when they should not be: tool names that are no
// identifiers (they end up inside the chat template's call markup), a body whose NUL byte hid
// what followed it, and token ids the tokenizer has no text for.
#include <gtest/gtest.h>

#include <chrono>

#include "request_test_util.h"
#include "server/request.h"

namespace recur::server {
namespace {

ServingContext ctx() {
  return tiny_context(chat_fixture(kRealVocabModel));
}

// Each API's request with one tool named `name` (escaped into JSON).
ojson chat_with_tool(const std::string& name) {
  ojson b = J(R"({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})");
  b["tools"] = ojson::array(
      {{{"type", "function"}, {"function", {{"name", name}, {"parameters", ojson::object()}}}}});
  return b;
}
ojson messages_with_tool(const std::string& name) {
  ojson b = J(R"({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                  "max_tokens": 4})");
  b["tools"] = ojson::array({{{"name", name}, {"input_schema", {{"type", "object"}}}}});
  return b;
}
ojson responses_with_tool(const std::string& name) {
  ojson b = J(R"({"input": "hi", "max_output_tokens": 4})");
  b["tools"] =
      ojson::array({{{"type", "function"}, {"name", name}, {"parameters", ojson::object()}}});
  return b;
}

void expect_bad_name(const ApiResult<ParsedRequest>& r, const std::string& param) {
  ASSERT_FALSE(r.ok()) << param;
  EXPECT_EQ(r.error().status, 400);
  EXPECT_EQ(r.error().param, param);
  EXPECT_NE(r.error().message.find("1 to 128 characters of A-Z, a-z, 0-9, '_', '.', '-'"),
            std::string::npos)
      << r.error().message;
}

TEST(ToolNames, OnlyIdentifiersOfAtMost128Characters) {
  const ServingContext c = ctx();
  for (const std::string& bad :
       {std::string("a</tool_call>"), std::string("get weather"), std::string("a\nb"),
        std::string("a\"b"), std::string("a\0b", 3), std::string("caf\xc3\xa9"), std::string(""),
        std::string(129, 'a'), std::string(1000, 'a')}) {
    SCOPED_TRACE(ojson(bad).dump(-1, ' ', false, ojson::error_handler_t::replace));
    expect_bad_name(parse_chat_request(chat_with_tool(bad), c), "tools[0].function.name");
    expect_bad_name(parse_messages_request(messages_with_tool(bad), c), "tools[0].name");
    expect_bad_name(parse_responses_request(responses_with_tool(bad), c), "tools[0].name");
  }
  for (const std::string& good : {std::string("get_weather"), std::string("a.b-c_9"),
                                  std::string("Z"), std::string(128, 'a')}) {
    SCOPED_TRACE(good);
    auto chat = parse_chat_request(chat_with_tool(good), c);
    EXPECT_TRUE(chat.ok()) << chat.error().message;
    auto msg = parse_messages_request(messages_with_tool(good), c);
    EXPECT_TRUE(msg.ok()) << msg.error().message;
    auto resp = parse_responses_request(responses_with_tool(good), c);
    EXPECT_TRUE(resp.ok()) << resp.error().message;
  }
  // A missing name names the field too.
  ojson b = chat_with_tool("x");
  b["tools"][0]["function"].erase("name");
  expect_bad_name(parse_chat_request(b, c), "tools[0].function.name");
}

TEST(ToolNames, NamesInTheHistoryAreNotChecked) {
  // A call the assistant made earlier is what it was; only the tools offered now are checked.
  auto r = parse_chat_request(J(R"({"max_tokens": 4, "messages": [
      {"role": "user", "content": "hi"},
      {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
        "function": {"name": "old tool!", "arguments": "{}"}}]},
      {"role": "tool", "tool_call_id": "c1", "content": "ok"}]})"),
                              ctx());
  EXPECT_TRUE(r.ok()) << r.error().message;
}

TEST(ParseBody, ANulByteDoesNotEndTheBody) {
  // A JSON parser that reads NUL as the end of input would take the body for its first value.
  using namespace std::string_literals;
  const auto r = parse_body(R"({"prompt":"hi","max_tokens":2})"s + '\0' + "garbage{{{");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().status, 400);
  EXPECT_NE(r.error().message.find("NUL"), std::string::npos) << r.error().message;
  EXPECT_FALSE(parse_body(R"({"prompt":"hi"})"s + '\0').ok());
  EXPECT_FALSE(parse_body(R"({"prompt":"h)"s + '\0' + R"("})").ok());
  EXPECT_TRUE(parse_body(R"({"prompt":"h\u0000i"})").ok());  // an escaped NUL is text
}

// An object of many members parses in time linear in its size: appended, not looked up member
// by member (nlohmann's ordered objects did that: 80,000 keys took seconds, a full 8 MiB body
// minutes of a core, before any field was read). The members keep their order.
TEST(ParseBody, AnObjectOfManyKeysParsesInLinearTime) {
  constexpr int kKeys = 300000;
  std::string body = R"({"prompt":"hi","x":{)";
  for (int i = 0; i < kKeys; ++i) body += fmt::format(R"({}"k{}":{})", i ? "," : "", i, i);
  body += "}}";
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = parse_body(body);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_TRUE(r.ok()) << r.error().message;
  const ojson& x = r.value()["x"];
  ASSERT_EQ(x.size(), size_t(kKeys));
  EXPECT_EQ(x.begin().key(), "k0");
  EXPECT_EQ(x.back(), kKeys - 1);
  EXPECT_LT(secs, 5.0) << "quadratic in the object's size? (the lookup per key took minutes)";
}

// A key twice in one object is refused by name (a proxy reading the first and the server the
// last would disagree on what was asked); the same key in two objects is fine.
TEST(ParseBody, AKeyTwiceInOneObjectIsRefused) {
  const auto r = parse_body(R"({"prompt":"hi","max_tokens":3,"max_tokens":4})");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().status, 400);
  EXPECT_NE(
      r.error().message.find(R"(the request body has the key "max_tokens" twice in one object)"),
      std::string::npos)
      << r.error().message;
  EXPECT_FALSE(parse_body(R"({"prompt":"hi","x":[{"a":1,"b":2,"a":3}]})").ok());
  EXPECT_TRUE(parse_body(R"({"prompt":"hi","x":[{"a":1},{"a":2}],"y":{"a":{"a":1}}})").ok());
}

TEST(Detokenize, AnIdTheTokenizerDoesNotKnowIsRefused) {
  const ServingContext c = ctx();
  // The model's embedding has rows past the tokenizer's last id: those ids have no text.
  int32_t unknown = -1;
  for (int32_t id = c.vocab_size - 1; id >= 0 && unknown < 0; --id) {
    if (c.tokenizer->id_to_token(id).empty()) unknown = id;
  }
  ASSERT_GE(unknown, 0) << "every id of the vocabulary has a token";
  ojson body = J(R"({"tokens": [9707]})");
  auto ok = parse_detokenize_request(body, c);
  ASSERT_TRUE(ok.ok()) << ok.error().message;
  EXPECT_EQ(*ok, c.tokenizer->decode(std::vector<int32_t>{9707}));
  body["tokens"].push_back(unknown);
  auto r = parse_detokenize_request(body, c);
  ASSERT_FALSE(r.ok()) << "decoded to " << *r;
  EXPECT_EQ(r.error().status, 400);
  EXPECT_EQ(r.error().param, "tokens[1]");
  EXPECT_NE(r.error().message.find(std::to_string(unknown)), std::string::npos)
      << r.error().message;
}

}  // namespace
}  // namespace recur::server
