// json.dumps as transformers' tojson filter calls it, and request JSON turned into values.
#include <algorithm>
#include <cmath>
#include <limits>

#include "tokenizer/jinja_marked.h"
#include "tokenizer/jinja_value.h"

namespace recur::jinja {

namespace {

void json_string(const std::string& s, bool ensure_ascii, std::string& out) {
  out.push_back('"');
  auto escape_u = [&](uint32_t c) { out += fmt::format("\\u{:04x}", c); };
  auto plain = [&](unsigned char c) {
    switch (c) {
      case '"':
        out += "\\\"";
        return true;
      case '\\':
        out += "\\\\";
        return true;
      case '\n':
        out += "\\n";
        return true;
      case '\r':
        out += "\\r";
        return true;
      case '\t':
        out += "\\t";
        return true;
      case '\b':
        out += "\\b";
        return true;
      case '\f':
        out += "\\f";
        return true;
      default:
        break;
    }
    if (c < 0x20) {
      escape_u(c);
      return true;
    }
    return false;
  };
  if (!ensure_ascii) {
    for (char ch : s) {
      if (!plain(static_cast<unsigned char>(ch))) out.push_back(ch);
    }
  } else {
    for (char32_t c : utf8_decode(s)) {
      if (c < 0x80 && plain(static_cast<unsigned char>(c))) continue;
      if (c >= 0x20 && c < 0x7F) {
        out.push_back(static_cast<char>(c));
      } else if (c < 0x10000) {
        escape_u(c);
      } else {
        char32_t v = c - 0x10000;
        escape_u(0xD800 | (v >> 10));
        escape_u(0xDC00 | (v & 0x3FF));
      }
    }
  }
  out.push_back('"');
}

void json_dump(const Value& v, const JsonOptions& o, int level, std::string& out) {
  if (level > kMaxNesting) fail(ErrorCode::kUnsupported, "tojson: value nested too deeply");
  auto newline = [&](int lvl) {
    check_template_string_size(out.size() + 1 + size_t(lvl) * o.indent.size());
    out.push_back('\n');
    for (int i = 0; i < lvl; ++i) out += o.indent;
  };
  switch (v.type()) {
    case Value::Type::kNone:
      out += "null";
      return;
    case Value::Type::kBool:
      out += v.as_bool() ? "true" : "false";
      return;
    case Value::Type::kInt:
      out += std::to_string(v.as_int());
      return;
    case Value::Type::kFloat: {
      double d = v.as_float();
      if (std::isnan(d)) {
        out += "NaN";
      } else if (std::isinf(d)) {
        out += d < 0 ? "-Infinity" : "Infinity";
      } else {
        out += python_float_repr(d);
      }
      return;
    }
    case Value::Type::kString:
      json_string(v.str(), o.ensure_ascii, out);
      return;
    case Value::Type::kList: {
      if (!v.is_indexable_list()) {
        failf(ErrorCode::kInvalidArgument, "Object of type {} is not JSON serializable",
              type_name(v));
      }
      const List& items = v.items();
      if (items.empty()) {
        out += "[]";
        return;
      }
      out.push_back('[');
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) out += o.item_separator;
        if (o.has_indent) newline(level + 1);
        json_dump(items[i], o, level + 1, out);
      }
      if (o.has_indent) newline(level);
      out.push_back(']');
      return;
    }
    case Value::Type::kDict: {
      const Dict& d = v.dict();
      if (d.size() == 0) {
        out += "{}";
        return;
      }
      std::vector<const std::pair<std::string, Value>*> entries;
      for (const auto& e : d.entries) entries.push_back(&e);
      if (o.sort_keys) {
        std::stable_sort(entries.begin(), entries.end(),
                         [](auto* a, auto* b) { return a->first < b->first; });
      }
      out.push_back('{');
      for (size_t i = 0; i < entries.size(); ++i) {
        if (i) out += o.item_separator;
        if (o.has_indent) newline(level + 1);
        json_string(entries[i]->first, o.ensure_ascii, out);
        out += o.key_separator;
        json_dump(entries[i]->second, o, level + 1, out);
      }
      if (o.has_indent) newline(level);
      out.push_back('}');
      return;
    }
    default:
      failf(ErrorCode::kInvalidArgument, "Object of type {} is not JSON serializable",
            type_name(v));
  }
}

}  // namespace

std::string to_json(const Value& v, const JsonOptions& options) {
  std::string out;
  json_dump(v, options, 0, out);
  return out;
}

namespace {

Value from_json_at(const nlohmann::ordered_json& j, int depth, bool from_request) {
  if (depth > kMaxNesting) {
    failf(ErrorCode::kInvalidArgument, "JSON nested more than {} levels deep", kMaxNesting);
  }
  using T = nlohmann::ordered_json::value_t;
  switch (j.type()) {
    case T::null:
      return Value::none();
    case T::boolean:
      return Value::boolean(j.get<bool>());
    case T::number_integer:
      return Value::integer(j.get<int64_t>());
    case T::number_unsigned: {
      uint64_t u = j.get<uint64_t>();
      if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        failf(ErrorCode::kUnsupported, "integer {} is too large", u);
      }
      return Value::integer(static_cast<int64_t>(u));
    }
    case T::number_float:
      return Value::floating(j.get<double>());
    case T::string:
      return from_request ? Value::request_string(j.get<std::string>())
                          : Value::string(j.get<std::string>());
    case T::array: {
      List items;
      items.reserve(j.size());
      for (const auto& e : j) items.push_back(from_json_at(e, depth + 1, from_request));
      return Value::list(std::move(items));
    }
    case T::object: {
      Dict d;
      d.keys_from_request = from_request;
      for (const auto& [k, e] : j.items()) d.set(k, from_json_at(e, depth + 1, from_request));
      return Value::dict(std::move(d));
    }
    default:
      fail(ErrorCode::kUnsupported, "binary JSON values are not supported");
  }
}

}  // namespace

Value value_from_json(const nlohmann::ordered_json& j) {
  return from_json_at(j, 0, false);
}

Value value_from_request(const nlohmann::ordered_json& j) {
  return from_json_at(j, 0, true);
}

}  // namespace recur::jinja
