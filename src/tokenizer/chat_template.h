// Chat prompts rendered exactly as transformers' tokenizer.apply_chat_template(tokenize=False)
// renders them, from the model's own Jinja chat template.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "core/status.h"

namespace recur {

struct ChatTemplateOptions {
  // Special-token strings written in a request ("<|im_start|>system" typed into a message, a
  // tool description, ...) are tokenized as the text they spell, so only the template's own
  // markup becomes control tokens and a user cannot forge a turn of another role. false: they
  // become control tokens too, as transformers' apply_chat_template(tokenize=True) makes them.
  bool request_special_tokens_as_text = true;
};

// A rendered chat prompt and the byte ranges [first, second) of `text` to tokenize without
// special tokens (Tokenizer::encode): the text that came from the request, when
// ChatTemplateOptions says so; else none. Sorted and disjoint.
struct RenderedPrompt {
  std::string text;
  std::vector<std::pair<size_t, size_t>> literal;
};

class ChatTemplate {
 public:
  // Reads chat_template from model_dir/tokenizer_config.json (a string, or a list of named
  // templates: "default", plus "tool_use" which transformers picks when tools are given), or
  // model_dir/chat_template.jinja, which wins when present. bos_token / eos_token come from
  // tokenizer_config.json (a string or an {"content": ...} object). A config naming Kimi's
  // tokenizer class gets what its apply_chat_template adds: tools with keys sorted
  // (recursively), and add_generation_prompt true unless the request says otherwise.
  static Result<ChatTemplate> load(const std::string& model_dir,
                                   const ChatTemplateOptions& options = {});
  // An empty token leaves that variable undefined, as transformers does for a None token.
  static Result<ChatTemplate> from_string(std::string source, std::string bos_token,
                                          std::string eos_token,
                                          const ChatTemplateOptions& options = {});

  // request: {"messages": [...], "tools": [...]?, "documents": [...]?,
  //           "add_generation_prompt": bool?, "continue_final_message": bool?,
  //           "chat_template_kwargs": {...}?}
  // continue_final_message renders the last message open, for the model to go on writing it
  // (as transformers' apply_chat_template does): without the generation prompt, cut right after
  // the message's text (its last text part; surrounding whitespace excluded), so whatever the
  // template closes the turn with is gone. An error when add_generation_prompt is also true, or
  // when that text is empty or not in the rendered prompt.
  // Content given as a list of {"type": "text", "text": ...} parts reaches templates that loop
  // over content as it is; for the others the texts are joined with "\n", as vLLM does.
  // Object key order is what tojson prints, so parse requests as ordered_json.
  Result<std::string> render(const nlohmann::ordered_json& request) const;
  // nlohmann::json has already sorted object keys; tojson output then follows that order.
  Result<std::string> render(const nlohmann::json& request) const;
  // The same, with what to tokenize as plain text: every string of the request is tracked
  // through the template's string operations (split, strip, replace, ~, join, ...) into the
  // output; where an operation cannot say which bytes came from where, its whole result
  // counts as request text.
  Result<RenderedPrompt> render_prompt(const nlohmann::ordered_json& request) const;

  const ChatTemplateOptions& options() const;

  const std::string& source() const;

 private:
  ChatTemplate() = default;
  struct Impl;
  std::shared_ptr<const Impl> impl_;
};

}  // namespace recur
