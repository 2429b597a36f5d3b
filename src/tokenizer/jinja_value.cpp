#include "tokenizer/jinja_value.h"

#include <utf8proc.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>

namespace recur::jinja {

void fail(ErrorCode code, std::string message) {
  throw TemplateError{code, std::move(message), false};
}

// ---- Value ----------------------------------------------------------------------------------

Value Value::undefined(std::string hint) {
  Value v;
  v.data_ = std::move(hint);
  return v;
}

Value Value::none() {
  Value v;
  v.type_ = Type::kNone;
  v.data_ = std::monostate{};
  return v;
}

Value Value::boolean(bool b) {
  Value v;
  v.type_ = Type::kBool;
  v.data_ = b;
  return v;
}

Value Value::integer(int64_t i) {
  Value v;
  v.type_ = Type::kInt;
  v.data_ = i;
  return v;
}

Value Value::floating(double d) {
  Value v;
  v.type_ = Type::kFloat;
  v.data_ = d;
  return v;
}

Value Value::string(std::string s, bool markup) {
  Value v;
  v.type_ = Type::kString;
  v.flag_ = markup;
  v.data_ = std::move(s);
  return v;
}

Value Value::marked_string(std::string s, UserSpans spans, bool markup) {
  Value v = string(std::move(s), markup);
  if (!spans.empty()) v.spans_ = std::make_shared<const UserSpans>(std::move(spans));
  return v;
}

Value Value::request_string(std::string s) {
  const size_t n = s.size();
  return marked_string(std::move(s), n ? UserSpans{{0, n}} : UserSpans{});
}

Value Value::list(List items, ListKind kind) {
  return list(std::make_shared<const List>(std::move(items)), kind);
}

Value Value::list(std::shared_ptr<const List> items, ListKind kind) {
  Value v;
  v.type_ = Type::kList;
  v.kind_ = kind;
  v.data_ = std::move(items);
  return v;
}

Value Value::dict(Dict d) {
  return dict(std::make_shared<const Dict>(std::move(d)));
}

Value Value::dict(std::shared_ptr<const Dict> d) {
  Value v;
  v.type_ = Type::kDict;
  v.data_ = std::move(d);
  return v;
}

Value Value::namespace_(std::shared_ptr<Namespace> ns) {
  Value v;
  v.type_ = Type::kNamespace;
  v.data_ = std::move(ns);
  return v;
}

Value Value::callable(std::shared_ptr<const Callable> fn) {
  Value v;
  v.type_ = Type::kCallable;
  v.data_ = std::move(fn);
  return v;
}

Value Value::loop(std::shared_ptr<LoopState> state) {
  Value v;
  v.type_ = Type::kLoop;
  v.data_ = std::move(state);
  return v;
}

int64_t Value::as_int() const {
  return type_ == Type::kBool ? (as_bool() ? 1 : 0) : std::get<int64_t>(data_);
}

double Value::as_float() const {
  return type_ == Type::kFloat ? std::get<double>(data_) : static_cast<double>(as_int());
}

const void* Value::identity() const {
  switch (type_) {
    case Type::kNamespace:
      return std::get<std::shared_ptr<Namespace>>(data_).get();
    case Type::kCallable:
      return std::get<std::shared_ptr<const Callable>>(data_).get();
    case Type::kLoop:
      return std::get<std::shared_ptr<LoopState>>(data_).get();
    case Type::kList:
      return list_ptr().get();
    case Type::kDict:
      return std::get<std::shared_ptr<const Dict>>(data_).get();
    default:
      return nullptr;
  }
}

// ---- Dict -----------------------------------------------------------------------------------

namespace {
constexpr size_t kLinearDictSize = 8;
}

const Value* Dict::find(std::string_view key) const {
  if (!index_.empty()) {
    auto it = index_.find(std::string(key));
    return it == index_.end() ? nullptr : &entries[it->second].second;
  }
  for (const auto& [k, v] : entries) {
    if (k == key) return &v;
  }
  return nullptr;
}

void Dict::set(std::string key, Value v) {
  if (index_.empty()) {
    for (auto& [k, existing] : entries) {
      if (k == key) {
        existing = std::move(v);
        return;
      }
    }
  } else {
    auto it = index_.find(key);
    if (it != index_.end()) {
      entries[it->second].second = std::move(v);
      return;
    }
    index_.emplace(key, entries.size());
  }
  entries.emplace_back(std::move(key), std::move(v));
  if (index_.empty() && entries.size() > kLinearDictSize) reindex();
}

void Dict::reindex() {
  index_.clear();
  for (size_t i = 0; i < entries.size(); ++i) index_.emplace(entries[i].first, i);
}

// ---- UTF-8 ----------------------------------------------------------------------------------

std::u32string utf8_decode(std::string_view s) {
  std::u32string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    char32_t cp = c;
    size_t n = 1;
    if (c >= 0xF0) {
      cp = c & 0x07;
      n = 4;
    } else if (c >= 0xE0) {
      cp = c & 0x0F;
      n = 3;
    } else if (c >= 0xC0) {
      cp = c & 0x1F;
      n = 2;
    }
    if (i + n > s.size()) n = s.size() - i;  // validated input never ends mid-sequence
    for (size_t k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
    out.push_back(cp);
    i += n;
  }
  return out;
}

void utf8_append(std::string& out, char32_t c) {
  if (c < 0x80) {
    out.push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (c >> 6)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else if (c < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (c >> 12)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (c >> 18)));
    out.push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  }
}

size_t utf8_length(std::string_view s) {
  size_t n = 0;
  for (char c : s) n += (static_cast<unsigned char>(c) & 0xC0) != 0x80;
  return n;
}

bool is_python_space(char32_t c) {
  if (c <= 0x20) return c == 0x20 || (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x1F);
  return c == 0x85 || c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 ||
         c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

std::string python_strip(std::string_view s, const std::string* chars, bool left, bool right) {
  auto [b, e] = python_strip_range(s, chars, left, right);
  return std::string(s.substr(b, e - b));
}

std::pair<size_t, size_t> python_strip_range(std::string_view s, const std::string* chars,
                                             bool left, bool right) {
  std::u32string set;
  if (chars) set = utf8_decode(*chars);
  auto strip_it = [&](char32_t c) {
    return chars ? set.find(c) != std::u32string::npos : is_python_space(c);
  };
  // Only the ends are decoded: strip runs on every message of a long conversation.
  auto code_point_at = [&](size_t i, size_t end) {
    size_t n = 1;
    while (i + n < end && (static_cast<unsigned char>(s[i + n]) & 0xC0) == 0x80) ++n;
    return utf8_decode(s.substr(i, n))[0];
  };
  size_t b = 0, e = s.size();
  while (left && b < e) {
    size_t n = 1;
    while (b + n < e && (static_cast<unsigned char>(s[b + n]) & 0xC0) == 0x80) ++n;
    if (!strip_it(code_point_at(b, e))) break;
    b += n;
  }
  while (right && e > b) {
    size_t start = e - 1;
    while (start > b && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
    if (!strip_it(code_point_at(start, e))) break;
    e = start;
  }
  return {b, e};
}

// ---- str() / repr() -------------------------------------------------------------------------

std::string type_name(const Value& v) {
  switch (v.type()) {
    case Value::Type::kUndefined:
      return "Undefined";
    case Value::Type::kNone:
      return "NoneType";
    case Value::Type::kBool:
      return "bool";
    case Value::Type::kInt:
      return "int";
    case Value::Type::kFloat:
      return "float";
    case Value::Type::kString:
      return v.markup() ? "Markup" : "str";
    case Value::Type::kList:
      switch (v.list_kind()) {
        case ListKind::kList:
          return "list";
        case ListKind::kTuple:
          return "tuple";
        case ListKind::kIterator:
          return "generator";
        case ListKind::kDictItems:
          return "dict_items";
        case ListKind::kDictKeys:
          return "dict_keys";
        case ListKind::kDictValues:
          return "dict_values";
      }
      return "list";
    case Value::Type::kDict:
      return "dict";
    case Value::Type::kNamespace:
      return "Namespace";
    case Value::Type::kCallable:
      return "function";
    case Value::Type::kLoop:
      return "LoopContext";
  }
  return "object";
}

std::string python_float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d < 0 ? "-inf" : "inf";
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof(buf), d, std::chars_format::scientific);
  std::string sci(buf, res.ptr);  // shortest round-trip digits: "-1.2345e+02"
  bool negative = sci[0] == '-';
  if (negative) sci.erase(0, 1);
  size_t e_pos = sci.find('e');
  std::string digits;
  for (size_t i = 0; i < e_pos; ++i) {
    if (sci[i] != '.') digits.push_back(sci[i]);
  }
  int exp10 = std::stoi(sci.substr(e_pos + 1));
  std::string out = negative ? "-" : "";
  // Python's repr switches to exponent form outside 1e-5 <= |d| < 1e16.
  if (exp10 < -4 || exp10 >= 16) {
    out += digits[0];
    if (digits.size() > 1) {
      out.push_back('.');
      out.append(digits, 1, std::string::npos);
    }
    out += exp10 < 0 ? "e-" : "e+";
    out += fmt::format("{:02d}", std::abs(exp10));
    return out;
  }
  int decpt = exp10 + 1;
  if (decpt <= 0) {
    out += "0." + std::string(-decpt, '0') + digits;
  } else if (static_cast<size_t>(decpt) >= digits.size()) {
    out += digits + std::string(decpt - digits.size(), '0') + ".0";
  } else {
    out += digits.substr(0, decpt) + "." + digits.substr(decpt);
  }
  return out;
}

namespace {

bool python_printable(char32_t c) {
  if (c < 0x7F) return c >= 0x20;
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(c))) {
    case UTF8PROC_CATEGORY_CN:
    case UTF8PROC_CATEGORY_CC:
    case UTF8PROC_CATEGORY_CF:
    case UTF8PROC_CATEGORY_CS:
    case UTF8PROC_CATEGORY_CO:
    case UTF8PROC_CATEGORY_ZL:
    case UTF8PROC_CATEGORY_ZP:
    case UTF8PROC_CATEGORY_ZS:
      return false;
    default:
      return true;
  }
}

std::string string_repr(const std::string& s) {
  char quote = '\'';
  if (s.find('\'') != std::string::npos && s.find('"') == std::string::npos) quote = '"';
  std::string out(1, quote);
  for (char32_t c : utf8_decode(s)) {
    if (c == static_cast<char32_t>(quote) || c == '\\') {
      out.push_back('\\');
      out.push_back(static_cast<char>(c));
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (python_printable(c)) {
      utf8_append(out, c);
    } else if (c <= 0xFF) {
      out += fmt::format("\\x{:02x}", static_cast<uint32_t>(c));
    } else if (c <= 0xFFFF) {
      out += fmt::format("\\u{:04x}", static_cast<uint32_t>(c));
    } else {
      out += fmt::format("\\U{:08x}", static_cast<uint32_t>(c));
    }
  }
  out.push_back(quote);
  return out;
}

std::string dict_repr(const Dict& d) {
  std::string out = "{";
  for (size_t i = 0; i < d.entries.size(); ++i) {
    if (i) out += ", ";
    out += string_repr(d.entries[i].first) + ": " + repr(d.entries[i].second);
  }
  return out + "}";
}

}  // namespace

std::string to_str(const Value& v) {
  switch (v.type()) {
    case Value::Type::kUndefined:
      return "";
    case Value::Type::kString:
      return v.str();
    default:
      return repr(v);
  }
}

namespace {

thread_local int repr_depth = 0;

struct ReprDepth {
  ReprDepth() {
    if (++repr_depth > kMaxNesting) {
      --repr_depth;
      fail(ErrorCode::kUnsupported, "value nested too deeply to print");
    }
  }
  ~ReprDepth() { --repr_depth; }
};

}  // namespace

std::string repr(const Value& v) {
  ReprDepth guard;
  switch (v.type()) {
    case Value::Type::kUndefined:
      return "Undefined";
    case Value::Type::kNone:
      return "None";
    case Value::Type::kBool:
      return v.as_bool() ? "True" : "False";
    case Value::Type::kInt:
      return std::to_string(v.as_int());
    case Value::Type::kFloat:
      return python_float_repr(v.as_float());
    case Value::Type::kString:
      return v.markup() ? "Markup(" + string_repr(v.str()) + ")" : string_repr(v.str());
    case Value::Type::kList: {
      if (v.list_kind() == ListKind::kIterator) {
        fail(ErrorCode::kUnsupported,
             "printing a generator (the result of map, select, items, ...) is not supported: "
             "Jinja prints its memory address; apply |list first");
      }
      const bool view = !v.is_indexable_list();
      std::string out = view ? type_name(v) + "([" : (v.is_tuple() ? "(" : "[");
      const List& items = v.items();
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) out += ", ";
        out += repr(items[i]);
      }
      if (v.is_tuple() && items.size() == 1) out += ",";
      return out + (view ? "])" : (v.is_tuple() ? ")" : "]"));
    }
    case Value::Type::kDict:
      return dict_repr(v.dict());
    case Value::Type::kNamespace:
      return "<Namespace " + dict_repr(v.ns().attrs) + ">";
    case Value::Type::kCallable:
      failf(ErrorCode::kUnsupported, "printing the function '{}' is not supported", v.fn().name);
    case Value::Type::kLoop:
      fail(ErrorCode::kUnsupported, "printing a loop object is not supported");
  }
  return "";
}

std::string html_escape(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out.push_back(c);
    }
  }
  return out;
}

// ---- comparison -----------------------------------------------------------------------------

bool equals(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.is_integral() && b.is_integral()) return a.as_int() == b.as_int();
    return a.as_float() == b.as_float();
  }
  if (a.type() != b.type()) return false;
  switch (a.type()) {
    case Value::Type::kUndefined:
    case Value::Type::kNone:
      return true;
    case Value::Type::kString:
      return a.str() == b.str();
    case Value::Type::kList: {
      if (a.list_kind() != b.list_kind() || a.items().size() != b.items().size()) return false;
      // Python compares dict_values (and generators) by identity only.
      if ((a.list_kind() == ListKind::kIterator || a.list_kind() == ListKind::kDictValues) &&
          a.identity() != b.identity()) {
        return false;
      }
      for (size_t i = 0; i < a.items().size(); ++i) {
        if (!equals(a.items()[i], b.items()[i])) return false;
      }
      return true;
    }
    case Value::Type::kDict: {
      if (a.dict().size() != b.dict().size()) return false;
      for (const auto& [k, v] : a.dict().entries) {
        const Value* other = b.dict().find(k);
        if (!other || !equals(v, *other)) return false;
      }
      return true;
    }
    default:
      return a.identity() == b.identity();
  }
}

int compare(const Value& a, const Value& b) {
  if (a.is_undefined() || b.is_undefined()) {
    const std::string& hint = (a.is_undefined() ? a : b).undefined_hint();
    fail(ErrorCode::kInvalidArgument, hint.empty() ? "value is undefined" : hint);
  }
  if (a.is_number() && b.is_number()) {
    if (a.is_integral() && b.is_integral()) {
      return a.as_int() < b.as_int() ? -1 : (a.as_int() > b.as_int() ? 1 : 0);
    }
    double x = a.as_float(), y = b.as_float();
    return x < y ? -1 : (x > y ? 1 : 0);
  }
  if (a.is_string() && b.is_string()) {
    int c = a.str().compare(b.str());  // UTF-8 byte order is code point order
    return c < 0 ? -1 : (c > 0 ? 1 : 0);
  }
  if (a.is_indexable_list() && b.is_indexable_list() && a.is_tuple() == b.is_tuple()) {
    const List& x = a.items();
    const List& y = b.items();
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (!equals(x[i], y[i])) return compare(x[i], y[i]);
    }
    return x.size() < y.size() ? -1 : (x.size() > y.size() ? 1 : 0);
  }
  failf(ErrorCode::kInvalidArgument, "'<' not supported between instances of '{}' and '{}'",
        type_name(a), type_name(b));
}

bool truthy(const Value& v) {
  switch (v.type()) {
    case Value::Type::kUndefined:
    case Value::Type::kNone:
      return false;
    case Value::Type::kBool:
      return v.as_bool();
    case Value::Type::kInt:
      return v.as_int() != 0;
    case Value::Type::kFloat:
      return v.as_float() != 0.0;
    case Value::Type::kString:
      return !v.str().empty();
    case Value::Type::kList:
      return v.list_kind() == ListKind::kIterator || !v.items().empty();
    case Value::Type::kDict:
      return v.dict().size() != 0;
    default:
      return true;
  }
}

}  // namespace recur::jinja
