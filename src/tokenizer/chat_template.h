// Chat prompts rendered exactly as transformers' tokenizer.apply_chat_template(tokenize=False)
// renders them, from the model's own Jinja chat template.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "core/status.h"

namespace recur {

class ChatTemplate {
 public:
  // Reads chat_template from model_dir/tokenizer_config.json (a string, or a list of named
  // templates: "default", plus "tool_use" which transformers picks when tools are given), or
  // model_dir/chat_template.jinja, which wins when present. bos_token / eos_token come from
  // tokenizer_config.json (a string or an {"content": ...} object).
  static Result<ChatTemplate> load(const std::string& model_dir);
  // An empty token leaves that variable undefined, as transformers does for a None token.
  static Result<ChatTemplate> from_string(std::string source, std::string bos_token,
                                          std::string eos_token);

  // request: {"messages": [...], "tools": [...]?, "documents": [...]?,
  //           "add_generation_prompt": bool?, "chat_template_kwargs": {...}?}
  // Content given as a list of {"type": "text", "text": ...} parts reaches templates that loop
  // over content as it is; for the others the texts are joined with "\n", as vLLM does.
  // Object key order is what tojson prints, so parse requests as ordered_json.
  Result<std::string> render(const nlohmann::ordered_json& request) const;
  // nlohmann::json has already sorted object keys; tojson output then follows that order.
  Result<std::string> render(const nlohmann::json& request) const;

  const std::string& source() const;

 private:
  ChatTemplate() = default;
  struct Impl;
  std::shared_ptr<const Impl> impl_;
};

}  // namespace recur
