// UTF-8 and Unicode helpers for the tokenizer (internal to coordinator/tokenizer).
//
// Everything here takes and returns UTF-8 byte strings. Functions documented as
// taking valid UTF-8 do not re-check it: the tokenizer validates its input once.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "common/utf8.h"

namespace penumbra::tokenizer_internal {

// Byte offset of the first byte that does not start a well-formed UTF-8
// sequence (overlongs, surrogates and code points past U+10FFFF are
// ill-formed), or std::string_view::npos when `s` is valid.
size_t FindInvalidUtf8(std::string_view s);

// Length in bytes of the sequence led by `lead` (1 for ASCII and for bytes
// that cannot lead a sequence). Only meaningful on valid UTF-8.
inline size_t Utf8SeqLen(unsigned char lead) {
  if (lead < 0x80) return 1;
  if (lead >= 0xF0) return 4;
  if (lead >= 0xE0) return 3;
  if (lead >= 0xC0) return 2;
  return 1;
}

// Decodes the code point starting at s[*i] (valid UTF-8) and advances *i.
char32_t DecodeUtf8(std::string_view s, size_t* i);
using ::penumbra::AppendUtf8;  // common/utf8.h

// Rust's String::from_utf8_lossy: each maximal ill-formed subpart becomes one
// U+FFFD.
std::string Utf8Lossy(std::string_view bytes);

enum class NormalForm { kNFC, kNFD, kNFKC, kNFKD };
// Unicode normalization of valid UTF-8 `s` (utf8proc).
std::string Normalize(std::string_view s, NormalForm form);
// Unicode lowercase mapping of valid UTF-8 `s`.
std::string Lowercase(std::string_view s);

// The White_Space property (Rust char::is_whitespace, Oniguruma \s).
bool IsWhiteSpace(char32_t c);
// Rust regex \w: alphabetic, marks, decimal digits, connector punctuation.
bool IsWordChar(char32_t c);

// GPT-2 byte-level alphabet: every byte maps to one printable code point.
const std::array<char32_t, 256>& ByteToUnicode();
// Inverse of ByteToUnicode; -1 for code points outside the alphabet.
int UnicodeToByte(char32_t cp);

}  // namespace penumbra::tokenizer_internal
