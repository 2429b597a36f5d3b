#include "tokenizer/added_vocabulary.h"

#include <algorithm>

#include "tokenizer/utf8_util.h"

namespace recur {

using json = nlohmann::json;

namespace {

// Where the run of white space that ends `text` begins (Rust regex `\s*$`).
size_t trailing_space_start(std::string_view text) {
  const auto* p = reinterpret_cast<const uint8_t*>(text.data());
  size_t i = text.size();
  while (i > 0) {
    size_t start = i - 1;
    while (start > 0 && (p[start] & 0xC0) == 0x80) --start;
    if (!is_unicode_white_space(decode_utf8_char(p + start, i - start))) break;
    i = start;
  }
  return i;
}

// Length of the run of white space that starts `text` (Rust regex `^\s*`).
size_t leading_space_length(std::string_view text) {
  const auto* p = reinterpret_cast<const uint8_t*>(text.data());
  size_t i = 0;
  while (i < text.size()) {
    Utf8Step s = utf8_step(p + i, text.size() - i);
    if (!is_unicode_white_space(decode_utf8_char(p + i, s.length))) break;
    i += s.length;
  }
  return i;
}

Result<bool> json_flag(const json& j, const char* name, bool fallback, std::string_view origin) {
  if (!j.contains(name)) return fallback;
  if (!j[name].is_boolean()) {
    return make_error(ErrorCode::kCorrupt, "{}: added token field \"{}\" is not a bool", origin,
                      name);
  }
  return j[name].get<bool>();
}

}  // namespace

int32_t AddedVocabulary::Matcher::child(int32_t node, uint8_t byte) const {
  for (const auto& [b, next] : nodes_[node].children) {
    if (b == byte) return next;
  }
  return -1;
}

void AddedVocabulary::Matcher::add(std::string_view pattern, int32_t token_index) {
  if (pattern.empty()) return;  // an empty token can never be matched
  int32_t node = 0;
  for (char c : pattern) {
    auto byte = static_cast<uint8_t>(c);
    int32_t next = child(node, byte);
    if (next < 0) {
      next = static_cast<int32_t>(nodes_.size());
      nodes_[node].children.emplace_back(byte, next);
      nodes_.emplace_back();
    }
    node = next;
  }
  // A duplicate content keeps its first token, as the first pattern wins in an Aho-Corasick set.
  if (nodes_[node].token_index < 0) nodes_[node].token_index = token_index;
  first_byte_[static_cast<uint8_t>(pattern[0])] = true;
}

bool AddedVocabulary::Matcher::find(std::string_view text, size_t from, Hit& hit) const {
  const auto* p = reinterpret_cast<const uint8_t*>(text.data());
  for (size_t start = from; start < text.size(); ++start) {
    if (!first_byte_[p[start]]) continue;
    int32_t node = 0;
    int32_t best = -1;
    size_t best_end = 0;
    for (size_t i = start; i < text.size(); ++i) {
      node = child(node, p[i]);
      if (node < 0) break;
      if (nodes_[node].token_index >= 0) {
        best = nodes_[node].token_index;
        best_end = i + 1;
      }
    }
    if (best >= 0) {
      hit = {start, best_end, best};
      return true;
    }
  }
  return false;
}

Result<AddedVocabulary> AddedVocabulary::from_json(const json& added_tokens,
                                                   const Normalizer& normalizer,
                                                   std::string_view origin) {
  AddedVocabulary v;
  RECUR_ASSIGN_OR_RETURN(v.word_char_,
                         Regex::compile(R"([\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\p{Join_Control}])"));
  if (added_tokens.is_null()) return v;
  if (!added_tokens.is_array()) {
    return make_error(ErrorCode::kCorrupt, "{}: added_tokens is not an array", origin);
  }
  for (const json& j : added_tokens) {
    if (!j.is_object() || !j.contains("id") || !j["id"].is_number_integer() ||
        !j.contains("content") || !j["content"].is_string()) {
      return make_error(ErrorCode::kCorrupt,
                        "{}: added token without integer id and string content", origin);
    }
    AddedToken t;
    t.content = j["content"].get<std::string>();
    int64_t id = j["id"].get<int64_t>();
    if (id < 0 || id > INT32_MAX) {
      return make_error(ErrorCode::kCorrupt, "{}: added token \"{}\" has id {}", origin, t.content,
                        id);
    }
    if (find_invalid_utf8(t.content)) {
      return make_error(ErrorCode::kCorrupt, "{}: added token {} is not UTF-8", origin, id);
    }
    t.id = static_cast<int32_t>(id);
    RECUR_ASSIGN_OR_RETURN(t.special, json_flag(j, "special", false, origin));
    RECUR_ASSIGN_OR_RETURN(t.lstrip, json_flag(j, "lstrip", false, origin));
    RECUR_ASSIGN_OR_RETURN(t.rstrip, json_flag(j, "rstrip", false, origin));
    RECUR_ASSIGN_OR_RETURN(t.single_word, json_flag(j, "single_word", false, origin));
    // Hugging Face's default: special tokens are matched raw, others after normalization.
    RECUR_ASSIGN_OR_RETURN(t.normalized, json_flag(j, "normalized", !t.special, origin));
    v.tokens_.push_back(std::move(t));
  }
  for (size_t i = 0; i < v.tokens_.size(); ++i) {
    const AddedToken& t = v.tokens_[i];
    if (t.normalized) {
      std::string storage;
      RECUR_ASSIGN_OR_RETURN(std::string_view normalized, normalizer.normalize(t.content, storage));
      v.normalized_.add(normalized, static_cast<int32_t>(i));
    } else {
      v.raw_.add(t.content, static_cast<int32_t>(i));
    }
  }
  return v;
}

bool AddedVocabulary::is_word_boundary_ok(std::string_view text, size_t start, size_t end) const {
  // single_word: the token may not touch a word character on either side.
  auto is_word_char = [&](std::string_view ch) {
    std::vector<Regex::Match> m;
    return word_char_.find_all(ch, m).ok() && !m.empty();
  };
  if (start > 0) {
    size_t s = start - 1;
    while (s > 0 && (static_cast<uint8_t>(text[s]) & 0xC0) == 0x80) --s;
    if (is_word_char(text.substr(s, start - s))) return false;
  }
  if (end < text.size()) {
    Utf8Step st = utf8_step(reinterpret_cast<const uint8_t*>(text.data()) + end, text.size() - end);
    if (is_word_char(text.substr(end, st.length))) return false;
  }
  return true;
}

bool AddedVocabulary::Literal::overlaps(size_t begin, size_t end) const {
  if (everywhere) return true;
  begin += offset;
  end += offset;
  // The first range ending after `begin`; it overlaps if it starts before `end`.
  auto it =
      std::upper_bound(ranges.begin(), ranges.end(), begin,
                       [](size_t b, const std::pair<size_t, size_t>& r) { return b < r.second; });
  return it != ranges.end() && it->first < end;
}

void AddedVocabulary::split(std::string_view text, bool normalized_tokens,
                            std::vector<Segment>& out, const Literal& literal) const {
  const Matcher& matcher = normalized_tokens ? normalized_ : raw_;
  size_t start_offset = 0;  // end of what has been emitted
  size_t from = 0;          // where the search resumes: after the last match, stripped or not
  Matcher::Hit hit;
  while (!matcher.empty() && from < text.size() && matcher.find(text, from, hit)) {
    from = hit.end;
    const AddedToken& t = tokens_[hit.token_index];
    size_t start = hit.start, stop = hit.end;
    if (t.special && literal.overlaps(start, stop)) continue;
    if (t.single_word && !is_word_boundary_ok(text, start, stop)) continue;
    if (t.lstrip) start = std::max(trailing_space_start(text.substr(0, start)), start_offset);
    if (t.rstrip) stop += leading_space_length(text.substr(stop));
    if (start_offset < start) out.push_back({text.substr(start_offset, start - start_offset), -1});
    out.push_back({text.substr(start, stop - start), t.id});
    start_offset = stop;
  }
  if (start_offset < text.size()) out.push_back({text.substr(start_offset), -1});
}

}  // namespace recur
