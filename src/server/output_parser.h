// Splits generated text, as it streams, into reasoning (<think>…</think>), content, and tool
// calls, in the form the model's chat template asks for: Hermes/Qwen3 JSON
// (<tool_call>{"name": …, "arguments": …}</tool_call>), Qwen3.5 XML
// (<tool_call><function=NAME><parameter=ARG>VALUE</parameter></function></tool_call>, whose
// values are typed from the tool's JSON schema) or Kimi's section
// (<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:INDEX
// <|tool_call_argument_begin|>{json}<|tool_call_end|>…<|tool_calls_section_end|>, the call
// keeping the model's id). Text that may still turn out to begin a marker
// is held back until it cannot, so a streamed split always equals the split of the whole text.
// Calls written inside <think> are calls too; a malformed call is returned as the text it was.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "server/request.h"

namespace recur::server {

struct ToolCall {
  std::string id;
  std::string name;
  std::string arguments;  // a JSON text, as OpenAI sends it (cut: as far as it was written)
  bool cut = false;       // a forced call the output ended (or garbled) before it was whole
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
  // End of output: releases what was held back (an unterminated tool call is parsed if it is
  // complete, else returned as text; a forced one comes back as the call it began, cut).
  void finish(std::vector<Segment>* out);

  int tool_calls() const { return calls_; }

 private:
  enum class State { kThinkStart, kReasoning, kContent, kToolCall };
  void process(bool final, std::vector<Segment>* out);
  void emit_text(Segment::Kind kind, std::string_view text, std::vector<Segment>* out);
  // `id` empty: a new one with id_prefix_.
  void emit_call(std::string name, std::string arguments, std::vector<Segment>* out,
                 std::string id = {}, bool cut = false);
  // Where the current XML call ends in buf_: npos while it may still go on.
  size_t xml_call_end(bool final);
  void handle_block(std::string_view block, bool terminated, std::vector<Segment>* out);
  bool handle_json(std::string_view block, std::vector<Segment>* out);
  bool handle_xml(std::string_view block, bool terminated, std::vector<Segment>* out);
  size_t xml_parameter(std::string_view block, size_t pos, std::string_view tool,
                       ojson* args) const;
  bool handle_kimi(std::string_view block, std::vector<Segment>* out);
  // A forced call that did not parse whole: its name and what of its arguments can be read.
  bool handle_cut(std::string_view block, std::vector<Segment>* out);
  const ojson* parameter_schema(std::string_view tool, std::string_view parameter) const;

  OutputOptions options_;
  std::string id_prefix_;
  State state_;
  std::string buf_;              // text not yet released
  bool strip_newlines_ = false;  // drop newlines at the start of the next reasoning/content
  bool after_call_ = false;      // whitespace between and after tool calls is dropped
  bool call_in_think_ = false;   // the open tool call began inside <think>
  bool call_started_ = false;    // the open tool call's body begins as a call does
  size_t scan_ = 0;              // XML call: buf_ is searched from here on
  bool in_value_ = false;        // XML call: scan_ is inside a parameter value
  bool forced_open_ = false;     // the open call is the one the forced prefix began
  std::string forced_rest_;      // what of the forced prefix is in that call's block
  int calls_ = 0;
};

// kKimi when the chat template writes Kimi's call sections, kXml when it writes or asks for
// <function=NAME> calls, else kJson.
ToolCallFormat detect_tool_call_format(std::string_view chat_template);

// What the assistant turn starts with to force a call (tool_choice "required": `name` empty,
// or a named function), in the given form; the model writes the rest.
std::string forced_call_prefix(ToolCallFormat format, std::string_view name);

// A parameter value written in XML, as JSON: typed by its schema (null: none known).
ojson typed_argument(std::string_view value, const ojson* schema);

// The JSON object `text` (an object cut short) begins, closed at the last point where what was
// written is whole: a string value cut mid-way is closed, a key without its value or a number
// cut mid-way is left out. nullopt when no object can be made of it.
std::optional<std::string> close_json_object(std::string_view text);

// The JSON value `text` begins (after whitespace), as written: up to its end when it has one,
// else all the rest (a value the output cut, or one that is not JSON).
std::string written_json(std::string_view text);

}  // namespace recur::server
