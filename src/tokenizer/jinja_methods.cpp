// The Python methods of str, dict and list that chat templates call, e.g.
// message.content.split('</think>')[-1].lstrip('\n') or tool.get('name').
#include <utf8proc.h>

#include <algorithm>

#include "tokenizer/jinja_builtins.h"
#include "tokenizer/jinja_marked.h"

namespace recur::jinja {

namespace {

bool is_cased_upper(char32_t c) {
  return utf8proc_category(static_cast<utf8proc_int32_t>(c)) == UTF8PROC_CATEGORY_LU ||
         utf8proc_category(static_cast<utf8proc_int32_t>(c)) == UTF8PROC_CATEGORY_LT;
}
bool is_cased_lower(char32_t c) {
  return utf8proc_category(static_cast<utf8proc_int32_t>(c)) == UTF8PROC_CATEGORY_LL;
}
bool is_cased(char32_t c) {
  return is_cased_upper(c) || is_cased_lower(c);
}
char32_t to_upper(char32_t c) {
  return static_cast<char32_t>(utf8proc_toupper(static_cast<utf8proc_int32_t>(c)));
}
char32_t to_lower(char32_t c) {
  return static_cast<char32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(c)));
}
char32_t to_title(char32_t c) {
  return static_cast<char32_t>(utf8proc_totitle(static_cast<utf8proc_int32_t>(c)));
}

bool is_line_break(char32_t c) {
  return c == '\n' || c == '\r' || c == '\v' || c == '\f' || (c >= 0x1C && c <= 0x1E) ||
         c == 0x85 || c == 0x2028 || c == 0x2029;
}

// Python's str.split / rsplit; the parts are substrings of `self`, keeping their marks.
List split(const Value& self, const Value* sep_value, int64_t maxsplit, bool from_right) {
  const std::string& s = self.str();
  List parts;
  if (!sep_value || sep_value->is_none()) {
    std::u32string cps = utf8_decode(s);
    const std::vector<size_t> at = code_point_offsets(s);
    std::vector<std::pair<size_t, size_t>> words;  // [begin, end) in code points
    size_t i = 0;
    while (i < cps.size()) {
      while (i < cps.size() && is_python_space(cps[i])) ++i;
      if (i >= cps.size()) break;
      size_t b = i;
      while (i < cps.size() && !is_python_space(cps[i])) ++i;
      words.emplace_back(b, i);
    }
    if (maxsplit >= 0 && static_cast<int64_t>(words.size()) > maxsplit) {
      // The unsplit remainder keeps its whitespace on the far side.
      if (!from_right) {
        size_t rest = words[maxsplit].first;
        words.resize(maxsplit);
        words.emplace_back(rest, cps.size());
      } else {
        size_t keep = words.size() - maxsplit;
        size_t end = words[keep - 1].second;
        words.erase(words.begin(), words.begin() + keep);
        words.insert(words.begin(), {0, end});
      }
    }
    for (auto [b, e] : words) parts.push_back(substring(self, at[b], at[e], false));
    return parts;
  }
  if (!sep_value->is_string()) {
    failf(ErrorCode::kInvalidArgument, "must be str or None, not {}", type_name(*sep_value));
  }
  const std::string& sep = sep_value->str();
  if (sep.empty()) fail(ErrorCode::kInvalidArgument, "empty separator");
  std::vector<std::pair<size_t, size_t>> pieces;  // byte ranges of s
  if (!from_right) {
    size_t pos = 0;
    while (maxsplit < 0 || static_cast<int64_t>(pieces.size()) < maxsplit) {
      size_t hit = s.find(sep, pos);
      if (hit == std::string::npos) break;
      pieces.emplace_back(pos, hit);
      pos = hit + sep.size();
    }
    pieces.emplace_back(pos, s.size());
  } else {
    size_t end = s.size();
    while (maxsplit < 0 || static_cast<int64_t>(pieces.size()) < maxsplit) {
      if (end < sep.size()) break;
      size_t hit = s.rfind(sep, end - sep.size());
      if (hit == std::string::npos) break;
      pieces.emplace_back(hit + sep.size(), end);
      end = hit;
    }
    pieces.emplace_back(0, end);
    std::reverse(pieces.begin(), pieces.end());
  }
  for (auto [b, e] : pieces) parts.push_back(substring(self, b, e, false));
  return parts;
}

// Python's str.replace; kept text keeps its marks, inserted text carries those of `with`.
Value replace(const Value& self, const std::string& old, const Value& with, int64_t count) {
  const std::string& s = self.str();
  MarkedText out;
  if (old.empty()) {
    // Python inserts `with` around every code point.
    const std::vector<size_t> at = code_point_offsets(s);
    int64_t done = 0;
    for (size_t i = 0; i < at.size(); ++i) {
      if (count < 0 || done < count) {
        out.append(with);
        ++done;
      }
      if (i + 1 < at.size()) out.append_slice(self, at[i], at[i + 1]);
    }
    return out.take();
  }
  size_t pos = 0;
  int64_t done = 0;
  while (count < 0 || done < count) {
    size_t hit = s.find(old, pos);
    if (hit == std::string::npos) break;
    out.append_slice(self, pos, hit);
    out.append(with);
    pos = hit + old.size();
    ++done;
  }
  out.append_slice(self, pos, s.size());
  return out.take();
}

const std::string& need_string(const Value* v, std::string_view what) {
  if (!v || !v->is_string()) {
    failf(ErrorCode::kInvalidArgument, "{} must be a string, not {}", what,
          v ? type_name(*v) : "nothing");
  }
  return v->str();
}

// Code point range [start, end) of Python's optional start/end arguments.
std::u32string window(const std::string& s, const Value* start, const Value* end) {
  std::u32string cps = utf8_decode(s);
  auto clamp = [&](const Value* v, int64_t dflt) {
    if (!v || v->is_none()) return dflt;
    int64_t i = v->as_int(), n = static_cast<int64_t>(cps.size());
    if (i < 0) i = std::max<int64_t>(0, i + n);
    return std::min(i, n);
  };
  int64_t b = clamp(start, 0), e = clamp(end, static_cast<int64_t>(cps.size()));
  return b < e ? cps.substr(b, e - b) : std::u32string();
}

bool affix_match(const Value& self, const BoundArgs& a, bool prefix) {
  if (!a.has(1) && !a.has(2)) {
    // Whole-string affixes compare equal as UTF-8 bytes exactly when they do as code points.
    const std::string& s = self.str();
    auto test = [&](const Value& v) {
      const std::string& affix = need_string(&v, prefix ? "startswith arg" : "endswith arg");
      if (affix.size() > s.size()) return false;
      return prefix ? s.compare(0, affix.size(), affix) == 0
                    : s.compare(s.size() - affix.size(), affix.size(), affix) == 0;
    };
    const Value* arg = a.get(0);
    if (arg && arg->is_list() && arg->is_tuple()) {
      return std::any_of(arg->items().begin(), arg->items().end(), test);
    }
    return test(arg ? *arg : Value());
  }
  std::u32string text = window(self.str(), a.get(1), a.get(2));
  auto test = [&](const Value& v) {
    std::u32string affix = utf8_decode(need_string(&v, prefix ? "startswith arg" : "endswith arg"));
    if (affix.size() > text.size()) return false;
    return prefix ? text.compare(0, affix.size(), affix) == 0
                  : text.compare(text.size() - affix.size(), affix.size(), affix) == 0;
  };
  const Value* arg = a.get(0);
  if (arg && arg->is_list() && arg->is_tuple()) {
    return std::any_of(arg->items().begin(), arg->items().end(), test);
  }
  return test(arg ? *arg : Value());
}

int64_t find(const Value& self, const BoundArgs& a, bool from_right) {
  std::u32string sub = utf8_decode(need_string(a.get(0), "substring"));
  std::u32string cps = utf8_decode(self.str());
  int64_t n = static_cast<int64_t>(cps.size());
  auto clamp = [&](const Value* v, int64_t dflt) {
    if (!v || v->is_none()) return dflt;
    int64_t i = v->as_int();
    if (i < 0) i = std::max<int64_t>(0, i + n);
    return std::min(i, n);
  };
  int64_t b = clamp(a.get(1), 0), e = clamp(a.get(2), n);
  if (e - b < static_cast<int64_t>(sub.size())) return -1;
  std::u32string_view hay = std::u32string_view(cps).substr(b, e - b);
  size_t hit = from_right ? hay.rfind(sub) : hay.find(sub);
  return hit == std::u32string_view::npos ? -1 : b + static_cast<int64_t>(hit);
}

template <typename Pred>
bool all_code_points(const std::string& s, Pred pred) {
  if (s.empty()) return false;
  for (char32_t c : utf8_decode(s)) {
    if (!pred(c)) return false;
  }
  return true;
}

bool category_in(char32_t c, std::initializer_list<int> cats) {
  int cat = utf8proc_category(static_cast<utf8proc_int32_t>(c));
  return std::find(cats.begin(), cats.end(), cat) != cats.end();
}

Value string_method(const Value& self, const std::string& name, const CallArgs& args) {
  const std::string& s = self.str();
  auto no_args = [&] { (void)BoundArgs(args, name, {}); };
  if (name == "startswith" || name == "endswith") {
    BoundArgs a(args, name, {"prefix", "start", "end"});
    return Value::boolean(affix_match(self, a, name == "startswith"));
  }
  if (name == "split" || name == "rsplit") {
    BoundArgs a(args, name, {"sep", "maxsplit"});
    int64_t maxsplit = a.has(1) ? a.get(1)->as_int() : -1;
    return Value::list(split(self, a.get(0), maxsplit, name == "rsplit"));
  }
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    BoundArgs a(args, name, {"chars"});
    const Value* chars = a.get(0);
    const std::string* set = chars && !chars->is_none() ? &need_string(chars, "chars") : nullptr;
    auto [b, e] = python_strip_range(s, set, name != "rstrip", name != "lstrip");
    return substring(self, b, e);
  }
  if (name == "replace") {
    BoundArgs a(args, name, {"old", "new", "count"});
    int64_t count = a.has(2) ? a.get(2)->as_int() : -1;
    need_string(a.get(1), "new");
    return replace(self, need_string(a.get(0), "old"), *a.get(1), count);
  }
  if (name == "upper") return no_args(), mapped_string(self, python_upper(s), self.markup());
  if (name == "lower") return no_args(), mapped_string(self, python_lower(s), self.markup());
  if (name == "title") return no_args(), mapped_string(self, python_title(s), self.markup());
  if (name == "capitalize") {
    return no_args(), mapped_string(self, python_capitalize(s), self.markup());
  }
  if (name == "find" || name == "rfind" || name == "index") {
    BoundArgs a(args, name, {"sub", "start", "end"});
    int64_t at = find(self, a, name == "rfind");
    if (at < 0 && name == "index") fail(ErrorCode::kInvalidArgument, "substring not found");
    return Value::integer(at);
  }
  if (name == "count") {
    BoundArgs a(args, name, {"sub"});
    const std::string& sub = need_string(a.get(0), "substring");
    if (sub.empty()) return Value::integer(static_cast<int64_t>(utf8_length(s)) + 1);
    int64_t n = 0;
    for (size_t p = s.find(sub); p != std::string::npos; p = s.find(sub, p + sub.size())) ++n;
    return Value::integer(n);
  }
  if (name == "join") {
    BoundArgs a(args, name, {"iterable"});
    MarkedText out;
    auto items_owner = iterate(a.get_or(0, Value()));
    const List& items = *items_owner;
    for (size_t i = 0; i < items.size(); ++i) {
      if (!items[i].is_string()) {
        failf(ErrorCode::kInvalidArgument, "sequence item {}: expected str instance, {} found", i,
              type_name(items[i]));
      }
      if (i) out.append(self);
      out.append(items[i]);
    }
    return out.take();
  }
  if (name == "removeprefix" || name == "removesuffix") {
    BoundArgs a(args, name, {"affix"});
    const std::string& affix = need_string(a.get(0), "argument");
    bool prefix = name == "removeprefix";
    bool hit = s.size() >= affix.size() &&
               (prefix ? s.compare(0, affix.size(), affix) == 0
                       : s.compare(s.size() - affix.size(), affix.size(), affix) == 0);
    if (!hit) return self;
    Value rest = prefix ? substring(self, affix.size(), s.size())
                        : substring(self, 0, s.size() - affix.size());
    return as_string(rest);  // Python returns a plain str, even for Markup
  }
  if (name == "splitlines") {
    BoundArgs a(args, name, {"keepends"});
    if (a.has(0) && truthy(*a.get(0))) fail(ErrorCode::kUnsupported, "splitlines(keepends=True)");
    List out;
    for (auto [b, e] : python_splitlines_ranges(s)) out.push_back(substring(self, b, e, false));
    return Value::list(std::move(out));
  }
  if (name != "isspace" && name != "isdigit" && name != "isalpha" && name != "isalnum" &&
      name != "islower" && name != "isupper") {
    failf(ErrorCode::kUnsupported, "the str method '{}' is not supported", name);
  }
  no_args();
  if (name == "isspace") return Value::boolean(all_code_points(s, is_python_space));
  if (name == "isdigit") {
    return Value::boolean(all_code_points(s, [](char32_t c) {
      return category_in(c, {UTF8PROC_CATEGORY_ND}) || (c >= 0xB2 && c <= 0xB3) || c == 0xB9;
    }));
  }
  if (name == "isalpha") {
    return Value::boolean(all_code_points(s, [](char32_t c) {
      return category_in(c, {UTF8PROC_CATEGORY_LU, UTF8PROC_CATEGORY_LL, UTF8PROC_CATEGORY_LT,
                             UTF8PROC_CATEGORY_LM, UTF8PROC_CATEGORY_LO});
    }));
  }
  if (name == "isalnum") {
    return Value::boolean(all_code_points(s, [](char32_t c) {
      return category_in(c, {UTF8PROC_CATEGORY_LU, UTF8PROC_CATEGORY_LL, UTF8PROC_CATEGORY_LT,
                             UTF8PROC_CATEGORY_LM, UTF8PROC_CATEGORY_LO, UTF8PROC_CATEGORY_ND,
                             UTF8PROC_CATEGORY_NL, UTF8PROC_CATEGORY_NO});
    }));
  }
  if (name == "islower" || name == "isupper") {
    bool want_lower = name == "islower";
    bool any_cased = false;
    for (char32_t c : utf8_decode(s)) {
      if (want_lower ? is_cased_upper(c) : is_cased_lower(c)) return Value::boolean(false);
      any_cased = any_cased || is_cased(c);
    }
    return Value::boolean(any_cased);
  }
  return Value::boolean(false);
}

Value dict_method(const Value& self, const std::string& name, const CallArgs& args) {
  const Dict& d = self.dict();
  if (name == "get") {
    BoundArgs a(args, name, {"key", "default"});
    const Value* key = a.get(0);
    if (!key) fail(ErrorCode::kInvalidArgument, "get expected at least 1 argument, got 0");
    const Value* hit = key->is_string() ? d.find(key->str()) : nullptr;
    return hit ? *hit : a.get_or(1, Value::none());
  }
  if (name != "items" && name != "keys" && name != "values" && name != "copy") {
    failf(ErrorCode::kInvalidArgument, "access to attribute '{}' of 'dict' object is unsafe", name);
  }
  (void)BoundArgs(args, name, {});
  List out;
  ListKind kind;
  if (name == "items") {
    kind = ListKind::kDictItems;
    for (const auto& [k, v] : d.entries) {
      out.push_back(Value::list({key_value(d, k), v}, ListKind::kTuple));
    }
  } else if (name == "keys") {
    kind = ListKind::kDictKeys;
    for (const auto& [k, _] : d.entries) out.push_back(key_value(d, k));
  } else if (name == "values") {
    kind = ListKind::kDictValues;
    for (const auto& [_, v] : d.entries) out.push_back(v);
  } else {
    return self;  // copy(): values are immutable, sharing is a copy
  }
  return Value::list(std::move(out), kind);
}

Value list_method(const Value& self, const std::string& name, const CallArgs& args) {
  const List& items = self.items();
  if (name == "index" || name == "count") {
    BoundArgs a(args, name, {"value"});
    Value x = a.get_or(0, Value());
    int64_t n = 0;
    for (size_t i = 0; i < items.size(); ++i) {
      if (!equals(items[i], x)) continue;
      if (name == "index") return Value::integer(static_cast<int64_t>(i));
      ++n;
    }
    if (name == "index") failf(ErrorCode::kInvalidArgument, "{} is not in list", repr(x));
    return Value::integer(n);
  }
  if (name == "copy") return BoundArgs(args, name, {}), self;
  failf(ErrorCode::kInvalidArgument, "access to attribute '{}' of '{}' object is unsafe", name,
        type_name(self));
}

}  // namespace

std::string python_upper(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char32_t c : utf8_decode(s)) utf8_append(out, to_upper(c));
  return out;
}

std::string python_lower(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char32_t c : utf8_decode(s)) utf8_append(out, to_lower(c));
  return out;
}

std::string python_capitalize(std::string_view s) {
  std::string out;
  bool first = true;
  for (char32_t c : utf8_decode(s)) {
    utf8_append(out, first ? to_title(c) : to_lower(c));
    first = false;
  }
  return out;
}

std::string python_title(std::string_view s) {
  std::string out;
  bool previous_cased = false;
  for (char32_t c : utf8_decode(s)) {
    if (is_cased(c)) {
      utf8_append(out, previous_cased ? to_lower(c) : to_title(c));
      previous_cased = true;
    } else {
      utf8_append(out, c);
      previous_cased = false;
    }
  }
  return out;
}

std::vector<std::pair<size_t, size_t>> python_splitlines_ranges(std::string_view s) {
  std::vector<std::pair<size_t, size_t>> lines;
  std::u32string cps = utf8_decode(s);
  const std::vector<size_t> at = code_point_offsets(s);
  size_t b = 0;
  for (size_t i = 0; i < cps.size(); ++i) {
    if (!is_line_break(cps[i])) continue;
    lines.emplace_back(at[b], at[i]);
    if (cps[i] == '\r' && i + 1 < cps.size() && cps[i + 1] == '\n') ++i;
    b = i + 1;
  }
  if (b < cps.size()) lines.emplace_back(at[b], s.size());
  return lines;
}

Value call_method(const Value& receiver, const std::string& name, const CallArgs& args) {
  switch (receiver.type()) {
    case Value::Type::kString:
      if (name == "format") {
        fail(ErrorCode::kUnsupported, "the str method 'format' is not supported");
      }
      return string_method(receiver, name, args);
    case Value::Type::kDict:
      return dict_method(receiver, name, args);
    case Value::Type::kList:
      return list_method(receiver, name, args);
    default:
      failf(ErrorCode::kInternal, "no method '{}' on '{}'", name, type_name(receiver));
  }
}

}  // namespace recur::jinja
