// The OpenAI Responses API's output: reasoning, message and function_call items built from a
// generation's segments, as one response object or as its event stream. The non-streaming
// object is the stream's final one, so both always agree.
#include "server/format.h"

namespace recur::server {

namespace {

bool blank(std::string_view s) {
  return s.find_first_not_of(" \t\r\n") == std::string_view::npos;
}

ojson text_part(const std::string& text) {
  return {{"type", "output_text"},
          {"text", text},
          {"annotations", ojson::array()},
          {"logprobs", ojson::array()}};
}

ojson reasoning_part(const std::string& text) {
  return {{"type", "reasoning_text"}, {"text", text}};
}

ojson call_item(const ToolCall& call, const std::string& id, const char* status) {
  return {{"type", "function_call"},     {"id", id},
          {"call_id", call.id},          {"name", call.name},
          {"arguments", call.arguments}, {"status", status}};
}

const char* final_status(const ChoiceState& c) {
  switch (c.reason) {
    case FinishReason::kLength:
      return "incomplete";
    case FinishReason::kError:
      return "failed";
    case FinishReason::kCancelled:
      return "cancelled";
    case FinishReason::kStop:
      break;
  }
  return "completed";
}

}  // namespace

ResponsesStream::ResponsesStream(const Generation& gen) : gen_(gen) {}

ojson ResponsesStream::response(std::string_view status, bool final) const {
  const ChoiceState& c = gen_.choices().at(0);
  ojson r = ojson::object();
  r["id"] = gen_.id();
  r["object"] = "response";
  r["created_at"] = gen_.created();
  r["status"] = status;
  r["background"] = false;
  r["error"] = final && c.reason == FinishReason::kError
                   ? ojson{{"code", "server_error"}, {"message", c.message}}
                   : ojson(nullptr);
  r["incomplete_details"] = final && c.reason == FinishReason::kLength
                                ? ojson{{"reason", "max_output_tokens"}}
                                : ojson(nullptr);
  for (const auto& [k, v] : gen_.request().response_echo.items()) r[k] = v;
  r["model"] = gen_.context().model_name;
  r["output"] = final ? items_ : ojson::array();
  if (final) {
    const int p = gen_.prompt_tokens(), n = gen_.completion_tokens();
    r["usage"] = {{"input_tokens", p},
                  {"input_tokens_details", {{"cached_tokens", gen_.cached_tokens()}}},
                  {"output_tokens", n},
                  {"output_tokens_details", {{"reasoning_tokens", 0}}},
                  {"total_tokens", p + n}};
  } else {
    r["usage"] = nullptr;
  }
  return r;
}

void ResponsesStream::event(std::string* out, std::string_view type, ojson body) {
  ojson e = {{"type", type}, {"sequence_number", sequence_++}};
  for (auto& [k, v] : body.items()) e[k] = std::move(v);
  *out += sse_event(type, e);
}

std::string ResponsesStream::start() {
  std::string out;
  event(&out, "response.created", {{"response", response("in_progress", false)}});
  event(&out, "response.in_progress", {{"response", response("in_progress", false)}});
  return out;
}

void ResponsesStream::open_item(std::string* out, Open kind) {
  open_ = kind;
  text_.clear();
  const size_t index = items_.size();
  if (kind == Open::kReasoning) {
    item_id_ = random_id("rs_");
    event(out, "response.output_item.added",
          {{"output_index", index},
           {"item",
            {{"type", "reasoning"},
             {"id", item_id_},
             {"summary", ojson::array()},
             {"content", ojson::array()}}}});
    event(out, "response.content_part.added",
          {{"item_id", item_id_},
           {"output_index", index},
           {"content_index", 0},
           {"part", reasoning_part("")}});
  } else {
    item_id_ = random_id("msg_");
    event(out, "response.output_item.added",
          {{"output_index", index},
           {"item",
            {{"type", "message"},
             {"id", item_id_},
             {"status", "in_progress"},
             {"role", "assistant"},
             {"content", ojson::array()}}}});
    event(out, "response.content_part.added",
          {{"item_id", item_id_},
           {"output_index", index},
           {"content_index", 0},
           {"part", text_part("")}});
  }
}

void ResponsesStream::close_item(std::string* out, const char* status) {
  if (open_ == Open::kNone) return;
  const size_t index = items_.size();
  ojson item;
  if (open_ == Open::kReasoning) {
    event(out, "response.reasoning_text.done",
          {{"item_id", item_id_}, {"output_index", index}, {"content_index", 0}, {"text", text_}});
    event(out, "response.content_part.done",
          {{"item_id", item_id_},
           {"output_index", index},
           {"content_index", 0},
           {"part", reasoning_part(text_)}});
    item = {{"type", "reasoning"},
            {"id", item_id_},
            {"summary", ojson::array()},
            {"content", ojson::array({reasoning_part(text_)})}};
  } else {
    event(out, "response.output_text.done",
          {{"item_id", item_id_},
           {"output_index", index},
           {"content_index", 0},
           {"text", text_},
           {"logprobs", ojson::array()}});
    event(out, "response.content_part.done",
          {{"item_id", item_id_},
           {"output_index", index},
           {"content_index", 0},
           {"part", text_part(text_)}});
    item = {{"type", "message"},
            {"id", item_id_},
            {"status", status},
            {"role", "assistant"},
            {"content", ojson::array({text_part(text_)})}};
  }
  event(out, "response.output_item.done", {{"output_index", index}, {"item", item}});
  items_.push_back(std::move(item));
  open_ = Open::kNone;
}

std::string ResponsesStream::updates(const std::vector<ChoiceUpdate>& updates) {
  std::string out;
  this->updates(updates, &out);
  return out;
}

void ResponsesStream::updates(const std::vector<ChoiceUpdate>& updates, std::string* out) {
  for (const ChoiceUpdate& u : updates) {
    if (u.index != 0) continue;  // one choice: the API has no n
    for (const Segment& s : u.segments) {
      if (s.kind == Segment::Kind::kReasoning) {
        if (open_ != Open::kReasoning) {
          close_item(out);
          open_item(out, Open::kReasoning);
        }
        text_ += s.text;
        event(out, "response.reasoning_text.delta",
              {{"item_id", item_id_},
               {"output_index", items_.size()},
               {"content_index", 0},
               {"delta", s.text}});
      } else if (s.kind == Segment::Kind::kContent) {
        std::string delta;
        if (open_ != Open::kMessage) {
          // Whitespace between reasoning and a tool call is no message of its own.
          if (blank(s.text)) {
            pending_space_ += s.text;
            continue;
          }
          close_item(out);
          open_item(out, Open::kMessage);
          delta = pending_space_ + s.text;
          pending_space_.clear();
        } else {
          delta = s.text;
        }
        text_ += delta;
        event(out, "response.output_text.delta",
              {{"item_id", item_id_},
               {"output_index", items_.size()},
               {"content_index", 0},
               {"delta", delta},
               {"logprobs", ojson::array()}});
      } else {
        close_item(out);
        pending_space_.clear();
        const size_t index = items_.size();
        const std::string id = random_id("fc_");
        // Arguments follow as a delta: clients append deltas to the added item's arguments.
        ojson added = call_item(s.call, id, "in_progress");
        added["arguments"] = "";
        event(out, "response.output_item.added", {{"output_index", index}, {"item", added}});
        event(out, "response.function_call_arguments.delta",
              {{"item_id", id}, {"output_index", index}, {"delta", s.call.arguments}});
        event(out, "response.function_call_arguments.done",
              {{"item_id", id}, {"output_index", index}, {"arguments", s.call.arguments}});
        ojson item = call_item(s.call, id, s.call.cut ? "incomplete" : "completed");
        event(out, "response.output_item.done", {{"output_index", index}, {"item", item}});
        items_.push_back(std::move(item));
      }
    }
    if (u.finished) {
      const ChoiceState& c = gen_.choices().at(0);
      const std::string status = final_status(c);
      // The message max_output_tokens cut is incomplete, as the response is.
      const char* last = status == "incomplete" ? "incomplete" : "completed";
      close_item(out, last);
      if (items_.empty()) {  // every response has a message, if an empty one
        open_item(out, Open::kMessage);
        text_ = pending_space_;
        close_item(out, last);
      }
      final_ = response(status, true);
      event(out,
            status == "completed"    ? "response.completed"
            : status == "incomplete" ? "response.incomplete"
                                     : "response.failed",
            {{"response", final_}});
    }
  }
}

ojson responses_response(const Generation& gen) {
  ResponsesStream s(gen);
  ChoiceUpdate u;
  u.segments = gen.choices().at(0).segments;
  u.finished = true;
  std::string discarded;
  s.updates({u}, &discarded);
  return s.final_response();
}

}  // namespace recur::server
