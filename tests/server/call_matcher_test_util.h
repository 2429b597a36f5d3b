// What the forced-call matcher tests (JSON, XML and Kimi call forms) share: feeding a matcher
// text byte by byte, and checking a constraint's mask against its allows().
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "engine/token_constraint.h"

namespace recur::server {

// How many bytes of `text` a new Matcher of `g` takes after the grammar's primed text
// (text.size(): all); with `whole`, whether the calls are whole there.
template <class Matcher, class Grammar>
size_t bytes_taken(const Grammar& g, std::string_view text, bool* whole = nullptr) {
  Matcher m(&g);
  for (size_t i = 0; i < text.size(); ++i) {
    if (!m.feed(uint8_t(text[i]))) return i;
  }
  if (whole) *whole = m.can_end();
  return text.size();
}

// Whether `text` is whole calls of `g`.
template <class Matcher, class Grammar>
bool whole_calls_of(const Grammar& g, std::string_view text) {
  bool whole = false;
  return bytes_taken<Matcher>(g, text, &whole) == text.size() && whole;
}

// A new constraint of `spec` after the tokens `ids`, masking logits of all ones: whether it
// allowed every one of them, how many tokens the mask keeps, how many of the mask's answers
// differ from allows()' (tokens from n_text on must be masked), and whether it keeps `eos`.
struct MaskAgreement {
  bool fed = true;
  int kept = 0, differ = 0;
  bool eos_kept = false;
};
inline MaskAgreement mask_agreement(const ConstraintSpec& spec, std::span<const int32_t> ids,
                                    int n_text, int32_t eos, std::vector<float>* logits) {
  MaskAgreement out;
  auto con = spec.start();
  for (int32_t t : ids) {
    if (!con->allows(t)) {
      out.fed = false;
      return out;
    }
    con->accept(t);
  }
  std::fill(logits->begin(), logits->end(), 1.0f);
  con->mask(*logits);
  for (int t = 0; t < int(logits->size()); ++t) {
    const bool in = (*logits)[size_t(t)] == 1.0f;
    out.kept += in;
    out.differ += in != (t < n_text && con->allows(t));
  }
  out.eos_kept = (*logits)[size_t(eos)] == 1.0f;
  return out;
}

}  // namespace recur::server
