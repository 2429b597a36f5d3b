// Jinja's filters, tests and global functions, with transformers' overrides: tojson is
// json.dumps(ensure_ascii=False), raise_exception raises, strftime_now formats local time.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <ctime>
#include <functional>
#include <map>

#include "tokenizer/jinja_builtins.h"
#include "tokenizer/jinja_marked.h"

namespace recur::jinja {

BoundArgs::BoundArgs(const CallArgs& args, std::string_view function,
                     std::initializer_list<std::string_view> params)
    : slots_(params.size(), nullptr) {
  if (args.positional.size() > params.size()) {
    failf(ErrorCode::kInvalidArgument, "{}() takes at most {} argument(s) ({} given)", function,
          params.size(), args.positional.size());
  }
  for (size_t i = 0; i < args.positional.size(); ++i) slots_[i] = &args.positional[i];
  for (const auto& [key, value] : args.keyword) {
    auto it = std::find(params.begin(), params.end(), key);
    if (it == params.end()) {
      failf(ErrorCode::kInvalidArgument, "{}() got an unexpected keyword argument '{}'", function,
            key);
    }
    size_t i = static_cast<size_t>(it - params.begin());
    if (slots_[i]) {
      failf(ErrorCode::kInvalidArgument, "{}() got multiple values for argument '{}'", function,
            key);
    }
    slots_[i] = &value;
  }
}

namespace {

using Filter = std::function<Value(const Value&, const CallArgs&)>;
using Test = std::function<bool(const Value&, const CallArgs&)>;

int64_t need_int(const Value* v, std::string_view what) {
  if (!v || !v->is_integral()) {
    failf(ErrorCode::kInvalidArgument, "{} must be an integer, not {}", what,
          v ? type_name(*v) : "nothing");
  }
  return v->as_int();
}

// Jinja's make_attrgetter: "a.b.0" looks up a, then b, then item 0.
Value lookup_path(const Value& item, const std::string& path) {
  Value v = item;
  size_t pos = 0;
  while (pos <= path.size()) {
    size_t dot = path.find('.', pos);
    std::string part = path.substr(pos, dot == std::string::npos ? std::string::npos : dot - pos);
    int64_t index;
    auto res = std::from_chars(part.data(), part.data() + part.size(), index);
    bool numeric = !part.empty() && res.ec == std::errc() && res.ptr == part.data() + part.size();
    v = numeric ? get_item(v, Value::integer(index)) : get_item(v, Value::string(part));
    if (dot == std::string::npos) break;
    pos = dot + 1;
  }
  return v;
}

Value sort_key(const Value& item, const Value* attribute, bool case_sensitive) {
  Value key = attribute && !attribute->is_none() ? lookup_path(item, to_str(*attribute)) : item;
  if (!case_sensitive && key.is_string()) return Value::string(python_lower(key.str()));
  return key;
}

std::optional<int64_t> parse_python_int(std::string s, int base) {
  s = python_strip(s, nullptr, true, true);
  bool negative = false;
  size_t i = 0;
  if (i < s.size() && (s[i] == '+' || s[i] == '-')) negative = s[i++] == '-';
  if (i + 1 < s.size() && s[i] == '0') {
    char p = static_cast<char>(s[i + 1] | 0x20);
    int prefixed = p == 'x' ? 16 : p == 'o' ? 8 : p == 'b' ? 2 : 0;
    if (prefixed && (base == 0 || base == prefixed)) {
      base = prefixed;
      i += 2;
      if (i < s.size() && s[i] == '_') ++i;
    }
  }
  if (base == 0) {
    base = 10;
    // Python refuses "010" in base 0 but takes "000".
    if (i + 1 < s.size() && s[i] == '0' && s.find_first_not_of("0_", i) != std::string::npos) {
      return std::nullopt;
    }
  }
  if (base < 2 || base > 36)
    fail(ErrorCode::kInvalidArgument, "int() base must be >= 2 and <= 36, or 0");
  std::string digits;
  for (; i < s.size(); ++i) {
    if (s[i] == '_' && !digits.empty() && i + 1 < s.size() && s[i + 1] != '_') continue;
    digits.push_back(s[i]);
  }
  if (digits.empty()) return std::nullopt;
  int64_t v;
  auto res = std::from_chars(digits.data(), digits.data() + digits.size(), v, base);
  if (res.ec != std::errc() || res.ptr != digits.data() + digits.size()) return std::nullopt;
  return negative ? -v : v;
}

std::optional<double> parse_python_float(const std::string& text) {
  std::string s = python_strip(text, nullptr, true, true);
  std::string lower = python_lower(s);
  std::string body = lower;
  double sign = 1;
  if (!body.empty() && (body[0] == '+' || body[0] == '-')) {
    sign = body[0] == '-' ? -1 : 1;
    body = body.substr(1);
  }
  if (body == "inf" || body == "infinity") return sign * HUGE_VAL;
  if (body == "nan") return std::nan("");
  std::string digits;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '_') continue;
    digits.push_back(s[i]);
  }
  if (digits.empty() || digits[0] == '+') digits = digits.empty() ? digits : digits.substr(1);
  double v;
  auto res = std::from_chars(digits.data(), digits.data() + digits.size(), v);
  if (digits.empty() || res.ec != std::errc() || res.ptr != digits.data() + digits.size()) {
    return std::nullopt;
  }
  return v;
}

Value filter_tojson(const Value& in, const CallArgs& args) {
  BoundArgs a(args, "tojson", {"ensure_ascii", "indent", "separators", "sort_keys"});
  JsonOptions o;
  o.ensure_ascii = a.has(0) && truthy(*a.get(0));
  if (a.has(1) && !a.get(1)->is_none()) {
    const Value& indent = *a.get(1);
    o.has_indent = true;
    if (indent.is_integral()) {
      check_template_string_size(size_t(std::max<int64_t>(0, indent.as_int())));
      o.indent = std::string(std::max<int64_t>(0, indent.as_int()), ' ');
    } else if (indent.is_string()) {
      o.indent = indent.str();
    } else {
      fail(ErrorCode::kInvalidArgument, "tojson: indent must be an integer or a string");
    }
    o.item_separator.assign(1, ',');
  }
  if (a.has(2) && !a.get(2)->is_none()) {
    const Value& seps = *a.get(2);
    if (!seps.is_list() || seps.items().size() != 2 || !seps.items()[0].is_string() ||
        !seps.items()[1].is_string()) {
      fail(ErrorCode::kInvalidArgument, "tojson: separators must be two strings");
    }
    o.item_separator = seps.items()[0].str();
    o.key_separator = seps.items()[1].str();
  }
  o.sort_keys = a.has(3) && truthy(*a.get(3));
  return derived_string(to_json(in, o), false, {&in, a.get(1), a.get(2)});
}

Value filter_length(const Value& in) {
  switch (in.type()) {
    case Value::Type::kUndefined:
      return Value::integer(0);
    case Value::Type::kString:
      return Value::integer(static_cast<int64_t>(utf8_length(in.str())));
    case Value::Type::kList:
      if (in.list_kind() == ListKind::kIterator) {
        fail(ErrorCode::kInvalidArgument, "object of type 'generator' has no len()");
      }
      return Value::integer(static_cast<int64_t>(in.items().size()));
    case Value::Type::kDict:
      return Value::integer(static_cast<int64_t>(in.dict().size()));
    default:
      failf(ErrorCode::kInvalidArgument, "object of type '{}' has no len()", type_name(in));
  }
}

Value filter_int(const Value& in, const CallArgs& args) {
  BoundArgs a(args, "int", {"default", "base"});
  if (in.is_undefined()) fail_undefined(in);  // int(Undefined) raises, past do_int's except
  Value fallback = a.get_or(0, Value::integer(0));
  int base = static_cast<int>(a.has(1) ? need_int(a.get(1), "base") : 10);
  if (in.is_integral()) return Value::integer(in.as_int());
  if (in.is_string()) {
    if (auto v = parse_python_int(in.str(), base)) return Value::integer(*v);
    if (auto f = parse_python_float(in.str())) {
      if (std::isnan(*f)) return fallback;
      if (std::isinf(*f) || std::fabs(*f) > 9.2e18) {
        fail(ErrorCode::kUnsupported, "int: value out of range");
      }
      return Value::integer(static_cast<int64_t>(*f));
    }
    return fallback;
  }
  if (in.type() == Value::Type::kFloat) {
    double f = in.as_float();
    if (std::isnan(f)) return fallback;
    if (std::isinf(f) || std::fabs(f) > 9.2e18) fail(ErrorCode::kUnsupported, "int: out of range");
    return Value::integer(static_cast<int64_t>(f));
  }
  return fallback;
}

Value filter_float(const Value& in, const CallArgs& args) {
  BoundArgs a(args, "float", {"default"});
  if (in.is_undefined()) fail_undefined(in);
  Value fallback = a.get_or(0, Value::floating(0.0));
  if (in.is_number()) return Value::floating(in.as_float());
  if (in.is_string()) {
    if (auto f = parse_python_float(in.str())) return Value::floating(*f);
  }
  return fallback;
}

Value filter_round(const Value& in, const CallArgs& args) {
  BoundArgs a(args, "round", {"precision", "method"});
  int64_t precision = a.has(0) ? need_int(a.get(0), "precision") : 0;
  std::string method = a.has(1) ? to_str(*a.get(1)) : "common";
  if (method != "common" && method != "ceil" && method != "floor") {
    fail(ErrorCode::kInvalidArgument, "method must be common, ceil or floor");
  }
  if (!in.is_number()) failf(ErrorCode::kInvalidArgument, "cannot round '{}'", type_name(in));
  if (method == "common" && in.is_integral()) return Value::integer(in.as_int());
  double scale = std::pow(10.0, static_cast<double>(precision));
  double x = in.as_float() * scale;
  double r;
  if (method == "ceil") {
    r = std::ceil(x);
  } else if (method == "floor") {
    r = std::floor(x);
  } else if (precision >= 0) {
    // Python rounds the exact binary value, halves to even; so does printf.
    char buf[512];
    std::snprintf(buf, sizeof(buf), "%.*f", static_cast<int>(std::min<int64_t>(precision, 300)),
                  in.as_float());
    return Value::floating(std::strtod(buf, nullptr));
  } else {
    r = std::nearbyint(x);
  }
  return Value::floating(r / scale);
}

// Jinja's title filter capitalizes after '-', whitespace and opening brackets.
std::string jinja_title(const std::string& s) {
  std::string out;
  bool at_word_start = true;
  for (char32_t c : utf8_decode(s)) {
    bool delimiter = c == '-' || c == '(' || c == '{' || c == '[' || c == '<' || is_python_space(c);
    std::string ch;
    utf8_append(ch, c);
    if (delimiter) {
      out += ch;
      at_word_start = true;
    } else {
      out += at_word_start ? python_upper(ch) : python_lower(ch);
      at_word_start = false;
    }
  }
  return out;
}

Value filter_indent(const Value& in, const CallArgs& args) {
  BoundArgs a(args, "indent", {"width", "first", "blank"});
  if (in.is_undefined()) fail_undefined(in);
  Value pad = Value::string("    ");
  if (a.has(0)) {
    if (!a.get(0)->is_string()) {
      check_template_string_size(size_t(std::max<int64_t>(0, need_int(a.get(0), "width"))));
    }
    pad = a.get(0)->is_string() ? *a.get(0)
                                : Value::string(std::string(need_int(a.get(0), "width"), ' '));
  }
  bool first = a.has(1) && truthy(*a.get(1));
  bool blank = a.has(2) && truthy(*a.get(2));
  MarkedText text;
  text.append(as_string(in));
  text.append("\n");
  const Value lines_of = text.take();
  MarkedText out;
  if (first) out.append(pad);
  const auto lines = python_splitlines_ranges(lines_of.str());
  for (size_t i = 0; i < lines.size(); ++i) {
    if (i) out.append("\n");
    if (i && (blank || lines[i].first != lines[i].second)) out.append(pad);
    out.append_slice(lines_of, lines[i].first, lines[i].second);
  }
  return out.take(in.markup());
}

// select / reject / selectattr / rejectattr.
Value filter_select(const Value& in, const CallArgs& args, bool by_attribute, bool keep) {
  size_t next = 0;
  std::string attribute;
  if (by_attribute) {
    if (args.positional.empty()) fail(ErrorCode::kInvalidArgument, "missing attribute name");
    attribute = to_str(args.positional[next++]);
  }
  std::string test;
  if (next < args.positional.size()) test = to_str(args.positional[next++]);
  if (!test.empty() && !is_known_test(test)) {
    failf(ErrorCode::kUnsupported, "the test '{}' is not supported", test);
  }
  CallArgs test_args;
  test_args.positional.assign(args.positional.begin() + next, args.positional.end());
  test_args.keyword = args.keyword;
  List out;
  // Jinja's select/map only look inside a truthy input: 0 or None give nothing, not an error.
  auto iterated = truthy(in) ? iterate(in) : std::make_shared<const List>();
  for (const Value& item : *iterated) {
    Value subject = by_attribute ? lookup_path(item, attribute) : item;
    bool pass = test.empty() ? truthy(subject) : apply_test(test, subject, test_args);
    if (pass == keep) out.push_back(item);
  }
  return Value::list(std::move(out), ListKind::kIterator);
}

Value filter_map(const Value& in, const CallArgs& args) {
  List out;
  if (args.positional.empty()) {
    const Value* attribute = nullptr;
    const Value* fallback = nullptr;
    for (const auto& [k, v] : args.keyword) {
      if (k == "attribute") {
        attribute = &v;
      } else if (k == "default") {
        fallback = &v;
      } else {
        failf(ErrorCode::kInvalidArgument, "map: unexpected keyword argument '{}'", k);
      }
    }
    if (!attribute) fail(ErrorCode::kInvalidArgument, "map requires a filter name or attribute=");
    auto iterated = truthy(in) ? iterate(in) : std::make_shared<const List>();
    for (const Value& item : *iterated) {
      Value v = lookup_path(item, to_str(*attribute));
      out.push_back(v.is_undefined() && fallback ? *fallback : v);
    }
    return Value::list(std::move(out), ListKind::kIterator);
  }
  std::string name = to_str(args.positional[0]);
  if (!is_known_filter(name))
    failf(ErrorCode::kUnsupported, "the filter '{}' is not supported", name);
  CallArgs rest;
  rest.positional.assign(args.positional.begin() + 1, args.positional.end());
  rest.keyword = args.keyword;
  auto iterated = truthy(in) ? iterate(in) : std::make_shared<const List>();
  for (const Value& item : *iterated) out.push_back(apply_filter(name, item, rest));
  return Value::list(std::move(out), ListKind::kIterator);
}

Value filter_sorted(const Value& in, const CallArgs& args, std::string_view which) {
  if (which == "sort") {
    BoundArgs a(args, which, {"reverse", "case_sensitive", "attribute"});
    bool reverse = a.has(0) && truthy(*a.get(0));
    bool cs = a.has(1) && truthy(*a.get(1));
    List items = *iterate(in);
    std::vector<std::pair<Value, size_t>> keyed;
    for (size_t i = 0; i < items.size(); ++i)
      keyed.emplace_back(sort_key(items[i], a.get(2), cs), i);
    std::stable_sort(keyed.begin(), keyed.end(), [&](const auto& x, const auto& y) {
      return reverse ? compare(y.first, x.first) < 0 : compare(x.first, y.first) < 0;
    });
    List out;
    for (const auto& k : keyed) out.push_back(items[k.second]);
    return Value::list(std::move(out));
  }
  if (which == "dictsort") {
    BoundArgs a(args, which, {"case_sensitive", "by", "reverse"});
    if (!in.is_dict()) fail(ErrorCode::kInvalidArgument, "dictsort expects a mapping");
    bool cs = a.has(0) && truthy(*a.get(0));
    std::string by = a.has(1) ? to_str(*a.get(1)) : "key";
    if (by != "key" && by != "value") {
      fail(ErrorCode::kInvalidArgument, "You can only sort by either \"key\" or \"value\"");
    }
    bool reverse = a.has(2) && truthy(*a.get(2));
    List pairs;
    for (const auto& [k, v] : in.dict().entries)
      pairs.push_back(Value::list({key_value(in.dict(), k), v}, ListKind::kTuple));
    size_t at = by == "key" ? 0 : 1;
    std::stable_sort(pairs.begin(), pairs.end(), [&](const Value& x, const Value& y) {
      Value kx = sort_key(x.items()[at], nullptr, cs), ky = sort_key(y.items()[at], nullptr, cs);
      return reverse ? compare(ky, kx) < 0 : compare(kx, ky) < 0;
    });
    return Value::list(std::move(pairs));
  }
  // min, max, unique
  BoundArgs a(args, which, {"case_sensitive", "attribute"});
  bool cs = a.has(0) && truthy(*a.get(0));
  auto items_owner = iterate(in);
  const List& items = *items_owner;
  if (which == "unique") {
    List out;
    List seen;
    for (const Value& item : items) {
      Value key = sort_key(item, a.get(1), cs);
      if (std::any_of(seen.begin(), seen.end(), [&](const Value& s) { return equals(s, key); })) {
        continue;
      }
      seen.push_back(key);
      out.push_back(item);
    }
    return Value::list(std::move(out), ListKind::kIterator);
  }
  if (items.empty()) return Value::undefined("No aggregated item, sequence was empty.");
  size_t best = 0;
  for (size_t i = 1; i < items.size(); ++i) {
    int c = compare(sort_key(items[i], a.get(1), cs), sort_key(items[best], a.get(1), cs));
    if (which == "min" ? c < 0 : c > 0) best = i;
  }
  return items[best];
}

const std::map<std::string, Filter, std::less<>>& filters() {
  static const std::map<std::string, Filter, std::less<>> kFilters = [] {
    std::map<std::string, Filter, std::less<>> f;
    f["tojson"] = filter_tojson;
    f["trim"] = [](const Value& in, const CallArgs& args) {
      BoundArgs a(args, "trim", {"chars"});
      const Value* chars = a.get(0);
      std::string set = chars && !chars->is_none() ? to_str(*chars) : "";
      const Value text = as_string(in);
      auto [b, e] =
          python_strip_range(text.str(), chars && !chars->is_none() ? &set : nullptr, true, true);
      return substring(text, b, e, in.markup());
    };
    f["length"] = [](const Value& in, const CallArgs& args) {
      (void)BoundArgs(args, "length", {});
      return filter_length(in);
    };
    f["count"] = f["length"];
    f["first"] = [](const Value& in, const CallArgs& args) {
      (void)BoundArgs(args, "first", {});
      auto items = iterate(in);
      return items->empty() ? Value::undefined("No first item, sequence was empty.")
                            : items->front();
    };
    f["last"] = [](const Value& in, const CallArgs& args) {
      (void)BoundArgs(args, "last", {});
      if (in.is_list() && in.list_kind() == ListKind::kIterator) {
        fail(ErrorCode::kInvalidArgument, "'generator' object is not reversible");
      }
      auto items = iterate(in);
      return items->empty() ? Value::undefined("No last item, sequence was empty.") : items->back();
    };
    f["join"] = [](const Value& in, const CallArgs& args) {
      BoundArgs a(args, "join", {"d", "attribute"});
      const Value sep = a.has(0) ? *a.get(0) : Value::string("");
      MarkedText out;
      auto items_owner = iterate(in);
      const List& items = *items_owner;
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) out.append(sep);
        out.append(a.has(1) && !a.get(1)->is_none() ? lookup_path(items[i], to_str(*a.get(1)))
                                                    : items[i]);
      }
      return out.take();
    };
    f["upper"] = [](const Value& in, const CallArgs& args) {
      (void)BoundArgs(args, "upper", {});
      return mapped_string(as_string(in), python_upper(to_str(in)), in.markup());
    };
    f["lower"] = [](const Value& in, const CallArgs& args) {
      (void)BoundArgs(args, "lower", {});
      return mapped_string(as_string(in), python_lower(to_str(in)), in.markup());
    };
    f["capitalize"] = [](const Value& in, const CallArgs& args) {
      (void)BoundArgs(args, "capitalize", {});
      return mapped_string(as_string(in), python_capitalize(to_str(in)), in.markup());
    };
    f["title"] = [](const Value& in, const CallArgs& args) {
      (void)BoundArgs(args, "title", {});
      return mapped_string(as_string(in), jinja_title(to_str(in)), false);
    };
    f["default"] = [](const Value& in, const CallArgs& args) {
      BoundArgs a(args, "default", {"default_value", "boolean"});
      bool boolean = a.has(1) && truthy(*a.get(1));
      if (in.is_undefined() || (boolean && !truthy(in))) return a.get_or(0, Value::string(""));
      return in;
    };
    f["d"] = f["default"];
    f["string"] = [](const Value& in, const CallArgs& args) {
      (void)BoundArgs(args, "string", {});
      return in.is_string() ? in : as_string(in);
    };
    f["list"] = [](const Value& in, const CallArgs& args) {
      (void)BoundArgs(args, "list", {});
      return Value::list(iterate(in));
    };
    f["items"] = [](const Value& in, const CallArgs& args) {
      (void)BoundArgs(args, "items", {});
      List out;
      if (in.is_undefined()) return Value::list(std::move(out));
      if (!in.is_dict())
        fail(ErrorCode::kInvalidArgument, "Can only get item pairs from a mapping.");
      for (const auto& [k, v] : in.dict().entries) {
        out.push_back(Value::list({key_value(in.dict(), k), v}, ListKind::kTuple));
      }
      return Value::list(std::move(out), ListKind::kIterator);
    };
    f["replace"] = [](const Value& in, const CallArgs& args) {
      BoundArgs a(args, "replace", {"old", "new", "count"});
      CallArgs m;
      m.positional = {as_string(a.get_or(0, Value())), as_string(a.get_or(1, Value()))};
      if (a.has(2) && !a.get(2)->is_none()) m.positional.push_back(*a.get(2));
      return call_method(as_string(in), "replace", m);
    };
    f["int"] = filter_int;
    f["float"] = filter_float;
    f["safe"] = [](const Value& in, const CallArgs& args) {
      (void)BoundArgs(args, "safe", {});
      const Value text = as_string(in);
      return substring(text, 0, text.str().size(), true);
    };
    f["escape"] = [](const Value& in, const CallArgs& args) {
      (void)BoundArgs(args, "escape", {});
      if (in.is_string() && in.markup()) return in;
      MarkedText out;
      out.append_html_escaped(as_string(in));
      return out.take(true);
    };
    f["e"] = f["escape"];
    f["abs"] = [](const Value& in, const CallArgs& args) {
      (void)BoundArgs(args, "abs", {});
      if (!in.is_number())
        failf(ErrorCode::kInvalidArgument, "bad operand type for abs(): '{}'", type_name(in));
      if (in.type() == Value::Type::kFloat) return Value::floating(std::fabs(in.as_float()));
      return in.as_int() < 0 ? unary_op("-", in) : Value::integer(in.as_int());
    };
    f["round"] = filter_round;
    f["reverse"] = [](const Value& in, const CallArgs& args) {
      (void)BoundArgs(args, "reverse", {});
      if (in.is_string()) {
        const std::vector<size_t> at = code_point_offsets(in.str());
        MarkedText out;
        for (size_t i = at.size() - 1; i > 0; --i) out.append_slice(in, at[i - 1], at[i]);
        return out.take();
      }
      List items = *iterate(in);
      std::reverse(items.begin(), items.end());
      return Value::list(std::move(items), ListKind::kIterator);
    };
    for (const char* name : {"sort", "dictsort", "unique", "min", "max"}) {
      std::string n = name;
      f[n] = [n](const Value& in, const CallArgs& args) { return filter_sorted(in, args, n); };
    }
    f["sum"] = [](const Value& in, const CallArgs& args) {
      BoundArgs a(args, "sum", {"attribute", "start"});
      Value total = a.get_or(1, Value::integer(0));
      auto iterated = iterate(in);
      for (const Value& item : *iterated) {
        total = binary_op(
            "+", total,
            a.has(0) && !a.get(0)->is_none() ? lookup_path(item, to_str(*a.get(0))) : item);
      }
      return total;
    };
    f["map"] = filter_map;
    f["select"] = [](const Value& in, const CallArgs& a) {
      return filter_select(in, a, false, true);
    };
    f["reject"] = [](const Value& in, const CallArgs& a) {
      return filter_select(in, a, false, false);
    };
    f["selectattr"] = [](const Value& in, const CallArgs& a) {
      return filter_select(in, a, true, true);
    };
    f["rejectattr"] = [](const Value& in, const CallArgs& a) {
      return filter_select(in, a, true, false);
    };
    f["attr"] = [](const Value& in, const CallArgs& args) {
      BoundArgs a(args, "attr", {"name"});
      std::string name = to_str(a.get_or(0, Value()));
      // Python getattr only: dict keys are items, not attributes.
      Value v = get_attribute(in, name);
      if (in.is_dict() && v.type() != Value::Type::kCallable) {
        return Value::undefined(fmt::format("'dict object' has no attribute '{}'", name));
      }
      return v;
    };
    f["indent"] = filter_indent;
    return f;
  }();
  return kFilters;
}

// Jinja's sequence test: has len() and __getitem__ (Undefined has both).
bool is_sequence(const Value& v) {
  return v.is_undefined() || v.is_string() || v.is_indexable_list() || v.is_dict();
}

bool is_iterable(const Value& v) {
  return v.is_undefined() || v.is_string() || v.is_list() || v.is_dict();
}

const std::map<std::string, Test, std::less<>>& tests() {
  static const std::map<std::string, Test, std::less<>> kTests = [] {
    std::map<std::string, Test, std::less<>> t;
    auto unary = [&t](const char* name, std::function<bool(const Value&)> fn) {
      std::string n = name;
      t[n] = [n, fn](const Value& v, const CallArgs& args) {
        (void)BoundArgs(args, n, {});
        return fn(v);
      };
    };
    unary("defined", [](const Value& v) { return !v.is_undefined(); });
    unary("undefined", [](const Value& v) { return v.is_undefined(); });
    unary("none", [](const Value& v) { return v.is_none(); });
    unary("boolean", [](const Value& v) { return v.is_bool(); });
    unary("true", [](const Value& v) { return v.is_bool() && v.as_bool(); });
    unary("false", [](const Value& v) { return v.is_bool() && !v.as_bool(); });
    unary("integer", [](const Value& v) { return v.is_int(); });
    unary("float", [](const Value& v) { return v.type() == Value::Type::kFloat; });
    unary("number", [](const Value& v) { return v.is_number(); });
    unary("string", [](const Value& v) { return v.is_string(); });
    unary("mapping", [](const Value& v) { return v.is_dict(); });
    unary("iterable", is_iterable);
    unary("sequence", is_sequence);
    unary("callable", [](const Value& v) { return v.type() == Value::Type::kCallable; });
    unary("escaped", [](const Value& v) { return v.is_string() && v.markup(); });
    // Jinja compares the remainder with 1 and 0, so 0.5 is neither odd nor even.
    unary("odd", [](const Value& v) {
      return equals(binary_op("%", v, Value::integer(2)), Value::integer(1));
    });
    unary("even", [](const Value& v) {
      return equals(binary_op("%", v, Value::integer(2)), Value::integer(0));
    });
    unary("lower", [](const Value& v) {
      return truthy(call_method(Value::string(to_str(v)), "islower", {}));
    });
    unary("upper", [](const Value& v) {
      return truthy(call_method(Value::string(to_str(v)), "isupper", {}));
    });
    auto binary = [&t](std::initializer_list<const char*> names,
                       std::function<bool(const Value&, const Value&)> fn) {
      for (const char* name : names) {
        std::string n = name;
        t[n] = [n, fn](const Value& v, const CallArgs& args) {
          BoundArgs a(args, n, {"other"});
          if (!a.has(0)) failf(ErrorCode::kInvalidArgument, "test '{}' needs an argument", n);
          return fn(v, *a.get(0));
        };
      }
    };
    binary({"eq", "equalto", "=="}, [](const Value& a, const Value& b) { return equals(a, b); });
    binary({"ne", "!="}, [](const Value& a, const Value& b) { return !equals(a, b); });
    binary({"lt", "lessthan", "<"},
           [](const Value& a, const Value& b) { return compare(a, b) < 0; });
    binary({"le", "<="}, [](const Value& a, const Value& b) { return compare(a, b) <= 0; });
    binary({"gt", "greaterthan", ">"},
           [](const Value& a, const Value& b) { return compare(a, b) > 0; });
    binary({"ge", ">="}, [](const Value& a, const Value& b) { return compare(a, b) >= 0; });
    binary({"in"}, [](const Value& a, const Value& b) { return contains(b, a); });
    binary({"divisibleby"}, [](const Value& a, const Value& b) {
      return equals(binary_op("%", a, b), Value::integer(0));
    });
    binary({"sameas"}, [](const Value& a, const Value& b) {
      if (a.type() != b.type()) return false;
      if (a.is_none() || a.is_undefined()) return a.is_none();
      if (a.is_bool()) return a.as_bool() == b.as_bool();
      return a.identity() != nullptr && a.identity() == b.identity();
    });
    binary({"filter"},
           [](const Value& a, const Value&) { return a.is_string() && is_known_filter(a.str()); });
    binary({"test"},
           [](const Value& a, const Value&) { return a.is_string() && is_known_test(a.str()); });
    return t;
  }();
  return kTests;
}

Value make_namespace(const CallArgs& args) {
  auto ns = std::make_shared<Namespace>();
  for (const Value& init : args.positional) {
    if (init.is_dict()) {
      if (init.dict().keys_from_request) ns->attrs.keys_from_request = true;
      for (const auto& [k, v] : init.dict().entries) ns->attrs.set(k, v);
    } else {
      auto iterated = iterate(init);
      for (const Value& pair : *iterated) {
        if (!pair.is_list() || pair.items().size() != 2 || !pair.items()[0].is_string()) {
          fail(ErrorCode::kInvalidArgument, "namespace() expects a mapping or key/value pairs");
        }
        if (pair.items()[0].user_spans()) ns->attrs.keys_from_request = true;
        ns->attrs.set(pair.items()[0].str(), pair.items()[1]);
      }
    }
  }
  for (const auto& [k, v] : args.keyword) ns->attrs.set(k, v);
  return Value::namespace_(std::move(ns));
}

Value make_range(const CallArgs& args) {
  if (!args.keyword.empty())
    fail(ErrorCode::kInvalidArgument, "range() takes no keyword arguments");
  const auto& p = args.positional;
  if (p.empty() || p.size() > 3)
    fail(ErrorCode::kInvalidArgument, "range expected 1 to 3 arguments");
  int64_t start = 0, stop, step = 1;
  if (p.size() == 1) {
    stop = need_int(&p[0], "range() argument");
  } else {
    start = need_int(&p[0], "range() argument");
    stop = need_int(&p[1], "range() argument");
    if (p.size() == 3) step = need_int(&p[2], "range() argument");
  }
  if (step == 0) fail(ErrorCode::kInvalidArgument, "range() arg 3 must not be zero");
  List out;
  for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
    if (out.size() >= 100000) {
      fail(ErrorCode::kInvalidArgument,
           "Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
    }
    out.push_back(Value::integer(i));
  }
  return Value::list(std::move(out));
}

}  // namespace

bool is_known_filter(std::string_view name) {
  return filters().count(name) > 0;
}
bool is_known_test(std::string_view name) {
  return tests().count(name) > 0;
}

Value apply_filter(const std::string& name, const Value& input, const CallArgs& args) {
  auto it = filters().find(name);
  if (it == filters().end())
    failf(ErrorCode::kUnsupported, "the filter '{}' is not supported", name);
  return it->second(input, args);
}

bool apply_test(const std::string& name, const Value& input, const CallArgs& args) {
  auto it = tests().find(name);
  if (it == tests().end()) failf(ErrorCode::kUnsupported, "the test '{}' is not supported", name);
  return it->second(input, args);
}

const std::vector<std::string>& global_function_names() {
  static const std::vector<std::string> kNames = {
      "raise_exception", "namespace", "range",  "dict",
      "strftime_now",    "lipsum",    "cycler", "joiner"};
  return kNames;
}

Value call_global(const std::string& name, const CallArgs& args) {
  if (name == "raise_exception") {
    BoundArgs a(args, name, {"message"});
    // The template's own words, unprefixed: they are meant for the API caller.
    throw TemplateError{ErrorCode::kInvalidArgument, to_str(a.get_or(0, Value())), true, true};
  }
  if (name == "namespace") return make_namespace(args);
  if (name == "range") return make_range(args);
  if (name == "dict") {
    Value ns = make_namespace(args);
    return Value::dict(ns.ns().attrs);
  }
  if (name == "strftime_now") {
    BoundArgs a(args, name, {"format"});
    std::string format = to_str(a.get_or(0, Value()));
    std::time_t now = std::time(nullptr);
    std::tm local{};
    localtime_r(&now, &local);
    char buf[512];
    size_t n = format.empty() ? 0 : std::strftime(buf, sizeof(buf), format.c_str(), &local);
    if (n == 0 && !format.empty()) fail(ErrorCode::kInvalidArgument, "strftime_now: bad format");
    return derived_string(std::string(buf, n), false, {a.get(0)});
  }
  failf(ErrorCode::kUnsupported, "the global function '{}' is not supported", name);
}

Value call_loop_function(const Callable& fn, const CallArgs& args) {
  LoopState& st = fn.receiver.loop_state();
  if (!args.keyword.empty())
    failf(ErrorCode::kInvalidArgument, "{}() takes no keyword arguments", fn.name);
  if (fn.kind == Callable::Kind::kLoopCycle) {
    if (args.positional.empty()) fail(ErrorCode::kInvalidArgument, "no items for cycling given");
    return args.positional[st.index0 % args.positional.size()];
  }
  Value current = Value::list(args.positional, ListKind::kTuple);
  if (st.changed_seen && equals(st.changed_last, current)) return Value::boolean(false);
  st.changed_seen = true;
  st.changed_last = current;
  return Value::boolean(true);
}

}  // namespace recur::jinja
