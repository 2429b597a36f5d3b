// Text and ids through Qwen's byte-level BPE and Kimi's tiktoken vocabulary: encoding refuses
// invalid UTF-8 and otherwise round-trips normalized text; any ids decode, streamed or whole,
// to the same valid UTF-8.
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "fuzz_targets.h"
#include "tokenizer/normalizer.h"
#include "tokenizer/tokenizer.h"

namespace recur::fuzz {

namespace {

const Tokenizer& tokenizer(int which) {
  static const auto load = [](const std::string& dir) {
    auto t = Tokenizer::load(dir);
    if (!t.ok()) std::abort();
    return std::move(*t);
  };
  static const Tokenizer qwen =
      load(std::string(RECUR_SOURCE_DIR) + "/models/qwen3next-tiny-realvocab");
  static const Tokenizer kimi =
      load(std::string(RECUR_SOURCE_DIR) + "/tests/data/kimi-tokenizer-tiny");
  return which == 0 ? qwen : kimi;
}

// Whether NFC (Qwen's normalizer) leaves the valid UTF-8 text as it is.
bool is_nfc(std::string_view s) {
  static const Normalizer nfc = Normalizer::from_json(nlohmann::json{{"type", "NFC"}}).value();
  std::string storage;
  auto normalized = nfc.normalize(s, storage);
  return normalized.ok() && *normalized == s;
}

void check_streamed(const Tokenizer& tok, const std::vector<int32_t>& ids, bool skip_special) {
  StreamingDetokenizer stream(tok, skip_special);
  std::string streamed;
  for (int32_t id : ids) {
    std::string piece;
    stream.push(id, &piece);
    FUZZ_CHECK(valid_utf8(piece));
    streamed += piece;
  }
  stream.flush(&streamed);
  const std::string whole = tok.decode(ids, skip_special);
  FUZZ_CHECK(valid_utf8(whole));
  FUZZ_CHECK(streamed == whole);
}

}  // namespace

int fuzz_tokenizer(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t flags = data[0];
  const Tokenizer& tok = tokenizer(flags & 1);
  const std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);

  if (flags & 2) {
    // The bytes as ids: any int32, near the vocabulary's ends more often than not.
    std::vector<int32_t> ids;
    for (size_t i = 0; i + 3 <= text.size(); i += 3) {
      const uint32_t v = uint8_t(text[i]) | uint32_t(uint8_t(text[i + 1])) << 8 |
                         uint32_t(uint8_t(text[i + 2])) << 16;
      ids.push_back((flags & 4) ? int32_t(v * 2654435761u) : int32_t(v % (tok.vocab_size() + 8)));
    }
    check_streamed(tok, ids, false);
    check_streamed(tok, ids, true);
    return 0;
  }

  auto ids = tok.encode(text);
  FUZZ_CHECK(ids.ok() == valid_utf8(text));
  if (!ids.ok()) return 0;
  for (int32_t id : *ids) FUZZ_CHECK(id >= 0 && id < tok.vocab_size());
  const bool normalized = (flags & 1) || is_nfc(text);
  if (normalized) FUZZ_CHECK(tok.decode(*ids) == text);
  check_streamed(tok, *ids, flags & 4);

  // The whole text as request text: no special token comes out of it, and it still decodes
  // to itself.
  if (text.empty()) return 0;  // ranges are never empty
  const std::pair<size_t, size_t> all{0, text.size()};
  auto literal = tok.encode(text, std::span(&all, 1));
  FUZZ_CHECK(literal.ok());
  for (int32_t id : *literal) FUZZ_CHECK(id >= 0 && id < tok.vocab_size() && !tok.is_special(id));
  if (normalized) FUZZ_CHECK(tok.decode(*literal) == text);
  return 0;
}

}  // namespace recur::fuzz
