#include "server/json_fields.h"

#include <algorithm>
#include <cmath>
#include <random>

namespace recur::server {

namespace {

// The Messages API names its error types by HTTP status, where OpenAI's has two for most.
std::string anthropic_type(int status) {
  switch (status) {
    case 401:
      return "authentication_error";
    case 403:
      return "permission_error";
    case 404:
      return "not_found_error";
    case 413:
      return "request_too_large";
    case 429:
      return "rate_limit_error";
    case 503:
    case 529:
      return "overloaded_error";
    case 501:  // a transfer coding, or
    case 505:  // an HTTP version, the client chose
      return "invalid_request_error";
    default:
      return status >= 500 ? "api_error" : "invalid_request_error";
  }
}

}  // namespace

nlohmann::ordered_json ApiError::to_json(bool anthropic_shape) const {
  ojson err = ojson::object();
  err["message"] = message;
  err["type"] = anthropic_shape ? anthropic_type(status) : type;
  err["param"] = param.empty() ? ojson(nullptr) : ojson(param);
  err["code"] = code.empty() ? ojson(nullptr) : ojson(code);
  ojson out = ojson::object();
  if (anthropic_shape) out["type"] = "error";
  out["error"] = std::move(err);
  return out;
}

ApiError bad_request(std::string param, std::string message) {
  ApiError e;
  e.status = 400;
  e.param = std::move(param);
  e.message = std::move(message);
  return e;
}

ApiError from_error(const Error& e, std::string param) {
  ApiError out;
  out.param = std::move(param);
  out.message = e.message;
  switch (e.code) {
    case ErrorCode::kInvalidArgument:
      out.status = 400;
      break;
    case ErrorCode::kUnsupported:
      out.status = 400;
      out.code = "unsupported";
      break;
    case ErrorCode::kNotFound:
      out.status = 404;
      break;
    case ErrorCode::kOutOfResources:
      out.status = 503;
      out.type = "server_error";
      break;
    default:
      out.status = 500;
      out.type = "server_error";
      break;
  }
  return out;
}

namespace {

std::string type_name(const ojson& v) {
  if (v.is_number_integer()) return "integer";
  if (v.is_number_float()) return "number";
  return v.type_name();
}

ApiError wrong_type(std::string_view where, std::string_view key, const char* want,
                    const ojson& v) {
  return bad_request(fmt::format("{}{}", where, key),
                     fmt::format("'{}{}' must be {}, got {}", where, key, want, type_name(v)));
}

// Builds a document from the parser's events, appending each member to its object: nlohmann's
// own builder looks every key up in the ordered object first, quadratic in an object's size (a
// body of 80,000 keys took seconds). Keys twice in one object are found once it closes.
class LinearBuilder {
 public:
  using number_integer_t = ojson::number_integer_t;
  using number_unsigned_t = ojson::number_unsigned_t;
  using number_float_t = ojson::number_float_t;
  using string_t = ojson::string_t;
  using binary_t = ojson::binary_t;

  explicit LinearBuilder(ojson* root) : root_(root) {}
  const std::string& error() const { return error_; }

  // Each event's value goes into the open container; nlohmann stops when one returns false.
  bool null() { return put(nullptr); }
  bool boolean(bool v) { return put(v); }
  bool number_integer(number_integer_t v) { return put(v); }
  bool number_unsigned(number_unsigned_t v) { return put(v); }
  bool number_float(number_float_t v, const string_t&) { return put(v); }
  bool string(string_t& v) { return put(std::move(v)); }
  bool binary(binary_t& v) { return put(ojson::binary(std::move(v))); }
  // A container stays where it is while open: its parent grows only after it closes.
  bool start_object(std::size_t) { return put(ojson::object(), true); }
  bool start_array(std::size_t) { return put(ojson::array(), true); }
  bool key(string_t& k) {
    key_ = std::move(k);
    return true;
  }
  bool end_array() {
    open_.pop_back();
    return true;
  }
  bool end_object() {
    keys_.clear();
    for (const auto& member : *open_.back()->get_ptr<ojson::object_t*>()) {
      keys_.push_back(member.first);
    }
    open_.pop_back();
    std::sort(keys_.begin(), keys_.end());
    const auto twice = std::adjacent_find(keys_.begin(), keys_.end());
    if (twice == keys_.end()) return true;
    error_ = fmt::format("has the key \"{}\" twice in one object", limited(*twice));
    return false;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) {
    error_ = fmt::format("is not valid JSON: {}", e.what());  // nlohmann's say where it stopped
    return false;
  }

 private:
  static std::string_view limited(std::string_view key) { return key.substr(0, 100); }

  // Appends v to the open container (or makes it the root); a container v is then open.
  bool put(ojson v, bool opens = false) {
    ojson* at = root_;
    if (open_.empty()) {
      *root_ = std::move(v);
    } else if (auto* array = open_.back()->get_ptr<ojson::array_t*>()) {
      array->push_back(std::move(v));
      at = &array->back();
    } else {
      auto* object = open_.back()->get_ptr<ojson::object_t*>();
      object->emplace_back(std::move(key_), std::move(v));  // the vector's append, not a lookup
      at = &object->back().second;
    }
    if (opens) open_.push_back(at);
    return true;
  }

  ojson* root_;
  std::vector<ojson*> open_;  // the containers not yet closed, innermost last
  string_t key_;              // the open object's member whose value comes next
  std::vector<std::string_view> keys_;
  std::string error_;
};

}  // namespace

std::optional<ojson> parse_json_text(std::string_view text, std::string* error) {
  // The parser reads a NUL as the end of its input: what follows would go unread.
  if (const size_t nul = text.find('\0'); nul != std::string_view::npos) {
    *error = fmt::format("is not valid JSON: a NUL byte at offset {}", nul);
    return std::nullopt;
  }
  if (!depth_within(text, kMaxJsonDepth)) {
    *error = fmt::format("nests deeper than {} levels", kMaxJsonDepth);
    return std::nullopt;
  }
  ojson out;
  LinearBuilder builder(&out);
  if (!ojson::sax_parse(text.begin(), text.end(), &builder)) {
    *error = builder.error();
    return std::nullopt;
  }
  return out;
}

bool depth_within(std::string_view s, int limit) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > limit) return false;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return true;
}

ApiResult<ojson> parse_body(std::string_view body) {
  if (body.empty()) return bad_request("", "the request body is empty; send a JSON object");
  std::string error;
  std::optional<ojson> j = parse_json_text(body, &error);
  if (!j) return bad_request("", fmt::format("the request body {}", error));
  if (!j->is_object()) {
    return bad_request(
        "", fmt::format("the request body must be a JSON object, got {}", type_name(*j)));
  }
  return std::move(*j);
}

const ojson* field(const ojson& obj, std::string_view key) {
  if (!obj.is_object()) return nullptr;
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

std::optional<int64_t> as_int(const ojson& v, int64_t lo, int64_t hi) {
  int64_t x;
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > uint64_t(INT64_MAX)) return std::nullopt;
    x = int64_t(u);
  } else if (v.is_number_integer()) {
    x = v.get<int64_t>();
  } else if (v.is_number_float()) {
    const double d = v.get<double>();
    if (!std::isfinite(d) || d != std::floor(d) || d < -9.2e18 || d > 9.2e18) return std::nullopt;
    x = int64_t(d);
  } else {
    return std::nullopt;
  }
  if (x < lo || x > hi) return std::nullopt;
  return x;
}

ApiResult<std::optional<bool>> get_bool(const ojson& obj, std::string_view key,
                                        std::string_view where) {
  const ojson* v = field(obj, key);
  if (!v) return std::optional<bool>();
  if (!v->is_boolean()) return wrong_type(where, key, "a boolean", *v);
  return std::optional<bool>(v->get<bool>());
}

ApiResult<std::optional<int64_t>> get_int(const ojson& obj, std::string_view key, int64_t lo,
                                          int64_t hi, std::string_view where) {
  const ojson* v = field(obj, key);
  if (!v) return std::optional<int64_t>();
  if (!v->is_number()) return wrong_type(where, key, "an integer", *v);
  auto x = as_int(*v, INT64_MIN, INT64_MAX);
  // An integer too large for 64 bits (1e20, 18446744073709551616) is out of range, not a
  // fraction.
  const bool whole = v->is_number_unsigned() ||
                     (v->is_number_float() && std::floor(v->get<double>()) == v->get<double>());
  if (!x && !whole) {
    return bad_request(fmt::format("{}{}", where, key),
                       fmt::format("'{}{}' must be an integer, got {}", where, key, v->dump()));
  }
  if (!x || *x < lo || *x > hi) {
    return bad_request(fmt::format("{}{}", where, key),
                       fmt::format("'{}{}' is out of range: it must be in [{}, {}], got {}", where,
                                   key, lo, hi, v->dump()));
  }
  return std::optional<int64_t>(*x);
}

ApiResult<std::optional<double>> get_number(const ojson& obj, std::string_view key, double lo,
                                            double hi, std::string_view where) {
  const ojson* v = field(obj, key);
  if (!v) return std::optional<double>();
  if (!v->is_number()) return wrong_type(where, key, "a number", *v);
  const double x = v->get<double>();
  if (!std::isfinite(x) || x < lo || x > hi) {
    return bad_request(fmt::format("{}{}", where, key),
                       fmt::format("'{}{}' is out of range: it must be in [{}, {}], got {}", where,
                                   key, lo, hi, v->dump()));
  }
  return std::optional<double>(x);
}

ApiResult<std::optional<std::string>> get_string(const ojson& obj, std::string_view key,
                                                 std::string_view where) {
  const ojson* v = field(obj, key);
  if (!v) return std::optional<std::string>();
  if (!v->is_string()) return wrong_type(where, key, "a string", *v);
  return std::optional<std::string>(v->get<std::string>());
}

ApiResult<std::string> get_tool_name(const ojson& obj, std::string_view key,
                                     std::string_view where) {
  const ojson* v = field(obj, key);
  std::string why;
  if (!v) {
    why = "it is missing";
  } else if (!v->is_string()) {
    why = "got " + type_name(*v);
  } else {
    const std::string& name = v->get_ref<const std::string&>();
    const size_t bad =
        name.find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-");
    if (!name.empty() && name.size() <= 128 && bad == std::string::npos) return name;
    why = name.empty()        ? "it is empty"
          : name.size() > 128 ? fmt::format("it has {} bytes", name.size())
                              : fmt::format("byte {} is not one of them", bad);
  }
  return bad_request(fmt::format("{}{}", where, key),
                     fmt::format("'{}{}' must be 1 to 128 characters of A-Z, a-z, 0-9, '_', "
                                 "'.', '-' ({})",
                                 where, key, why));
}

std::string random_id(std::string_view prefix, int chars) {
  static constexpr char kAlphabet[] =
      "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
  thread_local std::mt19937_64 rng{std::random_device{}()};
  std::string s(prefix);
  for (int i = 0; i < chars; ++i) s += kAlphabet[rng() % (sizeof(kAlphabet) - 1)];
  return s;
}

std::string dump(const ojson& j) {
  return j.dump(-1, ' ', false, ojson::error_handler_t::replace);
}

}  // namespace recur::server
