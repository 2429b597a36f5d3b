// The `normalizer` section of tokenizer.json: Unicode normalization forms (via utf8proc),
// alone or in a Sequence.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace recur {

class Normalizer {
 public:
  enum class Form { kNFC, kNFD, kNFKC, kNFKD };

  // Accepts null (no normalization), NFC, NFD, NFKC, NFKD and Sequence of those.
  static Result<Normalizer> from_json(const nlohmann::json& j);

  // How many times fewer bytes normalization may leave of a text, at most: 1 without any form;
  // 4 with one (NFKC maps a 4-byte mathematical letter to one ASCII byte; NFC composes 9 bytes
  // of Hangul jamo into a 3-byte syllable).
  size_t max_shrink() const { return forms_.empty() ? 1 : 4; }
  // `text` must be valid UTF-8. Returns `text` itself when normalization leaves it unchanged
  // (always for ASCII), else a view of `storage`, which receives the normalized text.
  Result<std::string_view> normalize(std::string_view text, std::string& storage) const;

 private:
  std::vector<Form> forms_;
};

}  // namespace recur
