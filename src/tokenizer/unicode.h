// UTF-8 and Unicode character properties for the tokenizer: decoding, lossy repair of
// invalid input (as Python's errors="replace" and Rust's from_utf8_lossy do), and the
// general-category / White_Space lookups the pre-tokenizer splitters need.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "tokenizer/unicode_data.h"

namespace spade::uni {

// General categories, in the order of the generated tables.
enum Cat : uint8_t {
  Cn, Lu, Ll, Lt, Lm, Lo, Mn, Mc, Me, Nd, Nl, No, Pc, Pd, Ps, Pe, Pi, Pf, Po, Sm, Sc, Sk, So,
  Zs, Zl, Zp, Cc, Cf, Cs, Co,
};

inline uint8_t props(uint32_t cp) {
  if (cp >= 0x110000) return Cn;
  return unicode_data::kPropStage2[(size_t(unicode_data::kPropStage1[cp >> 8]) << 8) | (cp & 0xFF)];
}
inline Cat category(uint32_t cp) { return Cat(props(cp) & 0x1F); }
inline bool is_letter(uint32_t cp) { uint8_t c = props(cp) & 0x1F; return c >= Lu && c <= Lo; }
inline bool is_number(uint32_t cp) { uint8_t c = props(cp) & 0x1F; return c >= Nd && c <= No; }
inline bool is_mark(uint32_t cp) { uint8_t c = props(cp) & 0x1F; return c >= Mn && c <= Me; }
inline bool is_space(uint32_t cp) { return (props(cp) & 0x20) != 0; }  // White_Space
inline bool nfc_unsafe(uint32_t cp) { return (props(cp) & 0x40) != 0; }
inline uint8_t combining_class(uint32_t cp) {
  if (cp >= 0x110000) return 0;
  return unicode_data::kCccStage2[(size_t(unicode_data::kCccStage1[cp >> 8]) << 8) | (cp & 0xFF)];
}

// Decodes the (valid) UTF-8 sequence at s[0..n); sets `len` to its byte length. On an
// invalid or truncated sequence returns 0xFFFD with len = 1. Requires n > 0.
inline uint32_t decode(const char* s, size_t n, size_t& len) {
  const auto* u = reinterpret_cast<const unsigned char*>(s);
  unsigned char c = u[0];
  if (c < 0x80) { len = 1; return c; }
  if (c >= 0xC2 && c < 0xE0 && n >= 2 && (u[1] & 0xC0) == 0x80) {
    len = 2;
    return (uint32_t(c & 0x1F) << 6) | (u[1] & 0x3F);
  }
  if (c >= 0xE0 && c < 0xF0 && n >= 3 && (u[1] & 0xC0) == 0x80 && (u[2] & 0xC0) == 0x80) {
    uint32_t cp = (uint32_t(c & 0x0F) << 12) | (uint32_t(u[1] & 0x3F) << 6) | (u[2] & 0x3F);
    if (cp >= 0x800 && (cp < 0xD800 || cp > 0xDFFF)) { len = 3; return cp; }
  }
  if (c >= 0xF0 && c < 0xF5 && n >= 4 && (u[1] & 0xC0) == 0x80 && (u[2] & 0xC0) == 0x80 &&
      (u[3] & 0xC0) == 0x80) {
    uint32_t cp = (uint32_t(c & 0x07) << 18) | (uint32_t(u[1] & 0x3F) << 12) |
                  (uint32_t(u[2] & 0x3F) << 6) | (u[3] & 0x3F);
    if (cp >= 0x10000 && cp < 0x110000) { len = 4; return cp; }
  }
  len = 1;
  return 0xFFFD;
}

void append_utf8(std::string& out, uint32_t cp);
inline size_t utf8_len(unsigned char lead) {
  return lead < 0x80 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4;
}

// Length of the longest prefix of s that is valid UTF-8.
size_t valid_prefix(std::string_view s);
inline bool is_valid(std::string_view s) { return valid_prefix(s) == s.size(); }
// Length of the maximal invalid subpart starting at s[0] (s[0] begins no valid sequence):
// the bytes that one U+FFFD replaces under the W3C/Unicode "maximal subpart" practice.
size_t invalid_run(std::string_view s);
// s with every maximal invalid subpart replaced by U+FFFD.
std::string repair(std::string_view s);
// Number of bytes at the end of s that could begin a valid sequence not yet complete
// (0..3): what a streaming decoder must hold back.
size_t incomplete_tail(std::string_view s);

}  // namespace spade::uni
