// The JSON schema and forced tool call constraints (json_constraint.h): one constraint over
// any of the matchers (JsonMatcher, ToolCallMatcher, XmlCallMatcher, KimiCallMatcher). Masking a
// step tries each byte once to find the first bytes the matcher takes, skips the tokens that
// start otherwise, and admits the string-safe tokens unchecked while only free strings are open;
// the rest run the matcher.
#include "server/json_constraint.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "tokenizer/utf8_util.h"

namespace recur::server {

std::shared_ptr<const VocabularyBytes> VocabularyBytes::build(const Tokenizer& tokenizer) {
  auto v = std::make_shared<VocabularyBytes>();
  const int n = tokenizer.vocab_size();
  v->bytes.resize(size_t(n));
  v->control.assign(size_t(n), 0);
  v->string_safe.assign(size_t(n), 0);
  v->chars.assign(size_t(n), 0);
  for (int id = 0; id < n; ++id) {
    const std::string_view b = tokenizer.id_to_bytes(id);
    v->bytes[size_t(id)] = std::string(b);
    v->control[size_t(id)] = b.empty() || tokenizer.is_special(id);
    bool safe = !v->control[size_t(id)] && !find_invalid_utf8(b).has_value();
    for (char c : b) safe = safe && uint8_t(c) >= 0x20 && c != '"' && c != '\\';
    v->string_safe[size_t(id)] = safe;
    if (safe) {  // UTF-8 characters: the bytes that are not continuation bytes
      size_t chars = 0;
      for (char c : b) chars += (uint8_t(c) & 0xC0) != 0x80;
      v->chars[size_t(id)] = uint16_t(std::min<size_t>(chars, 0xFFFF));
    }
    if (!v->control[size_t(id)]) v->by_first[uint8_t(b[0])].push_back(id);
  }
  return v;
}

namespace {

// The Kimi marker whose text `s` starts with; kMarkers.size() when none.
size_t kimi_marker_at(std::string_view s) {
  const auto& markers = KimiCallGrammar::kMarkers;
  size_t m = 0;
  while (m < markers.size() && !s.starts_with(markers[m])) ++m;
  return m;
}

// What every sequence's constraint reads: shared, immutable. `Grammar` is what the matcher
// follows (a compiled schema, or a forced call's grammar).
template <class Grammar>
struct SpecData {
  std::shared_ptr<const Grammar> grammar;
  std::shared_ptr<const VocabularyBytes> vocab;
  std::vector<int32_t> end_ids;
  std::string marker;
  // String-safe tokens that free strings may not take unchecked (a forced call's close tag).
  std::vector<int32_t> recheck;
};

template <class Matcher, class Grammar>
class MatcherConstraint final : public TokenConstraint {
 public:
  explicit MatcherConstraint(std::shared_ptr<const SpecData<Grammar>> spec)
      : spec_(std::move(spec)),
        vocab_(spec_->vocab.get()),
        end_ids_(&spec_->end_ids),
        marker_(&spec_->marker),
        matcher_(spec_->grammar.get()),
        scratch_(spec_->grammar.get()),
        first_(spec_->grammar.get()),
        active_(marker_->empty()) {
    allowed_.reserve(vocab_->bytes.size() + 4096);  // models pad their vocabularies a little
  }

  bool allows(int32_t token) override {
    if (!active_) return true;
    if (is_end(token)) return matcher_.can_end();
    if (token < 0 || size_t(token) >= vocab_->bytes.size() || vocab_->control[size_t(token)]) {
      return false;
    }
    scratch_.copy_from(matcher_);
    return scratch_.feed(vocab_->bytes[size_t(token)]);
  }

  void mask(std::span<float> logits) override {
    if (!active_) return;
    // Which tokens continue the text: while only strings are open, the string-safe ones that
    // fit their length at once; then, by first byte, those whose first two bytes the matcher
    // takes, each run to its end.
    const size_t n_text = vocab_->bytes.size();
    allowed_.assign(logits.size(), 0);
    if (const int room = matcher_.free_string_room(); room > 0) {
      const size_t n = std::min(n_text, logits.size());
      const uint8_t* safe = vocab_->string_safe.data();
      const uint16_t* chars = vocab_->chars.data();
      for (size_t id = 0; id < n; ++id) allowed_[id] = safe[id] && int(chars[id]) <= room;
      for (int32_t id : spec_->recheck) {
        if (size_t(id) < n && allowed_[size_t(id)]) {
          scratch_.copy_from(matcher_);
          allowed_[size_t(id)] = scratch_.feed(vocab_->bytes[size_t(id)]);
        }
      }
    }
    for (int b = 0; b < 256; ++b) {
      if (vocab_->by_first[size_t(b)].empty()) continue;
      first_.copy_from(matcher_);
      if (!first_.feed(uint8_t(b))) continue;
      bool second_known[256] = {}, second_ok[256] = {};
      for (int32_t id : vocab_->by_first[size_t(b)]) {
        if (size_t(id) >= logits.size() || allowed_[size_t(id)]) continue;
        const std::string& t = vocab_->bytes[size_t(id)];
        if (t.size() > 1) {
          const uint8_t c = uint8_t(t[1]);
          if (!second_known[c]) {
            scratch_.copy_from(first_);
            second_known[c] = true, second_ok[c] = scratch_.feed(c);
          }
          if (!second_ok[c]) continue;
          if (t.size() > 2) {
            scratch_.copy_from(first_);
            if (!scratch_.feed(std::string_view(t).substr(1))) continue;
          }
        }
        allowed_[size_t(id)] = 1;
      }
    }
    const bool end_ok = matcher_.can_end();
    for (int32_t id : *end_ids_) {
      if (id >= 0 && size_t(id) < logits.size()) allowed_[size_t(id)] = end_ok;
    }
    constexpr float kNone = -std::numeric_limits<float>::infinity();
    size_t kept = 0;
    for (size_t id = 0; id < logits.size(); ++id) {
      if (!allowed_[id]) logits[id] = kNone;
      kept += allowed_[id] && logits[id] != kNone;
    }
    if (kept == 0) {
      // Nothing the logits allow continues the value (a bias of -100 on every way on, say):
      // the end tokens stay, so the sequence ends rather than writes text the schema refuses.
      for (int32_t id : *end_ids_) {
        if (id >= 0 && size_t(id) < logits.size()) logits[size_t(id)] = 0.0f;
      }
    }
  }

  void accept(int32_t token) override {
    if (token < 0 || size_t(token) >= vocab_->bytes.size() || is_end(token)) return;
    const std::string& b = vocab_->bytes[size_t(token)];
    if (active_) {
      (void)matcher_.feed(b);  // the sampler drew it from the tokens allows() admits
      return;
    }
    // Looking for the marker; the JSON starts after it (the rest of its token included).
    const std::string& m = *marker_;
    for (size_t i = 0; i < b.size(); ++i) {
      if (b[i] == m[matched_]) {
        if (++matched_ == m.size()) {
          active_ = true;
          (void)matcher_.feed(std::string_view(b).substr(i + 1));
          return;
        }
      } else {
        matched_ = b[i] == m[0] ? 1 : 0;
      }
    }
  }

 private:
  bool is_end(int32_t token) const {
    return std::find(end_ids_->begin(), end_ids_->end(), token) != end_ids_->end();
  }

  std::shared_ptr<const SpecData<Grammar>> spec_;  // kept alive by the constraint
  const VocabularyBytes* vocab_;                   // spec_'s
  const std::vector<int32_t>* end_ids_;            // spec_'s
  const std::string* marker_;                      // spec_'s
  Matcher matcher_;                                // the text so far
  Matcher scratch_;                                // a copy for trying tokens
  Matcher first_;                                  // the text and one byte more
  std::vector<uint8_t> allowed_;                   // [vocab] mask's scratch
  bool active_;
  size_t matched_ = 0;  // bytes of the marker seen
};

template <class Matcher, class Grammar>
class MatcherConstraintSpec final : public ConstraintSpec {
 public:
  explicit MatcherConstraintSpec(std::shared_ptr<const SpecData<Grammar>> data)
      : data_(std::move(data)) {}
  std::unique_ptr<TokenConstraint> start() const override {
    return std::make_unique<MatcherConstraint<Matcher, Grammar>>(data_);
  }

 private:
  std::shared_ptr<const SpecData<Grammar>> data_;
};

// The string-safe tokens that hold `forbidden` whole (Qwen's `</tool_call>` token): a free
// string's fast path would admit them wherever they stand, and the call would end there.
std::vector<int32_t> tokens_holding(const VocabularyBytes& vocab, std::string_view forbidden) {
  std::vector<int32_t> found;
  if (forbidden.empty()) return found;
  for (size_t id = 0; id < vocab.bytes.size(); ++id) {
    if (vocab.string_safe[id] && vocab.bytes[id].find(forbidden) != std::string::npos) {
      found.push_back(int32_t(id));
    }
  }
  return found;
}

// The forced prefix (in the prompt) has closed any reasoning: the call starts at once.
template <class Matcher, class Grammar>
std::shared_ptr<const ConstraintSpec> forced_call_constraint(
    std::shared_ptr<const Grammar> grammar, std::shared_ptr<const VocabularyBytes> vocab,
    std::vector<int32_t> end_ids) {
  std::vector<int32_t> recheck = tokens_holding(*vocab, grammar->forbidden);
  auto data = std::make_shared<const SpecData<Grammar>>(SpecData<Grammar>{
      std::move(grammar), std::move(vocab), std::move(end_ids), "", std::move(recheck)});
  return std::make_shared<MatcherConstraintSpec<Matcher, Grammar>>(std::move(data));
}

}  // namespace

std::shared_ptr<const ConstraintSpec> json_constraint(std::shared_ptr<const CompiledSchema> schema,
                                                      std::shared_ptr<const VocabularyBytes> vocab,
                                                      std::vector<int32_t> end_ids,
                                                      std::string active_after) {
  auto data = std::make_shared<const SpecData<CompiledSchema>>(SpecData<CompiledSchema>{
      std::move(schema), std::move(vocab), std::move(end_ids), std::move(active_after), {}});
  return std::make_shared<MatcherConstraintSpec<JsonMatcher, CompiledSchema>>(std::move(data));
}

std::shared_ptr<const ConstraintSpec> tool_call_constraint(
    std::shared_ptr<const ToolCallGrammar> grammar, std::shared_ptr<const VocabularyBytes> vocab,
    std::vector<int32_t> end_ids) {
  return forced_call_constraint<ToolCallMatcher>(std::move(grammar), std::move(vocab),
                                                 std::move(end_ids));
}

std::shared_ptr<const ConstraintSpec> xml_call_constraint(
    std::shared_ptr<const XmlCallGrammar> grammar, std::shared_ptr<const VocabularyBytes> vocab,
    std::vector<int32_t> end_ids) {
  return forced_call_constraint<XmlCallMatcher>(std::move(grammar), std::move(vocab),
                                                std::move(end_ids));
}

std::shared_ptr<const VocabularyBytes> kimi_call_vocabulary(const Tokenizer& tokenizer,
                                                            const VocabularyBytes& base) {
  using G = KimiCallGrammar;
  std::array<int32_t, G::kMarkers.size()> marker_ids{};
  for (size_t m = 0; m < G::kMarkers.size(); ++m) {
    const auto id = tokenizer.token_to_id(G::kMarkers[m]);
    if (!id || *id < 0 || size_t(*id) >= base.bytes.size()) return nullptr;
    marker_ids[m] = *id;
  }
  const auto reserved = [](char c) {
    return uint8_t(c) >= G::kMarkerByte && uint8_t(c) < G::kMarkerByte + G::kMarkers.size();
  };
  auto v = std::make_shared<VocabularyBytes>(base);
  for (auto& first : v->by_first) first.clear();
  for (size_t id = 0; id < v->bytes.size(); ++id) {
    std::string& b = v->bytes[id];
    const auto marker = std::find(marker_ids.begin(), marker_ids.end(), int32_t(id));
    if (marker != marker_ids.end()) {
      b.assign(1, char(G::kMarkerByte + (marker - marker_ids.begin())));
      v->control[id] = 0, v->string_safe[id] = 0;
    } else if (!v->control[id] && std::any_of(b.begin(), b.end(), reserved)) {
      v->control[id] = 1, v->string_safe[id] = 0;  // it would read as a marker
    } else if (!v->control[id] && b.find(G::kMarkerStart) != std::string::npos) {
      // A text token holding a marker's text whole (an added token with the rest of a call,
      // say) reads as the marker it spells; its text stays the parser's either way.
      std::string read;
      for (size_t i = 0; i < b.size();) {
        const size_t m = kimi_marker_at(std::string_view(b).substr(i));
        read += m < G::kMarkers.size() ? char(G::kMarkerByte + m) : b[i];
        i += m < G::kMarkers.size() ? G::kMarkers[m].size() : 1;
      }
      if (read.size() != b.size()) b = std::move(read), v->string_safe[id] = 0;
    }
    if (!v->control[id]) v->by_first[uint8_t(b[0])].push_back(int32_t(id));
  }
  return v;
}

std::shared_ptr<const ConstraintSpec> kimi_call_constraint(
    std::shared_ptr<const KimiCallGrammar> grammar, std::shared_ptr<const VocabularyBytes> vocab,
    std::vector<int32_t> end_ids) {
  return forced_call_constraint<KimiCallMatcher>(std::move(grammar), std::move(vocab),
                                                 std::move(end_ids));
}

}  // namespace recur::server
