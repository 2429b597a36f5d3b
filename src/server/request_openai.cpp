// OpenAI /v1/chat/completions and /v1/completions request validation, and the steps shared
// with the Anthropic endpoint (sampling fields, chat rendering, length checks).
#include <algorithm>
#include <limits>

#include "server/output_parser.h"
#include "server/request.h"

namespace recur::server {

namespace {

constexpr int kMaxChoices = 256;  // prompts x n in one request
constexpr size_t kMaxStops = 64;
constexpr size_t kMaxStopBytes = 1024;
constexpr size_t kMaxLogitBias = 4096;

ApiResult<bool> parse_stop(const ojson& v, const char* param, StopConditions* stop) {
  auto add = [&](const ojson& s) -> ApiResult<bool> {
    if (!s.is_string()) return bad_request(param, fmt::format("'{}' must hold strings", param));
    std::string str = s.get<std::string>();
    if (str.size() > kMaxStopBytes) {
      return bad_request(param,
                         fmt::format("a stop string is longer than {} bytes", kMaxStopBytes));
    }
    if (!str.empty()) stop->stop_strings.push_back(std::move(str));
    return true;
  };
  if (v.is_string()) return add(v);
  if (!v.is_array()) {
    return bad_request(param, fmt::format("'{}' must be a string or a list of strings", param));
  }
  if (v.size() > kMaxStops) {
    return bad_request(param, fmt::format("'{}' has more than {} entries", param, kMaxStops));
  }
  for (const auto& s : v) RECUR_API_CHECK(add(s));
  return true;
}

ApiResult<std::vector<int32_t>> parse_ids(const ojson& v, const char* param, int vocab) {
  std::vector<int32_t> ids;
  ids.reserve(v.size());
  for (const auto& x : v) {
    auto id = as_int(x, 0, vocab - 1);
    if (!id) {
      return bad_request(
          param, fmt::format("'{}' must hold token ids in [0, {}), got {}", param, vocab, dump(x)));
    }
    ids.push_back(int32_t(*id));
  }
  return ids;
}

// Message content: a string, or a list of text parts.
ApiResult<bool> check_content(const ojson& content, const std::string& where) {
  if (content.is_string()) return true;
  if (!content.is_array()) {
    return bad_request(where,
                       fmt::format("'{}' must be a string or a list of content parts", where));
  }
  for (size_t j = 0; j < content.size(); ++j) {
    const ojson& part = content[j];
    const std::string pw = fmt::format("{}[{}]", where, j);
    if (!part.is_object()) return bad_request(pw, fmt::format("'{}' must be an object", pw));
    const ojson* type = field(part, "type");
    if (!type || !type->is_string() || *type != "text") {
      return bad_request(pw + ".type",
                         fmt::format("'{}.type' must be \"text\"; this model reads text only", pw));
    }
    const ojson* text = field(part, "text");
    if (!text || !text->is_string()) {
      return bad_request(pw + ".text", fmt::format("'{}.text' must be a string", pw));
    }
  }
  return true;
}

// Validated content as one text (parts joined with "\n", as for the chat template).
std::string text_content(const ojson& content) {
  if (content.is_string()) return content.get<std::string>();
  std::string text;
  for (size_t j = 0; j < content.size(); ++j) {
    if (j) text += '\n';
    text += content[j]["text"].get<std::string>();
  }
  return text;
}

// Validates OpenAI messages and returns them as the chat template takes them.
ApiResult<ojson> normalize_messages(const ojson& msgs) {
  if (!msgs.is_array() || msgs.empty()) {
    return bad_request("messages", "'messages' must be a non-empty list of messages");
  }
  ojson out = ojson::array();
  for (size_t i = 0; i < msgs.size(); ++i) {
    const ojson& m = msgs[i];
    const std::string where = fmt::format("messages[{}]", i);
    if (!m.is_object()) return bad_request(where, fmt::format("'{}' must be an object", where));
    const ojson* role = field(m, "role");
    if (!role || !role->is_string()) {
      return bad_request(where + ".role", fmt::format("'{}.role' must be a string", where));
    }
    std::string r = role->get<std::string>();
    if (r == "developer") r = "system";
    if (r != "system" && r != "user" && r != "assistant" && r != "tool") {
      return bad_request(where + ".role",
                         fmt::format("'{}.role' must be system, developer, user, assistant or "
                                     "tool, got \"{}\"",
                                     where, r));
    }
    ojson msg = ojson::object();
    msg["role"] = r;
    const ojson* content = field(m, "content");
    const ojson* calls = field(m, "tool_calls");
    if (content) {
      RECUR_API_CHECK(check_content(*content, where + ".content"));
      msg["content"] = *content;
    } else if (r == "assistant") {
      msg["content"] = "";  // templates test `in message.content`, which fails on None
    } else {
      return bad_request(where + ".content", fmt::format("'{}.content' is required", where));
    }
    RECUR_API_ASSIGN(auto name, get_string(m, "name", where + "."));
    if (name) msg["name"] = *name;
    if (r == "assistant") {
      RECUR_API_ASSIGN(auto reasoning, get_string(m, "reasoning_content", where + "."));
      if (reasoning) msg["reasoning_content"] = *reasoning;
    }
    if (calls) {
      if (r != "assistant" || !calls->is_array()) {
        return bad_request(
            where + ".tool_calls",
            fmt::format("'{}.tool_calls' must be a list, on assistant messages", where));
      }
      ojson norm = ojson::array();
      for (size_t k = 0; k < calls->size(); ++k) {
        const ojson& c = (*calls)[k];
        const std::string cw = fmt::format("{}.tool_calls[{}]", where, k);
        const ojson* fn = field(c, "function");
        if (!c.is_object() || !fn || !fn->is_object()) {
          return bad_request(cw, fmt::format("'{}' must be an object with a \"function\"", cw));
        }
        RECUR_API_ASSIGN(auto fname, get_string(*fn, "name", cw + ".function."));
        if (!fname || fname->empty()) {
          return bad_request(cw + ".function.name",
                             fmt::format("'{}.function.name' must be a non-empty string", cw));
        }
        ojson args = ojson::object();
        if (const ojson* a = field(*fn, "arguments")) {
          if (a->is_string()) {
            // Templates print arguments with tojson: give them the object when it is one.
            std::string unparsed;
            std::optional<ojson> parsed =
                parse_json_text(a->get_ref<const std::string&>(), &unparsed);
            args = (parsed && parsed->is_object()) ? std::move(*parsed) : *a;
          } else if (a->is_object()) {
            args = *a;
          } else {
            return bad_request(cw + ".function.arguments",
                               fmt::format("'{}.function.arguments' must be a JSON string", cw));
          }
        }
        ojson call = ojson::object();
        RECUR_API_ASSIGN(auto id, get_string(c, "id", cw + "."));
        if (id) call["id"] = *id;
        call["type"] = "function";
        call["function"] = {{"name", *fname}, {"arguments", std::move(args)}};
        norm.push_back(std::move(call));
      }
      msg["tool_calls"] = std::move(norm);
    }
    if (r == "tool") {
      RECUR_API_ASSIGN(auto call_id, get_string(m, "tool_call_id", where + "."));
      if (call_id) msg["tool_call_id"] = *call_id;
    }
    out.push_back(std::move(msg));
  }
  return out;
}

ApiResult<bool> check_tools(const ojson& tools) {
  if (!tools.is_array()) return bad_request("tools", "'tools' must be a list");
  for (size_t i = 0; i < tools.size(); ++i) {
    const ojson& t = tools[i];
    const std::string where = fmt::format("tools[{}]", i);
    const ojson* type = field(t, "type");
    const ojson* fn = field(t, "function");
    if (!t.is_object() || !type || *type != "function" || !fn || !fn->is_object()) {
      return bad_request(where, fmt::format("'{}' must be {{\"type\": \"function\", \"function\": "
                                            "{{...}}}}",
                                            where));
    }
    RECUR_API_CHECK(get_tool_name(*fn, "name", where + ".function."));
    RECUR_API_CHECK(get_string(*fn, "description", where + ".function."));
    const ojson* params = field(*fn, "parameters");
    if (params && !params->is_object()) {
      return bad_request(where + ".function.parameters",
                         fmt::format("'{}.function.parameters' must be an object", where));
    }
  }
  return true;
}

bool has_tool(const ojson& tools, const std::string& name) {
  for (const auto& t : tools) {
    if (t["function"]["name"] == name) return true;
  }
  return false;
}

// "none" | "auto" | "required" | {"type": "function", "function": {"name": N}} -> mode string.
ApiResult<std::string> parse_tool_choice(const ojson& body, const ojson* tools) {
  const ojson* tc = field(body, "tool_choice");
  const bool have_tools = tools && !tools->empty();
  if (!tc) return std::string(have_tools ? "auto" : "none");
  std::string mode;
  if (tc->is_string()) {
    mode = tc->get<std::string>();
    if (mode != "none" && mode != "auto" && mode != "required") {
      return bad_request("tool_choice",
                         "'tool_choice' must be none, auto, required or "
                         "{\"type\": \"function\", \"function\": {\"name\": ...}}");
    }
  } else if (tc->is_object() && field(*tc, "function") && (*tc)["function"].is_object() &&
             field((*tc)["function"], "name") && (*tc)["function"]["name"].is_string()) {
    mode = "named:" + (*tc)["function"]["name"].get<std::string>();
  } else {
    return bad_request("tool_choice",
                       "'tool_choice' must be none, auto, required or "
                       "{\"type\": \"function\", \"function\": {\"name\": ...}}");
  }
  RECUR_API_CHECK(check_tool_choice(mode, tools));
  return mode;
}

// Edit distance, for suggesting the known field a misspelt one meant.
size_t distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

// A template that fails to render is the model directory's fault, not the request's; only
// raise_exception() (the template's own words, for the caller) and malformed request values
// are the client's. The tokenizer layer names its own failures "chat template ...".
// A 500 for a chat template that the model directory got wrong.
ApiError chat_template_error(std::string message) {
  ApiError e;
  e.status = 500;
  e.type = "server_error";
  e.code = "chat_template_error";
  e.message = std::move(message);
  return e;
}

// The field a request's prompt comes from, and the one that bounds its output, by endpoint.
const char* prompt_param(Endpoint e) {
  return e == Endpoint::kCompletions ? "prompt" : e == Endpoint::kResponses ? "input" : "messages";
}
const char* max_tokens_param(Endpoint e) {
  return e == Endpoint::kResponses ? "max_output_tokens" : "max_tokens";
}

ApiError template_failure(const Error& e, const ServingContext& ctx, Endpoint endpoint) {
  if (e.message.rfind("chat template", 0) != 0) return from_error(e, prompt_param(endpoint));
  return chat_template_error(fmt::format(
      "the chat template of the model directory served as '{}' failed to render this request; "
      "this is a fault of the model directory (its tokenizer_config.json or "
      "chat_template.jinja), not of the request: {}",
      ctx.model_name, e.message));
}

ApiError context_exceeded(std::string param, std::string message) {
  ApiError e = bad_request(std::move(param), std::move(message));
  e.code = "context_length_exceeded";
  return e;
}

ApiResult<int> parse_max_tokens(const ojson& body, const char* key, ParsedRequest* req) {
  RECUR_API_ASSIGN(auto mt, get_int(body, key, 1, std::numeric_limits<int32_t>::max()));
  if (mt) {
    req->engine.max_tokens = int(*mt);
    req->max_tokens_given = true;
  }
  return 0;
}

ApiResult<bool> parse_stream(const ojson& body, ParsedRequest* req) {
  RECUR_API_ASSIGN(auto stream, get_bool(body, "stream"));
  req->stream = stream.value_or(false);
  if (const ojson* so = field(body, "stream_options")) {
    if (!req->stream) {
      return bad_request("stream_options", "'stream_options' is only allowed with stream=true");
    }
    if (!so->is_object())
      return bad_request("stream_options", "'stream_options' must be an object");
    RECUR_API_ASSIGN(auto usage, get_bool(*so, "include_usage", "stream_options."));
    req->include_usage = usage.value_or(false);
    // vLLM's extension: with include_usage, every chunk carries the usage so far.
    RECUR_API_ASSIGN(auto continuous, get_bool(*so, "continuous_usage_stats", "stream_options."));
    req->continuous_usage = req->include_usage && continuous.value_or(false);
  }
  return true;
}

ApiResult<bool> parse_n(const ojson& body, ParsedRequest* req) {
  RECUR_API_ASSIGN(auto n, get_int(body, "n", 1, 128));
  req->n = int(n.value_or(1));
  return true;
}

// Fields every OpenAI endpoint accepts and ignores: they label or route requests elsewhere.
const std::initializer_list<std::string_view> kIgnoredFields = {
    "user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key"};

}  // namespace

ApiResult<bool> check_tool_choice(const std::string& mode, const ojson* tools) {
  if (mode != "none" && mode != "auto" && (!tools || tools->empty())) {
    return bad_request("tool_choice", "'tool_choice' asks for a tool call but 'tools' is empty");
  }
  if (mode.rfind("named:", 0) == 0 && !has_tool(*tools, mode.substr(6))) {
    return bad_request(
        "tool_choice",
        fmt::format("'tool_choice' names \"{}\", which is not in 'tools'", mode.substr(6)));
  }
  return true;
}

ApiResult<ojson> chat_function_tool(const ojson& tool, const std::string& where,
                                    const std::string& name,
                                    const std::optional<std::string>& description,
                                    const char* schema_key) {
  const ojson* schema = field(tool, schema_key);
  if (schema && !schema->is_object()) {
    return bad_request(fmt::format("{}.{}", where, schema_key),
                       fmt::format("'{}.{}' must be an object", where, schema_key));
  }
  ojson fn = {{"name", name}};
  if (description) fn["description"] = *description;
  fn["parameters"] = schema ? *schema : ojson::object();
  return ojson{{"type", "function"}, {"function", std::move(fn)}};
}

const std::initializer_list<std::string_view> kSamplingFields = {"temperature",
                                                                 "top_p",
                                                                 "top_k",
                                                                 "min_p",
                                                                 "presence_penalty",
                                                                 "frequency_penalty",
                                                                 "repetition_penalty",
                                                                 "logit_bias",
                                                                 "seed",
                                                                 "stop_token_ids",
                                                                 "ignore_eos",
                                                                 "skip_special_tokens",
                                                                 "return_token_ids",
                                                                 "min_tokens",
                                                                 "response_format",
                                                                 "guided_json",
                                                                 "json_schema",
                                                                 "structured_outputs",
                                                                 "priority",
                                                                 "include_stop_str_in_output"};

ApiResult<bool> check_fields(const ojson& body,
                             std::initializer_list<std::initializer_list<std::string_view>> known,
                             const ServingContext& ctx) {
  if (ctx.allow_unknown_fields) return true;
  for (const auto& [key, value] : body.items()) {
    bool found = false;
    std::string_view closest;
    size_t best = 3;  // suggest only names within two edits
    for (const auto& list : known) {
      for (std::string_view k : list) {
        if (k == key) found = true;
        const size_t d = distance(key, k);
        if (d < best) {
          best = d;
          closest = k;
        }
      }
    }
    if (found) continue;
    ApiError e = bad_request(
        key,
        fmt::format("unknown field '{}'{}; this server refuses fields it does not know "
                    "(start it with --allow-unknown-fields to ignore them)",
                    key, closest.empty() ? "" : fmt::format(" (did you mean '{}'?)", closest)));
    e.code = "unknown_parameter";
    return e;
  }
  return true;
}

ApiResult<bool> check_model(const ojson& body, const ServingContext& ctx) {
  RECUR_API_ASSIGN(auto model, get_string(body, "model"));
  if (model && *model != ctx.model_name) {
    ApiError e;
    e.status = 404;
    e.param = "model";
    e.code = "model_not_found";
    e.message = fmt::format("The model '{}' does not exist; this server serves '{}'", *model,
                            ctx.model_name);
    return e;
  }
  return true;
}

ApiResult<bool> parse_sampling(const ojson& b, const ServingContext& ctx, ParsedRequest* req) {
  SamplingParams& sp = req->engine.sampling;
  sp = default_sampling(ctx.generation);

  RECUR_API_ASSIGN(auto temperature, get_number(b, "temperature", 0, 100));
  if (temperature) sp.temperature = float(*temperature);
  RECUR_API_ASSIGN(auto top_p, get_number(b, "top_p", 0, 1));
  if (top_p) {
    if (*top_p <= 0) return bad_request("top_p", "'top_p' must be in (0, 1]");
    sp.top_p = float(*top_p);
  }
  RECUR_API_ASSIGN(auto top_k, get_int(b, "top_k", -1, std::numeric_limits<int32_t>::max()));
  if (top_k) sp.top_k = int(*top_k);
  RECUR_API_ASSIGN(auto min_p, get_number(b, "min_p", 0, 1));
  if (min_p) sp.min_p = float(*min_p);
  RECUR_API_ASSIGN(auto presence, get_number(b, "presence_penalty", -2, 2));
  if (presence) sp.presence_penalty = float(*presence);
  RECUR_API_ASSIGN(auto frequency, get_number(b, "frequency_penalty", -2, 2));
  if (frequency) sp.frequency_penalty = float(*frequency);
  RECUR_API_ASSIGN(auto repetition, get_number(b, "repetition_penalty", 0, 100));
  if (repetition) {
    if (*repetition <= 0)
      return bad_request("repetition_penalty", "'repetition_penalty' must be > 0");
    sp.repetition_penalty = float(*repetition);
  }
  if (const ojson* bias = field(b, "logit_bias")) {
    if (!bias->is_object()) {
      return bad_request("logit_bias", "'logit_bias' must be an object of token id -> bias");
    }
    if (bias->size() > kMaxLogitBias) {
      return bad_request("logit_bias",
                         fmt::format("'logit_bias' has more than {} entries", kMaxLogitBias));
    }
    for (const auto& [key, value] : bias->items()) {
      int64_t id = -1;
      size_t used = 0;
      try {
        id = std::stoll(key, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used == 0 || used != key.size() || id < 0 || id >= ctx.vocab_size) {
        return bad_request("logit_bias", fmt::format("'logit_bias' key \"{}\" is not a token id "
                                                     "in [0, {})",
                                                     key, ctx.vocab_size));
      }
      if (!value.is_number() || !(value.get<double>() >= -100 && value.get<double>() <= 100)) {
        return bad_request("logit_bias", fmt::format("'logit_bias' values must be numbers in "
                                                     "[-100, 100], got {} for {}",
                                                     dump(value), key));
      }
      sp.logit_bias.emplace_back(int32_t(id), value.get<float>());
    }
  }
  RECUR_API_ASSIGN(auto seed, get_int(b, "seed", std::numeric_limits<int64_t>::min(),
                                      std::numeric_limits<int64_t>::max()));
  if (seed) sp.seed = uint64_t(*seed);
  if (const ojson* ids = field(b, "stop_token_ids")) {
    if (!ids->is_array()) return bad_request("stop_token_ids", "'stop_token_ids' must be a list");
    RECUR_API_ASSIGN(req->engine.stop.stop_token_ids,
                     parse_ids(*ids, "stop_token_ids", ctx.vocab_size));
  }
  RECUR_API_ASSIGN(auto ignore_eos, get_bool(b, "ignore_eos"));
  req->engine.stop.ignore_eos = ignore_eos.value_or(false);
  RECUR_API_ASSIGN(auto skip, get_bool(b, "skip_special_tokens"));
  req->engine.skip_special_tokens = skip.value_or(true);
  RECUR_API_ASSIGN(auto ids, get_bool(b, "return_token_ids"));
  req->return_token_ids = ids.value_or(false);
  // As vLLM, the stop token's text and a stop string are left out unless asked for. An
  // Anthropic turn keeps the text of a stop_token_ids token (recur's extension there ends the
  // turn after it) but never a stop sequence, as the Messages API defines them.
  RECUR_API_ASSIGN(auto include_stop, get_bool(b, "include_stop_str_in_output"));
  req->keep_stop_token_text = include_stop.value_or(req->endpoint == Endpoint::kMessages);
  req->keep_stop_string = include_stop.value_or(false);
  // vLLM's extension: lower is scheduled first (engine Request::priority).
  RECUR_API_ASSIGN(auto priority, get_int(b, "priority", INT32_MIN, INT32_MAX));
  req->engine.priority = int(priority.value_or(0));
  RECUR_API_ASSIGN(auto min_tokens, get_int(b, "min_tokens", 0, INT32_MAX));
  if (min_tokens && *min_tokens > 0)
    return bad_request("min_tokens", "'min_tokens' is not supported");
  RECUR_API_CHECK(parse_structured_outputs(b, req));
  return true;
}

ApiResult<bool> check_text_fits(size_t bytes, const ServingContext& ctx, const std::string& param) {
  if (!ctx.tokenizer) return true;
  const size_t longest = ctx.tokenizer->max_token_bytes();
  const size_t at_least = (bytes + longest - 1) / std::max<size_t>(longest, 1);
  if (at_least + 1 <= size_t(std::max(ctx.max_context, 0))) return true;
  return context_exceeded(
      param, fmt::format("This model's maximum context length is {} tokens; the prompt has at "
                         "least {} tokens ({} bytes of text), which leaves no room to generate",
                         ctx.max_context, at_least, bytes));
}

ApiResult<bool> render_chat(const ojson& messages, const ojson* tools, const ojson* kwargs,
                            const std::string& tool_choice, const ServingContext& ctx,
                            ParsedRequest* req, const ChatEnding& ending) {
  if (!ctx.chat_template && !ctx.chat_template_error.empty()) {
    return chat_template_error(fmt::format(
        "the chat template of the model directory served as '{}' could not be loaded, so chat "
        "requests cannot be rendered; this is a fault of the model directory, not of the "
        "request: {}",
        ctx.model_name, ctx.chat_template_error));
  }
  if (!ctx.chat_template || !ctx.tokenizer) {
    return bad_request(prompt_param(req->endpoint),
                       "this model directory has no chat template or tokenizer; "
                       "use /v1/completions");
  }
  ojson request = ojson::object();
  request["messages"] = messages;
  const bool have_tools = tools && !tools->empty();
  const bool use_tools = have_tools && tool_choice != "none";
  if (have_tools) request["tools"] = *tools;
  request["add_generation_prompt"] = ending.add_generation_prompt;
  if (ending.continue_final_message) request["continue_final_message"] = true;
  if (kwargs) request["chat_template_kwargs"] = *kwargs;
  // Which bytes came from the request, so that special-token strings written there are
  // tokenized as text (ChatTemplateOptions::request_special_tokens_as_text).
  auto prompt = ctx.chat_template->render_prompt(request);
  if (!prompt.ok()) return template_failure(prompt.error(), ctx, req->endpoint);
  std::string* text = &prompt->text;

  OutputOptions& out = req->output;
  out.parse_reasoning = ctx.tokenizer->token_to_id("</think>").has_value();
  if (out.parse_reasoning) {
    // A template may open <think> itself: then the output starts inside the reasoning.
    const size_t open = text->rfind("<think>");
    if (open != std::string::npos) {
      const size_t after = open + 7;
      out.start_in_reasoning = text->find_first_not_of(" \t\r\n", after) == std::string::npos;
    }
  }
  out.parse_tools = use_tools;
  out.tool_format = ctx.tool_format;
  // The schemas type XML calls' arguments; JSON calls carry their own types.
  if (use_tools && ctx.tool_format == ToolCallFormat::kXml) {
    out.tools = std::make_shared<const ojson>(*tools);
  }
  if (tool_choice == "required" || tool_choice.rfind("named:", 0) == 0) {
    // A forced call starts the assistant turn (reasoning closed first, when the template left
    // it open); constrained decoding (attach_constraint) keeps the rest a call.
    if (out.start_in_reasoning) out.forced_prefix = "\n</think>\n\n";
    const std::string_view name =
        tool_choice == "required" ? std::string_view() : std::string_view(tool_choice).substr(6);
    const size_t call_at = text->size() + out.forced_prefix.size();
    out.forced_prefix += forced_call_prefix(ctx.tool_format, name);
    // The grammar of the call in the template's form.
    if (ctx.tool_format == ToolCallFormat::kJson && tools) {
      req->forced_call = json_call_grammar(*tools, name, out.parallel_tool_calls);
    } else if (ctx.tool_format == ToolCallFormat::kXml && tools) {
      req->forced_xml_call = xml_call_grammar(*tools, name, out.parallel_tool_calls);
    } else if (ctx.tool_format == ToolCallFormat::kKimi && tools) {
      req->forced_kimi_call = kimi_call_grammar(*tools, name, out.parallel_tool_calls);
    }
    // The function name (from tool_choice) is request text too: everything after the prefix
    // a call without a name has, which holds no control token of the template's.
    if (!name.empty() && ctx.chat_template->options().request_special_tokens_as_text) {
      prompt->literal.emplace_back(call_at + forced_call_prefix(ctx.tool_format, {}).size(),
                                   text->size() + out.forced_prefix.size());
    }
  }
  const char* param = prompt_param(req->endpoint);
  RECUR_API_CHECK(check_text_fits(text->size() + out.forced_prefix.size(), ctx, param));
  auto ids = ctx.tokenizer->encode(*text + out.forced_prefix, prompt->literal);
  if (!ids.ok()) return from_error(ids.error(), param);
  req->prompts.push_back(std::move(*ids));
  req->prompt_texts.push_back(std::move(*text));
  return true;
}

ApiResult<bool> check_lengths(const ServingContext& ctx, ParsedRequest* req) {
  if (req->prompts.empty()) return bad_request("prompt", "the prompt is empty");
  if (int64_t(req->prompts.size()) * req->n > kMaxChoices) {
    return bad_request("n", fmt::format("prompts x n must be at most {}", kMaxChoices));
  }
  const char* param = prompt_param(req->endpoint);
  for (const auto& p : req->prompts) {
    if (p.empty()) return bad_request(param, "the prompt is empty");
    for (int32_t id : p) {
      if (id < 0 || id >= ctx.vocab_size) {
        return bad_request(param, fmt::format("prompt token id {} is outside the vocabulary "
                                              "[0, {})",
                                              id, ctx.vocab_size));
      }
    }
    if (int64_t(p.size()) + 1 > ctx.max_context) {
      return context_exceeded(
          param,
          fmt::format(
              "This model's maximum context length is {} tokens; the prompt has {} tokens, which "
              "leaves no room to generate",
              ctx.max_context, p.size()));
    }
    if (req->max_tokens_given && int64_t(p.size()) + req->engine.max_tokens > ctx.max_context) {
      return context_exceeded(
          max_tokens_param(req->endpoint),
          fmt::format(
              "This model's maximum context length is {} tokens; the request asks for {} tokens "
              "({} in the prompt, {} to generate)",
              ctx.max_context, int64_t(p.size()) + req->engine.max_tokens, p.size(),
              req->engine.max_tokens));
    }
  }
  const Status st = req->engine.sampling.validate(ctx.vocab_size);
  if (!st.ok()) return from_error(st.error());
  return true;
}

ApiResult<ParsedRequest> parse_chat_request(const ojson& body, const ServingContext& ctx) {
  ParsedRequest req;
  req.endpoint = Endpoint::kChat;
  RECUR_API_CHECK(check_fields(
      body,
      {kSamplingFields,
       kIgnoredFields,
       {"model", "messages", "stream", "stream_options", "n", "max_tokens", "max_completion_tokens",
        "stop", "logprobs", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
        "chat_template_kwargs", "reasoning_effort", "add_generation_prompt",
        "continue_final_message", "echo"}},
      ctx));
  RECUR_API_CHECK(check_model(body, ctx));
  RECUR_API_CHECK(parse_sampling(body, ctx, &req));
  RECUR_API_CHECK(parse_stream(body, &req));
  RECUR_API_CHECK(parse_n(body, &req));
  RECUR_API_CHECK(parse_max_tokens(body, "max_tokens", &req));
  RECUR_API_CHECK(parse_max_tokens(body, "max_completion_tokens", &req));
  if (const ojson* stop = field(body, "stop"))
    RECUR_API_CHECK(parse_stop(*stop, "stop", &req.engine.stop));

  RECUR_API_ASSIGN(auto logprobs, get_bool(body, "logprobs"));
  RECUR_API_ASSIGN(auto top, get_int(body, "top_logprobs", 0, kMaxTopLogprobs));
  req.chat_logprobs = logprobs.value_or(false);
  if (top && !req.chat_logprobs) {
    return bad_request("top_logprobs", "'top_logprobs' needs 'logprobs': true");
  }
  req.engine.sampling.logprobs = req.chat_logprobs ? int(top.value_or(0)) : -1;

  const ojson* messages = field(body, "messages");
  if (!messages) return bad_request("messages", "'messages' is required");
  RECUR_API_ASSIGN(ojson norm, normalize_messages(*messages));
  const ojson* tools = field(body, "tools");
  if (tools) RECUR_API_CHECK(check_tools(*tools));
  RECUR_API_ASSIGN(std::string choice, parse_tool_choice(body, tools));
  RECUR_API_ASSIGN(auto parallel, get_bool(body, "parallel_tool_calls"));
  req.output.parallel_tool_calls = parallel.value_or(true);
  const ojson* kwargs = field(body, "chat_template_kwargs");
  if (kwargs && !kwargs->is_object()) {
    return bad_request("chat_template_kwargs", "'chat_template_kwargs' must be an object");
  }
  // reasoning_effort: "none" and "minimal" switch thinking off (a template variable, as
  // enable_thinking in chat_template_kwargs, which wins when both are given).
  RECUR_API_ASSIGN(auto effort, get_string(body, "reasoning_effort"));
  ojson with_effort;
  if (effort) {
    if (*effort != "none" && *effort != "minimal" && *effort != "low" && *effort != "medium" &&
        *effort != "high") {
      return bad_request("reasoning_effort",
                         "'reasoning_effort' must be none, minimal, low, medium or high");
    }
    with_effort = kwargs ? *kwargs : ojson::object();
    if (!with_effort.contains("enable_thinking")) {
      with_effort["enable_thinking"] = *effort != "none" && *effort != "minimal";
    }
    kwargs = &with_effort;
  }
  // vLLM's rendering switches: continuing the final message needs add_generation_prompt false.
  ChatEnding ending;
  RECUR_API_ASSIGN(auto agp, get_bool(body, "add_generation_prompt"));
  RECUR_API_ASSIGN(auto cont, get_bool(body, "continue_final_message"));
  ending.add_generation_prompt = agp.value_or(true);
  ending.continue_final_message = cont.value_or(false);
  if (ending.continue_final_message && ending.add_generation_prompt) {
    return bad_request("continue_final_message",
                       "'continue_final_message' needs 'add_generation_prompt': false");
  }
  // vLLM's echo: a final assistant message comes back ahead of what the model adds to it.
  RECUR_API_ASSIGN(auto echo, get_bool(body, "echo"));
  const ojson& last = norm.back();
  if (echo.value_or(false) && last["role"] == "assistant") {
    req.chat_echo = text_content(last["content"]);
  }
  RECUR_API_CHECK(render_chat(norm, tools, kwargs, choice, ctx, &req, ending));
  RECUR_API_CHECK(check_lengths(ctx, &req));
  RECUR_API_CHECK(attach_constraint(ctx, &req));
  return req;
}

ApiResult<ParsedRequest> parse_completion_request(const ojson& body, const ServingContext& ctx) {
  ParsedRequest req;
  req.endpoint = Endpoint::kCompletions;
  RECUR_API_CHECK(check_fields(body,
                               {kSamplingFields,
                                kIgnoredFields,
                                {"model", "prompt", "stream", "stream_options", "n", "max_tokens",
                                 "stop", "best_of", "suffix", "logprobs", "echo"}},
                               ctx));
  RECUR_API_CHECK(check_model(body, ctx));
  RECUR_API_CHECK(parse_sampling(body, ctx, &req));
  RECUR_API_CHECK(parse_stream(body, &req));
  RECUR_API_CHECK(parse_n(body, &req));
  RECUR_API_CHECK(parse_max_tokens(body, "max_tokens", &req));
  if (const ojson* stop = field(body, "stop"))
    RECUR_API_CHECK(parse_stop(*stop, "stop", &req.engine.stop));
  RECUR_API_ASSIGN(auto best_of, get_int(body, "best_of", 1, 128));
  if (best_of && *best_of != req.n) {
    return bad_request("best_of", "'best_of' other than n is not supported");
  }
  RECUR_API_ASSIGN(auto suffix, get_string(body, "suffix"));
  if (suffix && !suffix->empty()) return bad_request("suffix", "'suffix' is not supported");
  RECUR_API_ASSIGN(auto logprobs, get_int(body, "logprobs", 0, kMaxTopLogprobs));
  req.engine.sampling.logprobs = logprobs ? int(*logprobs) : -1;
  RECUR_API_ASSIGN(auto echo, get_bool(body, "echo"));
  req.echo = echo.value_or(false);
  if (req.echo && logprobs) {
    return bad_request("echo", "'echo' with 'logprobs' is not supported (no prompt logprobs)");
  }

  const ojson* prompt = field(body, "prompt");
  if (!prompt) return bad_request("prompt", "'prompt' is required");
  auto encode = [&](const ojson& s) -> ApiResult<bool> {
    if (!ctx.tokenizer) {
      return bad_request("prompt", "this model directory has no tokenizer; give token ids");
    }
    const std::string& text = s.get_ref<const std::string&>();
    RECUR_API_CHECK(check_text_fits(text.size(), ctx, "prompt"));
    auto ids = ctx.tokenizer->encode(text);
    if (!ids.ok()) return from_error(ids.error(), "prompt");
    req.prompts.push_back(std::move(*ids));
    req.prompt_texts.push_back(s.get<std::string>());
    return true;
  };
  auto add_ids = [&](const ojson& arr) -> ApiResult<bool> {
    RECUR_API_ASSIGN(auto ids, parse_ids(arr, "prompt", ctx.vocab_size));
    req.prompt_texts.push_back(ctx.tokenizer ? ctx.tokenizer->decode(ids) : std::string());
    req.prompts.push_back(std::move(ids));
    return true;
  };
  const char* shape =
      "'prompt' must be a string, a list of strings, a list of token ids or a "
      "list of lists of token ids";
  if (prompt->is_string()) {
    RECUR_API_CHECK(encode(*prompt));
  } else if (prompt->is_array() && !prompt->empty()) {
    const ojson& first = prompt->front();
    if (first.is_number()) {
      RECUR_API_CHECK(add_ids(*prompt));
    } else if (prompt->size() > size_t(kMaxChoices)) {
      return bad_request("prompt", fmt::format("'prompt' lists more than {} prompts", kMaxChoices));
    } else {
      for (const auto& p : *prompt) {
        if (p.is_string() && first.is_string()) {
          RECUR_API_CHECK(encode(p));
        } else if (p.is_array() && first.is_array()) {
          RECUR_API_CHECK(add_ids(p));
        } else {
          return bad_request("prompt", shape);
        }
      }
    }
  } else {
    return bad_request("prompt", shape);
  }
  RECUR_API_CHECK(check_lengths(ctx, &req));
  RECUR_API_CHECK(attach_constraint(ctx, &req));
  return req;
}

}  // namespace recur::server
