// Values of the Jinja engine: the Python objects a chat template sees (str, int, float, list,
// dict, None, Undefined, namespace), with Python's str()/repr()/==/< and json.dumps semantics.
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#include "core/status.h"

namespace recur::jinja {

// Thrown inside the engine only (it keeps the evaluator free of Result plumbing);
// Template::parse and Template::render turn it into a recur::Error.
struct TemplateError {
  ErrorCode code = ErrorCode::kInvalidArgument;
  std::string message;
  bool has_position = false;        // message already names line and column
  bool raised_by_template = false;  // raise_exception(): the template author's own words
};

[[noreturn]] void fail(ErrorCode code, std::string message);

template <typename... Args>
[[noreturn]] void failf(ErrorCode code, fmt::format_string<Args...> f, Args&&... args) {
  fail(code, fmt::format(f, std::forward<Args>(args)...));
}

// Nesting a render may print or a request may hold; deeper input is refused, not a crash.
constexpr int kMaxNesting = 512;

class Value;
using List = std::vector<Value>;
// Byte ranges [first, second) of a string that came from the request rather than from the
// template (jinja_marked.h): sorted, disjoint and not touching.
using UserSpans = std::vector<std::pair<size_t, size_t>>;
struct Dict;
struct Namespace;
struct Callable;
struct LoopState;

// Which Python sequence a list value stands for; it decides printing, len() and indexing.
// Jinja's map/select/items filters return generators, dict.items() returns a view.
enum class ListKind : uint8_t { kList, kTuple, kIterator, kDictItems, kDictKeys, kDictValues };

class Value {
 public:
  enum class Type {
    kUndefined,
    kNone,
    kBool,
    kInt,
    kFloat,
    kString,
    kList,
    kDict,
    kNamespace,
    kCallable,
    kLoop
  };

  Value() = default;  // Undefined
  static Value undefined(std::string hint);
  static Value none();
  static Value boolean(bool b);
  static Value integer(int64_t i);
  static Value floating(double d);
  static Value string(std::string s, bool markup = false);
  // A string whose bytes at `spans` came from the request (empty: none did).
  static Value marked_string(std::string s, UserSpans spans, bool markup = false);
  // A string that came from the request as a whole.
  static Value request_string(std::string s);
  static Value list(List items, ListKind kind = ListKind::kList);
  static Value list(std::shared_ptr<const List> items, ListKind kind = ListKind::kList);
  static Value dict(Dict d);
  static Value dict(std::shared_ptr<const Dict> d);
  static Value namespace_(std::shared_ptr<Namespace> ns);
  static Value callable(std::shared_ptr<const Callable> fn);
  static Value loop(std::shared_ptr<LoopState> state);

  Type type() const { return type_; }
  bool is_undefined() const { return type_ == Type::kUndefined; }
  bool is_none() const { return type_ == Type::kNone; }
  bool is_string() const { return type_ == Type::kString; }
  bool is_list() const { return type_ == Type::kList; }
  bool is_dict() const { return type_ == Type::kDict; }
  bool is_int() const { return type_ == Type::kInt; }
  bool is_bool() const { return type_ == Type::kBool; }
  // int or bool: Python's bool is an int.
  bool is_integral() const { return type_ == Type::kInt || type_ == Type::kBool; }
  bool is_number() const { return is_integral() || type_ == Type::kFloat; }

  bool as_bool() const { return std::get<bool>(data_); }
  int64_t as_int() const;   // int or bool
  double as_float() const;  // any number
  const std::string& str() const { return std::get<std::string>(data_); }
  bool markup() const { return flag_; }  // a string marked safe (MarkupSafe's Markup)
  // Where a string holds request data; null when nowhere.
  const UserSpans* user_spans() const { return spans_.get(); }
  ListKind list_kind() const { return kind_; }
  bool is_tuple() const { return kind_ == ListKind::kTuple; }
  // A real list or tuple: indexable, sliceable, with len().
  bool is_indexable_list() const {
    return type_ == Type::kList && (kind_ == ListKind::kList || kind_ == ListKind::kTuple);
  }
  const List& items() const { return *std::get<std::shared_ptr<const List>>(data_); }
  const std::shared_ptr<const List>& list_ptr() const {
    return std::get<std::shared_ptr<const List>>(data_);
  }
  const Dict& dict() const { return *std::get<std::shared_ptr<const Dict>>(data_); }
  Namespace& ns() const { return *std::get<std::shared_ptr<Namespace>>(data_); }
  const Callable& fn() const { return *std::get<std::shared_ptr<const Callable>>(data_); }
  LoopState& loop_state() const { return *std::get<std::shared_ptr<LoopState>>(data_); }
  // What an Undefined stands for, for error messages ("'x' is undefined").
  const std::string& undefined_hint() const { return std::get<std::string>(data_); }

  // Identity for namespaces, callables and loops (Python `is`).
  const void* identity() const;

 private:
  Type type_ = Type::kUndefined;
  bool flag_ = false;  // Markup string
  ListKind kind_ = ListKind::kList;
  std::variant<std::monostate, bool, int64_t, double, std::string, std::shared_ptr<const List>,
               std::shared_ptr<const Dict>, std::shared_ptr<Namespace>,
               std::shared_ptr<const Callable>, std::shared_ptr<LoopState>>
      data_{std::string()};
  std::shared_ptr<const UserSpans> spans_;  // strings only; null: no request data
};

// A Python dict with string keys, in insertion order.
struct Dict {
  std::vector<std::pair<std::string, Value>> entries;
  bool keys_from_request = false;  // the keys are request data (an object of the request)

  const Value* find(std::string_view key) const;
  void set(std::string key, Value v);  // replaces in place, or appends
  size_t size() const { return entries.size(); }

 private:
  std::unordered_map<std::string, size_t> index_;  // built once the dict grows past a few keys
  void reindex();
};

// Jinja's namespace(): the one mutable object, so `{% set ns.x = ... %}` can escape a loop.
struct Namespace {
  Dict attrs;
};

// Something a template can call: a global function, a macro, or a bound method.
struct Callable {
  enum class Kind { kGlobal, kMacro, kMethod, kLoopCycle, kLoopChanged };
  Kind kind = Kind::kGlobal;
  std::string name;
  Value receiver;               // kMethod: the object; kLoop*: the loop
  const void* macro = nullptr;  // kMacro: the Stmt that defines it
  // kMacro defined inside a loop, macro or block: the variables it saw there.
  std::shared_ptr<const Dict> closure;
};

// The `loop` object of a for loop.
struct LoopState {
  std::shared_ptr<const List> items;
  size_t index0 = 0;
  bool changed_seen = false;
  Value changed_last;
};

bool truthy(const Value& v);
std::string type_name(const Value& v);
// Python str(): Undefined prints as "", None as "None", containers as their repr().
std::string to_str(const Value& v);
std::string repr(const Value& v);
bool equals(const Value& a, const Value& b);
// Python ordering (<): numbers, strings, lists, tuples; anything else is a TypeError.
int compare(const Value& a, const Value& b);
std::string python_float_repr(double d);
// MarkupSafe's escape().
std::string html_escape(std::string_view s);

struct JsonOptions {
  bool ensure_ascii = false;
  bool has_indent = false;
  std::string indent;
  std::string item_separator = ", ";
  std::string key_separator = ": ";
  bool sort_keys = false;
};
// ---- jinja_json.cpp ----
// Python's json.dumps with the given options.
std::string to_json(const Value& v, const JsonOptions& options);
// Request data as the template sees it; objects keep their key order.
Value value_from_json(const nlohmann::ordered_json& j);
// The same with every string and object key marked as request data (jinja_marked.h).
Value value_from_request(const nlohmann::ordered_json& j);

// UTF-8 helpers: template strings are indexed and measured in code points, as in Python.
std::u32string utf8_decode(std::string_view s);
void utf8_append(std::string& out, char32_t c);
size_t utf8_length(std::string_view s);
bool is_python_space(char32_t c);
// str.strip / lstrip / rstrip; chars == nullptr strips whitespace.
std::string python_strip(std::string_view s, const std::string* chars, bool left, bool right);
// The bytes [first, second) of `s` that python_strip keeps.
std::pair<size_t, size_t> python_strip_range(std::string_view s, const std::string* chars,
                                             bool left, bool right);

}  // namespace recur::jinja
