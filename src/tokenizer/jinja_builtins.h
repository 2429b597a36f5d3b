// What templates can do to values: Jinja's operators, attribute and item lookup, filters,
// tests, global functions, and the Python str/dict/list methods templates call.
// Everything throws TemplateError; the evaluator adds the line and column.
#pragma once

#include <initializer_list>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tokenizer/jinja_value.h"

namespace recur::jinja {

struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;
};

// Binds call arguments to a Python-style parameter list, rejecting extras by name.
class BoundArgs {
 public:
  BoundArgs(const CallArgs& args, std::string_view function,
            std::initializer_list<std::string_view> params);
  const Value* get(size_t i) const { return slots_[i]; }
  bool has(size_t i) const { return slots_[i] != nullptr; }
  Value get_or(size_t i, Value fallback) const { return slots_[i] ? *slots_[i] : fallback; }

 private:
  std::vector<const Value*> slots_;
};

// ---- jinja_ops.cpp ----
// Python iter(), materialized: list items, dict keys, string characters; Undefined is empty.
std::shared_ptr<const List> iterate(const Value& v);
Value get_attribute(const Value& obj, const std::string& name);  // Jinja's getattr()
Value get_item(const Value& obj, const Value& key);              // Jinja's getitem()
Value get_slice(const Value& obj, const Value* start, const Value* stop, const Value* step);
Value binary_op(std::string_view op, const Value& a, const Value& b);
Value unary_op(std::string_view op, const Value& v);
bool compare_op(std::string_view op, const Value& a, const Value& b);
bool contains(const Value& container, const Value& item);
[[noreturn]] void fail_undefined(const Value& v);
Value loop_attribute(const Value& loop, const std::string& name);

// ---- jinja_methods.cpp ----
Value call_method(const Value& receiver, const std::string& name, const CallArgs& args);
// Python's str.upper / lower / capitalize / title, code point by code point.
std::string python_upper(std::string_view s);
std::string python_lower(std::string_view s);
std::string python_capitalize(std::string_view s);
std::string python_title(std::string_view s);
std::vector<std::pair<size_t, size_t>> python_splitlines_ranges(std::string_view s);  // bytes

// ---- jinja_filters.cpp ----
bool is_known_filter(std::string_view name);
bool is_known_test(std::string_view name);
Value apply_filter(const std::string& name, const Value& input, const CallArgs& args);
bool apply_test(const std::string& name, const Value& input, const CallArgs& args);
// Functions every template sees (raise_exception, namespace, range, ...), by name.
const std::vector<std::string>& global_function_names();
Value call_global(const std::string& name, const CallArgs& args);
Value call_loop_function(const Callable& fn, const CallArgs& args);

}  // namespace recur::jinja
