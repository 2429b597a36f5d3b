// vLLM's /tokenize and /detokenize: a prompt or a chat (rendered as /v1/chat/completions
// renders it) to token ids, and ids back to text.
#include "server/request.h"

namespace recur::server {

ApiResult<TokenizeRequest> parse_tokenize_request(const ojson& body, const ServingContext& ctx) {
  RECUR_API_CHECK(check_fields(
      body,
      {{"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
        "continue_final_message", "tools", "chat_template_kwargs", "return_token_strs"}},
      ctx));
  RECUR_API_CHECK(check_model(body, ctx));
  if (!ctx.tokenizer) return bad_request("", "this model directory has no tokenizer");
  // There is no BOS or EOS to add: the chat template writes what the model reads.
  RECUR_API_CHECK(get_bool(body, "add_special_tokens"));
  TokenizeRequest out;
  RECUR_API_ASSIGN(auto strs, get_bool(body, "return_token_strs"));
  out.token_strs = strs.value_or(false);
  const ojson* prompt = field(body, "prompt");
  const ojson* messages = field(body, "messages");
  if (!prompt == !messages) {
    return bad_request("prompt", "give either 'prompt' (a string) or 'messages'");
  }
  if (prompt) {
    if (!prompt->is_string()) return bad_request("prompt", "'prompt' must be a string");
    const std::string& text = prompt->get_ref<const std::string&>();
    RECUR_API_CHECK(check_text_fits(text.size(), ctx, "prompt"));
    auto ids = ctx.tokenizer->encode(text);
    if (!ids.ok()) return from_error(ids.error(), "prompt");
    out.ids = std::move(*ids);
    return out;
  }
  // The chat request these fields make, rendered and tokenized as a chat completion would be.
  ojson chat = ojson::object();
  for (const char* key : {"messages", "add_generation_prompt", "continue_final_message", "tools",
                          "chat_template_kwargs"}) {
    if (const ojson* v = field(body, key)) chat[key] = *v;
  }
  RECUR_API_ASSIGN(ParsedRequest req, parse_chat_request(chat, ctx));
  out.ids = std::move(req.prompts.at(0));
  return out;
}

ApiResult<std::string> parse_detokenize_request(const ojson& body, const ServingContext& ctx) {
  RECUR_API_CHECK(check_fields(body, {{"model", "tokens"}}, ctx));
  RECUR_API_CHECK(check_model(body, ctx));
  if (!ctx.tokenizer) return bad_request("", "this model directory has no tokenizer");
  const ojson* tokens = field(body, "tokens");
  if (!tokens || !tokens->is_array()) {
    return bad_request("tokens", "'tokens' must be a list of token ids");
  }
  std::vector<int32_t> ids;
  ids.reserve(tokens->size());
  for (size_t i = 0; i < tokens->size(); ++i) {
    const ojson& t = (*tokens)[i];
    const std::string where = fmt::format("tokens[{}]", i);
    auto id = as_int(t, 0, ctx.vocab_size - 1);
    if (!id) {
      return bad_request(where, fmt::format("'tokens' must hold token ids in [0, {}), got {}",
                                            ctx.vocab_size, dump(t)));
    }
    // The model's vocabulary may have rows past the tokenizer's ids: those have no text, and
    // dropping them would answer for ids the client did not send.
    if (ctx.tokenizer->id_to_token(int32_t(*id)).empty()) {
      return bad_request(
          where, fmt::format("'{}' is {}, an id the tokenizer has no token for", where, *id));
    }
    ids.push_back(int32_t(*id));
  }
  return ctx.tokenizer->decode(ids);
}

}  // namespace recur::server
