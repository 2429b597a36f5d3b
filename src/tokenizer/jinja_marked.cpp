#include "tokenizer/jinja_marked.h"

#include <algorithm>

namespace recur::jinja {

namespace {

bool holds_request_data_at(const Value& v, int depth) {
  // Past the nesting any render may print, assume the worst: a mark may spread, not vanish.
  if (depth > kMaxNesting) return true;
  switch (v.type()) {
    case Value::Type::kString:
      return v.user_spans() != nullptr;
    case Value::Type::kList:
      return std::any_of(v.items().begin(), v.items().end(),
                         [&](const Value& x) { return holds_request_data_at(x, depth + 1); });
    case Value::Type::kDict:
      if (v.dict().keys_from_request) return true;
      return std::any_of(v.dict().entries.begin(), v.dict().entries.end(),
                         [&](const auto& e) { return holds_request_data_at(e.second, depth + 1); });
    case Value::Type::kNamespace: {
      const Dict& attrs = v.ns().attrs;
      if (attrs.keys_from_request) return true;
      return std::any_of(attrs.entries.begin(), attrs.entries.end(),
                         [&](const auto& e) { return holds_request_data_at(e.second, depth + 1); });
    }
    default:
      return false;
  }
}

}  // namespace

void check_template_string_size(size_t bytes) {
  if (bytes > kMaxTemplateStringBytes) {
    failf(ErrorCode::kOutOfResources, "the template builds a string of more than {} MiB",
          kMaxTemplateStringBytes >> 20);
  }
}

bool holds_request_data(const Value& v) {
  return holds_request_data_at(v, 0);
}

void MarkedText::mark(size_t begin, size_t end) {
  if (begin >= end) return;
  if (!spans_.empty() && spans_.back().second >= begin) {
    spans_.back().second = std::max(spans_.back().second, end);
  } else {
    spans_.emplace_back(begin, end);
  }
}

void MarkedText::append_request(std::string_view request_text) {
  const size_t at = text_.size();
  check_template_string_size(at + request_text.size());
  text_ += request_text;
  mark(at, text_.size());
}

void MarkedText::append(const Value& v) {
  if (!v.is_string()) {
    std::string s = to_str(v);
    if (holds_request_data(v)) {
      append_request(s);
    } else {
      append(std::string_view(s));
    }
    return;
  }
  append_slice(v, 0, v.str().size());
}

void MarkedText::append_slice(const Value& s, size_t begin, size_t end) {
  const size_t at = text_.size();
  check_template_string_size(at + (end - begin));
  text_.append(s.str(), begin, end - begin);
  if (const UserSpans* spans = s.user_spans()) {
    for (const auto& [b, e] : *spans) {
      const size_t lo = std::max(b, begin), hi = std::min(e, end);
      if (lo < hi) mark(at + lo - begin, at + hi - begin);
    }
  }
}

void MarkedText::append_html_escaped(const Value& s) {
  const std::string& str = s.str();
  const UserSpans* spans = s.user_spans();
  size_t next_span = 0;
  for (size_t i = 0; i < str.size(); ++i) {
    while (spans && next_span < spans->size() && (*spans)[next_span].second <= i) ++next_span;
    const bool from_request = spans && next_span < spans->size() && (*spans)[next_span].first <= i;
    const size_t at = text_.size();
    append(html_escape(std::string_view(str).substr(i, 1)));
    if (from_request) mark(at, text_.size());
  }
}

Value MarkedText::take(bool markup) {
  return Value::marked_string(std::move(text_), std::move(spans_), markup);
}

Value substring(const Value& s, size_t begin, size_t end) {
  return substring(s, begin, end, s.markup());
}

Value substring(const Value& s, size_t begin, size_t end, bool markup) {
  if (!s.user_spans()) return Value::string(s.str().substr(begin, end - begin), markup);
  MarkedText t;
  t.append_slice(s, begin, end);
  return t.take(markup);
}

Value derived_string(std::string s, bool markup, std::initializer_list<const Value*> sources) {
  for (const Value* v : sources) {
    if (v && holds_request_data(*v)) {
      const size_t n = s.size();
      return Value::marked_string(std::move(s), n ? UserSpans{{0, n}} : UserSpans{}, markup);
    }
  }
  return Value::string(std::move(s), markup);
}

Value mapped_string(const Value& s, std::string mapped, bool markup) {
  const UserSpans* spans = s.user_spans();
  if (!spans) return Value::string(std::move(mapped), markup);
  if (code_point_offsets(s.str()) == code_point_offsets(mapped)) {
    return Value::marked_string(std::move(mapped), *spans, markup);
  }
  return derived_string(std::move(mapped), markup, {&s});
}

Value as_string(const Value& v) {
  if (v.is_string()) {
    return v.user_spans() ? Value::marked_string(v.str(), *v.user_spans()) : Value::string(v.str());
  }
  return derived_string(to_str(v), false, {&v});
}

Value key_value(const Dict& d, const std::string& key) {
  return d.keys_from_request ? Value::request_string(key) : Value::string(key);
}

std::vector<size_t> code_point_offsets(std::string_view s) {
  std::vector<size_t> offsets;
  offsets.reserve(s.size() + 1);
  for (size_t i = 0; i < s.size(); ++i) {
    if ((static_cast<unsigned char>(s[i]) & 0xC0) != 0x80) offsets.push_back(i);
  }
  offsets.push_back(s.size());
  return offsets;
}

}  // namespace recur::jinja
