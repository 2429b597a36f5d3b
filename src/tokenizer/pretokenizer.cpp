#include "tokenizer/pretokenizer.h"

#include <algorithm>
#include <cctype>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "tokenizer/utf8_util.h"

namespace recur {

using json = nlohmann::json;

namespace {

// GPT-2's pattern, which ByteLevel applies itself when its use_regex flag is set.
constexpr std::string_view kByteLevelPattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// Oniguruma's Unicode \w (UTS #18 word characters); PCRE2's UCP \w is narrower.
constexpr std::string_view kWordClassBody = R"(\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\p{Join_Control})";

std::string pcre2_error_text(int code) {
  PCRE2_UCHAR buf[256];
  pcre2_get_error_message(code, buf, sizeof(buf));
  return reinterpret_cast<const char*>(buf);
}

}  // namespace

Result<std::string> translate_oniguruma_pattern(std::string_view p) {
  std::string out;
  out.reserve(p.size() + 32);
  bool in_class = false;
  auto unsupported = [&](size_t at, std::string_view what) {
    return make_error(ErrorCode::kUnsupported,
                      "tokenizer.json: regex {} at offset {} has no PCRE2 translation: {}", what,
                      at, p);
  };
  for (size_t i = 0; i < p.size(); ++i) {
    char c = p[i];
    if (c == '\\') {
      if (i + 1 >= p.size()) return unsupported(i, "trailing backslash");
      char e = p[++i];
      switch (e) {
        case 's':
          out += "\\p{White_Space}";
          break;
        case 'S':
          out += "\\P{White_Space}";
          break;
        case 'w':
          out += in_class ? std::string(kWordClassBody) : "[" + std::string(kWordClassBody) + "]";
          break;
        case 'h':
          out += in_class ? "0-9a-fA-F" : "[0-9a-fA-F]";
          break;
        case 'W':
        case 'H':
          if (in_class) return unsupported(i - 1, "negated class escape inside [...]");
          out += e == 'W' ? "[^" + std::string(kWordClassBody) + "]" : "[^0-9a-fA-F]";
          break;
        case 'u':  // Ruby's \uHHHH
          if (i + 4 < p.size()) {
            out += "\\x{" + std::string(p.substr(i + 1, 4)) + "}";
            i += 4;
          } else {
            return unsupported(i - 1, "short \\u escape");
          }
          break;
        default:
          out += '\\';
          out += e;
      }
      continue;
    }
    if (in_class) {
      if (c == '[') {
        if (i + 1 < p.size() && p[i + 1] == ':') {  // POSIX bracket, same in PCRE2
          size_t close = p.find(":]", i + 2);
          if (close == std::string_view::npos) return unsupported(i, "unterminated [:class:]");
          out += p.substr(i, close + 2 - i);
          i = close + 1;
          continue;
        }
        return unsupported(i, "nested character class");
      }
      if (c == '&' && i + 1 < p.size() && p[i + 1] == '&') {
        return unsupported(i, "class intersection &&");
      }
      if (c == ']') in_class = false;
      out += c;
      continue;
    }
    if (c == '[') {
      in_class = true;
      out += c;
      if (i + 1 < p.size() && p[i + 1] == '^') out += p[++i];
      continue;
    }
    if (c == '(' && p.substr(i).starts_with("(?")) {
      // Inline options: Ruby's m is PCRE2's s (dot matches newline).
      size_t j = i + 2;
      while (j < p.size() && (p[j] == 'i' || p[j] == 'm' || p[j] == 'x' || p[j] == '-')) ++j;
      if (j > i + 2 && j < p.size() && (p[j] == ':' || p[j] == ')')) {
        out += "(?";
        for (size_t k = i + 2; k < j; ++k) out += p[k] == 'm' ? 's' : p[k];
        i = j - 1;
        continue;
      }
    }
    out += c;
  }
  if (in_class) return unsupported(p.size(), "unterminated character class");
  return out;
}

struct Regex::Code {
  pcre2_code* code = nullptr;
  ~Code() { pcre2_code_free(code); }
};

Result<Regex> Regex::compile(std::string_view pattern) {
  int err = 0;
  PCRE2_SIZE err_offset = 0;
  // MULTILINE: ^ and $ are line anchors in Oniguruma's Ruby syntax.
  pcre2_code* code =
      pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                    PCRE2_UTF | PCRE2_UCP | PCRE2_MULTILINE, &err, &err_offset, nullptr);
  if (code == nullptr) {
    return make_error(ErrorCode::kCorrupt, "regex /{}/ does not compile at offset {}: {}", pattern,
                      err_offset, pcre2_error_text(err));
  }
  // Without JIT (unsupported CPU) pcre2_match falls back to the interpreter.
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  Regex r;
  auto holder = std::make_shared<Code>();
  holder->code = code;
  r.code_ = std::move(holder);
  return r;
}

Result<Regex> Regex::compile_oniguruma(std::string_view pattern) {
  RECUR_ASSIGN_OR_RETURN(std::string translated, translate_oniguruma_pattern(pattern));
  return compile(translated);
}

Result<Regex> Regex::compile_literal(std::string_view literal) {
  std::string quoted;
  for (char c : literal) {
    // Quote every ASCII punctuation character; letters and digits stay (\d etc. mean classes).
    auto u = static_cast<unsigned char>(c);
    if (u < 0x80 && !std::isalnum(u)) quoted += '\\';
    quoted += c;
  }
  return compile(quoted);
}

namespace {

struct MatchDataDeleter {
  void operator()(pcre2_match_data* m) const { pcre2_match_data_free(m); }
};

// One ovector pair is enough: only the whole match is used. Per thread, so encode stays const.
pcre2_match_data* thread_match_data() {
  thread_local std::unique_ptr<pcre2_match_data, MatchDataDeleter> data(
      pcre2_match_data_create(1, nullptr));
  return data.get();
}

}  // namespace

Status Regex::find_all(std::string_view text, std::vector<Match>& matches) const {
  return for_each_match(text, [&](size_t s, size_t e) { matches.push_back({s, e}); });
}

Status Regex::for_each_match(std::string_view text,
                             FunctionRef<void(size_t start, size_t end)> on_match) const {
  pcre2_match_data* md = thread_match_data();
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t n = text.size();
  size_t pos = 0;
  bool have_last = false;
  size_t last_end = 0;
  while (pos <= n) {
    int rc = pcre2_match(code_->code, subject, n, pos, PCRE2_NO_UTF_CHECK, md, nullptr);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT) {
      rc =
          pcre2_match(code_->code, subject, n, pos, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, md, nullptr);
    }
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      return make_error(ErrorCode::kInvalidArgument, "regex match failed at byte {}: {}", pos,
                        pcre2_error_text(rc));
    }
    PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    size_t s = ov[0], e = ov[1];
    if (s == e && have_last && last_end == e) {
      if (pos >= n) break;
      Utf8Step step = utf8_step(reinterpret_cast<const uint8_t*>(text.data()) + pos, n - pos);
      pos += step.length;
      continue;
    }
    on_match(s, e);
    pos = e;
    have_last = true;
    last_end = e;
  }
  return {};
}

Result<PreTokenizer> PreTokenizer::from_json(const json& j) {
  PreTokenizer p;
  RECUR_RETURN_IF_ERROR(p.append_steps(j));
  return p;
}

PreTokenizer PreTokenizer::matches_of(Regex regex) {
  PreTokenizer p;
  Step step;
  step.regex = std::move(regex);
  step.behavior = Behavior::kRemoved;  // inverted: what is removed is what does not match
  step.invert = true;
  p.steps_.push_back(std::move(step));
  p.byte_level_ = true;
  return p;
}

Status PreTokenizer::append_steps(const json& j) {
  if (j.is_null()) return {};
  if (!j.is_object() || !j.contains("type") || !j["type"].is_string()) {
    return make_error(ErrorCode::kCorrupt, "tokenizer.json: pre_tokenizer without a \"type\"");
  }
  if (byte_level_) {
    return make_error(ErrorCode::kUnsupported,
                      "tokenizer.json: pre_tokenizer steps after ByteLevel are not supported");
  }
  std::string type = j["type"].get<std::string>();
  if (type == "Sequence") {
    if (!j.contains("pretokenizers") || !j["pretokenizers"].is_array()) {
      return make_error(ErrorCode::kCorrupt,
                        "tokenizer.json: Sequence pre_tokenizer without \"pretokenizers\"");
    }
    for (const auto& s : j["pretokenizers"]) RECUR_RETURN_IF_ERROR(append_steps(s));
    return {};
  }
  if (type == "Split") {
    Step step;
    const json& pattern = j.value("pattern", json());
    if (pattern.is_object() && pattern.contains("Regex") && pattern["Regex"].is_string()) {
      RECUR_ASSIGN_OR_RETURN(step.regex,
                             Regex::compile_oniguruma(pattern["Regex"].get<std::string>()));
    } else if (pattern.is_object() && pattern.contains("String") && pattern["String"].is_string()) {
      RECUR_ASSIGN_OR_RETURN(step.regex,
                             Regex::compile_literal(pattern["String"].get<std::string>()));
    } else {
      return make_error(
          ErrorCode::kCorrupt,
          "tokenizer.json: Split pre_tokenizer needs pattern {{\"Regex\"|\"String\"}}");
    }
    std::string behavior = j.value("behavior", std::string("Isolated"));
    if (behavior == "Removed") {
      step.behavior = Behavior::kRemoved;
    } else if (behavior == "Isolated") {
      step.behavior = Behavior::kIsolated;
    } else if (behavior == "MergedWithPrevious") {
      step.behavior = Behavior::kMergedWithPrevious;
    } else if (behavior == "MergedWithNext") {
      step.behavior = Behavior::kMergedWithNext;
    } else if (behavior == "Contiguous") {
      step.behavior = Behavior::kContiguous;
    } else {
      return make_error(ErrorCode::kUnsupported, "tokenizer.json: Split behavior \"{}\"", behavior);
    }
    step.invert = j.value("invert", false);
    steps_.push_back(std::move(step));
    return {};
  }
  if (type == "ByteLevel") {
    // Defaults are those of Hugging Face's ByteLevel::default().
    if (j.value("add_prefix_space", true)) {
      Step prefix;
      prefix.kind = Step::kPrefixSpace;
      steps_.push_back(std::move(prefix));
    }
    if (j.value("use_regex", true)) {
      Step split;
      RECUR_ASSIGN_OR_RETURN(split.regex, Regex::compile_oniguruma(kByteLevelPattern));
      steps_.push_back(std::move(split));
    }
    byte_level_ = true;
    return {};
  }
  return make_error(ErrorCode::kUnsupported,
                    "tokenizer.json: pre_tokenizer type \"{}\" is not supported (supported: "
                    "Split, ByteLevel, Sequence)",
                    type);
}

Status PreTokenizer::apply(const Step& step, std::string_view text, std::deque<std::string>& arena,
                           FunctionRef<void(std::string_view)> out) const {
  if (text.empty()) return {};
  if (step.kind == Step::kPrefixSpace) {
    if (text.front() == ' ') {
      out(text);
    } else {
      std::string& prefixed = arena.emplace_back();
      prefixed.reserve(text.size() + 1);
      prefixed.push_back(' ');
      prefixed.append(text);
      out(prefixed);
    }
    return {};
  }
  if (step.behavior == Behavior::kIsolated && !step.invert) {  // the common case: streamed
    size_t prev = 0;
    RECUR_RETURN_IF_ERROR(step.regex.for_each_match(text, [&](size_t start, size_t end) {
      if (start != prev) out(text.substr(prev, start - prev));
      if (end != start) out(text.substr(start, end - start));
      prev = end;
    }));
    if (prev != text.size()) out(text.substr(prev));
    return {};
  }
  if (step.behavior == Behavior::kRemoved && step.invert) {  // matches only (tiktoken): streamed
    return step.regex.for_each_match(text, [&](size_t start, size_t end) {
      if (end != start) out(text.substr(start, end - start));
    });
  }
  std::vector<Regex::Match> matches;
  RECUR_RETURN_IF_ERROR(step.regex.find_all(text, matches));

  // Every byte of `text` in order: the gaps between matches and the matches themselves.
  struct Span {
    size_t start, end;
    bool is_match;
  };
  std::vector<Span> spans;
  spans.reserve(matches.size() * 2 + 1);
  size_t prev = 0;
  for (const Regex::Match& m : matches) {
    if (m.start != prev) spans.push_back({prev, m.start, step.invert});
    spans.push_back({m.start, m.end, !step.invert});
    prev = m.end;
  }
  if (prev != text.size()) spans.push_back({prev, text.size(), step.invert});

  std::vector<Span> pieces;
  pieces.reserve(spans.size());
  switch (step.behavior) {
    case Behavior::kIsolated:
      pieces = std::move(spans);
      break;
    case Behavior::kRemoved:
      for (const Span& s : spans) {
        if (!s.is_match) pieces.push_back(s);
      }
      break;
    case Behavior::kMergedWithPrevious: {
      bool previous_match = false;
      for (const Span& s : spans) {
        if (s.is_match && !previous_match && !pieces.empty()) {
          pieces.back().end = s.end;
        } else {
          pieces.push_back(s);
        }
        previous_match = s.is_match;
      }
      break;
    }
    case Behavior::kMergedWithNext: {
      bool previous_match = false;  // scanning right to left: "previous" is the right neighbour
      for (size_t i = spans.size(); i-- > 0;) {
        const Span& s = spans[i];
        if (s.is_match && !previous_match && !pieces.empty()) {
          pieces.back().start = s.start;
        } else {
          pieces.push_back(s);
        }
        previous_match = s.is_match;
      }
      std::reverse(pieces.begin(), pieces.end());
      break;
    }
    case Behavior::kContiguous: {
      bool previous_match = false;
      for (const Span& s : spans) {
        if (s.is_match == previous_match && !pieces.empty()) {
          pieces.back().end = s.end;
        } else {
          pieces.push_back(s);
        }
        previous_match = s.is_match;
      }
      break;
    }
  }
  for (const Span& s : pieces) {
    if (s.end > s.start) out(text.substr(s.start, s.end - s.start));
  }
  return {};
}

Status PreTokenizer::run_from(size_t step, std::string_view text, std::deque<std::string>& arena,
                              FunctionRef<void(std::string_view)> on_piece) const {
  if (step == steps_.size()) {
    on_piece(text);
    return {};
  }
  // Depth first: each piece goes through the remaining steps before the next piece is found;
  // the final order is the same as running each step over all pieces.
  Status inner;
  auto next = [&](std::string_view piece) {
    if (inner.ok()) inner = run_from(step + 1, piece, arena, on_piece);
  };
  RECUR_RETURN_IF_ERROR(apply(steps_[step], text, arena, next));
  return inner;
}

Status PreTokenizer::split(std::string_view text, std::deque<std::string>& arena,
                           FunctionRef<void(std::string_view)> on_piece) const {
  if (text.empty()) return {};
  return run_from(0, text, arena, on_piece);
}

}  // namespace recur
