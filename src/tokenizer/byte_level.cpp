#include "tokenizer/byte_level.h"

#include <array>

#include "tokenizer/unicode.h"

namespace spade::tok {

namespace {

struct Alphabet {
  std::array<uint32_t, 256> cp{};          // byte -> code point
  std::array<std::string, 256> utf8;
  std::array<int16_t, 324> back{};         // code point (< 324) -> byte, or -1
  Alphabet() {
    back.fill(-1);
    int extra = 0;
    for (int b = 0; b < 256; ++b) {
      bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
      cp[b] = printable ? uint32_t(b) : uint32_t(256 + extra++);
      uni::append_utf8(utf8[b], cp[b]);
      back[cp[b]] = int16_t(b);
    }
  }
};
const Alphabet& alphabet() {
  static const Alphabet a;
  return a;
}

}  // namespace

const std::string& byte_level_char(uint8_t b) { return alphabet().utf8[b]; }

bool byte_level_decode(std::string_view p, std::string& out) {
  const Alphabet& a = alphabet();
  out.clear();
  for (size_t i = 0; i < p.size();) {
    size_t len;
    uint32_t cp = uni::decode(p.data() + i, p.size() - i, len);
    if (cp >= a.back.size() || a.back[cp] < 0 || (cp == 0xFFFD && len == 1)) return false;
    out.push_back(char(a.back[cp]));
    i += len;
  }
  return true;
}

std::string byte_level_encode(std::string_view bytes) {
  std::string out;
  for (unsigned char c : bytes) out += alphabet().utf8[c];
  return out;
}

}  // namespace spade::tok
