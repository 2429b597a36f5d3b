// Chat template sources (Jinja) compiled and rendered over a request with tools and every
// message role: a template that does not parse or fails while rendering is an error, never a
// crash; what it renders has the same text with and without the request-text ranges, and the
// ranges are what the tokenizer takes: not empty, sorted, disjoint and inside the text.
#include <string>
#include <string_view>

#include "fuzz_targets.h"
#include "tokenizer/chat_template.h"

namespace recur::fuzz {

namespace {

const char* kRequest = R"({"messages": [
  {"role": "system", "content": "You are <|im_start|>helpful."},
  {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?"}]},
  {"role": "assistant", "content": "", "reasoning_content": "think",
   "tool_calls": [{"id": "c1", "type": "function",
                   "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
  {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": 3}"},
  {"role": "user", "content": "and\ntomorrow?"}],
 "tools": [{"type": "function", "function": {"name": "get_weather", "description": "d",
   "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
 "add_generation_prompt": true, "chat_template_kwargs": {"enable_thinking": false}})";

}  // namespace

int fuzz_template(const uint8_t* data, size_t size) {
  std::span<const uint8_t> rest(data, size);
  const std::span<const uint8_t> source = take_piece(&rest, 0);
  static const nlohmann::ordered_json fixed = nlohmann::ordered_json::parse(kRequest);
  // After a NUL byte, the input may carry its own request.
  nlohmann::ordered_json own;
  if (!rest.empty()) own = nlohmann::ordered_json::parse(rest.begin(), rest.end(), nullptr, false);
  const nlohmann::ordered_json& request = own.is_object() ? own : fixed;

  auto tmpl = ChatTemplate::from_string(
      std::string(reinterpret_cast<const char*>(source.data()), source.size()), "<s>", "</s>");
  if (!tmpl.ok()) {
    FUZZ_CHECK(!tmpl.error().message.empty());
    return 0;
  }
  auto text = tmpl->render(request);
  auto prompt = tmpl->render_prompt(request);
  FUZZ_CHECK(text.ok() == prompt.ok());
  if (!text.ok()) {
    FUZZ_CHECK(!text.error().message.empty());
    return 0;
  }
  FUZZ_CHECK(prompt->text == *text);
  size_t end = 0;
  for (const auto& [first, second] : prompt->literal) {
    // As Tokenizer::encode takes them: not empty, sorted, disjoint, inside the text.
    FUZZ_CHECK(first >= end && first < second && second <= text->size());
    end = second;
  }
  return 0;
}

}  // namespace recur::fuzz
