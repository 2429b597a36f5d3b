// Splits a Jinja template into text and tag tokens, applying whitespace control the way
// transformers configures Jinja (trim_blocks=True, lstrip_blocks=True, "-"/"+" modifiers).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace recur::jinja {

enum class TokenType {
  kText,
  kVarBegin,    // {{
  kVarEnd,      // }}
  kBlockBegin,  // {%
  kBlockEnd,    // %}
  kName,
  kString,
  kInt,
  kFloat,
  kOperator,
  kEof,
};

struct Token {
  TokenType type = TokenType::kEof;
  std::string text;  // text data, name, operator, or decoded string literal
  int64_t int_value = 0;
  double float_value = 0;
  int line = 1;
  int column = 1;
};

// Normalizes newlines (\r\n and \r become \n) and drops one trailing newline, as Jinja does.
std::string normalize_template_source(std::string_view source);

// Tokenizes normalized source. Throws TemplateError naming line and column on malformed input.
std::vector<Token> tokenize(std::string_view source);

}  // namespace recur::jinja
