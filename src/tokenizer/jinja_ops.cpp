// Operators, lookups and the Python methods of str, dict and list, as Jinja's sandbox
// (ImmutableSandboxedEnvironment, the one transformers uses) exposes them.
#include <algorithm>
#include <cmath>
#include <set>

#include "tokenizer/jinja_builtins.h"
#include "tokenizer/jinja_marked.h"

namespace recur::jinja {

namespace {

std::string object_type_repr(const Value& v) {
  if (v.is_none()) return "None";
  return type_name(v) + " object";
}

Value missing_attribute(const Value& obj, const std::string& name) {
  return Value::undefined(fmt::format("'{}' has no attribute '{}'", object_type_repr(obj), name));
}

Value method(const Value& receiver, const std::string& name) {
  auto fn = std::make_shared<Callable>();
  fn->kind = Callable::Kind::kMethod;
  fn->name = name;
  fn->receiver = receiver;
  return Value::callable(std::move(fn));
}

const std::set<std::string, std::less<>>& string_methods() {
  // Every method Python's str has; calling one the engine lacks is an error, not Undefined.
  static const std::set<std::string, std::less<>> kNames = {
      "capitalize",   "casefold",    "center",    "count",      "encode",       "endswith",
      "expandtabs",   "find",        "format",    "format_map", "index",        "isalnum",
      "isalpha",      "isascii",     "isdecimal", "isdigit",    "isidentifier", "islower",
      "isnumeric",    "isprintable", "isspace",   "istitle",    "isupper",      "join",
      "ljust",        "lower",       "lstrip",    "maketrans",  "partition",    "removeprefix",
      "removesuffix", "replace",     "rfind",     "rindex",     "rjust",        "rpartition",
      "rsplit",       "rstrip",      "split",     "splitlines", "startswith",   "strip",
      "swapcase",     "title",       "translate", "upper",      "zfill"};
  return kNames;
}

// Mutating methods exist on dict and list, but the immutable sandbox refuses to call them.
const std::set<std::string, std::less<>>& dict_methods() {
  static const std::set<std::string, std::less<>> kNames = {
      "items",   "keys",   "values",     "get",   "copy",    "pop",
      "popitem", "update", "setdefault", "clear", "fromkeys"};
  return kNames;
}

const std::set<std::string, std::less<>>& list_methods() {
  static const std::set<std::string, std::less<>> kNames = {"index",   "count",  "copy", "append",
                                                            "extend",  "insert", "pop",  "remove",
                                                            "reverse", "sort",   "clear"};
  return kNames;
}

// Python's index normalization for a sequence of length n; nullopt when out of range.
bool normalize_index(int64_t& i, size_t n) {
  if (i < 0) i += static_cast<int64_t>(n);
  return i >= 0 && static_cast<size_t>(i) < n;
}

[[noreturn]] void fail_overflow() {
  fail(ErrorCode::kUnsupported, "integer overflow (Python integers are unbounded)");
}

int64_t checked_add(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_add_overflow(a, b, &r)) fail_overflow();
  return r;
}
int64_t checked_sub(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_sub_overflow(a, b, &r)) fail_overflow();
  return r;
}
int64_t checked_mul(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_mul_overflow(a, b, &r)) fail_overflow();
  return r;
}

Value repeat(const Value& s, int64_t n) {
  MarkedText out;
  if (n <= 0) return out.take(s.markup());
  check_template_string_size(
      size_t(std::min<double>(static_cast<double>(s.str().size()) * static_cast<double>(n), 1e18)));
  for (int64_t i = 0; i < n; ++i) out.append(s);
  return out.take(s.markup());
}

[[noreturn]] void unsupported_operands(std::string_view op, const Value& a, const Value& b) {
  failf(ErrorCode::kInvalidArgument, "unsupported operand type(s) for {}: '{}' and '{}'", op,
        type_name(a), type_name(b));
}

}  // namespace

void fail_undefined(const Value& v) {
  const std::string& hint = v.undefined_hint();
  fail(ErrorCode::kInvalidArgument, hint.empty() ? "value is undefined" : hint);
}

std::shared_ptr<const List> iterate(const Value& v) {
  switch (v.type()) {
    case Value::Type::kUndefined:
      return std::make_shared<const List>();
    case Value::Type::kList:
      return v.list_ptr();
    case Value::Type::kDict: {
      List keys;
      for (const auto& [k, _] : v.dict().entries) keys.push_back(key_value(v.dict(), k));
      return std::make_shared<const List>(std::move(keys));
    }
    case Value::Type::kString: {
      List chars;
      const std::vector<size_t> at = code_point_offsets(v.str());
      for (size_t i = 0; i + 1 < at.size(); ++i) chars.push_back(substring(v, at[i], at[i + 1]));
      return std::make_shared<const List>(std::move(chars));
    }
    default:
      failf(ErrorCode::kInvalidArgument, "'{}' object is not iterable", type_name(v));
  }
}

Value loop_attribute(const Value& loop, const std::string& name) {
  const LoopState& st = loop.loop_state();
  const int64_t n = static_cast<int64_t>(st.items->size());
  const int64_t i = static_cast<int64_t>(st.index0);
  if (name == "index0") return Value::integer(i);
  if (name == "index") return Value::integer(i + 1);
  if (name == "revindex0") return Value::integer(n - i - 1);
  if (name == "revindex") return Value::integer(n - i);
  if (name == "first") return Value::boolean(i == 0);
  if (name == "last") return Value::boolean(i == n - 1);
  if (name == "length") return Value::integer(n);
  if (name == "depth") return Value::integer(1);
  if (name == "depth0") return Value::integer(0);
  if (name == "previtem") {
    return i > 0 ? (*st.items)[i - 1] : Value::undefined("there is no previous item");
  }
  if (name == "nextitem") {
    return i + 1 < n ? (*st.items)[i + 1] : Value::undefined("there is no next item");
  }
  if (name == "cycle" || name == "changed") {
    auto fn = std::make_shared<Callable>();
    fn->kind = name == "cycle" ? Callable::Kind::kLoopCycle : Callable::Kind::kLoopChanged;
    fn->name = "loop." + name;
    fn->receiver = loop;
    return Value::callable(std::move(fn));
  }
  return missing_attribute(loop, name);
}

Value get_attribute(const Value& obj, const std::string& name) {
  switch (obj.type()) {
    case Value::Type::kUndefined:
      fail_undefined(obj);
    case Value::Type::kDict: {
      if (dict_methods().count(name)) return method(obj, name);
      const Value* v = obj.dict().find(name);
      return v ? *v : missing_attribute(obj, name);
    }
    case Value::Type::kString:
      return string_methods().count(name) ? method(obj, name) : missing_attribute(obj, name);
    case Value::Type::kList:
      if (obj.list_kind() == ListKind::kList && list_methods().count(name)) {
        return method(obj, name);
      }
      if (obj.is_tuple() && (name == "index" || name == "count")) return method(obj, name);
      return missing_attribute(obj, name);
    case Value::Type::kNamespace: {
      const Value* v = obj.ns().attrs.find(name);
      return v ? *v : missing_attribute(obj, name);
    }
    case Value::Type::kLoop:
      return loop_attribute(obj, name);
    default:
      return missing_attribute(obj, name);
  }
}

Value get_item(const Value& obj, const Value& key) {
  switch (obj.type()) {
    case Value::Type::kUndefined:
      fail_undefined(obj);
    case Value::Type::kDict:
      if (key.is_string()) {
        if (const Value* v = obj.dict().find(key.str())) return *v;
      }
      break;
    case Value::Type::kList:
      if (key.is_integral() && obj.is_indexable_list()) {
        int64_t i = key.as_int();
        if (normalize_index(i, obj.items().size())) return obj.items()[i];
        return Value::undefined(
            fmt::format("{} object has no element {}", type_name(obj), key.as_int()));
      }
      break;
    case Value::Type::kString:
      if (key.is_integral()) {
        const std::vector<size_t> at = code_point_offsets(obj.str());
        int64_t i = key.as_int();
        if (normalize_index(i, at.size() - 1)) return substring(obj, at[i], at[i + 1]);
        return Value::undefined(fmt::format("str object has no element {}", key.as_int()));
      }
      break;
    default:
      break;
  }
  if (key.is_string()) return get_attribute(obj, key.str());
  return Value::undefined(fmt::format("'{}' has no item {}", object_type_repr(obj), repr(key)));
}

Value get_slice(const Value& obj, const Value* start, const Value* stop, const Value* step) {
  if (obj.is_undefined()) fail_undefined(obj);
  auto bound = [](const Value* v) -> const Value* {
    if (!v || v->is_none()) return nullptr;
    if (!v->is_integral()) {
      fail(ErrorCode::kInvalidArgument,
           "slice indices must be integers or None or have an __index__ method");
    }
    return v;
  };
  // Jinja slices with Python's own subscript (no getitem fallback), so misuse is a TypeError.
  if (!obj.is_string() && !obj.is_indexable_list()) {
    failf(ErrorCode::kInvalidArgument, "'{}' object is not subscriptable", type_name(obj));
  }
  start = bound(start);
  stop = bound(stop);
  step = bound(step);
  int64_t st = step ? step->as_int() : 1;
  if (st == 0) fail(ErrorCode::kInvalidArgument, "slice step cannot be zero");

  std::vector<size_t> at;  // code point offsets
  size_t n;
  if (obj.is_string()) {
    at = code_point_offsets(obj.str());
    n = at.size() - 1;
  } else {
    n = obj.items().size();
  }
  // PySlice_AdjustIndices.
  const int64_t len = static_cast<int64_t>(n);
  auto adjust = [&](const Value* v, int64_t dflt) {
    if (!v) return dflt;
    int64_t i = v->as_int();
    if (i < 0) {
      i += len;
      if (i < 0) i = st < 0 ? -1 : 0;
    } else if (i >= len) {
      i = st < 0 ? len - 1 : len;
    }
    return i;
  };
  int64_t b = adjust(start, st < 0 ? len - 1 : 0);
  int64_t e = adjust(stop, st < 0 ? -1 : len);
  std::vector<size_t> picks;
  for (int64_t i = b; st > 0 ? i < e : i > e; i += st) picks.push_back(static_cast<size_t>(i));

  if (obj.is_string()) {
    MarkedText out;
    for (size_t i : picks) out.append_slice(obj, at[i], at[i + 1]);
    return out.take(obj.markup());
  }
  List out;
  out.reserve(picks.size());
  for (size_t i : picks) out.push_back(obj.items()[i]);
  return Value::list(std::move(out), obj.list_kind());
}

Value unary_op(std::string_view op, const Value& v) {
  if (v.is_undefined()) fail_undefined(v);
  if (!v.is_number()) {
    failf(ErrorCode::kInvalidArgument, "bad operand type for unary {}: '{}'", op, type_name(v));
  }
  if (op == "+") return v.is_bool() ? Value::integer(v.as_int()) : v;
  if (v.type() == Value::Type::kFloat) return Value::floating(-v.as_float());
  return Value::integer(checked_sub(0, v.as_int()));
}

Value binary_op(std::string_view op, const Value& a, const Value& b) {
  if (a.is_undefined()) fail_undefined(a);
  if (b.is_undefined()) fail_undefined(b);
  const bool ints = a.is_integral() && b.is_integral();
  const bool nums = a.is_number() && b.is_number();
  if (op == "+") {
    if (ints) return Value::integer(checked_add(a.as_int(), b.as_int()));
    if (nums) return Value::floating(a.as_float() + b.as_float());
    if (a.is_string() && b.is_string()) {
      // MarkupSafe: adding plain text to a Markup string escapes the plain text.
      MarkedText sum;
      for (const Value* part : {&a, &b}) {
        if (a.markup() != b.markup() && !part->markup()) {
          sum.append_html_escaped(*part);
        } else {
          sum.append(*part);
        }
      }
      return sum.take(a.markup() || b.markup());
    }
    if (a.is_indexable_list() && b.is_indexable_list() && a.is_tuple() == b.is_tuple()) {
      List out = a.items();
      out.insert(out.end(), b.items().begin(), b.items().end());
      return Value::list(std::move(out), a.list_kind());
    }
    unsupported_operands(op, a, b);
  }
  if (op == "-") {
    if (ints) return Value::integer(checked_sub(a.as_int(), b.as_int()));
    if (nums) return Value::floating(a.as_float() - b.as_float());
    unsupported_operands(op, a, b);
  }
  if (op == "*") {
    if (ints) return Value::integer(checked_mul(a.as_int(), b.as_int()));
    if (nums) return Value::floating(a.as_float() * b.as_float());
    const Value& seq = a.is_integral() ? b : a;
    const Value& count = a.is_integral() ? a : b;
    if (count.is_integral() && seq.is_string()) {
      return repeat(seq, count.as_int());
    }
    if (count.is_integral() && seq.is_indexable_list()) {
      // Lists count against the same bound, a value's worth of bytes per item.
      check_template_string_size(size_t(std::min<double>(
          double(seq.items().size()) * double(std::max<int64_t>(0, count.as_int())) * sizeof(Value),
          1e18)));
      List out;
      for (int64_t i = 0; i < count.as_int(); ++i) {
        out.insert(out.end(), seq.items().begin(), seq.items().end());
      }
      return Value::list(std::move(out), seq.list_kind());
    }
    unsupported_operands(op, a, b);
  }
  if (op == "/" || op == "//" || op == "%") {
    if (a.is_string() && op == "%") {
      fail(ErrorCode::kUnsupported, "printf-style string formatting ('%') is not supported");
    }
    if (!nums) unsupported_operands(op, a, b);
    if (b.as_float() == 0.0) {
      fail(ErrorCode::kInvalidArgument,
           op == "/" ? "division by zero"
                     : (op == "//" ? "integer division or modulo by zero" : "modulo by zero"));
    }
    if (op == "/") return Value::floating(a.as_float() / b.as_float());
    if (ints) {
      int64_t x = a.as_int(), y = b.as_int();
      if (x == INT64_MIN && y == -1) fail_overflow();
      int64_t q = x / y, m = x % y;
      if (m != 0 && ((m < 0) != (y < 0))) {
        --q;
        m += y;
      }
      return Value::integer(op == "//" ? q : m);
    }
    double x = a.as_float(), y = b.as_float();
    if (op == "//") return Value::floating(std::floor(x / y));
    double m = std::fmod(x, y);
    if (m != 0 && ((m < 0) != (y < 0))) m += y;
    if (m == 0) m = std::copysign(0.0, y);  // Python's zero remainder takes the divisor's sign
    return Value::floating(m);
  }
  if (op == "**") {
    if (!nums) unsupported_operands(op, a, b);
    if (ints && b.as_int() >= 0) {
      int64_t result = 1, base = a.as_int();
      if (base == -1) return Value::integer(b.as_int() % 2 ? -1 : 1);
      for (int64_t e = b.as_int(); e > 0; --e) {
        result = checked_mul(result, base);
        if (result == 0 || result == 1) break;
      }
      return Value::integer(result);
    }
    const double base = a.as_float(), exponent = b.as_float();
    if (base == 0.0 && exponent < 0) {
      fail(ErrorCode::kInvalidArgument, "0.0 cannot be raised to a negative power");
    }
    if (base < 0 && exponent != std::floor(exponent)) {
      fail(ErrorCode::kUnsupported, "a negative number to a fractional power (a complex number)");
    }
    return Value::floating(std::pow(base, exponent));
  }
  failf(ErrorCode::kInternal, "unknown operator '{}'", op);
}

bool contains(const Value& container, const Value& item) {
  switch (container.type()) {
    case Value::Type::kUndefined:
      return false;
    case Value::Type::kString:
      if (item.is_undefined()) fail_undefined(item);
      if (!item.is_string()) {
        failf(ErrorCode::kInvalidArgument, "'in <string>' requires string as left operand, not {}",
              type_name(item));
      }
      return container.str().find(item.str()) != std::string::npos;
    case Value::Type::kList:
      return std::any_of(container.items().begin(), container.items().end(),
                         [&](const Value& v) { return equals(v, item); });
    case Value::Type::kDict:
      if ((item.is_list() && !item.is_tuple()) || item.is_dict() ||
          item.type() == Value::Type::kNamespace) {
        failf(ErrorCode::kInvalidArgument, "unhashable type: '{}'", type_name(item));
      }
      return item.is_string() && container.dict().find(item.str());
    default:
      failf(ErrorCode::kInvalidArgument, "argument of type '{}' is not iterable",
            type_name(container));
  }
}

bool compare_op(std::string_view op, const Value& a, const Value& b) {
  if (op == "==") return equals(a, b);
  if (op == "!=") return !equals(a, b);
  if (op == "in") return contains(b, a);
  if (op == "not in") return !contains(b, a);
  int c = compare(a, b);
  if (op == "<") return c < 0;
  if (op == "<=") return c <= 0;
  if (op == ">") return c > 0;
  return c >= 0;
}

}  // namespace recur::jinja
