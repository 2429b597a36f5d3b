// UTF-8 helpers shared by the tokenizer: validation, lossy decoding the way Rust's
// String::from_utf8_lossy does it, and the GPT-2 byte-to-unicode mapping of ByteLevel.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace recur {

// What the bytes at the start of a buffer hold.
struct Utf8Step {
  enum Kind { kChar, kInvalid, kTruncated };
  Kind kind;
  // kChar: bytes of the character. kInvalid: bytes of the maximal invalid subpart (>= 1), which
  // becomes one U+FFFD. kTruncated: the whole buffer, a valid prefix that more bytes could finish.
  size_t length;
};
Utf8Step utf8_step(const uint8_t* p, size_t n);

// A lead byte of a multi-byte character (RFC 3629): how many continuation bytes follow, and the
// range of the first of them (the rest are 0x80-0xBF). False for ASCII and for bytes that
// begin no character.
struct Utf8Lead {
  int continuations;
  uint8_t lo, hi;
};
bool utf8_lead(uint8_t b0, Utf8Lead* lead);

// Byte offset of the first byte that does not begin a valid UTF-8 character, if any.
std::optional<size_t> find_invalid_utf8(std::string_view bytes);

// Appends `bytes` with each invalid subpart (including a truncated tail) replaced by U+FFFD.
void append_utf8_lossy(std::string& out, std::string_view bytes);

// Length of the longest prefix of `bytes` whose lossy decoding cannot change when more bytes are
// appended: all but a trailing truncated character.
size_t utf8_stable_prefix(std::string_view bytes);

// Unicode White_Space, as Rust's char::is_whitespace and Oniguruma's \s use it.
bool is_unicode_white_space(int32_t cp);

void append_utf8(std::string& out, int32_t cp);
// Code point of the valid character of `length` bytes at `p` (length from utf8_step).
int32_t decode_utf8_char(const uint8_t* p, size_t length);

// The ByteLevel alphabet: each byte maps to one printable code point.
int32_t byte_to_unicode(uint8_t byte);
// Inverse of byte_to_unicode; -1 for a code point outside the alphabet.
int unicode_to_byte(int32_t cp);

}  // namespace recur
