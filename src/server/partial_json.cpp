// JSON cut short by the end of generation: where a forced tool call's arguments end as written
// when max_tokens ends them, and the object they began, closed (Anthropic's tool_use input).
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "server/output_parser.h"

namespace recur::server {

namespace {

bool is_space(char c) {
  return c == ' ' || c == '\n' || c == '\r' || c == '\t';
}

// Where the string whose opening quote is at `open` ends (its closing quote), or npos when it is
// cut; *whole_to is then where its text is still whole (before an escape cut mid-way).
size_t string_end(std::string_view s, size_t open, size_t* whole_to) {
  size_t i = open + 1;
  *whole_to = i;
  while (i < s.size()) {
    if (s[i] == '"') return i;
    if (s[i] != '\\') {
      *whole_to = ++i;
      continue;
    }
    const size_t len = i + 1 < s.size() && s[i + 1] == 'u' ? 6 : 2;
    if (i + len > s.size()) break;
    i += len;
    *whole_to = i;
  }
  return std::string_view::npos;
}

}  // namespace

std::string written_json(std::string_view s) {
  const size_t start = s.find_first_not_of(" \t\r\n");
  if (start == std::string_view::npos) return {};
  // Only a string or container has an end to find; brackets are counted, not matched.
  if (s[start] != '{' && s[start] != '[' && s[start] != '"') return std::string(s.substr(start));
  int depth = 0;
  for (size_t i = start; i < s.size(); ++i) {
    const char c = s[i];
    if (c == '"') {
      size_t whole_to = 0;
      i = string_end(s, i, &whole_to);
      if (i == std::string_view::npos) break;
    } else if (c == '{' || c == '[') {
      ++depth;
    } else if (c == '}' || c == ']') {
      --depth;
    } else {
      continue;
    }
    if (depth <= 0) return std::string(s.substr(start, i + 1 - start));
  }
  return std::string(s.substr(start));
}

std::optional<std::string> close_json_object(std::string_view s) {
  enum class Want { kKey, kColon, kValue, kComma };
  struct Open {
    char close;
    Want want;
  };
  std::vector<Open> stack;
  const size_t start = s.find_first_not_of(" \t\r\n");
  if (start == std::string_view::npos || s[start] != '{') return std::nullopt;
  // The last point where the text, with the open containers closed, is whole JSON.
  size_t safe = std::string_view::npos;
  std::string safe_close, cut_string;
  auto closers = [&] {
    std::string c;
    for (auto it = stack.rbegin(); it != stack.rend(); ++it) c += it->close;
    return c;
  };
  auto mark = [&](size_t pos) {
    safe = pos;
    safe_close = closers();
  };
  std::optional<std::string> whole;
  for (size_t i = start; i < s.size(); ++i) {
    const char c = s[i];
    if (is_space(c)) continue;
    Want* want = stack.empty() ? nullptr : &stack.back().want;
    if (c == '{' || c == '[') {
      if (want && *want != Want::kValue) break;
      if (want) *want = Want::kComma;
      if (stack.size() >= size_t(kMaxJsonDepth)) break;
      stack.push_back({c == '{' ? '}' : ']', c == '{' ? Want::kKey : Want::kValue});
      mark(i + 1);
    } else if (c == '}' || c == ']') {
      if (!want || stack.back().close != c) break;
      stack.pop_back();
      if (stack.empty()) {
        whole = std::string(s.substr(start, i + 1 - start));
        break;
      }
      mark(i + 1);
    } else if (!want) {
      break;
    } else if (c == ':' || c == ',') {
      if (c == ':' ? *want != Want::kColon : *want != Want::kComma) break;
      *want = c == ':' ? Want::kValue : (stack.back().close == '}' ? Want::kKey : Want::kValue);
    } else if (c == '"') {
      if (*want != Want::kKey && *want != Want::kValue) break;
      size_t whole_to = 0;
      const size_t end = string_end(s, i, &whole_to);
      if (end == std::string_view::npos) {
        // A string value cut mid-way is closed where its text is whole; a cut key is dropped.
        if (*want == Want::kValue) {
          cut_string = std::string(s.substr(start, whole_to - start)) + '"' + closers();
        }
        break;
      }
      i = end;
      if (*want == Want::kKey) {
        *want = Want::kColon;
      } else {
        *want = Want::kComma;
        mark(end + 1);
      }
    } else {
      // A number or literal: whole only once something follows it.
      if (*want != Want::kValue) break;
      size_t j = i;
      while (j < s.size() && !is_space(s[j]) && s[j] != ',' && s[j] != '}' && s[j] != ']') ++j;
      if (j == s.size()) break;
      *want = Want::kComma;
      i = j - 1;
      mark(j);
    }
  }
  std::vector<std::string> tries;
  if (whole) tries.push_back(std::move(*whole));
  if (!cut_string.empty()) tries.push_back(std::move(cut_string));
  if (safe != std::string_view::npos) {
    tries.push_back(std::string(s.substr(start, safe - start)) + safe_close);
  }
  for (std::string& t : tries) {
    const ojson j = ojson::parse(t, nullptr, false);
    if (!j.is_discarded() && j.is_object()) return std::move(t);
  }
  return std::nullopt;
}

}  // namespace recur::server
