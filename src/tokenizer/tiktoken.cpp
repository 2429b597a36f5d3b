#include "tokenizer/tiktoken.h"

#include <fmt/format.h>

#include <cctype>
#include <climits>
#include <unordered_set>

#include "tokenizer/pretokenizer.h"
#include "tokenizer/utf8_util.h"

namespace recur {

using json = nlohmann::json;

namespace {

// The pre-tokenizer of Kimi's TikTokenTokenizer (tokenization_kimi.py): Han runs, words with
// an optional contraction (Han excluded), 1-3 digits, punctuation runs, then white space.
constexpr std::string_view kKimiPattern =
    R"([\p{Han}]+)"
    R"(|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
    R"(|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
    R"(|\p{N}{1,3})"
    R"(| ?[^\s\p{L}\p{N}]+[\r\n]*)"
    R"(|\s*[\r\n]+)"
    R"(|\s+(?!\S))"
    R"(|\s+)";

// Kimi reserves 256 + 2 special-token ids after the ranks; those its config does not name are
// <|reserved_token_ID|>.
constexpr int kKimiReservedSpecialTokens = 258;
// Kimi's encode: 400,000-character chunks, runs cut at 25,000 characters (tiktoken's regex
// is slow on longer runs).
constexpr ChunkLimits kKimiChunks = {400'000, 25'000};

// Python's str.isspace: bidirectional class WS, B or S, or category Zs.
bool python_isspace(int32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 ||
         cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 ||
         cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

// Rust's Unicode \w (UTS #18 word characters).
constexpr std::string_view kWordClassBody = R"(\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\p{Join_Control})";

int base64_value(char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}

// Standard base64 with padding; false on anything else.
bool decode_base64(std::string_view in, std::string& out) {
  out.clear();
  if (in.empty() || in.size() % 4 != 0) return false;
  size_t pad = 0;
  while (pad < 2 && in[in.size() - 1 - pad] == '=') ++pad;
  uint32_t acc = 0;
  int bits = 0;
  for (size_t i = 0; i < in.size() - pad; ++i) {
    const int v = base64_value(in[i]);
    if (v < 0) return false;
    acc = (acc << 6) | uint32_t(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(static_cast<char>((acc >> bits) & 0xFF));
    }
  }
  // Padding bits must be zero, so each token has one spelling.
  return (acc & ((1u << bits) - 1)) == 0;
}

std::string_view next_line(std::string_view text, size_t& pos) {
  const size_t end = std::min(text.find('\n', pos), text.size());
  std::string_view line = text.substr(pos, end - pos);
  pos = end + 1;
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  return line;
}

bool is_blank(char c) {
  return c == ' ' || c == '\t';
}

// True for a name PCRE2 knows as a script (Han, Latin, ...), not a category or property.
bool is_script_name(std::string_view name) {
  return Regex::compile(fmt::format(R"(\p{{sc:{}}})", name)).ok();
}

// Parses a Rust regex class starting at p[i] == '[' into one PCRE2 item matching one character.
class ClassTranslator {
 public:
  explicit ClassTranslator(std::string_view p) : p_(p) {}

  Result<std::string> item(size_t& i) {
    ++i;  // '['
    const bool negated = i < p_.size() && p_[i] == '^';
    if (negated) ++i;
    std::vector<std::string> operands;  // joined by &&
    std::string flat;                   // PCRE2 class body of the current operand
    std::vector<std::string> nested;    // nested classes of the current operand (a union)
    bool plain = true;                  // no && and no nested class: a PCRE2 class as it is
    bool first = true;
    auto close_operand = [&] {
      std::string op;
      if (nested.empty()) {
        op = "[" + flat + "]";
      } else if (flat.empty() && nested.size() == 1) {
        op = nested[0];
      } else {
        op = "(?:";
        if (!flat.empty()) op += "[" + flat + "]|";
        for (size_t k = 0; k < nested.size(); ++k) op += (k ? "|" : "") + nested[k];
        op += ")";
      }
      operands.push_back(std::move(op));
      flat.clear();
      nested.clear();
    };
    while (i < p_.size()) {
      const char c = p_[i];
      if (c == ']' && !first) {
        ++i;
        close_operand();
        if (plain) {
          // A plain class keeps PCRE2's own negation.
          std::string body = operands[0].substr(1, operands[0].size() - 2);
          return negated ? "[^" + body + "]" : operands[0];
        }
        std::string joined = operands.back();
        for (size_t k = operands.size() - 1; k-- > 0;) {
          joined = "(?:(?=" + joined + ")" + operands[k] + ")";
        }
        return negated ? "(?:(?!" + joined + R"()[\s\S])" : joined;
      }
      first = false;
      if (c == '&' && i + 1 < p_.size() && p_[i + 1] == '&') {
        plain = false;
        i += 2;
        close_operand();
        continue;
      }
      if (c == '[') {
        if (i + 1 < p_.size() && p_[i + 1] == ':') {  // [:alpha:], same in PCRE2
          const size_t close = p_.find(":]", i + 2);
          if (close == std::string_view::npos) return unsupported(i, "unterminated [:class:]");
          flat.append(p_.substr(i, close + 2 - i));
          i = close + 2;
          continue;
        }
        plain = false;
        RECUR_ASSIGN_OR_RETURN(std::string sub, item(i));
        nested.push_back(std::move(sub));
        continue;
      }
      if (c == '\\') {
        if (i + 1 >= p_.size()) return unsupported(i, "trailing backslash");
        const char e = p_[i + 1];
        switch (e) {
          case 's':
            flat += R"(\p{White_Space})";
            break;
          case 'S':
            flat += R"(\P{White_Space})";
            break;
          case 'd':
            flat += R"(\p{Nd})";
            break;
          case 'D':
            flat += R"(\P{Nd})";
            break;
          case 'w':
            flat += kWordClassBody;
            break;
          case 'p':
          case 'P': {
            RECUR_ASSIGN_OR_RETURN(std::string prop, property(i));
            flat += prop;
            continue;
          }
          default:
            if (std::isalpha(static_cast<unsigned char>(e)) &&
                std::string_view("nrtfvx").find(e) == std::string_view::npos) {
              return unsupported(i, fmt::format("escape \\{} inside [...]", e));
            }
            flat += '\\';
            flat += e;
        }
        i += 2;
        continue;
      }
      flat += c;
      ++i;
    }
    return unsupported(i, "unterminated character class");
  }

  // \p{Name} / \P{Name} / \pL at p[i] == '\\', in PCRE2 form; advances i past it.
  Result<std::string> property(size_t& i) {
    const char kind = p_[i + 1];
    std::string name;
    if (i + 2 < p_.size() && p_[i + 2] == '{') {
      const size_t close = p_.find('}', i + 3);
      if (close == std::string_view::npos) return unsupported(i, "unterminated \\p{...}");
      name = std::string(p_.substr(i + 3, close - i - 3));
      i = close + 1;
    } else if (i + 2 < p_.size()) {
      name = std::string(1, p_[i + 2]);
      i += 3;
    } else {
      return unsupported(i, "\\p without a name");
    }
    if (name.find_first_of(":=") == std::string::npos && name.size() > 2 && is_script_name(name)) {
      name = "sc:" + name;
    }
    return fmt::format("\\{}{{{}}}", kind, name);
  }

  Error unsupported(size_t at, std::string_view what) const {
    return make_error(ErrorCode::kUnsupported,
                      "tiktoken pattern: {} at offset {} has no PCRE2 translation: {}", what, at,
                      p_);
  }

 private:
  std::string_view p_;
};

}  // namespace

Status for_each_chunk(std::string_view text, const ChunkLimits& limits,
                      FunctionRef<Status(std::string_view)> fn) {
  if (limits.chars == 0 && limits.run == 0) return text.empty() ? Status() : fn(text);
  const auto* p = reinterpret_cast<const uint8_t*>(text.data());
  size_t slice_start = 0;  // the chunk being built
  size_t chars = 0;        // characters since the last `chars` cut
  size_t run = 0;          // length of the current run of one kind
  bool run_space = false;
  auto cut = [&](size_t at) -> Status {
    const std::string_view chunk = text.substr(slice_start, at - slice_start);
    slice_start = at;
    return chunk.empty() ? Status() : fn(chunk);
  };
  for (size_t i = 0; i < text.size();) {
    if (limits.chars > 0 && chars == limits.chars) {
      RECUR_RETURN_IF_ERROR(cut(i));
      chars = 0;
    }
    const Utf8Step step = utf8_step(p + i, text.size() - i);
    const bool space = python_isspace(decode_utf8_char(p + i, step.length));
    if (chars == 0) {
      run_space = space;  // each chunk starts a run
      run = 0;
    }
    if (space != run_space) {
      run = 1;
      run_space = space;
    } else if (++run > limits.run && limits.run > 0) {
      RECUR_RETURN_IF_ERROR(cut(i));
      run = 1;
    }
    ++chars;
    i += step.length;
  }
  return cut(text.size());
}

Result<std::vector<RankedToken>> parse_tiktoken_ranks(std::string_view text,
                                                      std::string_view origin) {
  std::vector<RankedToken> tokens;
  std::unordered_set<std::string> seen_tokens;
  std::unordered_set<int32_t> seen_ranks;
  size_t pos = 0;
  size_t line_number = 0;
  std::string bytes;
  while (pos < text.size()) {
    ++line_number;
    const std::string_view line = next_line(text, pos);
    if (line.find_first_not_of(" \t") == std::string_view::npos) continue;
    auto bad = [&](std::string_view what) {
      return make_error(ErrorCode::kCorrupt, "{}: line {}: {} (expected \"BASE64 RANK\")", origin,
                        line_number, what);
    };
    size_t a = 0;
    while (a < line.size() && is_blank(line[a])) ++a;
    size_t b = a;
    while (b < line.size() && !is_blank(line[b])) ++b;
    size_t c = b;
    while (c < line.size() && is_blank(line[c])) ++c;
    size_t d = c;
    while (d < line.size() && !is_blank(line[d])) ++d;
    if (c == line.size() || line.find_first_not_of(" \t", d) != std::string_view::npos) {
      return bad("not two fields");
    }
    const std::string_view b64 = line.substr(a, b - a), rank_text = line.substr(c, d - c);
    if (!decode_base64(b64, bytes)) {
      return bad(fmt::format("\"{}\" is not base64", b64.substr(0, 64)));
    }
    int64_t rank = 0;
    for (char ch : rank_text) {
      if (ch < '0' || ch > '9' || rank > INT32_MAX) {
        return bad(fmt::format("rank \"{}\" is not an integer in [0, 2^31)", rank_text));
      }
      rank = rank * 10 + (ch - '0');
    }
    if (rank > INT32_MAX) {
      return bad(fmt::format("rank \"{}\" is not an integer in [0, 2^31)", rank_text));
    }
    if (!seen_ranks.insert(int32_t(rank)).second) {
      return bad(fmt::format("rank {} appears twice", rank));
    }
    if (!seen_tokens.insert(bytes).second) return bad(fmt::format("token {} appears twice", b64));
    tokens.push_back({bytes, int32_t(rank)});
  }
  if (tokens.empty()) return make_error(ErrorCode::kCorrupt, "{}: no tokens", origin);
  return tokens;
}

Result<std::string> translate_tiktoken_pattern(std::string_view p) {
  ClassTranslator classes(p);
  std::string out;
  out.reserve(p.size() + 64);
  for (size_t i = 0; i < p.size();) {
    const char c = p[i];
    if (c == '[') {
      RECUR_ASSIGN_OR_RETURN(std::string item, classes.item(i));
      out += item;
      continue;
    }
    if (c == '\\') {
      if (i + 1 >= p.size()) return classes.unsupported(i, "trailing backslash");
      const char e = p[i + 1];
      switch (e) {
        case 's':
          out += R"(\p{White_Space})";
          break;
        case 'S':
          out += R"(\P{White_Space})";
          break;
        case 'd':
          out += R"(\p{Nd})";
          break;
        case 'D':
          out += R"(\P{Nd})";
          break;
        case 'w':
          out += "[" + std::string(kWordClassBody) + "]";
          break;
        case 'W':
          out += "[^" + std::string(kWordClassBody) + "]";
          break;
        case 'p':
        case 'P': {
          RECUR_ASSIGN_OR_RETURN(std::string prop, classes.property(i));
          out += prop;
          continue;
        }
        default:
          out += '\\';
          out += e;
      }
      i += 2;
      continue;
    }
    if (c == '(' && p.substr(i).starts_with("(?")) {
      // Inline flags: i, s, x and U mean the same in PCRE2; Rust's u (Unicode) is always on.
      size_t j = i + 2;
      std::string flags;
      while (j < p.size() && std::string_view("imsxUu-").find(p[j]) != std::string_view::npos) {
        if (p[j] == 'm') return classes.unsupported(i, "multi-line flag (?m)");
        if (p[j] != 'u') flags += p[j];
        ++j;
      }
      if (j > i + 2 && j < p.size() && (p[j] == ':' || p[j] == ')')) {
        out += "(?" + flags;
        i = j;
        continue;
      }
    }
    if (c == '.') {
      out += R"([^\n])";
    } else if (c == '$') {
      out += R"(\z)";
    } else if (c == '^') {
      out += R"(\A)";
    } else {
      out += c;
    }
    ++i;
  }
  return out;
}

bool names_kimi_tokenizer(const json& config) {
  if (!config.is_object()) return false;
  auto names_kimi = [](const json& v) {
    return v.is_string() &&
           v.get_ref<const std::string&>().ends_with("tokenization_kimi.TikTokenTokenizer");
  };
  if (const auto it = config.find("auto_map"); it != config.end() && it->is_object()) {
    if (const auto at = it->find("AutoTokenizer"); at != it->end()) {
      if (names_kimi(*at) || (at->is_array() && !at->empty() && names_kimi((*at)[0]))) return true;
    }
  }
  const auto it = config.find("tokenizer_class");
  return it != config.end() && *it == "TikTokenTokenizer";
}

Result<TiktokenConfig> read_tiktoken_config(const json& config, size_t base_tokens,
                                            std::string_view origin) {
  if (!config.is_object()) return make_error(ErrorCode::kCorrupt, "{}: not a JSON object", origin);
  const bool kimi = names_kimi_tokenizer(config);

  TiktokenConfig out;
  if (const auto it = config.find("pat_str"); it != config.end()) {
    if (!it->is_string() || it->get_ref<const std::string&>().empty()) {
      return make_error(ErrorCode::kCorrupt, "{}: \"pat_str\" is not a non-empty string", origin);
    }
    out.pattern = it->get<std::string>();
  } else if (kimi) {
    out.pattern = kKimiPattern;
  } else {
    return make_error(ErrorCode::kUnsupported,
                      "{}: no pre-tokenizer pattern for tiktoken.model: the config has no "
                      "\"pat_str\" and names no tokenizer class whose pattern is known (known: "
                      "tokenization_kimi.TikTokenTokenizer)",
                      origin);
  }
  if (kimi) out.chunks = kKimiChunks;

  out.added_tokens = json::array();
  std::unordered_set<int64_t> listed;
  if (const auto it = config.find("added_tokens_decoder"); it != config.end()) {
    if (!it->is_object()) {
      return make_error(ErrorCode::kCorrupt, "{}: \"added_tokens_decoder\" is not an object",
                        origin);
    }
    for (const auto& [key, entry] : it->items()) {
      int64_t id = -1;
      if (!key.empty() && key.size() <= 10 && key.find_first_not_of("0123456789") == key.npos) {
        id = std::stoll(key);
      }
      if (id < 0 || id > INT32_MAX || !entry.is_object() || !entry.contains("content") ||
          !entry["content"].is_string()) {
        return make_error(ErrorCode::kCorrupt,
                          "{}: added_tokens_decoder entry \"{}\" needs an id in [0, 2^31) as its "
                          "key and a string \"content\"",
                          origin, key);
      }
      json token = entry;
      token["id"] = id;
      token["normalized"] = false;  // no normalizer: matched in the raw text
      out.added_tokens.push_back(std::move(token));
      listed.insert(id);
    }
  }
  if (kimi) {
    for (int k = 0; k < kKimiReservedSpecialTokens; ++k) {
      const int64_t id = int64_t(base_tokens) + k;
      if (listed.contains(id)) continue;
      out.added_tokens.push_back({{"id", id},
                                  {"content", fmt::format("<|reserved_token_{}|>", id)},
                                  {"special", true},
                                  {"normalized", false}});
    }
  }
  return out;
}

}  // namespace recur
