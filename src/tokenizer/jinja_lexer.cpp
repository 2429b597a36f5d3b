#include "tokenizer/jinja_lexer.h"

#include <charconv>
#include <cstdlib>

#include "tokenizer/jinja_value.h"

namespace recur::jinja {

std::string normalize_template_source(std::string_view source) {
  std::string out;
  out.reserve(source.size());
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\r') {
      out.push_back('\n');
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
    } else {
      out.push_back(source[i]);
    }
  }
  if (!out.empty() && out.back() == '\n') out.pop_back();  // keep_trailing_newline=False
  return out;
}

namespace {

// "line L, column C" for a byte offset of `source`.
std::string describe_position(std::string_view source, size_t offset) {
  int line = 1;
  size_t line_start = 0;
  for (size_t i = 0; i < offset && i < source.size(); ++i) {
    if (source[i] == '\n') {
      ++line;
      line_start = i + 1;
    }
  }
  return fmt::format("line {}, column {}", line, offset - line_start + 1);
}

bool is_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}
bool is_digit(char c) {
  return c >= '0' && c <= '9';
}
bool is_name_start(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
}
bool is_name_char(char c) {
  return is_name_start(c) || is_digit(c);
}

// Python's \s on str: every Unicode whitespace code point.
bool all_python_space(std::string_view s) {
  for (char32_t c : utf8_decode(s)) {
    if (!is_python_space(c)) return false;
  }
  return true;
}

size_t skip_python_space(std::string_view s, size_t pos) {
  while (pos < s.size()) {
    unsigned char c = static_cast<unsigned char>(s[pos]);
    if (c < 0x80) {
      if (!is_python_space(c)) break;
      ++pos;
      continue;
    }
    size_t n = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : 2;
    if (!is_python_space(utf8_decode(s.substr(pos, n))[0])) break;
    pos += n;
  }
  return pos;
}

std::string rstrip_python_space(std::string_view s) {
  return python_strip(s, nullptr, /*left=*/false, /*right=*/true);
}

class Lexer {
 public:
  explicit Lexer(std::string_view src) : src_(src) {
    line_starts_.push_back(0);
    for (size_t i = 0; i < src_.size(); ++i) {
      if (src_[i] == '\n') line_starts_.push_back(i + 1);
    }
  }

  std::vector<Token> run() {
    while (pos_ < src_.size()) {
      size_t tag = find_tag(pos_);
      if (tag == std::string_view::npos) {
        emit_text(src_.substr(pos_), pos_);
        break;
      }
      char kind = src_[tag + 1];
      char sign = tag + 2 < src_.size() && (src_[tag + 2] == '-' || src_[tag + 2] == '+')
                      ? src_[tag + 2]
                      : 0;
      size_t raw_body = kind == '%' ? match_raw_begin(tag) : std::string_view::npos;
      emit_text(strip_before_tag(src_.substr(pos_, tag - pos_), sign, kind != '{'), pos_);
      if (kind == '#') {
        lex_comment(tag, sign);
      } else if (raw_body != std::string_view::npos) {
        lex_raw(raw_body);
      } else {
        lex_tag(tag, kind, sign);
      }
    }
    Token eof;
    eof.type = TokenType::kEof;
    set_position(eof, src_.size());
    out_.push_back(eof);
    return std::move(out_);
  }

 private:
  std::string_view src_;
  size_t pos_ = 0;
  std::vector<Token> out_;
  std::vector<size_t> line_starts_;

  [[noreturn]] void error_at(size_t offset, const std::string& message) {
    throw TemplateError{ErrorCode::kInvalidArgument,
                        fmt::format("{}: {}", describe_position(src_, offset), message), true};
  }

  void set_position(Token& t, size_t offset) {
    size_t lo = 0, hi = line_starts_.size();
    while (hi - lo > 1) {
      size_t mid = (lo + hi) / 2;
      (line_starts_[mid] <= offset ? lo : hi) = mid;
    }
    t.line = static_cast<int>(lo + 1);
    t.column = static_cast<int>(offset - line_starts_[lo] + 1);
  }

  void push(TokenType type, std::string text, size_t offset) {
    Token t;
    t.type = type;
    t.text = std::move(text);
    set_position(t, offset);
    out_.push_back(std::move(t));
  }

  void emit_text(std::string_view text, size_t offset) {
    if (!text.empty()) push(TokenType::kText, std::string(text), offset);
  }

  size_t find_tag(size_t from) const {
    for (size_t i = src_.find('{', from); i != std::string_view::npos; i = src_.find('{', i + 1)) {
      if (i + 1 < src_.size() && (src_[i + 1] == '{' || src_[i + 1] == '%' || src_[i + 1] == '#')) {
        return i;
      }
    }
    return std::string_view::npos;
  }

  // "-" strips all whitespace before a tag; lstrip_blocks strips the spaces that indent a
  // block or comment tag standing at the start of a line, unless the tag says "+".
  std::string strip_before_tag(std::string_view text, char sign, bool block_or_comment) const {
    if (sign == '-') return rstrip_python_space(text);
    if (sign == '+' || !block_or_comment) return std::string(text);
    size_t nl = text.rfind('\n');
    size_t line_pos = nl == std::string_view::npos ? 0 : nl + 1;
    bool line_starting = pos_ == 0 || src_[pos_ - 1] == '\n';
    if ((line_pos > 0 || line_starting) && all_python_space(text.substr(line_pos))) {
      return std::string(text.substr(0, line_pos));
    }
    return std::string(text);
  }

  // After a closing tag: "-" eats all whitespace; otherwise trim_blocks eats one newline.
  size_t after_close(size_t end, char close_sign, bool trim_newline) const {
    if (close_sign == '-') return skip_python_space(src_, end);
    if (trim_newline && close_sign != '+' && end < src_.size() && src_[end] == '\n') return end + 1;
    return end;
  }

  void lex_comment(size_t tag, char sign) {
    size_t body = tag + 2 + (sign ? 1 : 0);
    size_t close = src_.find("#}", body);
    if (close == std::string_view::npos) error_at(tag, "unclosed comment '{#'");
    char close_sign =
        close > body && (src_[close - 1] == '-' || src_[close - 1] == '+') ? src_[close - 1] : 0;
    pos_ = after_close(close + 2, close_sign, true);
  }

  // {% raw %}: returns the offset just past the opening tag, or npos if this is not one.
  size_t match_raw_begin(size_t tag) {
    size_t p = tag + 2;
    if (p < src_.size() && (src_[p] == '-' || src_[p] == '+')) ++p;
    while (p < src_.size() && is_space(src_[p])) ++p;
    if (src_.substr(p, 3) != "raw" || (p + 3 < src_.size() && is_name_char(src_[p + 3]))) {
      return std::string_view::npos;
    }
    p += 3;
    while (p < src_.size() && is_space(src_[p])) ++p;
    if (src_.substr(p, 3) == "-%}") return skip_python_space(src_, p + 3);
    if (src_.substr(p, 2) == "%}") return p + 2;
    return std::string_view::npos;
  }

  void lex_raw(size_t body) {
    for (size_t tag = src_.find("{%", body); tag != std::string_view::npos;
         tag = src_.find("{%", tag + 1)) {
      size_t p = tag + 2;
      char sign = 0;
      if (p < src_.size() && (src_[p] == '-' || src_[p] == '+')) sign = src_[p++];
      while (p < src_.size() && is_space(src_[p])) ++p;
      if (src_.substr(p, 6) != "endraw") continue;
      p += 6;
      while (p < src_.size() && is_space(src_[p])) ++p;
      char close_sign = 0;
      if (p < src_.size() && (src_[p] == '-' || src_[p] == '+')) close_sign = src_[p++];
      if (src_.substr(p, 2) != "%}") continue;
      size_t saved = pos_;
      pos_ = body;  // lstrip_blocks looks at what precedes the raw text
      emit_text(strip_before_tag(src_.substr(body, tag - body), sign, true), body);
      pos_ = saved;
      pos_ = after_close(p + 2, close_sign, true);
      return;
    }
    error_at(body, "missing '{% endraw %}'");
  }

  void lex_tag(size_t tag, char kind, char sign) {
    bool block = kind == '%';
    push(block ? TokenType::kBlockBegin : TokenType::kVarBegin, block ? "{%" : "{{", tag);
    size_t p = tag + 2 + (sign ? 1 : 0);
    std::vector<char> brackets;
    while (true) {
      while (p < src_.size() && is_space(src_[p])) ++p;
      if (p >= src_.size()) error_at(tag, block ? "unclosed tag '{%'" : "unclosed tag '{{'");
      if (brackets.empty()) {
        std::string_view rest = src_.substr(p);
        char close_sign = 0;
        size_t close_len = 0;
        if (block) {
          if (rest.substr(0, 3) == "-%}" || rest.substr(0, 3) == "+%}") {
            close_sign = rest[0];
            close_len = 3;
          } else if (rest.substr(0, 2) == "%}") {
            close_len = 2;
          }
        } else if (rest.substr(0, 3) == "-}}") {
          close_sign = '-';
          close_len = 3;
        } else if (rest.substr(0, 2) == "}}") {
          close_len = 2;
        }
        if (close_len) {
          push(block ? TokenType::kBlockEnd : TokenType::kVarEnd, block ? "%}" : "}}", p);
          pos_ = after_close(p + close_len, close_sign, block);
          return;
        }
      }
      p = lex_expression_token(p, brackets);
    }
  }

  size_t lex_expression_token(size_t p, std::vector<char>& brackets) {
    char c = src_[p];
    if (is_name_start(c)) {
      size_t e = p;
      while (e < src_.size() && is_name_char(src_[e])) ++e;
      push(TokenType::kName, std::string(src_.substr(p, e - p)), p);
      return e;
    }
    if (is_digit(c)) return lex_number(p);
    if (c == '\'' || c == '"') return lex_string(p);
    static const char* const kOperators[] = {"//", "**", "==", "!=", ">=", "<=", "+", "-", "/",
                                             "*",  "%",  "~",  "[",  "]",  "(",  ")", "{", "}",
                                             ">",  "<",  "=",  ".",  ":",  "|",  ",", ";"};
    for (const char* op : kOperators) {
      std::string_view o(op);
      if (src_.substr(p, o.size()) != o) continue;
      if (o == "(" || o == "[" || o == "{") {
        brackets.push_back(o[0]);
      } else if (o == ")" || o == "]" || o == "}") {
        char open = o == ")" ? '(' : o == "]" ? '[' : '{';
        if (brackets.empty() || brackets.back() != open)
          error_at(p, fmt::format("unexpected '{}'", o));
        brackets.pop_back();
      }
      push(TokenType::kOperator, std::string(o), p);
      return p + o.size();
    }
    error_at(p, fmt::format("unexpected character '{}'", c));
  }

  size_t scan_digits(size_t p) const {
    while (p < src_.size() && (is_digit(src_[p]) ||
                               (src_[p] == '_' && p + 1 < src_.size() && is_digit(src_[p + 1])))) {
      ++p;
    }
    return p;
  }

  size_t lex_number(size_t p) {
    size_t e = scan_digits(p);
    bool after_dot = p > 0 && src_[p - 1] == '.';  // `x.0.1` is two attribute lookups
    bool is_float = false;
    if (!after_dot && e + 1 < src_.size() && src_[e] == '.' && is_digit(src_[e + 1])) {
      e = scan_digits(e + 1);
      is_float = true;
    }
    if (!after_dot && e < src_.size() && (src_[e] == 'e' || src_[e] == 'E')) {
      size_t x = e + 1;
      if (x < src_.size() && (src_[x] == '+' || src_[x] == '-')) ++x;
      if (x < src_.size() && is_digit(src_[x])) {
        e = scan_digits(x);
        is_float = true;
      }
    }
    if (!is_float && e < src_.size() && is_name_start(src_[e]) && src_.substr(p, e - p) == "0") {
      error_at(p, "integer literals with a base prefix are not supported");
    }
    std::string digits;
    for (size_t i = p; i < e; ++i) {
      if (src_[i] != '_') digits.push_back(src_[i]);
    }
    Token t;
    set_position(t, p);
    t.text = digits;
    if (is_float) {
      t.type = TokenType::kFloat;
      t.float_value = std::strtod(digits.c_str(), nullptr);
    } else {
      t.type = TokenType::kInt;
      auto res = std::from_chars(digits.data(), digits.data() + digits.size(), t.int_value);
      if (res.ec != std::errc()) error_at(p, "integer literal out of range");
    }
    out_.push_back(std::move(t));
    return e;
  }

  size_t lex_string(size_t p) {
    char quote = src_[p];
    size_t e = p + 1;
    while (e < src_.size() && src_[e] != quote) e += src_[e] == '\\' ? 2 : 1;
    if (e >= src_.size()) error_at(p, "unterminated string literal");
    push(TokenType::kString, unescape(src_.substr(p + 1, e - p - 1), p), p);
    return e + 1;
  }

  // Python's "unicode-escape" decoding, which Jinja applies to string literals.
  std::string unescape(std::string_view s, size_t offset) {
    std::string out;
    for (size_t i = 0; i < s.size(); ++i) {
      if (s[i] != '\\' || i + 1 >= s.size()) {
        out.push_back(s[i]);
        continue;
      }
      char c = s[++i];
      auto hex = [&](size_t n) -> char32_t {
        uint32_t v = 0;
        for (size_t k = 1; k <= n; ++k) {
          char h = i + k < s.size() ? s[i + k] : 0;
          int d = is_digit(h)              ? h - '0'
                  : (h >= 'a' && h <= 'f') ? h - 'a' + 10
                  : (h >= 'A' && h <= 'F') ? h - 'A' + 10
                                           : -1;
          if (d < 0) error_at(offset, "malformed \\x/\\u escape in string literal");
          v = v * 16 + d;
        }
        i += n;
        return v;
      };
      switch (c) {
        case '\n':
          break;
        case '\\':
          out.push_back('\\');
          break;
        case '\'':
          out.push_back('\'');
          break;
        case '"':
          out.push_back('"');
          break;
        case 'a':
          out.push_back('\a');
          break;
        case 'b':
          out.push_back('\b');
          break;
        case 'f':
          out.push_back('\f');
          break;
        case 'n':
          out.push_back('\n');
          break;
        case 'r':
          out.push_back('\r');
          break;
        case 't':
          out.push_back('\t');
          break;
        case 'v':
          out.push_back('\v');
          break;
        case 'x':
          utf8_append(out, hex(2));
          break;
        case 'u':
        case 'U': {
          char32_t cp = hex(c == 'u' ? 4 : 8);
          if ((cp >= 0xD800 && cp <= 0xDFFF) || cp > 0x10FFFF) {
            error_at(offset, "surrogate or out-of-range \\u escape is not supported");
          }
          utf8_append(out, cp);
          break;
        }
        case 'N':
          error_at(offset, "\\N{...} escapes are not supported");
        default:
          if (c >= '0' && c <= '7') {
            uint32_t v = c - '0';
            for (int k = 0; k < 2 && i + 1 < s.size() && s[i + 1] >= '0' && s[i + 1] <= '7'; ++k) {
              v = v * 8 + (s[++i] - '0');
            }
            utf8_append(out, v);
          } else {
            out.push_back('\\');  // unknown escapes stay as written
            out.push_back(c);
          }
      }
    }
    return out;
  }
};

}  // namespace

std::vector<Token> tokenize(std::string_view source) {
  return Lexer(source).run();
}

}  // namespace recur::jinja
