// Kimi-Linear's chat template (tests/data/kimi-tokenizer-tiny/chat_template.jinja) through
// recur's Jinja engine, with what Kimi's tokenizer class adds around it (tools with sorted keys,
// the generation prompt by default). Expected texts are read off the template under
// transformers' settings (trim_blocks, lstrip_blocks): every line break of the template sits
// next to a whitespace-stripping tag except the one after "## Return of ID".
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "tokenizer/chat_template.h"

namespace recur {
namespace {

using ojson = nlohmann::ordered_json;

const std::string kKimiDir = std::string(RECUR_SOURCE_DIR) + "/tests/data/kimi-tokenizer-tiny";

std::string render(const std::string& request) {
  static const ChatTemplate* tmpl = [] {
    auto t = ChatTemplate::load(kKimiDir);
    if (!t.ok()) {
      ADD_FAILURE() << t.error().to_string();
      std::abort();
    }
    return new ChatTemplate(std::move(*t));
  }();
  auto text = tmpl->render(ojson::parse(request));
  EXPECT_TRUE(text.ok()) << text.error().to_string();
  return text.ok() ? *text : std::string();
}

TEST(ChatTemplateKimi, TurnsAndTheGenerationPrompt) {
  const std::string turns =
      "<|im_system|>system<|im_middle|>You are helpful.<|im_end|>"
      "<|im_user|>user<|im_middle|>Hi<|im_end|>"
      "<|im_assistant|>assistant<|im_middle|>Hello!<|im_end|>"
      "<|im_user|>user<|im_middle|>Bye<|im_end|>";
  const std::string messages = R"("messages": [{"role": "system", "content": "You are helpful."},
      {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
      {"role": "user", "content": "Bye"}])";
  EXPECT_EQ(render("{" + messages + R"(, "add_generation_prompt": false})"), turns);
  EXPECT_EQ(render("{" + messages + R"(, "add_generation_prompt": true})"),
            turns + "<|im_assistant|>assistant<|im_middle|>");
  // Kimi's apply_chat_template adds the generation prompt unless told not to.
  EXPECT_EQ(render("{" + messages + "}"), turns + "<|im_assistant|>assistant<|im_middle|>");
  // No default system turn; a message's name replaces its role in the header.
  EXPECT_EQ(render(R"({"messages": [{"role": "user", "name": "ann", "content": "x"}],
                       "add_generation_prompt": false})"),
            "<|im_user|>ann<|im_middle|>x<|im_end|>");
}

TEST(ChatTemplateKimi, ToolsCallsAndResults) {
  const std::string text = render(R"({"messages": [
      {"role": "user", "content": "Weather in Paris?"},
      {"role": "assistant", "content": "Let me check.", "tool_calls": [
        {"id": "functions.get_weather:0", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
        {"id": "functions.get_weather:1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"days": 2, "city": "Oslo"}}}]},
      {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"},
      {"role": "tool", "tool_call_id": "functions.get_weather:1", "name": "get_weather",
       "content": "rain"},
      {"role": "assistant", "content": "Paris is sunny."}],
    "tools": [{"type": "function", "function": {"name": "get_weather",
      "parameters": {"type": "object", "required": ["city"],
                     "properties": {"city": {"type": "string", "description": "Ville"}}},
      "description": "Météo"}}],
    "add_generation_prompt": false})");
  const std::string expected =
      // Keys sorted at every level, compact separators, non-ASCII kept.
      "<|im_system|>tool_declare<|im_middle|>"
      R"([{"function":{"description":"Météo","name":"get_weather","parameters":)"
      R"({"properties":{"city":{"description":"Ville","type":"string"}},"required":["city"],)"
      R"("type":"object"}},"type":"function"}])"
      "<|im_end|>"
      "<|im_user|>user<|im_middle|>Weather in Paris?<|im_end|>"
      "<|im_assistant|>assistant<|im_middle|>Let me check.<|tool_calls_section_begin|>"
      // String arguments as written; objects through tojson (default separators, key order).
      R"(<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"})"
      "<|tool_call_end|>"
      "<|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>"
      R"({"days": 2, "city": "Oslo"}<|tool_call_end|>)"
      "<|tool_calls_section_end|><|im_end|>"
      // A result is a system-side turn named for the tool (or "tool"), after its call's id.
      "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\nsunny<|im_end|>"
      "<|im_system|>get_weather<|im_middle|>## Return of functions.get_weather:1\nrain<|im_end|>"
      "<|im_assistant|>assistant<|im_middle|>Paris is sunny.<|im_end|>";
  EXPECT_EQ(text, expected);
  // A call without content: nothing before the section.
  EXPECT_EQ(render(R"({"messages": [{"role": "assistant", "content": null, "tool_calls": [
                {"id": "functions.f:0", "type": "function",
                 "function": {"name": "f", "arguments": "{}"}}]}],
              "add_generation_prompt": false})"),
            "<|im_assistant|>assistant<|im_middle|><|tool_calls_section_begin|><|tool_call_begin|>"
            "functions.f:0<|tool_call_argument_begin|>{}<|tool_call_end|>"
            "<|tool_calls_section_end|><|im_end|>");
}

TEST(ChatTemplateKimi, ContentPartsReachTheTemplateAsParts) {
  // The template loops over the parts itself (through a variable set from msg.get('content')),
  // so they are joined by nothing, as transformers renders them.
  EXPECT_EQ(render(R"({"messages": [{"role": "user", "content": [
                 {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
               "add_generation_prompt": false})"),
            "<|im_user|>user<|im_middle|>ab<|im_end|>");
}

}  // namespace
}  // namespace recur
