// OpenAI Responses API (/v1/responses) request validation: `instructions` and `input` (a string,
// or message, function_call, function_call_output and reasoning items) become chat messages in
// OpenAI's shape, function tools become chat tools, and the chat template renders them like a
// chat completion. Nothing is stored, so items that refer to earlier responses are refused.
#include "server/request.h"

namespace recur::server {

namespace {

// A message's content: a string, or text parts (input_text, output_text).
ApiResult<std::string> content_text(const ojson& content, const std::string& where) {
  if (content.is_string()) return content.get<std::string>();
  if (!content.is_array()) {
    return bad_request(where,
                       fmt::format("'{}' must be a string or a list of content parts", where));
  }
  std::string out;
  for (size_t j = 0; j < content.size(); ++j) {
    const ojson& part = content[j];
    const std::string pw = fmt::format("{}[{}]", where, j);
    const ojson* type = field(part, "type");
    if (!part.is_object() || !type || !type->is_string()) {
      return bad_request(pw, fmt::format("'{}' must be a content part with a \"type\"", pw));
    }
    const std::string t = type->get<std::string>();
    if (t != "input_text" && t != "output_text" && t != "text") {
      return bad_request(pw + ".type",
                         fmt::format("'{}.type' \"{}\" is not supported; this model reads text "
                                     "only (input_text, output_text)",
                                     pw, t));
    }
    RECUR_API_ASSIGN(auto text, get_string(part, "text", pw + "."));
    if (!text) return bad_request(pw + ".text", fmt::format("'{}.text' must be a string", pw));
    if (!out.empty()) out += "\n";
    out += *text;
  }
  return out;
}

ApiResult<std::string> required_string(const ojson& item, const char* key,
                                       const std::string& where) {
  RECUR_API_ASSIGN(auto s, get_string(item, key, where + "."));
  if (!s || s->empty()) {
    return bad_request(fmt::format("{}.{}", where, key),
                       fmt::format("'{}.{}' must be a non-empty string", where, key));
  }
  return *s;
}

ApiResult<ojson> input_messages(const ojson& body) {
  ojson out = ojson::array();
  RECUR_API_ASSIGN(auto instructions, get_string(body, "instructions"));
  if (instructions) out.push_back({{"role", "system"}, {"content", *instructions}});
  const ojson* input = field(body, "input");
  if (!input) return bad_request("input", "'input' is required");
  if (input->is_string()) {
    out.push_back({{"role", "user"}, {"content", *input}});
    return out;
  }
  if (!input->is_array() || input->empty()) {
    return bad_request("input", "'input' must be a string or a non-empty list of items");
  }
  std::string reasoning;  // of the assistant turn the next items make
  auto assistant = [&]() -> ojson& {
    if (out.empty() || out.back()["role"] != "assistant") {
      out.push_back({{"role", "assistant"}, {"content", ""}});
    }
    if (!reasoning.empty()) {
      out.back()["reasoning_content"] = reasoning;
      reasoning.clear();
    }
    return out.back();
  };
  for (size_t i = 0; i < input->size(); ++i) {
    const ojson& item = (*input)[i];
    const std::string where = fmt::format("input[{}]", i);
    if (!item.is_object()) return bad_request(where, fmt::format("'{}' must be an object", where));
    RECUR_API_ASSIGN(auto type, get_string(item, "type", where + "."));
    const std::string t = type.value_or("message");
    if (t == "message") {
      RECUR_API_ASSIGN(std::string role, required_string(item, "role", where));
      if (role == "developer") role = "system";
      if (role != "user" && role != "assistant" && role != "system") {
        return bad_request(where + ".role",
                           fmt::format("'{}.role' must be user, assistant, system or developer, "
                                       "got \"{}\"",
                                       where, role));
      }
      const ojson* content = field(item, "content");
      if (!content) {
        return bad_request(where + ".content", fmt::format("'{}.content' is required", where));
      }
      RECUR_API_ASSIGN(std::string text, content_text(*content, where + ".content"));
      if (role == "assistant") {
        ojson& msg = assistant();
        if (msg.contains("tool_calls")) {  // text after calls starts a turn of its own
          out.push_back({{"role", "assistant"}, {"content", text}});
        } else {
          std::string joined = msg["content"].get<std::string>();
          msg["content"] = joined.empty() ? text : joined + "\n" + text;
        }
      } else {
        out.push_back({{"role", role}, {"content", text}});
      }
    } else if (t == "function_call") {
      RECUR_API_ASSIGN(std::string call_id, required_string(item, "call_id", where));
      RECUR_API_ASSIGN(std::string name, required_string(item, "name", where));
      RECUR_API_ASSIGN(auto arguments, get_string(item, "arguments", where + "."));
      // Templates print arguments with tojson: give them the object when it is one.
      ojson args = ojson::object();
      if (arguments) {
        std::string unparsed;
        std::optional<ojson> parsed = parse_json_text(*arguments, &unparsed);
        args = (parsed && parsed->is_object()) ? std::move(*parsed) : ojson(*arguments);
      }
      ojson& msg = assistant();
      if (!msg.contains("tool_calls")) msg["tool_calls"] = ojson::array();
      msg["tool_calls"].push_back({{"id", call_id},
                                   {"type", "function"},
                                   {"function", {{"name", name}, {"arguments", std::move(args)}}}});
    } else if (t == "function_call_output") {
      RECUR_API_ASSIGN(std::string call_id, required_string(item, "call_id", where));
      const ojson* output = field(item, "output");
      if (!output) {
        return bad_request(where + ".output", fmt::format("'{}.output' is required", where));
      }
      RECUR_API_ASSIGN(std::string text, content_text(*output, where + ".output"));
      out.push_back({{"role", "tool"}, {"content", text}, {"tool_call_id", call_id}});
    } else if (t == "reasoning") {
      // Reasoning text (content) or its summary; encrypted content is another server's.
      for (const char* key : {"content", "summary"}) {
        const ojson* parts = field(item, key);
        if (!parts) continue;
        if (!parts->is_array()) {
          return bad_request(fmt::format("{}.{}", where, key),
                             fmt::format("'{}.{}' must be a list", where, key));
        }
        for (const ojson& p : *parts) {
          const ojson* text = field(p, "text");
          if (!text || !text->is_string()) {
            return bad_request(
                fmt::format("{}.{}", where, key),
                fmt::format("'{}.{}' must hold {{\"type\", \"text\"}} parts", where, key));
          }
          if (!reasoning.empty()) reasoning += "\n";
          reasoning += text->get<std::string>();
        }
        if (!parts->empty()) break;
      }
    } else if (t == "item_reference") {
      return bad_request(where + ".type",
                         "item references are not supported: this server stores no responses; "
                         "send every item in full");
    } else {
      return bad_request(where + ".type",
                         fmt::format("'{}.type' \"{}\" is not supported (message, function_call, "
                                     "function_call_output, reasoning)",
                                     where, t));
    }
  }
  return out;
}

// Function tools in chat's shape.
ApiResult<ojson> convert_tools(const ojson& tools) {
  if (!tools.is_array()) return bad_request("tools", "'tools' must be a list");
  ojson out = ojson::array();
  for (size_t i = 0; i < tools.size(); ++i) {
    const ojson& t = tools[i];
    const std::string where = fmt::format("tools[{}]", i);
    if (!t.is_object()) return bad_request(where, fmt::format("'{}' must be an object", where));
    RECUR_API_ASSIGN(auto type, get_string(t, "type", where + "."));
    if (type != "function") {
      return bad_request(where + ".type",
                         fmt::format("'{}.type' must be \"function\"; built-in tools (web search, "
                                     "file search, ...) are not supported",
                                     where));
    }
    RECUR_API_ASSIGN(std::string name, get_tool_name(t, "name", where + "."));
    RECUR_API_ASSIGN(auto desc, get_string(t, "description", where + "."));
    RECUR_API_CHECK(get_bool(t, "strict", where + "."));
    RECUR_API_ASSIGN(ojson fn, chat_function_tool(t, where, name, desc, "parameters"));
    out.push_back(std::move(fn));
  }
  return out;
}

ApiResult<std::string> tool_choice(const ojson& body, const ojson& tools) {
  const bool have_tools = tools.is_array() && !tools.empty();
  const ojson* tc = field(body, "tool_choice");
  if (!tc) return std::string(have_tools ? "auto" : "none");
  std::string mode;
  if (tc->is_string()) {
    mode = tc->get<std::string>();
  } else if (tc->is_object() && field(*tc, "type") && (*tc)["type"] == "function" &&
             field(*tc, "name") && (*tc)["name"].is_string()) {
    mode = "named:" + (*tc)["name"].get<std::string>();
  }
  if (mode != "none" && mode != "auto" && mode != "required" && mode.rfind("named:", 0) != 0) {
    return bad_request("tool_choice",
                       "'tool_choice' must be none, auto, required or {\"type\": \"function\", "
                       "\"name\": ...}");
  }
  RECUR_API_CHECK(check_tool_choice(mode, &tools));
  if (!have_tools) mode = "none";
  return mode;
}

// Fields that would need stored state or features this server does not have; text.format
// (structured outputs) into req.
ApiResult<bool> refuse_unsupported(const ojson& body, ParsedRequest* req) {
  for (const char* key : {"previous_response_id", "conversation", "prompt"}) {
    if (field(body, key)) {
      return bad_request(key, fmt::format("'{}' is not supported: this server stores no "
                                          "responses or prompts; send the whole conversation in "
                                          "'input'",
                                          key));
    }
  }
  RECUR_API_ASSIGN(auto background, get_bool(body, "background"));
  if (background.value_or(false)) {
    return bad_request("background", "'background' responses are not supported");
  }
  if (const ojson* text = field(body, "text")) {
    if (!text->is_object()) return bad_request("text", "'text' must be an object");
    if (const ojson* format = field(*text, "format")) {
      RECUR_API_CHECK(parse_response_format(*format, "text.format", req));
    }
  }
  RECUR_API_ASSIGN(auto truncation, get_string(body, "truncation"));
  if (truncation && *truncation != "disabled" && *truncation != "auto") {
    return bad_request("truncation", "'truncation' must be disabled or auto");
  }
  if (const ojson* include = field(body, "include"); include && !include->is_array()) {
    return bad_request("include", "'include' must be a list");
  }
  return true;
}

}  // namespace

ApiResult<ParsedRequest> parse_responses_request(const ojson& body, const ServingContext& ctx) {
  ParsedRequest req;
  req.endpoint = Endpoint::kResponses;
  RECUR_API_CHECK(check_fields(body,
                               {kSamplingFields,
                                {"model",
                                 "input",
                                 "instructions",
                                 "max_output_tokens",
                                 "stream",
                                 "stream_options",
                                 "tools",
                                 "tool_choice",
                                 "parallel_tool_calls",
                                 "reasoning",
                                 "text",
                                 "truncation",
                                 "include",
                                 "previous_response_id",
                                 "conversation",
                                 "prompt",
                                 "background",
                                 "store",
                                 "metadata",
                                 "user",
                                 "service_tier",
                                 "safety_identifier",
                                 "prompt_cache_key",
                                 "chat_template_kwargs"}},
                               ctx));
  RECUR_API_CHECK(check_model(body, ctx));
  RECUR_API_CHECK(refuse_unsupported(body, &req));
  RECUR_API_CHECK(parse_sampling(body, ctx, &req));
  RECUR_API_ASSIGN(auto stream, get_bool(body, "stream"));
  req.stream = stream.value_or(false);
  if (const ojson* so = field(body, "stream_options"); so && !so->is_object()) {
    return bad_request("stream_options", "'stream_options' must be an object");
  }
  RECUR_API_ASSIGN(auto max_tokens, get_int(body, "max_output_tokens", 1, INT32_MAX));
  if (max_tokens) {
    req.engine.max_tokens = int(*max_tokens);
    req.max_tokens_given = true;
  }
  RECUR_API_ASSIGN(ojson messages, input_messages(body));
  ojson tools = ojson::array();
  if (const ojson* t = field(body, "tools")) {
    RECUR_API_ASSIGN(tools, convert_tools(*t));
  }
  RECUR_API_ASSIGN(std::string choice, tool_choice(body, tools));
  RECUR_API_ASSIGN(auto parallel, get_bool(body, "parallel_tool_calls"));
  req.output.parallel_tool_calls = parallel.value_or(true);

  ojson kwargs = ojson::object();
  if (const ojson* extra = field(body, "chat_template_kwargs")) {
    if (!extra->is_object()) {
      return bad_request("chat_template_kwargs", "'chat_template_kwargs' must be an object");
    }
    kwargs = *extra;
  }
  ojson reasoning = {{"effort", nullptr}, {"summary", nullptr}};
  if (const ojson* r = field(body, "reasoning")) {
    if (!r->is_object()) return bad_request("reasoning", "'reasoning' must be an object");
    RECUR_API_ASSIGN(auto effort, get_string(*r, "effort", "reasoning."));
    if (effort) {
      if (*effort != "none" && *effort != "minimal" && *effort != "low" && *effort != "medium" &&
          *effort != "high") {
        return bad_request("reasoning.effort",
                           "'reasoning.effort' must be none, minimal, low, medium or high");
      }
      // none and minimal switch thinking off, unless chat_template_kwargs says otherwise.
      if (!kwargs.contains("enable_thinking")) {
        kwargs["enable_thinking"] = *effort != "none" && *effort != "minimal";
      }
      reasoning["effort"] = *effort;
    }
    RECUR_API_CHECK(get_string(*r, "summary", "reasoning."));
  }
  const bool use_tools = !tools.empty();
  RECUR_API_CHECK(render_chat(messages, use_tools ? &tools : nullptr,
                              kwargs.empty() ? nullptr : &kwargs, choice, ctx, &req));
  RECUR_API_CHECK(check_lengths(ctx, &req));
  RECUR_API_CHECK(attach_constraint(ctx, &req));

  // What the response object repeats of the request.
  ojson& echo = req.response_echo;
  echo = ojson::object();
  RECUR_API_ASSIGN(auto instructions, get_string(body, "instructions"));
  echo["instructions"] = instructions ? ojson(*instructions) : ojson(nullptr);
  echo["max_output_tokens"] = max_tokens ? ojson(*max_tokens) : ojson(nullptr);
  echo["parallel_tool_calls"] = req.output.parallel_tool_calls;
  echo["previous_response_id"] = nullptr;
  echo["reasoning"] = reasoning;
  echo["store"] = false;
  // Floats as they print shortest (0.7, not 0.699999988).
  const auto num = [](float f) { return std::stod(fmt::format("{}", f)); };
  echo["temperature"] = num(req.engine.sampling.temperature);
  echo["text"] = {{"format", req.json_schema ? req.response_format : ojson{{"type", "text"}}}};
  echo["tool_choice"] = choice.rfind("named:", 0) == 0
                            ? ojson{{"type", "function"}, {"name", choice.substr(6)}}
                            : ojson(choice);
  ojson echo_tools = ojson::array();
  for (const auto& t : tools) {
    ojson one = {{"type", "function"}, {"name", t["function"]["name"]}};
    if (t["function"].contains("description")) one["description"] = t["function"]["description"];
    one["parameters"] = t["function"]["parameters"];
    one["strict"] = false;
    echo_tools.push_back(std::move(one));
  }
  echo["tools"] = std::move(echo_tools);
  echo["top_p"] = num(req.engine.sampling.top_p);
  echo["truncation"] = "disabled";
  const ojson* metadata = field(body, "metadata");
  echo["metadata"] = metadata && metadata->is_object() ? *metadata : ojson::object();
  RECUR_API_ASSIGN(auto user, get_string(body, "user"));
  echo["user"] = user ? ojson(*user) : ojson(nullptr);
  return req;
}

}  // namespace recur::server
