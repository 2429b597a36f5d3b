// ChatTemplate: the Qwen3 template of the test model rendered exactly as transformers'
// apply_chat_template renders it (reference cases), more conversations checked against Jinja,
// loading rules, and request validation.
#include "tokenizer/chat_template.h"

#include <gtest/gtest.h>

#include <unistd.h>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

namespace recur {
namespace {

namespace fs = std::filesystem;

const std::string kModelDir = std::string(RECUR_SOURCE_DIR) + "/models/qwen3next-tiny-realvocab";
const std::string kReferenceCases =
    std::string(RECUR_SOURCE_DIR) + "/tests/data/tokenizer-qwen3/chat_template.json";

ChatTemplate load_model_template() {
  auto t = ChatTemplate::load(kModelDir);
  if (!t.ok()) {
    ADD_FAILURE() << t.error().to_string();
    return ChatTemplate::from_string("", "", "").value();
  }
  return std::move(t).value();
}

Result<std::string> render(const ChatTemplate& t, const char* request_json) {
  return t.render(nlohmann::ordered_json::parse(request_json));
}

// A scratch model directory, removed when the test ends.
class TempModelDir {
 public:
  explicit TempModelDir(const std::string& tag)
      : path_(fs::temp_directory_path() /
              ("recur_chat_template_" + tag + "_" + std::to_string(::getpid()))) {
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempModelDir() { fs::remove_all(path_); }
  void write(const std::string& name, const std::string& text) const {
    std::ofstream(path_ / name, std::ios::binary) << text;
  }
  std::string path() const { return path_.string(); }

 private:
  fs::path path_;
};

// The reference data: transformers' own renders of the test model's template.
TEST(ChatTemplate, MatchesTransformersReferenceCases) {
  std::ifstream in(kReferenceCases);
  ASSERT_TRUE(in) << kReferenceCases;
  const auto cases = nlohmann::ordered_json::parse(in);
  ASSERT_TRUE(cases.is_array());
  ASSERT_EQ(cases.size(), 12u);
  const ChatTemplate t = load_model_template();
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto& c = cases[i];
    SCOPED_TRACE("case " + std::to_string(i) + ": " + c["messages"].dump());
    nlohmann::ordered_json request = {{"messages", c["messages"]},
                                      {"add_generation_prompt", c["add_generation_prompt"]}};
    if (!c["tools"].is_null()) request["tools"] = c["tools"];
    if (!c["extra"].empty()) request["chat_template_kwargs"] = c["extra"];
    auto out = t.render(request);
    ASSERT_TRUE(out.ok()) << out.error().to_string();
    EXPECT_EQ(out.value(), c["rendered"].get<std::string>());
  }
}

// Conversations the reference data lacks. Expected texts are Jinja's renders of the same
// template in transformers' environment; text parts are joined with "\n" and a null content
// becomes "" first, as vLLM does for templates that expect string content.
struct ConversationCase {
  const char* name;
  const char* request;
  const char* expected;
};

const ConversationCase kConversations[] = {
    {"tool calls with object arguments and consecutive tool responses",
     R"({"messages": [{"role": "system", "content": "You help."}, {"role": "user", "content": "Weather in Paris and Lyon?"}, {"role": "assistant", "content": "Checking both.", "tool_calls": [{"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}, {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Lyon", "units": ["C", "F"], "detail": {"hourly": false, "days": 2.0}}}}]}, {"role": "tool", "tool_call_id": "a", "content": "{\"temp\": 21}"}, {"role": "tool", "tool_call_id": "b", "content": "{\"temp\": 19}"}, {"role": "assistant", "content": "Paris 21, Lyon 19."}, {"role": "user", "content": "Thanks — and Nice?"}], "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Current weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}], "add_generation_prompt": true})",
     R"(<|im_start|>system
You help.

# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{"type": "function", "function": {"name": "get_weather", "description": "Current weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
<|im_start|>user
Weather in Paris and Lyon?<|im_end|>
<|im_start|>assistant
Checking both.
<tool_call>
{"name": "get_weather", "arguments": {"city": "Paris"}}
</tool_call>
<tool_call>
{"name": "get_weather", "arguments": {"city": "Lyon", "units": ["C", "F"], "detail": {"hourly": false, "days": 2.0}}}
</tool_call><|im_end|>
<|im_start|>user
<tool_response>
{"temp": 21}
</tool_response>
<tool_response>
{"temp": 19}
</tool_response><|im_end|>
<|im_start|>assistant
Paris 21, Lyon 19.<|im_end|>
<|im_start|>user
Thanks — and Nice?<|im_end|>
<|im_start|>assistant
)"},
    {"tool call arguments given as a JSON string are printed verbatim",
     R"({"messages": [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": null, "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]}, {"role": "tool", "content": "sunny"}], "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Current weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}], "add_generation_prompt": true})",
     R"(<|im_start|>system
# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{"type": "function", "function": {"name": "get_weather", "description": "Current weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
<|im_start|>user
Weather?<|im_end|>
<|im_start|>assistant
<tool_call>
{"name": "get_weather", "arguments": {"city":"Paris"}}
</tool_call><|im_end|>
<|im_start|>user
<tool_response>
sunny
</tool_response><|im_end|>
<|im_start|>assistant
)"},
    {"thinking in history is dropped before the last query and kept after it",
     R"({"messages": [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "<think>\nfirst thoughts\n</think>\n\nA1"}, {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "<think>\nsecond thoughts\n</think>\n\nA2"}], "add_generation_prompt": false})",
     R"(<|im_start|>user
Q1<|im_end|>
<|im_start|>assistant
A1<|im_end|>
<|im_start|>user
Q2<|im_end|>
<|im_start|>assistant
<think>
second thoughts
</think>

A2<|im_end|>
)"},
    {"reasoning_content field is used instead of parsing content",
     R"({"messages": [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1", "reasoning_content": "old reasoning"}, {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "\nA2", "reasoning_content": "\nnew reasoning\n"}], "add_generation_prompt": false})",
     R"(<|im_start|>user
Q1<|im_end|>
<|im_start|>assistant
A1<|im_end|>
<|im_start|>user
Q2<|im_end|>
<|im_start|>assistant
<think>
new reasoning
</think>

A2<|im_end|>
)"},
    {"multi-step tool use keeps reasoning of every step after the query", R"({"messages": [{"role": "user", "content": "Plan a trip"}, {"role": "assistant", "content": "", "reasoning_content": "need weather", "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]}, {"role": "tool", "content": "hot"}, {"role": "assistant", "content": "<think>\nit is hot\n</think>\n\nPack light."}], "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Current weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}], "add_generation_prompt": false})",
     R"(<|im_start|>system
# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{"type": "function", "function": {"name": "get_weather", "description": "Current weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
<|im_start|>user
Plan a trip<|im_end|>
<|im_start|>assistant
<think>
need weather
</think>

<tool_call>
{"name": "get_weather", "arguments": {"city": "Rome"}}
</tool_call><|im_end|>
<|im_start|>user
<tool_response>
hot
</tool_response><|im_end|>
<|im_start|>assistant
<think>
it is hot
</think>

Pack light.<|im_end|>
)"},
    {"content given as text parts",
     R"({"messages": [{"role": "system", "content": [{"type": "text", "text": "Be terse."}]}, {"role": "user", "content": [{"type": "text", "text": "First part."}, {"type": "text", "text": "Second part."}]}], "add_generation_prompt": true})",
     R"(<|im_start|>system
Be terse.<|im_end|>
<|im_start|>user
First part.
Second part.<|im_end|>
<|im_start|>assistant
)"},
    {"enable_thinking false after a multi-turn history",
     R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}], "add_generation_prompt": true, "chat_template_kwargs": {"enable_thinking": false}})",
     R"(<|im_start|>user
Hi<|im_end|>
<|im_start|>assistant
Hello!<|im_end|>
<|im_start|>user
Bye<|im_end|>
<|im_start|>assistant
<think>

</think>

)"},
    {"tool response wrapped like a user turn is not a query",
     R"({"messages": [{"role": "user", "content": "Go"}, {"role": "assistant", "content": "<think>\nstep\n</think>\n\ncalling"}, {"role": "user", "content": "<tool_response>\nok\n</tool_response>"}], "add_generation_prompt": true})",
     R"(<|im_start|>user
Go<|im_end|>
<|im_start|>assistant
<think>
step
</think>

calling<|im_end|>
<|im_start|>user
<tool_response>
ok
</tool_response><|im_end|>
<|im_start|>assistant
)"},
};

TEST(ChatTemplate, MoreConversationsMatchJinja) {
  const ChatTemplate t = load_model_template();
  for (const ConversationCase& c : kConversations) {
    SCOPED_TRACE(c.name);
    auto out = render(t, c.request);
    ASSERT_TRUE(out.ok()) << out.error().to_string();
    EXPECT_EQ(out.value(), c.expected);
  }
}

TEST(ChatTemplate, DefaultsToNoGenerationPrompt) {
  const ChatTemplate t = load_model_template();
  auto out = render(t, R"({"messages": [{"role": "user", "content": "Hi"}]})");
  ASSERT_TRUE(out.ok()) << out.error().to_string();
  EXPECT_EQ(out.value(), "<|im_start|>user\nHi<|im_end|>\n");
}

// nlohmann::json sorts keys; without tools nothing prints a dict, so the text is the same.
TEST(ChatTemplate, PlainJsonRequestRenders) {
  const ChatTemplate t = load_model_template();
  nlohmann::json request = {{"messages", {{{"role", "user"}, {"content", "Hi"}}}},
                            {"add_generation_prompt", true}};
  auto out = t.render(request);
  ASSERT_TRUE(out.ok()) << out.error().to_string();
  EXPECT_EQ(out.value(), "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
}

TEST(ChatTemplate, TemplatesThatLoopOverContentGetThePartsAsGiven) {
  auto t = ChatTemplate::from_string(
      "{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}"
      "{% for p in m.content %}[{{ p.type }}:{{ p.text }}]{% endfor %}{% endif %}{% endfor %}",
      "", "");
  ASSERT_TRUE(t.ok()) << t.error().to_string();
  auto out = render(*t, R"({"messages": [{"role": "user", "content": [
      {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}, {"role": "user", "content": "c"}]})");
  ASSERT_TRUE(out.ok()) << out.error().to_string();
  EXPECT_EQ(out.value(), "[text:a][text:b]c");
}

TEST(ChatTemplate, SpecialTokensAndKwargsReachTheTemplate) {
  auto t = ChatTemplate::from_string(
      "{{ bos_token }}|{{ eos_token }}|{{ custom }}|{{ tools is none }}|{{ documents is none }}|"
      "{{ add_generation_prompt }}",
      "<s>", "</s>");
  ASSERT_TRUE(t.ok()) << t.error().to_string();
  auto out = render(*t, R"({"messages": [], "add_generation_prompt": true,
                             "chat_template_kwargs": {"custom": [1, "x"]}})");
  ASSERT_TRUE(out.ok()) << out.error().to_string();
  EXPECT_EQ(out.value(), "<s>|</s>|[1, 'x']|True|True|True");

  auto docs = ChatTemplate::from_string("{{ documents|map(attribute='title')|join(',') }}", "", "");
  ASSERT_TRUE(docs.ok());
  auto out_docs =
      render(*docs, R"({"messages": [], "documents": [{"title": "a"}, {"title": "b"}]})");
  ASSERT_TRUE(out_docs.ok()) << out_docs.error().to_string();
  EXPECT_EQ(out_docs.value(), "a,b");

  // An empty token is left undefined, like a None token in transformers.
  auto no_bos = ChatTemplate::from_string("{{ bos_token is defined }}{{ eos_token }}", "", "E");
  ASSERT_TRUE(no_bos.ok());
  auto out2 = render(*no_bos, R"({"messages": []})");
  ASSERT_TRUE(out2.ok());
  EXPECT_EQ(out2.value(), "FalseE");
}

TEST(ChatTemplate, RaiseExceptionMessageIsTheError) {
  auto t = ChatTemplate::from_string(
      "{% if messages[0].role != 'user' %}{{ raise_exception('First message must be from the "
      "user.') }}{% endif %}ok",
      "", "");
  ASSERT_TRUE(t.ok());
  auto out = render(*t, R"({"messages": [{"role": "assistant", "content": "x"}]})");
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.error().code, ErrorCode::kInvalidArgument);
  EXPECT_EQ(out.error().message, "First message must be from the user.");
}

TEST(ChatTemplate, RejectsMalformedRequests) {
  const ChatTemplate t = load_model_template();
  struct Bad {
    const char* request;
    ErrorCode code;
    const char* needle;
  };
  const Bad cases[] = {
      {R"([1, 2])", ErrorCode::kInvalidArgument, "must be a JSON object"},
      {R"({"tools": []})", ErrorCode::kInvalidArgument, "\"messages\" array"},
      {R"({"messages": ["hi"]})", ErrorCode::kInvalidArgument, "messages[0] must be an object"},
      {R"({"messages": [], "add_generation_prompt": "yes"})", ErrorCode::kInvalidArgument,
       "add_generation_prompt"},
      {R"({"messages": [], "chat_template_kwargs": [1]})", ErrorCode::kInvalidArgument,
       "must be an object"},
      {R"({"messages": [], "chat_template_kwargs": {"messages": []}})", ErrorCode::kInvalidArgument,
       "may not set \"messages\""},
      {R"({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})",
       ErrorCode::kUnsupported, "messages[0].content[0]: only text parts are supported"},
      {R"({"messages": [{"role": "user", "content": [{"type": "text"}]}]})",
       ErrorCode::kInvalidArgument, "needs a \"text\" string"},
      {R"({"messages": [{"role": "user", "content": "x", "n": 18446744073709551615}]})",
       ErrorCode::kUnsupported, "too large"},
      // The template itself fails here: messages[0] of an empty list is undefined.
      {R"({"messages": []})", ErrorCode::kInvalidArgument, "chat template line"},
  };
  for (const Bad& bad : cases) {
    SCOPED_TRACE(bad.request);
    auto out = render(t, bad.request);
    ASSERT_FALSE(out.ok());
    EXPECT_EQ(out.error().code, bad.code) << out.error().to_string();
    EXPECT_NE(out.error().message.find(bad.needle), std::string::npos) << out.error().message;
  }
}

// Request data nested deeper than any chat needs is refused rather than recursed into.
TEST(ChatTemplate, RejectsDeeplyNestedRequestData) {
  const ChatTemplate t = load_model_template();
  const std::string deep = std::string(600, '[') + std::string(600, ']');
  auto out = render(
      t, (R"({"messages": [{"role": "user", "content": "x", "extra": )" + deep + "}]}").c_str());
  ASSERT_FALSE(out.ok());
  EXPECT_NE(out.error().message.find("nested more than 512 levels"), std::string::npos)
      << out.error().message;
}

// A template that grows a string or list without bound (a checkpoint's, run on every request)
// ends with an error naming the bound, not with all of memory.
TEST(ChatTemplate, TemplatesThatExplodeStopAtTheStringBound) {
  const char* templates[] = {
      "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
      "{% endfor %}{{ ns.s | length }}",
      "{% set ns = namespace(s=[1, 2]) %}{% for i in range(64) %}{% set ns.s = ns.s * 2 %}"
      "{% endfor %}{{ ns.s | length }}",
      "{{ 'x' * 100000000 }}",
      "{{ messages | tojson(indent=1000000000) }}",
      "{{ 'a\nb' | indent(1000000000, true) }}",
      "{% set ns = namespace(s='ab') %}{% for i in range(64) %}"
      "{% set ns.s = ns.s.replace('a', 'aa').replace('b', 'bb') %}{% endfor %}{{ ns.s }}",
      "{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}",  // the output itself
  };
  for (const char* text : templates) {
    SCOPED_TRACE(text);
    auto t = ChatTemplate::from_string(text, "", "");
    ASSERT_TRUE(t.ok()) << t.error().to_string();
    auto out = render(*t, R"({"messages": [{"role": "user", "content": "x"}]})");
    ASSERT_FALSE(out.ok());
    EXPECT_EQ(out.error().code, ErrorCode::kOutOfResources) << out.error().to_string();
    EXPECT_NE(out.error().message.find("more than 64 MiB"), std::string::npos)
        << out.error().message;
  }
}

TEST(ChatTemplate, LoadPrefersChatTemplateJinja) {
  TempModelDir dir("jinja_wins");
  dir.write("tokenizer_config.json",
            R"({"chat_template": "from config", "bos_token": {"content": "<s>", "lstrip": false},
                "eos_token": "</s>"})");
  dir.write("chat_template.jinja", "from file {{ bos_token }}{{ eos_token }}\n");
  auto t = ChatTemplate::load(dir.path());
  ASSERT_TRUE(t.ok()) << t.error().to_string();
  auto out = render(*t, R"({"messages": []})");
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(out.value(), "from file <s></s>");  // Jinja drops the file's final newline
}

TEST(ChatTemplate, LoadNamedTemplatesPicksToolUseWhenToolsAreGiven) {
  TempModelDir dir("named");
  dir.write("tokenizer_config.json",
            R"({"chat_template": [{"name": "default", "template": "default {{ messages|length }}"},
                                  {"name": "rag", "template": "rag"},
                                  {"name": "tool_use", "template": "tools {{ tools|length }}"}]})");
  auto t = ChatTemplate::load(dir.path());
  ASSERT_TRUE(t.ok()) << t.error().to_string();
  auto plain = render(*t, R"({"messages": [{"role": "user", "content": "x"}]})");
  auto tools = render(*t, R"({"messages": [], "tools": [{"type": "function"}]})");
  ASSERT_TRUE(plain.ok() && tools.ok());
  EXPECT_EQ(plain.value(), "default 1");
  EXPECT_EQ(tools.value(), "tools 1");
  EXPECT_EQ(t->source(), "default {{ messages|length }}");
}

TEST(ChatTemplate, LoadErrors) {
  TempModelDir empty("empty");
  auto missing = ChatTemplate::load(empty.path());
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.error().code, ErrorCode::kNotFound);

  TempModelDir corrupt("corrupt");
  corrupt.write("tokenizer_config.json", "{not json");
  auto bad_json = ChatTemplate::load(corrupt.path());
  ASSERT_FALSE(bad_json.ok());
  EXPECT_EQ(bad_json.error().code, ErrorCode::kCorrupt);

  TempModelDir no_default("no_default");
  no_default.write("tokenizer_config.json",
                   R"({"chat_template": [{"name": "tool_use", "template": "x"}]})");
  auto nameless = ChatTemplate::load(no_default.path());
  ASSERT_FALSE(nameless.ok());
  EXPECT_NE(nameless.error().message.find("\"default\""), std::string::npos);

  TempModelDir bad_syntax("bad_syntax");
  bad_syntax.write("chat_template.jinja", "{% for m in messages %}{{ m|nosuchfilter }}");
  auto unsupported = ChatTemplate::load(bad_syntax.path());
  ASSERT_FALSE(unsupported.ok());
  EXPECT_EQ(unsupported.error().code, ErrorCode::kUnsupported);
  EXPECT_NE(unsupported.error().message.find("chat template line 1, column 29"), std::string::npos)
      << unsupported.error().message;
}

TEST(ChatTemplate, ConcurrentRendersAgree) {
  const ChatTemplate t = load_model_template();
  const auto request = nlohmann::ordered_json::parse(kConversations[0].request);
  std::vector<std::string> results(4);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < results.size(); ++i) {
    threads.emplace_back([&, i] {
      for (int k = 0; k < 25; ++k) {
        auto out = t.render(request);
        results[i] = out.ok() ? out.value() : out.error().to_string();
      }
    });
  }
  for (auto& th : threads) th.join();
  for (const auto& r : results) EXPECT_EQ(r, kConversations[0].expected);
}

}  // namespace
}  // namespace recur
