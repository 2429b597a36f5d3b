// Responses on the wire: OpenAI chat/completions objects and SSE chunks, and Anthropic
// messages and their event stream, built from a Generation's choices and updates.
#pragma once

#include <string>
#include <vector>

#include "server/generation.h"

namespace recur::server {

// "data: <json>\n\n"
std::string sse_data(const ojson& j);
// Appends s as a JSON string literal; invalid UTF-8 becomes U+FFFD.
void append_json_string(std::string* out, std::string_view s);
// "event: <name>\ndata: <json>\n\n"
std::string sse_event(std::string_view name, const ojson& j);

// What the Messages API says of an answer the engine cut short (`why`: the engine's reason).
std::string cut_answer_message(std::string_view why);

// Non-streaming responses, once every choice has finished.
ojson openai_response(const Generation& gen);
ojson anthropic_response(const Generation& gen);

// Streaming: turns updates into SSE text; done() closes the stream.
class OpenAiStream {
 public:
  explicit OpenAiStream(const Generation& gen);
  // Appends the SSE text of these updates to *out (reusing its capacity: no allocation per
  // token once the stream is warm).
  void updates(const std::vector<ChoiceUpdate>& updates, std::string* out);
  void done(std::string* out);  // the usage chunk when asked for, then data: [DONE]
  std::string updates(const std::vector<ChoiceUpdate>& updates);
  std::string done();

 private:
  // One event per token and stream is the hot path: chunks are written as text around a
  // prefix and suffix made once, not built as JSON objects.
  void chunk(std::string* out, size_t index, std::string_view fields);
  const Generation& gen_;
  std::string prefix_, suffix_;                  // around the one choice of a chunk
  std::string fields_, delta_;                   // scratch, kept between calls
  std::vector<bool> started_;                    // per choice: role / echo sent
  std::vector<std::vector<TokenInfo>> pending_;  // tokens not yet attached to a chunk
  std::vector<int> calls_;                       // tool calls sent per choice
  std::vector<int> shown_;                       // continuous usage: tokens counted so far
  std::vector<size_t> offsets_;                  // completions logprobs: text offset so far
};

class AnthropicStream {
 public:
  explicit AnthropicStream(const Generation& gen);
  std::string start();  // message_start (updates() sends it before its first events)
  void updates(const std::vector<ChoiceUpdate>& updates, std::string* out);
  std::string updates(const std::vector<ChoiceUpdate>& updates);

 private:
  std::string close_block();
  const Generation& gen_;
  bool started_ = false;  // message_start sent
  int index_ = -1;        // current content block
  int open_ = -1;         // Segment::Kind of the open block, -1: none
};

// OpenAI Responses API: the response object, and its event stream (response.created, output
// items with their deltas, then response.completed, .incomplete or .failed).
ojson responses_response(const Generation& gen);

class ResponsesStream {
 public:
  explicit ResponsesStream(const Generation& gen);
  std::string start();  // response.created, response.in_progress
  void updates(const std::vector<ChoiceUpdate>& updates, std::string* out);
  std::string updates(const std::vector<ChoiceUpdate>& updates);
  // The response object once the choice has finished (what response.completed carries).
  const ojson& final_response() const { return final_; }

 private:
  enum class Open { kNone, kReasoning, kMessage };
  ojson response(std::string_view status, bool final) const;
  void event(std::string* out, std::string_view type, ojson body);
  void open_item(std::string* out, Open kind);
  void close_item(std::string* out, const char* status = "completed");  // a message's status
  const Generation& gen_;
  int64_t sequence_ = 0;
  Open open_ = Open::kNone;
  std::string item_id_, text_;    // of the open item
  std::string pending_space_;     // content that is only whitespace, not yet in an item
  ojson items_ = ojson::array();  // finished output items, for the final response object
  ojson final_;
};

// OpenAI logprobs objects for the given tokens (chat: {"content": [...]}; completions:
// {"tokens", "token_logprobs", "top_logprobs", "text_offset"}).
ojson chat_logprobs(const Generation& gen, const std::vector<TokenInfo>& tokens);
// text_offset: where the first token starts in the choice's text; advanced past the tokens.
ojson completion_logprobs(const Generation& gen, const std::vector<TokenInfo>& tokens,
                          size_t* text_offset);

}  // namespace recur::server
