// Error values that cross layer boundaries. Exceptions never leave a layer; a Result carries
// either the value or an Error whose message names what is wrong (file, tensor, field).
#pragma once

#include <fmt/format.h>

#include <optional>
#include <string>
#include <utility>
#include <variant>

namespace recur {

enum class ErrorCode {
  kInvalidArgument,  // bad user input: a request, a flag, a config field
  kNotFound,         // a file, tensor or key that should exist does not
  kCorrupt,          // a file whose contents contradict its own format
  kUnsupported,      // valid input this build does not handle (dtype, model type)
  kOutOfResources,   // a pool or budget cannot hold what was asked
  kIo,               // the operating system refused a read, map or open
  kInternal,         // a broken invariant that was caught instead of crashing
};

const char* error_code_name(ErrorCode code);

struct Error {
  ErrorCode code = ErrorCode::kInternal;
  std::string message;

  std::string to_string() const { return fmt::format("{}: {}", error_code_name(code), message); }
};

template <typename... Args>
Error make_error(ErrorCode code, fmt::format_string<Args...> f, Args&&... args) {
  return Error{code, fmt::format(f, std::forward<Args>(args)...)};
}

// Status: success or an Error.
class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(Error e) : error_(std::move(e)) {}  // NOLINT(implicit)
  bool ok() const { return !error_.has_value(); }
  explicit operator bool() const { return ok(); }
  const Error& error() const { return *error_; }

 private:
  std::optional<Error> error_;
};

// Result<T>: a value or an Error.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT(implicit)
  Result(Error e) : v_(std::move(e)) {}      // NOLINT(implicit)
  bool ok() const { return v_.index() == 0; }
  explicit operator bool() const { return ok(); }
  T& value() & { return std::get<0>(v_); }
  const T& value() const& { return std::get<0>(v_); }
  T&& value() && { return std::get<0>(std::move(v_)); }
  T& operator*() & { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  const Error& error() const { return std::get<1>(v_); }
  Status status() const { return ok() ? Status() : Status(error()); }

 private:
  std::variant<T, Error> v_;
};

}  // namespace recur

// Propagate an error from an expression yielding Status or Result.
#define RECUR_CONCAT_INNER(a, b) a##b
#define RECUR_CONCAT(a, b) RECUR_CONCAT_INNER(a, b)
#define RECUR_RETURN_IF_ERROR(expr)                \
  do {                                             \
    auto _recur_st = (expr);                       \
    if (!_recur_st.ok()) return _recur_st.error(); \
  } while (0)
#define RECUR_ASSIGN_OR_RETURN(lhs, expr)               \
  auto RECUR_CONCAT(_recur_res_, __LINE__) = (expr);    \
  if (!RECUR_CONCAT(_recur_res_, __LINE__).ok())        \
    return RECUR_CONCAT(_recur_res_, __LINE__).error(); \
  lhs = std::move(RECUR_CONCAT(_recur_res_, __LINE__)).value()

// Internal invariants only; never for user input.
#define RECUR_CHECK(cond)                                          \
  do {                                                             \
    if (!(cond)) ::recur::check_failed(#cond, __FILE__, __LINE__); \
  } while (0)

namespace recur {
[[noreturn]] void check_failed(const char* cond, const char* file, int line);
}
