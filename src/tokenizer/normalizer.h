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

  // `text` must be valid UTF-8. Returns `text` itself when normalization leaves it unchanged
  // (always for ASCII), else a view of `storage`, which receives the normalized text.
  Result<std::string_view> normalize(std::string_view text, std::string& storage) const;

 private:
  std::vector<Form> forms_;
};

}  // namespace recur
