// Errors the HTTP API reports to clients: an HTTP status plus the OpenAI error object
// {"error": {"message", "type", "param", "code"}}. ApiResult mirrors recur::Result.
#pragma once

#include <fmt/format.h>

#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <variant>

#include "core/status.h"

namespace recur::server {

struct ApiError {
  int status = 400;
  std::string message;
  std::string type = "invalid_request_error";  // OpenAI's: invalid_request_error, server_error
  std::string param;                           // empty: null
  std::string code;                            // empty: null

  // {"error": {...}}; with anthropic_shape also {"type": "error"} at the top level, and the
  // Messages API's type for the status (not_found_error, overloaded_error, api_error, ...).
  nlohmann::ordered_json to_json(bool anthropic_shape = false) const;
};

ApiError bad_request(std::string param, std::string message);
// The HTTP status and type for an engine or library error (kInvalidArgument -> 400, ...).
ApiError from_error(const Error& e, std::string param = "");

template <typename T>
class [[nodiscard]] ApiResult {
 public:
  ApiResult(T value) : v_(std::move(value)) {}  // NOLINT(implicit)
  ApiResult(ApiError e) : v_(std::move(e)) {}   // NOLINT(implicit)
  bool ok() const { return v_.index() == 0; }
  T& value() & { return std::get<0>(v_); }
  const T& value() const& { return std::get<0>(v_); }
  T&& value() && { return std::get<0>(std::move(v_)); }
  T& operator*() & { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  const ApiError& error() const { return std::get<1>(v_); }

 private:
  std::variant<T, ApiError> v_;
};

}  // namespace recur::server

#define RECUR_API_ASSIGN(lhs, expr)                                                              \
  auto RECUR_CONCAT(_api_res_, __LINE__) = (expr);                                               \
  if (!RECUR_CONCAT(_api_res_, __LINE__).ok()) return RECUR_CONCAT(_api_res_, __LINE__).error(); \
  lhs = std::move(RECUR_CONCAT(_api_res_, __LINE__)).value()

#define RECUR_API_CHECK(expr)                    \
  do {                                           \
    auto _api_res = (expr);                      \
    if (!_api_res.ok()) return _api_res.error(); \
  } while (0)
