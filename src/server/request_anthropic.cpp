// Anthropic /v1/messages: the request is translated to chat messages and tools in OpenAI's
// shape, then rendered by the model's chat template like a chat completion.
#include "server/request.h"

namespace recur::server {

namespace {

// Text of a block list or string; only text blocks are accepted where `where` allows no others.
ApiResult<std::string> text_of(const ojson& content, const std::string& where) {
  if (content.is_string()) return content.get<std::string>();
  if (!content.is_array()) {
    return bad_request(where, fmt::format("'{}' must be a string or a list of blocks", where));
  }
  std::string out;
  for (size_t i = 0; i < content.size(); ++i) {
    const ojson& b = content[i];
    if (!b.is_object() || !field(b, "type") || b["type"] != "text" || !field(b, "text") ||
        !b["text"].is_string()) {
      return bad_request(fmt::format("{}[{}]", where, i),
                         fmt::format("'{}[{}]' must be a text block", where, i));
    }
    if (!out.empty()) out += "\n";
    out += b["text"].get<std::string>();
  }
  return out;
}

// Appends a user or assistant chat message; merge: one of the same role before it is the same
// turn (consecutive messages of a role are one turn in the Messages API), so they become one.
void push_turn(ojson msg, bool merge, ojson* out) {
  if (!merge || out->empty() || out->back()["role"] != msg["role"]) {
    out->push_back(std::move(msg));
    return;
  }
  ojson& prev = out->back();
  for (const char* key : {"content", "reasoning_content"}) {
    const ojson* add = field(msg, key);
    if (!add || add->get_ref<const std::string&>().empty()) continue;
    const ojson* have = field(prev, key);
    std::string text = have ? have->get<std::string>() : std::string();
    if (!text.empty()) text += '\n';
    text += add->get_ref<const std::string&>();
    prev[key] = std::move(text);
  }
  if (const ojson* calls = field(msg, "tool_calls")) {
    if (!field(prev, "tool_calls")) prev["tool_calls"] = ojson::array();
    for (const ojson& c : *calls) prev["tool_calls"].push_back(c);
  }
}

ApiResult<bool> add_message(const ojson& m, size_t i, bool merge, ojson* out) {
  const std::string where = fmt::format("messages[{}]", i);
  if (!m.is_object()) return bad_request(where, fmt::format("'{}' must be an object", where));
  const ojson* role = field(m, "role");
  if (!role || !role->is_string() || (*role != "user" && *role != "assistant")) {
    return bad_request(where + ".role", fmt::format("'{}.role' must be user or assistant", where));
  }
  const ojson* content = field(m, "content");
  if (!content)
    return bad_request(where + ".content", fmt::format("'{}.content' is required", where));
  const bool user = *role == "user";
  if (content->is_string()) {
    push_turn({{"role", *role}, {"content", *content}}, merge, out);
    return true;
  }
  if (!content->is_array()) {
    return bad_request(where + ".content",
                       fmt::format("'{}.content' must be a string or a list of blocks", where));
  }
  std::string text, thinking;
  ojson calls = ojson::array();
  for (size_t j = 0; j < content->size(); ++j) {
    const ojson& b = (*content)[j];
    const std::string bw = fmt::format("{}.content[{}]", where, j);
    const ojson* type = field(b, "type");
    if (!b.is_object() || !type || !type->is_string()) {
      return bad_request(bw, fmt::format("'{}' must be a block with a \"type\"", bw));
    }
    const std::string t = type->get<std::string>();
    if (t == "text") {
      RECUR_API_ASSIGN(auto s, get_string(b, "text", bw + "."));
      if (!s) return bad_request(bw + ".text", fmt::format("'{}.text' must be a string", bw));
      if (!text.empty()) text += "\n";
      text += *s;
    } else if (t == "thinking" && !user) {
      RECUR_API_ASSIGN(auto s, get_string(b, "thinking", bw + "."));
      thinking += s.value_or("");
    } else if (t == "redacted_thinking" && !user) {
      continue;
    } else if (t == "tool_use" && !user) {
      RECUR_API_ASSIGN(auto id, get_string(b, "id", bw + "."));
      RECUR_API_ASSIGN(auto name, get_string(b, "name", bw + "."));
      if (!name || name->empty()) {
        return bad_request(bw + ".name", fmt::format("'{}.name' must be a non-empty string", bw));
      }
      const ojson* input = field(b, "input");
      if (input && !input->is_object()) {
        return bad_request(bw + ".input", fmt::format("'{}.input' must be an object", bw));
      }
      calls.push_back(
          {{"id", id.value_or("")},
           {"type", "function"},
           {"function", {{"name", *name}, {"arguments", input ? *input : ojson::object()}}}});
    } else if (t == "tool_result" && user) {
      RECUR_API_ASSIGN(auto id, get_string(b, "tool_use_id", bw + "."));
      std::string result;
      if (const ojson* c = field(b, "content")) {
        RECUR_API_ASSIGN(result, text_of(*c, bw + ".content"));
      }
      out->push_back({{"role", "tool"}, {"content", result}, {"tool_call_id", id.value_or("")}});
    } else {
      return bad_request(bw + ".type", fmt::format("'{}.type' \"{}\" is not supported in a {} "
                                                   "message",
                                                   bw, t, role->get<std::string>()));
    }
  }
  if (user) {
    if (!text.empty() || out->empty() || out->back()["role"] != "tool") {
      push_turn({{"role", "user"}, {"content", text}}, merge, out);
    }
    return true;
  }
  ojson msg = {{"role", "assistant"}, {"content", text}};
  if (!thinking.empty()) msg["reasoning_content"] = thinking;
  if (!calls.empty()) msg["tool_calls"] = std::move(calls);
  push_turn(std::move(msg), merge, out);
  return true;
}

// A conversation that ends on an assistant message is a prefill: the model goes on from its
// text. One without text (or with tool calls, which a result must answer) is not continued;
// an empty one is dropped, which leaves a fresh assistant turn to open.
ChatEnding prefill(ojson* messages) {
  ChatEnding ending;
  const ojson& last = messages->back();
  if (last["role"] != "assistant" || field(last, "tool_calls")) return ending;
  const std::string& text = last["content"].get_ref<const std::string&>();
  if (text.find_first_not_of(" \t\r\n") == std::string::npos) {
    if (!field(last, "reasoning_content")) messages->erase(messages->end() - 1);
    return ending;
  }
  ending.add_generation_prompt = false;
  ending.continue_final_message = true;
  return ending;
}

ApiResult<ojson> convert_tools(const ojson& tools) {
  if (!tools.is_array()) return bad_request("tools", "'tools' must be a list");
  ojson out = ojson::array();
  for (size_t i = 0; i < tools.size(); ++i) {
    const ojson& t = tools[i];
    const std::string where = fmt::format("tools[{}]", i);
    if (!t.is_object()) return bad_request(where, fmt::format("'{}' must be an object", where));
    RECUR_API_ASSIGN(std::string name, get_tool_name(t, "name", where + "."));
    RECUR_API_ASSIGN(auto desc, get_string(t, "description", where + "."));
    RECUR_API_ASSIGN(ojson fn, chat_function_tool(t, where, name, desc, "input_schema"));
    out.push_back(std::move(fn));
  }
  return out;
}

// What a messages request and a count_tokens request share: the prompt.
const std::initializer_list<std::string_view> kPromptFields = {
    "model", "messages", "system", "tools", "tool_choice", "thinking", "chat_template_kwargs"};

// count_only: /v1/messages/count_tokens (no generation fields, no length checks).
ApiResult<ParsedRequest> parse_messages(const ojson& body, const ServingContext& ctx,
                                        bool count_only) {
  ParsedRequest req;
  req.endpoint = Endpoint::kMessages;
  if (count_only) {
    RECUR_API_CHECK(check_fields(body, {kPromptFields}, ctx));
  } else {
    RECUR_API_CHECK(check_fields(body,
                                 {kPromptFields,
                                  kSamplingFields,
                                  {"max_tokens", "stream", "stop_sequences", "metadata",
                                   "service_tier", "output_format", "output_config"}},
                                 ctx));
  }
  if (!field(body, "model")) return bad_request("model", "'model' is required");
  RECUR_API_CHECK(check_model(body, ctx));
  if (!count_only) {
    RECUR_API_CHECK(parse_sampling(body, ctx, &req));
    // Structured outputs: output_config.format, or the beta's output_format ({"type":
    // "json_schema", "schema": ...}).
    const ojson* config = field(body, "output_config");
    if (config && !config->is_object()) {
      return bad_request("output_config", "'output_config' must be an object");
    }
    for (const auto& [name, format] :
         {std::pair{"output_config.format", config ? field(*config, "format") : nullptr},
          std::pair{"output_format", field(body, "output_format")}}) {
      if (format) RECUR_API_CHECK(parse_response_format(*format, name, &req));
    }
  }
  RECUR_API_ASSIGN(auto stream, get_bool(body, "stream"));
  req.stream = stream.value_or(false);
  RECUR_API_ASSIGN(auto max_tokens, get_int(body, "max_tokens", 1, INT32_MAX));
  if (!max_tokens && !count_only) return bad_request("max_tokens", "'max_tokens' is required");
  req.engine.max_tokens = int(max_tokens.value_or(1));
  req.max_tokens_given = true;
  if (const ojson* stops = field(body, "stop_sequences")) {
    if (!stops->is_array() || stops->size() > 64) {
      return bad_request("stop_sequences", "'stop_sequences' must be a list of at most 64 strings");
    }
    for (const auto& s : *stops) {
      if (!s.is_string() || s.get_ref<const std::string&>().size() > 1024) {
        return bad_request("stop_sequences", "'stop_sequences' must hold strings (<= 1024 bytes)");
      }
      if (!s.get_ref<const std::string&>().empty()) {
        req.engine.stop.stop_strings.push_back(s.get<std::string>());
      }
    }
  }

  ojson messages = ojson::array();
  if (const ojson* system = field(body, "system")) {
    RECUR_API_ASSIGN(std::string text, text_of(*system, "system"));
    messages.push_back({{"role", "system"}, {"content", text}});
  }
  const ojson* msgs = field(body, "messages");
  if (!msgs || !msgs->is_array() || msgs->empty()) {
    return bad_request("messages", "'messages' must be a non-empty list of messages");
  }
  for (size_t i = 0; i < msgs->size(); ++i) {
    const ojson* role = field((*msgs)[i], "role");
    const ojson* prev = i > 0 ? field((*msgs)[i - 1], "role") : nullptr;
    const bool merge = role && prev && *role == *prev;
    RECUR_API_CHECK(add_message((*msgs)[i], i, merge, &messages));
  }
  const ChatEnding ending = prefill(&messages);

  ojson tools;
  if (const ojson* t = field(body, "tools")) {
    RECUR_API_ASSIGN(tools, convert_tools(*t));
  }
  const bool have_tools = tools.is_array() && !tools.empty();
  std::string choice = have_tools ? "auto" : "none";
  if (const ojson* tc = field(body, "tool_choice")) {
    const ojson* type = field(*tc, "type");
    if (!tc->is_object() || !type || !type->is_string()) {
      return bad_request("tool_choice", "'tool_choice' must be {\"type\": auto|any|tool|none}");
    }
    const std::string t = type->get<std::string>();
    if (t == "auto" || t == "none") {
      choice = t;
    } else if (t == "any") {
      choice = "required";
    } else if (t == "tool") {
      RECUR_API_ASSIGN(auto name, get_string(*tc, "name", "tool_choice."));
      if (!name) return bad_request("tool_choice.name", "'tool_choice.name' is required");
      choice = "named:" + *name;
    } else {
      return bad_request("tool_choice.type", "'tool_choice.type' must be auto, any, tool or none");
    }
    RECUR_API_CHECK(check_tool_choice(choice, &tools));
    if (!have_tools) choice = "none";
    RECUR_API_ASSIGN(auto no_parallel, get_bool(*tc, "disable_parallel_tool_use", "tool_choice."));
    req.output.parallel_tool_calls = !no_parallel.value_or(false);
  }
  ojson kwargs;
  if (const ojson* thinking = field(body, "thinking")) {
    // adaptive (the model decides) thinks, as the template lets it; between_tools is thinking
    // off. Budgets and display are accepted and not applied: the whole reasoning comes back.
    const ojson* type = field(*thinking, "type");
    const bool on = type && (*type == "enabled" || *type == "adaptive");
    if (!thinking->is_object() || !type ||
        (!on && *type != "disabled" && *type != "between_tools")) {
      return bad_request("thinking",
                         "'thinking' must be {\"type\": \"enabled\"|\"adaptive\"|\"disabled\"|"
                         "\"between_tools\"}");
    }
    RECUR_API_CHECK(get_int(*thinking, "budget_tokens", 0, INT32_MAX, "thinking."));
    RECUR_API_ASSIGN(auto display, get_string(*thinking, "display", "thinking."));
    if (display && *display != "summarized" && *display != "omitted") {
      return bad_request("thinking.display", "'thinking.display' must be summarized or omitted");
    }
    kwargs = {{"enable_thinking", on}};
  }
  if (const ojson* extra = field(body, "chat_template_kwargs")) {
    if (!extra->is_object()) {
      return bad_request("chat_template_kwargs", "'chat_template_kwargs' must be an object");
    }
    if (kwargs.is_null()) kwargs = ojson::object();
    for (const auto& [k, v] : extra->items()) kwargs[k] = v;
  }
  RECUR_API_CHECK(render_chat(messages, have_tools ? &tools : nullptr,
                              kwargs.is_null() ? nullptr : &kwargs, choice, ctx, &req, ending));
  if (!count_only) RECUR_API_CHECK(check_lengths(ctx, &req));
  if (!count_only) RECUR_API_CHECK(attach_constraint(ctx, &req));
  return req;
}

}  // namespace

ApiResult<ParsedRequest> parse_messages_request(const ojson& body, const ServingContext& ctx) {
  return parse_messages(body, ctx, false);
}

ApiResult<int64_t> count_message_tokens(const ojson& body, const ServingContext& ctx) {
  RECUR_API_ASSIGN(ParsedRequest req, parse_messages(body, ctx, true));
  // The forced prefix of a required tool call is part of the prompt the model reads.
  return int64_t(req.prompts.at(0).size());
}

}  // namespace recur::server
