#include "server/format.h"

#include <cmath>

namespace recur::server {

namespace {

// -inf logprobs have no JSON form; vLLM reports them as -9999.
double lp(float v) {
  return std::isfinite(v) ? double(v) : -9999.0;
}

std::string token_text(const Generation& gen, int32_t id) {
  const Tokenizer* tok = gen.context().tokenizer;
  return tok ? std::string(tok->id_to_bytes(id)) : std::string();
}

ojson bytes_of(const std::string& s) {
  ojson b = ojson::array();
  for (unsigned char c : s) b.push_back(int(c));
  return b;
}

ojson usage_json(const Generation& gen) {
  const int p = gen.prompt_tokens(), c = gen.completion_tokens();
  return {{"prompt_tokens", p},
          {"completion_tokens", c},
          {"total_tokens", p + c},
          {"prompt_tokens_details", {{"cached_tokens", gen.cached_tokens()}}}};
}

// Anthropic counts cached prompt tokens apart: input_tokens + cache_read_input_tokens is the
// whole prompt.
ojson anthropic_usage(const Generation& gen, int output_tokens) {
  const int cached = gen.cached_tokens();
  return {{"input_tokens", gen.prompt_tokens() - cached},
          {"cache_creation_input_tokens", 0},
          {"cache_read_input_tokens", cached},
          {"output_tokens", output_tokens}};
}

// vLLM's stop_reason: the stop_token_ids entry or the stop string that ended the choice.
ojson stop_reason(const ChoiceState& c) {
  if (c.stop_token) return *c.stop_token;
  return c.stop_string.empty() ? ojson(nullptr) : ojson(c.stop_string);
}

// Characters, as OpenAI's text_offset counts them: bytes that do not continue a UTF-8 one.
size_t code_points(std::string_view s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xc0) != 0x80;
  return n;
}

ojson tool_call_json(const ToolCall& call, int index, bool with_index) {
  ojson j = ojson::object();
  if (with_index) j["index"] = index;
  j["id"] = call.id;
  j["type"] = "function";
  j["function"] = {{"name", call.name}, {"arguments", call.arguments}};
  return j;
}

// Anthropic stop_reason and stop_sequence.
std::pair<std::string, ojson> anthropic_stop(const ChoiceState& c) {
  if (c.reason == FinishReason::kLength) return {"max_tokens", nullptr};
  if (c.parser && c.parser->tool_calls() > 0) return {"tool_use", nullptr};
  if (!c.stop_string.empty()) return {"stop_sequence", c.stop_string};
  return {"end_turn", nullptr};
}

// tool_use input is an object: a cut call's is its arguments closed where what was written is
// whole ({} when none is), the most of them that can be an object without making any up.
ojson tool_input(const ToolCall& call) {
  const std::optional<std::string> closed =
      call.cut ? close_json_object(call.arguments) : call.arguments;
  ojson j = closed ? ojson::parse(*closed, nullptr, false) : ojson::object();
  return (!j.is_discarded() && j.is_object()) ? j : ojson::object();
}

// A streamed tool_use's input_json_delta: a cut call's arguments as written, cut (as Anthropic
// streams a tool_use that max_tokens ends).
std::string partial_json(const ToolCall& call) {
  return call.cut ? call.arguments : dump(tool_input(call));
}

}  // namespace

std::string sse_data(const ojson& j) {
  return "data: " + dump(j) + "\n\n";
}

void append_json_string(std::string* out, std::string_view s) {
  static constexpr char kHex[] = "0123456789abcdef";
  out->reserve(out->size() + s.size() + 2);
  *out += '"';
  size_t i = 0;
  while (i < s.size()) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      switch (c) {
        case '"':
          *out += "\\\"";
          break;
        case '\\':
          *out += "\\\\";
          break;
        case '\n':
          *out += "\\n";
          break;
        case '\r':
          *out += "\\r";
          break;
        case '\t':
          *out += "\\t";
          break;
        default:
          if (c < 0x20) {
            *out += "\\u00";
            *out += kHex[c >> 4];
            *out += kHex[c & 15];
          } else {
            *out += char(c);
          }
      }
      ++i;
      continue;
    }
    // A whole, well-formed UTF-8 sequence is copied; anything else becomes U+FFFD.
    const int len = c >= 0xf5 ? 0 : c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : c >= 0xc2 ? 2 : 0;
    bool ok = len > 0 && i + size_t(len) <= s.size();
    for (int k = 1; ok && k < len; ++k)
      ok = (static_cast<unsigned char>(s[i + size_t(k)]) & 0xc0) == 0x80;
    if (ok && len == 3) {
      const unsigned char c1 = static_cast<unsigned char>(s[i + 1]);
      ok = !(c == 0xe0 && c1 < 0xa0) && !(c == 0xed && c1 >= 0xa0);  // overlong, surrogate
    } else if (ok && len == 4) {
      const unsigned char c1 = static_cast<unsigned char>(s[i + 1]);
      ok = !(c == 0xf0 && c1 < 0x90) && !(c == 0xf4 && c1 >= 0x90);  // overlong, > U+10FFFF
    }
    if (ok) {
      out->append(s.data() + i, size_t(len));
      i += size_t(len);
    } else {
      *out += "\xef\xbf\xbd";
      ++i;
    }
  }
  *out += '"';
}

std::string sse_event(std::string_view name, const ojson& j) {
  return "event: " + std::string(name) + "\ndata: " + dump(j) + "\n\n";
}

std::string cut_answer_message(std::string_view why) {
  return fmt::format("the answer was cut short ({}); it is incomplete", why);
}

ojson chat_logprobs(const Generation& gen, const std::vector<TokenInfo>& tokens) {
  ojson content = ojson::array();
  const int top_n = gen.request().engine.sampling.logprobs;
  for (const auto& t : tokens) {
    const std::string s = token_text(gen, t.id);
    ojson top = ojson::array();
    for (int k = 0; k < int(t.top.size()) && k < top_n; ++k) {
      const std::string ts = token_text(gen, t.top[size_t(k)].id);
      top.push_back(
          {{"token", ts}, {"logprob", lp(t.top[size_t(k)].logprob)}, {"bytes", bytes_of(ts)}});
    }
    content.push_back({{"token", s},
                       {"logprob", lp(t.logprob)},
                       {"bytes", bytes_of(s)},
                       {"top_logprobs", std::move(top)}});
  }
  return {{"content", std::move(content)}};
}

ojson completion_logprobs(const Generation& gen, const std::vector<TokenInfo>& tokens,
                          size_t* text_offset) {
  ojson toks = ojson::array(), lps = ojson::array(), tops = ojson::array(),
        offsets = ojson::array();
  const int top_n = gen.request().engine.sampling.logprobs;
  for (const auto& t : tokens) {
    const std::string s = token_text(gen, t.id);
    toks.push_back(s);
    lps.push_back(lp(t.logprob));
    offsets.push_back(*text_offset);
    *text_offset += code_points(s);
    // The n most likely tokens and the sampled one, as OpenAI lists them (n + 1 at most).
    ojson top = ojson::object();
    bool sampled = false;
    for (int k = 0; k < int(t.top.size()) && k < top_n; ++k) {
      top[token_text(gen, t.top[size_t(k)].id)] = lp(t.top[size_t(k)].logprob);
      sampled = sampled || t.top[size_t(k)].id == t.id;
    }
    if (!sampled) top[s] = lp(t.logprob);
    tops.push_back(std::move(top));
  }
  return {{"tokens", std::move(toks)},
          {"token_logprobs", std::move(lps)},
          {"top_logprobs", std::move(tops)},
          {"text_offset", std::move(offsets)}};
}

ojson openai_response(const Generation& gen) {
  const ParsedRequest& req = gen.request();
  const bool chat = req.endpoint == Endpoint::kChat;
  ojson choices = ojson::array();
  for (size_t i = 0; i < gen.choices().size(); ++i) {
    const ChoiceState& c = gen.choices()[i];
    ojson choice = ojson::object();
    choice["index"] = i;
    if (chat) {
      std::string content, reasoning;
      ojson calls = ojson::array();
      for (const Segment& s : c.segments) {
        if (s.kind == Segment::Kind::kContent) content += s.text;
        if (s.kind == Segment::Kind::kReasoning) reasoning += s.text;
        if (s.kind == Segment::Kind::kToolCall) calls.push_back(tool_call_json(s.call, 0, false));
      }
      content.insert(0, req.chat_echo);
      ojson msg = {{"role", "assistant"}};
      msg["content"] = (content.empty() && !calls.empty()) ? ojson(nullptr) : ojson(content);
      msg["reasoning_content"] = reasoning.empty() ? ojson(nullptr) : ojson(reasoning);
      if (!calls.empty()) msg["tool_calls"] = std::move(calls);
      choice["message"] = std::move(msg);
      choice["logprobs"] = req.chat_logprobs ? chat_logprobs(gen, c.tokens) : ojson(nullptr);
    } else {
      const std::string& prompt = req.prompt_texts[size_t(c.prompt_index)];
      choice["text"] = req.echo ? prompt + c.text : c.text;
      size_t offset = 0;  // echo and logprobs together are refused
      choice["logprobs"] = req.engine.sampling.logprobs >= 0
                               ? completion_logprobs(gen, c.tokens, &offset)
                               : ojson(nullptr);
    }
    choice["finish_reason"] = gen.openai_finish_reason(int(i));
    choice["stop_reason"] = stop_reason(c);
    if (req.return_token_ids) {
      choice["token_ids"] = c.ids;
      choice["prompt_token_ids"] = req.prompts[size_t(c.prompt_index)];
    }
    choices.push_back(std::move(choice));
  }
  return {{"id", gen.id()},
          {"object", chat ? "chat.completion" : "text_completion"},
          {"created", gen.created()},
          {"model", gen.context().model_name},
          {"choices", std::move(choices)},
          {"usage", usage_json(gen)}};
}

OpenAiStream::OpenAiStream(const Generation& gen)
    : gen_(gen),
      started_(gen.choices().size(), false),
      pending_(gen.choices().size()),
      calls_(gen.choices().size(), 0),
      shown_(gen.choices().size(), 0),
      offsets_(gen.choices().size(), 0) {
  const bool chat = gen.request().endpoint == Endpoint::kChat;
  prefix_ = "data: {\"id\":";
  append_json_string(&prefix_, gen.id());
  prefix_ += chat ? ",\"object\":\"chat.completion.chunk\"" : ",\"object\":\"text_completion\"";
  prefix_ += ",\"created\":" + std::to_string(gen.created()) + ",\"model\":";
  append_json_string(&prefix_, gen.context().model_name);
  prefix_ += ",\"choices\":[{\"index\":";
  suffix_ = gen.request().include_usage ? "}],\"usage\":null}\n\n" : "}]}\n\n";
  if (gen.request().continuous_usage) suffix_ = "}],\"usage\":";
}

namespace {

// Decimal digits of v, without std::to_string's allocation.
void append_uint(std::string* out, uint64_t v) {
  char buf[20];
  int n = 0;
  do {
    buf[n++] = char('0' + v % 10);
    v /= 10;
  } while (v);
  while (n > 0) *out += buf[--n];
}

void append_int(std::string* out, int64_t v) {
  if (v < 0) {
    *out += '-';
    append_uint(out, uint64_t(0) - uint64_t(v));
  } else {
    append_uint(out, uint64_t(v));
  }
}

}  // namespace

void OpenAiStream::chunk(std::string* out, size_t index, std::string_view fields) {
  *out += prefix_;
  append_uint(out, index);
  *out += ',';
  *out += fields;
  *out += suffix_;
  if (!gen_.request().continuous_usage) return;
  // vLLM's continuous usage: the choice's tokens so far, on every chunk.
  const ChoiceState& c = gen_.choices()[index];
  const size_t prompt = gen_.request().prompts[size_t(c.prompt_index)].size();
  *out += "{\"prompt_tokens\":";
  append_uint(out, prompt);
  *out += ",\"completion_tokens\":";
  append_uint(out, uint64_t(shown_[index]));
  *out += ",\"total_tokens\":";
  append_uint(out, prompt + uint64_t(shown_[index]));
  *out += "}}\n\n";
}

std::string OpenAiStream::updates(const std::vector<ChoiceUpdate>& updates) {
  std::string out;
  this->updates(updates, &out);
  return out;
}

std::string OpenAiStream::done() {
  std::string out;
  done(&out);
  return out;
}

void OpenAiStream::updates(const std::vector<ChoiceUpdate>& updates, std::string* out_ptr) {
  const ParsedRequest& req = gen_.request();
  const bool chat = req.endpoint == Endpoint::kChat;
  const bool want_tokens = req.engine.sampling.logprobs >= 0 || req.return_token_ids;
  std::string& out = *out_ptr;
  std::string& fields = fields_;
  for (const ChoiceUpdate& u : updates) {
    const size_t i = size_t(u.index);
    const ChoiceState& c = gen_.choices()[i];
    auto& pending = pending_[i];
    if (want_tokens) pending.insert(pending.end(), u.tokens.begin(), u.tokens.end());
    // Tokens ride on the first chunk of their text that goes out (text held back by the parser
    // goes out later, with them), never on the role chunk, which has none.
    auto tail = [&](bool finish, bool tokens) {
      if (!tokens) {
        fields += ",\"logprobs\":null,\"finish_reason\":null";
        return;
      }
      if (req.return_token_ids && !pending.empty()) {
        fields += ",\"token_ids\":[";
        for (size_t k = 0; k < pending.size(); ++k) {
          if (k) fields += ',';
          append_int(&fields, pending[k].id);
        }
        fields += ']';
      }
      fields += ",\"logprobs\":";
      if (req.engine.sampling.logprobs >= 0) {
        fields += dump(chat ? chat_logprobs(gen_, pending)
                            : completion_logprobs(gen_, pending, &offsets_[i]));
      } else {
        fields += "null";
      }
      pending.clear();
      fields += ",\"finish_reason\":";
      if (finish) {
        append_json_string(&fields, gen_.openai_finish_reason(int(i)));
        fields += ",\"stop_reason\":";
        fields += dump(stop_reason(c));
      } else {
        fields += "null";
      }
    };
    if (u.finished && c.reason == FinishReason::kError) {
      ApiError e;
      e.status = 500;
      e.type = "server_error";
      e.message = c.message;
      out += sse_data(e.to_json());
    }
    if (chat) {
      auto emit = [&](std::string_view delta, bool finish, bool tokens = true) {
        fields.assign("\"delta\":");
        fields += delta;
        tail(finish, tokens);
        chunk(&out, i, fields);
      };
      std::string& delta = delta_;
      if (!started_[i]) {
        started_[i] = true;
        emit(R"({"role":"assistant","content":""})", false, false);
        if (!req.chat_echo.empty()) {
          delta.assign("{\"content\":");
          append_json_string(&delta, req.chat_echo);
          delta += '}';
          emit(delta, false, false);
        }
      }
      shown_[i] = c.generated;  // the role and echo chunks came before these tokens
      for (const Segment& s : u.segments) {
        if (s.kind == Segment::Kind::kToolCall) {
          // Name first, then the arguments: the shape OpenAI streams calls in.
          ojson head = tool_call_json(s.call, calls_[i], true);
          head["function"]["arguments"] = "";
          emit(dump(ojson{{"tool_calls", ojson::array({std::move(head)})}}), false);
          emit(dump(ojson{{"tool_calls",
                           ojson::array({{{"index", calls_[i]},
                                          {"function", {{"arguments", s.call.arguments}}}}})}}),
               false);
          ++calls_[i];
          continue;
        }
        delta.assign(s.kind == Segment::Kind::kContent ? "{\"content\":"
                                                       : "{\"reasoning_content\":");
        append_json_string(&delta, s.text);
        delta += '}';
        emit(delta, false);
      }
      if (u.finished) emit("{}", true);
    } else {
      shown_[i] = c.generated;
      std::string_view text = u.text;
      std::string echoed;
      if (!started_[i]) {
        started_[i] = true;
        if (req.echo) text = echoed = req.prompt_texts[size_t(c.prompt_index)] + u.text;
      }
      if (text.empty() && pending.empty() && !u.finished) continue;
      fields.assign("\"text\":");
      append_json_string(&fields, text);
      tail(u.finished, true);
      chunk(&out, i, fields);
    }
  }
}

void OpenAiStream::done(std::string* out_ptr) {
  std::string& out = *out_ptr;
  if (gen_.request().include_usage) {
    const bool chat = gen_.request().endpoint == Endpoint::kChat;
    ojson j = {
        {"id", gen_.id()},           {"object", chat ? "chat.completion.chunk" : "text_completion"},
        {"created", gen_.created()}, {"model", gen_.context().model_name},
        {"choices", ojson::array()}, {"usage", usage_json(gen_)}};
    out += sse_data(j);
  }
  out += "data: [DONE]\n\n";
}

ojson anthropic_response(const Generation& gen) {
  const ChoiceState& c = gen.choices().front();
  ojson content = ojson::array();
  for (const Segment& s : c.segments) {
    if (s.kind == Segment::Kind::kContent) {
      content.push_back({{"type", "text"}, {"text", s.text}});
    } else if (s.kind == Segment::Kind::kReasoning) {
      content.push_back({{"type", "thinking"}, {"thinking", s.text}, {"signature", ""}});
    } else {
      content.push_back({{"type", "tool_use"},
                         {"id", s.call.id},
                         {"name", s.call.name},
                         {"input", tool_input(s.call)}});
    }
  }
  auto [reason, sequence] = anthropic_stop(c);
  return {{"id", gen.id()},
          {"type", "message"},
          {"role", "assistant"},
          {"model", gen.context().model_name},
          {"content", std::move(content)},
          {"stop_reason", reason},
          {"stop_sequence", sequence},
          {"usage", anthropic_usage(gen, c.generated)}};
}

AnthropicStream::AnthropicStream(const Generation& gen) : gen_(gen) {}

std::string AnthropicStream::start() {
  ojson msg = {{"id", gen_.id()},           {"type", "message"},
               {"role", "assistant"},       {"model", gen_.context().model_name},
               {"content", ojson::array()}, {"stop_reason", nullptr},
               {"stop_sequence", nullptr},  {"usage", anthropic_usage(gen_, 0)}};
  return sse_event("message_start", {{"type", "message_start"}, {"message", std::move(msg)}});
}

std::string AnthropicStream::close_block() {
  if (open_ < 0) return "";
  open_ = -1;
  return sse_event("content_block_stop", {{"type", "content_block_stop"}, {"index", index_}});
}

std::string AnthropicStream::updates(const std::vector<ChoiceUpdate>& updates) {
  std::string out;
  this->updates(updates, &out);
  return out;
}

void AnthropicStream::updates(const std::vector<ChoiceUpdate>& updates, std::string* out_ptr) {
  std::string& out = *out_ptr;
  // message_start waits for the first events: by then the prompt's prefix-cache reads are
  // known (when the engine tells them with its tokens), which its usage counts apart.
  if (!started_ && !updates.empty()) {
    started_ = true;
    out += start();
  }
  for (const ChoiceUpdate& u : updates) {
    for (const Segment& s : u.segments) {
      const int kind = int(s.kind);
      if (open_ != kind || s.kind == Segment::Kind::kToolCall) {
        out += close_block();
        ++index_;
        ojson block;
        if (s.kind == Segment::Kind::kContent) {
          block = {{"type", "text"}, {"text", ""}};
        } else if (s.kind == Segment::Kind::kReasoning) {
          block = {{"type", "thinking"}, {"thinking", ""}, {"signature", ""}};
        } else {
          block = {{"type", "tool_use"},
                   {"id", s.call.id},
                   {"name", s.call.name},
                   {"input", ojson::object()}};
        }
        out += sse_event("content_block_start", {{"type", "content_block_start"},
                                                 {"index", index_},
                                                 {"content_block", std::move(block)}});
        open_ = kind;
      }
      ojson delta;
      if (s.kind == Segment::Kind::kContent) {
        delta = {{"type", "text_delta"}, {"text", s.text}};
      } else if (s.kind == Segment::Kind::kReasoning) {
        delta = {{"type", "thinking_delta"}, {"thinking", s.text}};
      } else {
        delta = {{"type", "input_json_delta"}, {"partial_json", partial_json(s.call)}};
      }
      out += sse_event(
          "content_block_delta",
          {{"type", "content_block_delta"}, {"index", index_}, {"delta", std::move(delta)}});
      if (s.kind == Segment::Kind::kToolCall) out += close_block();
    }
    if (u.finished) {
      const ChoiceState& c = gen_.choices()[size_t(u.index)];
      out += close_block();
      if (c.reason == FinishReason::kError || c.reason == FinishReason::kCancelled) {
        // The error event is the stream's last: the message did not complete (the Messages API
        // has no stop reason for an answer the shutdown cut short).
        const bool cut = c.reason == FinishReason::kCancelled;
        out +=
            sse_event("error", {{"type", "error"},
                                {"error",
                                 {{"type", cut ? "overloaded_error" : "api_error"},
                                  {"message", cut ? cut_answer_message(c.message) : c.message}}}});
        continue;
      }
      auto [reason, sequence] = anthropic_stop(c);
      out += sse_event("message_delta",
                       {{"type", "message_delta"},
                        {"delta", {{"stop_reason", reason}, {"stop_sequence", sequence}}},
                        {"usage", anthropic_usage(gen_, c.generated)}});
      out += sse_event("message_stop", {{"type", "message_stop"}});
    }
  }
}

}  // namespace recur::server
