// Strings that remember which of their bytes came from the request (message content, tool
// definitions, ...) rather than from the template. Every operation that builds a string from
// others carries the marks along, so the rendered prompt can tell the template's own markup
// (<|im_start|>user) from the same characters typed by a user. An operation that cannot say
// which output bytes came from where marks its whole result as request data when any input
// holds some: a mark may spread, never get lost.
#pragma once

#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/jinja_value.h"

namespace recur::jinja {

// Whether `v` is or contains request data: a marked string, a dict whose keys came from the
// request, or a container holding either.
bool holds_request_data(const Value& v);

// A string built piece by piece (the output of a render, a macro, `~`, join, ...).
// The largest string a template may build (its output included): chat prompts are far smaller,
// and a template that doubles a string in a loop ends with an error instead of all memory.
constexpr size_t kMaxTemplateStringBytes = size_t(64) << 20;
// Fails with kOutOfResources when a string of `bytes` would pass kMaxTemplateStringBytes.
void check_template_string_size(size_t bytes);

class MarkedText {
 public:
  void append(std::string_view template_text) {
    check_template_string_size(text_.size() + template_text.size());
    text_ += template_text;
  }
  void append_request(std::string_view request_text);
  // str(v): a string keeps its marks; any other value prints as request data as a whole when
  // it holds any.
  void append(const Value& v);
  // Bytes [begin, end) of the string `s`, with their marks.
  void append_slice(const Value& s, size_t begin, size_t end);
  // MarkupSafe's escape() of the string `s`, byte by byte, keeping each byte's mark.
  void append_html_escaped(const Value& s);

  Value take(bool markup = false);
  std::string take_text() { return std::move(text_); }
  UserSpans take_spans() { return std::move(spans_); }

 private:
  void mark(size_t begin, size_t end);  // bytes [begin, end) of text_ are request data
  std::string text_;
  UserSpans spans_;
};

// Bytes [begin, end) of the string `s` as a string, with their marks and s's markup flag (or
// `markup`).
Value substring(const Value& s, size_t begin, size_t end);
Value substring(const Value& s, size_t begin, size_t end, bool markup);
// A string computed from `sources` in a way that does not say which byte came from which:
// request data as a whole if any source holds some.
Value derived_string(std::string s, bool markup, std::initializer_list<const Value*> sources);
// A per-code-point transform of the string `s` (upper(), title(), ...): the marks stay on
// their code points when every code point kept its byte length, else the whole result is
// request data if any of s was.
Value mapped_string(const Value& s, std::string mapped, bool markup);
// `v` as a string value: itself if it is one, else its str() (request data if v holds any).
Value as_string(const Value& v);
// The key of a dict entry as a string value.
Value key_value(const Dict& d, const std::string& key);

// Byte offset of every code point of `s`, plus s.size() at the end.
std::vector<size_t> code_point_offsets(std::string_view s);

}  // namespace recur::jinja
