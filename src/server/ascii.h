// ASCII text helpers shared by the HTTP layer and the model-output parser.
#pragma once

#include <string_view>

namespace recur::server {

// Equal but for the case of ASCII letters (HTTP tokens, JSON literals): bytes past ASCII must
// match exactly.
inline bool iequals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  const auto lower = [](char c) { return c >= 'A' && c <= 'Z' ? char(c - 'A' + 'a') : c; };
  for (size_t i = 0; i < a.size(); ++i) {
    if (lower(a[i]) != lower(b[i])) return false;
  }
  return true;
}

}  // namespace recur::server
