#include "tokenizer/utf8_util.h"

#include <utf8proc.h>

#include <array>

namespace recur {

bool utf8_lead(uint8_t b0, Utf8Lead* lead) {
  *lead = {0, 0x80, 0xBF};
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    lead->continuations = 1;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    lead->continuations = 2;
    if (b0 == 0xE0) lead->lo = 0xA0;
    if (b0 == 0xED) lead->hi = 0x9F;  // no surrogates
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    lead->continuations = 3;
    if (b0 == 0xF0) lead->lo = 0x90;
    if (b0 == 0xF4) lead->hi = 0x8F;  // nothing above U+10FFFF
  } else {
    return false;
  }
  return true;
}

Utf8Step utf8_step(const uint8_t* p, size_t n) {
  uint8_t b0 = p[0];
  if (b0 < 0x80) return {Utf8Step::kChar, 1};
  Utf8Lead lead;
  if (!utf8_lead(b0, &lead)) return {Utf8Step::kInvalid, 1};
  const size_t need = size_t(lead.continuations) + 1;
  for (size_t i = 1; i < need; ++i) {
    if (i >= n) return {Utf8Step::kTruncated, n};
    uint8_t b = p[i];
    bool ok = i == 1 ? (b >= lead.lo && b <= lead.hi) : (b >= 0x80 && b <= 0xBF);
    if (!ok) return {Utf8Step::kInvalid, i};
  }
  return {Utf8Step::kChar, need};
}

std::optional<size_t> find_invalid_utf8(std::string_view bytes) {
  const auto* p = reinterpret_cast<const uint8_t*>(bytes.data());
  size_t n = bytes.size();
  size_t i = 0;
  while (i < n) {
    if (p[i] < 0x80) {
      ++i;
      continue;
    }
    Utf8Step s = utf8_step(p + i, n - i);
    if (s.kind != Utf8Step::kChar) return i;
    i += s.length;
  }
  return std::nullopt;
}

void append_utf8_lossy(std::string& out, std::string_view bytes) {
  static constexpr std::string_view kReplacement = "\xEF\xBF\xBD";
  const auto* p = reinterpret_cast<const uint8_t*>(bytes.data());
  size_t n = bytes.size();
  size_t i = 0;
  size_t run_start = 0;  // valid bytes are copied in runs
  while (i < n) {
    if (p[i] < 0x80) {
      ++i;
      continue;
    }
    Utf8Step s = utf8_step(p + i, n - i);
    if (s.kind == Utf8Step::kChar) {
      i += s.length;
      continue;
    }
    out.append(bytes.substr(run_start, i - run_start));
    out.append(kReplacement);
    i += s.length;
    run_start = i;
  }
  out.append(bytes.substr(run_start));
}

size_t utf8_stable_prefix(std::string_view bytes) {
  // A truncated character is at most 3 bytes, so only the tail needs a look.
  size_t n = bytes.size();
  const auto* p = reinterpret_cast<const uint8_t*>(bytes.data());
  size_t from = n > 3 ? n - 3 : 0;
  for (size_t i = from; i < n; ++i) {
    if ((p[i] & 0xC0) == 0x80) continue;  // continuation bytes cannot start a character
    Utf8Step s = utf8_step(p + i, n - i);
    if (s.kind == Utf8Step::kTruncated) return i;
    i += s.length - 1;
  }
  return n;
}

bool is_unicode_white_space(int32_t cp) {
  // White_Space is exactly the separators (Zs, Zl, Zp) plus the C0 controls TAB..CR and NEL.
  if (cp < 0x80) return cp == ' ' || (cp >= 0x09 && cp <= 0x0D);
  if (cp == 0x85) return true;
  utf8proc_category_t c = utf8proc_category(cp);
  return c == UTF8PROC_CATEGORY_ZS || c == UTF8PROC_CATEGORY_ZL || c == UTF8PROC_CATEGORY_ZP;
}

void append_utf8(std::string& out, int32_t cp) {
  utf8proc_uint8_t buf[4];
  utf8proc_ssize_t n = utf8proc_encode_char(cp, buf);
  out.append(reinterpret_cast<const char*>(buf), static_cast<size_t>(n));
}

int32_t decode_utf8_char(const uint8_t* p, size_t length) {
  static constexpr uint8_t kLeadMask[5] = {0, 0x7F, 0x1F, 0x0F, 0x07};
  int32_t cp = p[0] & kLeadMask[length];
  for (size_t k = 1; k < length; ++k) cp = (cp << 6) | (p[k] & 0x3F);
  return cp;
}

namespace {

// GPT-2's scheme: printable Latin-1 bytes keep their code point; the others, in byte order,
// take 256, 257, ... so every byte becomes a visible character.
struct ByteLevelAlphabet {
  std::array<int32_t, 256> to_unicode{};
  std::array<int16_t, 256 + 256> to_byte{};

  ByteLevelAlphabet() {
    to_byte.fill(-1);
    int next = 256;
    for (int b = 0; b < 256; ++b) {
      bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      to_unicode[b] = printable ? b : next++;
      to_byte[to_unicode[b]] = static_cast<int16_t>(b);
    }
  }
};

const ByteLevelAlphabet& alphabet() {
  static const ByteLevelAlphabet a;
  return a;
}

}  // namespace

int32_t byte_to_unicode(uint8_t byte) {
  return alphabet().to_unicode[byte];
}

int unicode_to_byte(int32_t cp) {
  if (cp < 0 || cp >= 512) return -1;
  return alphabet().to_byte[cp];
}

}  // namespace recur
