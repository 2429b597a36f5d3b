// Structured outputs in requests: response_format (chat, completions; the Responses API's
// text.format), vLLM's guided_json and structured_outputs.json, llama.cpp's json_schema; and
// the engine request's constraint once the prompt is rendered (theirs, or a forced call's).
#include "server/request.h"

namespace recur::server {

namespace {

// The request's one schema, from `name`: a second structured-output field is a 400, whichever
// API's spelling either takes.
ApiResult<bool> set_schema(ParsedRequest* req, const std::string& name,
                           std::shared_ptr<const CompiledSchema> schema) {
  if (req->json_schema) {
    return bad_request(name, fmt::format("'{}' beside '{}': give one structured-output field", name,
                                         req->json_schema_field));
  }
  req->json_schema = std::move(schema);
  req->json_schema_field = name;
  return true;
}

}  // namespace

ApiResult<bool> parse_structured_outputs(const ojson& b, ParsedRequest* req) {
  if (const ojson* rf = field(b, "response_format")) {
    RECUR_API_CHECK(parse_response_format(*rf, "response_format", req));
  }
  // The same constraint as other servers spell it: vLLM's guided_json (a schema, or its JSON
  // text) and structured_outputs.json, llama.cpp's json_schema.
  const ojson* so = field(b, "structured_outputs");
  if (so && !so->is_object()) {
    return bad_request("structured_outputs", "'structured_outputs' must be an object");
  }
  for (const auto& [name, schema] :
       {std::pair{std::string("guided_json"), field(b, "guided_json")},
        std::pair{std::string("json_schema"), field(b, "json_schema")},
        std::pair{std::string("structured_outputs.json"), so ? field(*so, "json") : nullptr}}) {
    if (!schema) continue;
    ojson parsed = *schema;
    if (schema->is_string()) {
      std::string error;
      std::optional<ojson> text = parse_json_text(schema->get_ref<const std::string&>(), &error);
      if (!text) {
        return bad_request(name,
                           fmt::format("'{}' must be a JSON schema; the text {}", name, error));
      }
      parsed = std::move(*text);
    }
    RECUR_API_ASSIGN(auto compiled, compile_json_schema(parsed, name));
    RECUR_API_CHECK(set_schema(req, name, std::move(compiled)));
  }
  if (so) {
    for (const auto& [key, value] : so->items()) {
      if (key != "json") {
        return bad_request(
            "structured_outputs." + key,
            fmt::format("'structured_outputs.{}' is not supported (only json)", key));
      }
    }
  }
  return true;
}

ApiResult<bool> parse_response_format(const ojson& format, const std::string& where,
                                      ParsedRequest* req) {
  const ojson* type = format.is_object() ? field(format, "type") : nullptr;
  if (!type || !type->is_string()) {
    return bad_request(where, fmt::format("'{}' must be an object with a \"type\"", where));
  }
  req->response_format = format;
  if (*type == "text") return true;
  if (*type == "json_object") return set_schema(req, where, any_json_object_schema());
  if (*type != "json_schema") {
    return bad_request(where + ".type",
                       fmt::format("'{}.type' must be text, json_object or json_schema", where));
  }
  // Chat completions nest the schema under "json_schema"; the Responses API puts it beside.
  const bool nested = where == "response_format";
  const ojson* holder = nested ? field(format, "json_schema") : &format;
  const std::string at = nested ? where + ".json_schema" : where;
  if (!holder || !holder->is_object()) {
    return bad_request(at, fmt::format("'{}' must be an object with the schema", at));
  }
  RECUR_API_ASSIGN(auto name, get_string(*holder, "name", at + "."));
  if (name && (name->empty() || name->size() > 64)) {
    return bad_request(at + ".name", fmt::format("'{}.name' must have 1 to 64 characters", at));
  }
  RECUR_API_CHECK(get_bool(*holder, "strict", at + "."));
  const ojson* schema = field(*holder, "schema");
  if (!schema) return bad_request(at + ".schema", fmt::format("'{}.schema' is required", at));
  RECUR_API_ASSIGN(auto compiled, compile_json_schema(*schema, at + ".schema"));
  return set_schema(req, where, std::move(compiled));
}

ApiResult<bool> attach_constraint(const ServingContext& ctx, ParsedRequest* req) {
  if (!req->json_schema) {
    // A forced call's constraint. vLLM lets a forced call's schema replace response_format;
    // here the two never meet: a response format beside tools the model may call is refused
    // below, so a client never gets text that silently ignores the format it asked for.
    if (req->forced_call && ctx.vocab_bytes) {
      req->engine.constraint =
          tool_call_constraint(req->forced_call, ctx.vocab_bytes, ctx.eos_token_ids);
    } else if (req->forced_xml_call && ctx.vocab_bytes) {
      req->engine.constraint =
          xml_call_constraint(req->forced_xml_call, ctx.vocab_bytes, ctx.eos_token_ids);
    } else if (req->forced_kimi_call && ctx.kimi_vocab_bytes) {
      req->engine.constraint =
          kimi_call_constraint(req->forced_kimi_call, ctx.kimi_vocab_bytes, ctx.eos_token_ids);
    }
    return true;
  }
  const std::string& where = req->json_schema_field;
  if (!ctx.vocab_bytes) {
    return bad_request(where, "structured outputs need the model's tokenizer");
  }
  if (req->output.parse_tools) {
    return bad_request(where, fmt::format("'{}' with tools the model may call is not "
                                          "supported; set tool_choice to \"none\" or leave "
                                          "out one of them",
                                          where));
  }
  req->engine.constraint = json_constraint(req->json_schema, ctx.vocab_bytes, ctx.eos_token_ids,
                                           req->output.start_in_reasoning ? "</think>" : "");
  return true;
}

}  // namespace recur::server
