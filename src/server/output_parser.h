// Splits generated text, as it streams, into reasoning (Qwen3 <think>…</think>), content, and
// tool calls (Hermes/Qwen <tool_call>{"name": …, "arguments": …}</tool_call>). Text that may
// still turn out to begin a marker is held back until it cannot, so a streamed split always
// equals the split of the whole text.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "server/request.h"

namespace recur::server {

struct ToolCall {
  std::string id;
  std::string name;
  std::string arguments;  // a JSON text, as OpenAI sends it
};

struct Segment {
  enum class Kind { kContent, kReasoning, kToolCall };
  Kind kind = Kind::kContent;
  std::string text;  // kContent, kReasoning
  ToolCall call;     // kToolCall
};

class OutputParser {
 public:
  // `id_prefix` starts tool-call ids ("call_" for OpenAI, "toolu_" for Anthropic).
  explicit OutputParser(const OutputOptions& options, std::string id_prefix = "call_");

  // Appends what `text` completes; adjacent pieces of one kind are merged.
  void push(std::string_view text, std::vector<Segment>* out);
  // End of output: releases what was held back (an unterminated tool call is parsed if it can
  // be, else returned as content).
  void finish(std::vector<Segment>* out);

  int tool_calls() const { return calls_; }

 private:
  enum class State { kThinkStart, kReasoning, kContent, kToolCall };
  void process(bool final, std::vector<Segment>* out);
  void emit_text(Segment::Kind kind, std::string_view text, std::vector<Segment>* out);
  void handle_block(std::string_view block, bool terminated, std::vector<Segment>* out);

  OutputOptions options_;
  std::string id_prefix_;
  State state_;
  std::string buf_;              // text not yet released
  bool strip_newlines_ = false;  // drop newlines at the start of the next reasoning/content
  bool after_call_ = false;      // whitespace between and after tool calls is dropped
  int calls_ = 0;
};

// Which stop string ended `text` (the one that completes first), or "" if none occurs.
std::string matched_stop(std::string_view text, const std::vector<std::string>& stops);

}  // namespace recur::server
