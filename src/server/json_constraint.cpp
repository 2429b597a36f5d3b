// The JSON schema constraint (json_constraint.h). Masking a step tries each byte once to find
// the first bytes the matcher takes, skips the tokens that start otherwise, and admits the
// string-safe tokens unchecked while only free strings are open; the rest run the matcher.
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

// What every sequence's constraint reads: shared, immutable.
struct JsonSpecData {
  std::shared_ptr<const CompiledSchema> schema;
  std::shared_ptr<const VocabularyBytes> vocab;
  std::vector<int32_t> end_ids;
  std::string marker;
};

class JsonConstraint final : public TokenConstraint {
 public:
  explicit JsonConstraint(std::shared_ptr<const JsonSpecData> spec)
      : spec_(std::move(spec)),
        vocab_(spec_->vocab.get()),
        end_ids_(&spec_->end_ids),
        marker_(&spec_->marker),
        matcher_(spec_->schema.get()),
        scratch_(spec_->schema.get()),
        first_(spec_->schema.get()),
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

  std::shared_ptr<const JsonSpecData> spec_;  // kept alive by the constraint
  const VocabularyBytes* vocab_;              // spec_'s
  const std::vector<int32_t>* end_ids_;       // spec_'s
  const std::string* marker_;                 // spec_'s
  JsonMatcher matcher_;                       // the text so far
  JsonMatcher scratch_;                       // a copy for trying tokens
  JsonMatcher first_;                         // the text and one byte more
  std::vector<uint8_t> allowed_;              // [vocab] mask's scratch
  bool active_;
  size_t matched_ = 0;  // bytes of the marker seen
};

class JsonConstraintSpec final : public ConstraintSpec {
 public:
  explicit JsonConstraintSpec(std::shared_ptr<const JsonSpecData> data) : data_(std::move(data)) {}
  std::unique_ptr<TokenConstraint> start() const override {
    return std::make_unique<JsonConstraint>(data_);
  }

 private:
  std::shared_ptr<const JsonSpecData> data_;
};

}  // namespace

std::shared_ptr<const ConstraintSpec> json_constraint(std::shared_ptr<const CompiledSchema> schema,
                                                      std::shared_ptr<const VocabularyBytes> vocab,
                                                      std::vector<int32_t> end_ids,
                                                      std::string active_after) {
  auto data = std::make_shared<const JsonSpecData>(JsonSpecData{
      std::move(schema), std::move(vocab), std::move(end_ids), std::move(active_after)});
  return std::make_shared<JsonConstraintSpec>(std::move(data));
}

}  // namespace recur::server
