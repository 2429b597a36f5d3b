#include "tokenizer/chat_template.h"

#include <algorithm>
#include <filesystem>
#include <optional>

#include "io/json_text.h"
#include "io/mapped_file.h"
#include "tokenizer/jinja_eval.h"
#include "tokenizer/jinja_marked.h"
#include "tokenizer/tiktoken.h"

namespace recur {

namespace {

constexpr const char* kTemplateName = "chat template";
// vLLM joins the text parts of a message for templates that expect content to be a string.
constexpr const char* kTextPartSeparator = "\n";

struct NamedTemplate {
  std::string source;
  jinja::Template compiled;
  bool takes_content_parts = false;  // the template loops over message content itself
};

Result<NamedTemplate> compile(std::string source) {
  RECUR_ASSIGN_OR_RETURN(jinja::Template compiled, jinja::Template::parse(source, kTemplateName));
  NamedTemplate t;
  t.takes_content_parts = compiled.has_loop_over("content");
  t.source = std::move(source);
  t.compiled = std::move(compiled);
  return t;
}

// A special token as tokenizer_config.json stores it: "text", {"content": "text"}, or null.
Result<std::string> token_text(const nlohmann::json& config, const char* key) {
  auto it = config.find(key);
  if (it == config.end() || it->is_null()) return std::string();
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) {
    return (*it)["content"].get<std::string>();
  }
  return make_error(ErrorCode::kCorrupt,
                    "tokenizer_config.json: {} is neither a string nor "
                    "an object with a \"content\" string",
                    key);
}

using jinja::Dict;
using jinja::List;
using jinja::Value;

// What a tokenizer class adds to rendering around the template itself.
struct ClassRules {
  bool sort_tool_keys = false;  // Kimi: tools reach the template with keys sorted, recursively
  bool add_generation_prompt = false;  // its default when the request does not say
};

nlohmann::ordered_json sorted_keys(const nlohmann::ordered_json& j) {
  if (j.is_array()) {
    nlohmann::ordered_json out = nlohmann::ordered_json::array();
    for (const auto& x : j) out.push_back(sorted_keys(x));
    return out;
  }
  if (!j.is_object()) return j;
  std::vector<std::string> keys;
  for (const auto& [k, v] : j.items()) keys.push_back(k);
  std::sort(keys.begin(), keys.end());  // bytewise: code point order, as Python sorts str
  nlohmann::ordered_json out = nlohmann::ordered_json::object();
  for (const std::string& k : keys) out[k] = sorted_keys(j[k]);
  return out;
}

// Every string of the request is marked as request data (jinja_marked.h), so the rendered
// prompt can tell the template's markup from the same text written in a message.
Result<Value> content_value(const nlohmann::ordered_json& content, bool takes_parts, size_t index) {
  if (content.is_string()) return Value::request_string(content.get<std::string>());
  if (content.is_null()) return takes_parts ? Value::none() : Value::string("");
  if (!content.is_array() || takes_parts) return jinja::value_from_request(content);
  jinja::MarkedText joined;
  for (size_t j = 0; j < content.size(); ++j) {
    const auto& part = content[j];
    if (!part.is_object() || !part.contains("type") || part["type"] != "text") {
      std::string type = part.is_object() && part.contains("type") ? part["type"].dump() : "?";
      return make_error(ErrorCode::kUnsupported,
                        "messages[{}].content[{}]: only text parts are supported, got type {}",
                        index, j, type);
    }
    if (!part.contains("text") || !part["text"].is_string()) {
      return make_error(ErrorCode::kInvalidArgument,
                        "messages[{}].content[{}]: a text part needs a \"text\" string", index, j);
    }
    if (j) joined.append(kTextPartSeparator);
    joined.append_request(part["text"].get<std::string>());
  }
  return joined.take();
}

Result<Dict> render_globals(const nlohmann::ordered_json& request, bool takes_parts,
                            bool continue_final, const std::string& bos, const std::string& eos,
                            const ClassRules& rules) {
  if (!request.is_object()) {
    return make_error(ErrorCode::kInvalidArgument, "chat request must be a JSON object");
  }
  auto messages_it = request.find("messages");
  if (messages_it == request.end() || !messages_it->is_array()) {
    return make_error(ErrorCode::kInvalidArgument, "chat request needs a \"messages\" array");
  }
  Dict globals;
  if (!bos.empty()) globals.set("bos_token", Value::string(bos));
  if (!eos.empty()) globals.set("eos_token", Value::string(eos));

  List messages;
  for (size_t i = 0; i < messages_it->size(); ++i) {
    const auto& m = (*messages_it)[i];
    if (!m.is_object()) {
      return make_error(ErrorCode::kInvalidArgument, "messages[{}] must be an object", i);
    }
    Dict message;
    message.keys_from_request = true;
    for (const auto& [key, field] : m.items()) {
      if (key == "content") {
        RECUR_ASSIGN_OR_RETURN(Value content, content_value(field, takes_parts, i));
        message.set(key, std::move(content));
      } else {
        message.set(key, jinja::value_from_request(field));
      }
    }
    messages.push_back(Value::dict(std::move(message)));
  }
  globals.set("messages", Value::list(std::move(messages)));

  auto tools_it = request.find("tools");
  if (tools_it == request.end()) {
    globals.set("tools", Value::none());
  } else {
    globals.set("tools", jinja::value_from_request(rules.sort_tool_keys ? sorted_keys(*tools_it)
                                                                        : *tools_it));
  }
  auto documents_it = request.find("documents");
  globals.set("documents", documents_it == request.end()
                               ? Value::none()
                               : jinja::value_from_request(*documents_it));

  bool add_generation_prompt = rules.add_generation_prompt && !continue_final;
  auto agp_it = request.find("add_generation_prompt");
  if (agp_it != request.end() && !agp_it->is_null()) {
    if (!agp_it->is_boolean()) {
      return make_error(ErrorCode::kInvalidArgument, "\"add_generation_prompt\" must be a bool");
    }
    add_generation_prompt = agp_it->get<bool>();
    if (add_generation_prompt && continue_final) {
      return make_error(ErrorCode::kInvalidArgument,
                        "chat request: \"continue_final_message\" and \"add_generation_prompt\" "
                        "cannot both be true");
    }
  }
  globals.set("add_generation_prompt", Value::boolean(add_generation_prompt));

  auto kwargs_it = request.find("chat_template_kwargs");
  if (kwargs_it != request.end() && !kwargs_it->is_null()) {
    if (!kwargs_it->is_object()) {
      return make_error(ErrorCode::kInvalidArgument, "\"chat_template_kwargs\" must be an object");
    }
    for (const auto& [key, value] : kwargs_it->items()) {
      if (key == "messages" || key == "tools" || key == "documents" ||
          key == "add_generation_prompt" || key == "continue_final_message") {
        return make_error(ErrorCode::kInvalidArgument,
                          "chat_template_kwargs may not set \"{}\"; it is a request field", key);
      }
      globals.set(key, jinja::value_from_request(value));
    }
  }
  return globals;
}

Result<bool> continue_final_message(const nlohmann::ordered_json& request) {
  if (!request.is_object()) return false;
  auto it = request.find("continue_final_message");
  if (it == request.end() || it->is_null()) return false;
  if (!it->is_boolean()) {
    return make_error(ErrorCode::kInvalidArgument,
                      "chat request: \"continue_final_message\" must be a bool");
  }
  return it->get<bool>();
}

// Leaves the final message open: the prompt ends where its text ends in the rendered prompt.
Status cut_after_final_message(const nlohmann::ordered_json& request, RenderedPrompt* prompt) {
  const auto& messages = request["messages"];  // render_globals checked it is an array
  const nlohmann::ordered_json* content = nullptr;
  if (!messages.empty() && messages.back().is_object() && messages.back().contains("content")) {
    content = &messages.back()["content"];
  }
  std::string_view text;
  if (content && content->is_string()) {
    text = content->get_ref<const std::string&>();
  } else if (content && content->is_array()) {
    for (auto part = content->rbegin(); part != content->rend(); ++part) {
      if (part->is_object() && part->contains("text") && (*part)["text"].is_string()) {
        text = (*part)["text"].get_ref<const std::string&>();
        break;
      }
    }
  }
  constexpr std::string_view kSpace = " \t\r\n\f\v";
  const size_t first = text.find_first_not_of(kSpace);
  if (first == std::string_view::npos) {
    return make_error(ErrorCode::kInvalidArgument,
                      "chat request: continue_final_message needs text in the final message");
  }
  text = text.substr(first, text.find_last_not_of(kSpace) + 1 - first);
  const size_t at = prompt->text.rfind(text);
  if (at == std::string::npos) {
    return make_error(ErrorCode::kInvalidArgument,
                      "chat request: continue_final_message: the chat template does not write "
                      "the final message's text into the prompt");
  }
  const size_t cut = at + text.size();
  prompt->text.resize(cut);
  auto& spans = prompt->literal;
  std::erase_if(spans, [&](const std::pair<size_t, size_t>& r) { return r.first >= cut; });
  if (!spans.empty()) spans.back().second = std::min(spans.back().second, cut);
  return {};
}

}  // namespace

struct ChatTemplate::Impl {
  NamedTemplate main;
  std::optional<NamedTemplate> tool_use;
  std::string bos_token;
  std::string eos_token;
  ChatTemplateOptions options;
  ClassRules rules;
};

Result<ChatTemplate> ChatTemplate::from_string(std::string source, std::string bos_token,
                                               std::string eos_token,
                                               const ChatTemplateOptions& options) {
  auto impl = std::make_shared<Impl>();
  impl->options = options;
  RECUR_ASSIGN_OR_RETURN(impl->main, compile(std::move(source)));
  impl->bos_token = std::move(bos_token);
  impl->eos_token = std::move(eos_token);
  ChatTemplate t;
  t.impl_ = std::move(impl);
  return t;
}

Result<ChatTemplate> ChatTemplate::load(const std::string& model_dir,
                                        const ChatTemplateOptions& options) {
  namespace fs = std::filesystem;
  const std::string config_path = (fs::path(model_dir) / "tokenizer_config.json").string();
  const std::string jinja_path = (fs::path(model_dir) / "chat_template.jinja").string();
  std::error_code ec;
  const bool has_config = fs::is_regular_file(config_path, ec);
  const bool has_jinja = fs::is_regular_file(jinja_path, ec);

  nlohmann::json config = nlohmann::json::object();
  if (has_config) {
    RECUR_ASSIGN_OR_RETURN(std::string text, read_text_file(config_path));
    RECUR_ASSIGN_OR_RETURN(config, parse_json(text, config_path));
    if (!config.is_object()) {
      return make_error(ErrorCode::kCorrupt, "{}: not a JSON object", config_path);
    }
  }

  auto impl = std::make_shared<Impl>();
  impl->options = options;
  RECUR_ASSIGN_OR_RETURN(impl->bos_token, token_text(config, "bos_token"));
  RECUR_ASSIGN_OR_RETURN(impl->eos_token, token_text(config, "eos_token"));
  // Kimi's tokenizer sorts the tools' keys before rendering, and adds the generation prompt
  // unless told not to (its apply_chat_template).
  if (names_kimi_tokenizer(config)) impl->rules = {true, true};

  if (has_jinja) {
    RECUR_ASSIGN_OR_RETURN(std::string source, read_text_file(jinja_path));
    RECUR_ASSIGN_OR_RETURN(impl->main, compile(std::move(source)));
  } else {
    auto it = config.find("chat_template");
    if (it == config.end() || it->is_null()) {
      return make_error(ErrorCode::kNotFound,
                        "{}: no chat template (neither chat_template.jinja nor a chat_template "
                        "entry in tokenizer_config.json)",
                        model_dir);
    }
    if (it->is_string()) {
      RECUR_ASSIGN_OR_RETURN(impl->main, compile(it->get<std::string>()));
    } else if (it->is_array()) {
      bool has_default = false;
      for (const auto& entry : *it) {
        if (!entry.is_object() || !entry.contains("name") || !entry["name"].is_string() ||
            !entry.contains("template") || !entry["template"].is_string()) {
          return make_error(ErrorCode::kCorrupt,
                            "{}: chat_template list entries need \"name\" and \"template\" strings",
                            config_path);
        }
        const std::string name = entry["name"].get<std::string>();
        if (name != "default" && name != "tool_use") continue;
        RECUR_ASSIGN_OR_RETURN(NamedTemplate t, compile(entry["template"].get<std::string>()));
        if (name == "default") {
          impl->main = std::move(t);
          has_default = true;
        } else {
          impl->tool_use = std::move(t);
        }
      }
      if (!has_default) {
        return make_error(ErrorCode::kCorrupt,
                          "{}: chat_template lists named templates but none is called \"default\"",
                          config_path);
      }
    } else {
      return make_error(ErrorCode::kCorrupt, "{}: chat_template must be a string or a list",
                        config_path);
    }
  }
  ChatTemplate t;
  t.impl_ = std::move(impl);
  return t;
}

Result<std::string> ChatTemplate::render(const nlohmann::ordered_json& request) const {
  RECUR_ASSIGN_OR_RETURN(RenderedPrompt prompt, render_prompt(request));
  return std::move(prompt.text);
}

Result<RenderedPrompt> ChatTemplate::render_prompt(const nlohmann::ordered_json& request) const {
  const bool has_tools =
      request.is_object() && request.contains("tools") && !request["tools"].is_null();
  const NamedTemplate& chosen = has_tools && impl_->tool_use ? *impl_->tool_use : impl_->main;
  try {
    RECUR_ASSIGN_OR_RETURN(const bool continue_final, continue_final_message(request));
    RECUR_ASSIGN_OR_RETURN(Dict globals,
                           render_globals(request, chosen.takes_content_parts, continue_final,
                                          impl_->bos_token, impl_->eos_token, impl_->rules));
    RECUR_ASSIGN_OR_RETURN(jinja::Rendered rendered, chosen.compiled.render_marked(globals));
    RenderedPrompt prompt;
    prompt.text = std::move(rendered.text);
    if (impl_->options.request_special_tokens_as_text) {
      prompt.literal = std::move(rendered.request_spans);
    }
    if (continue_final) RECUR_RETURN_IF_ERROR(cut_after_final_message(request, &prompt));
    return prompt;
  } catch (const jinja::TemplateError& err) {  // a request value JSON can hold but Python cannot
    return Error{err.code, "chat request: " + err.message};
  }
}

const ChatTemplateOptions& ChatTemplate::options() const {
  return impl_->options;
}

Result<std::string> ChatTemplate::render(const nlohmann::json& request) const {
  return render(nlohmann::ordered_json(request));
}

const std::string& ChatTemplate::source() const {
  return impl_->main.source;
}

}  // namespace recur
