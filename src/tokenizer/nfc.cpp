#include "tokenizer/nfc.h"

#include <algorithm>
#include <vector>

#include "tokenizer/unicode.h"

namespace spade {

namespace {

constexpr uint32_t SBase = 0xAC00, LBase = 0x1100, VBase = 0x1161, TBase = 0x11A7;
constexpr uint32_t LCount = 19, VCount = 21, TCount = 28, NCount = VCount * TCount,
                   SCount = LCount * NCount;

void decompose(uint32_t cp, std::vector<uint32_t>& out) {
  if (cp >= SBase && cp < SBase + SCount) {
    uint32_t s = cp - SBase;
    out.push_back(LBase + s / NCount);
    out.push_back(VBase + (s % NCount) / TCount);
    if (s % TCount) out.push_back(TBase + s % TCount);
    return;
  }
  using unicode_data::kDecomp;
  const auto* end = kDecomp + unicode_data::kDecompCount;
  const auto* it = std::lower_bound(kDecomp, end, cp,
                                    [](const unicode_data::DecompEntry& e, uint32_t v) { return e.cp < v; });
  if (it == end || it->cp != cp) {
    out.push_back(cp);
    return;
  }
  for (uint32_t k = 0; k < it->len; ++k) decompose(unicode_data::kDecompPool[it->offset + k], out);
}

// The primary composite of (a, b), or 0.
uint32_t compose(uint32_t a, uint32_t b) {
  if (a >= LBase && a < LBase + LCount && b >= VBase && b < VBase + VCount)
    return SBase + ((a - LBase) * VCount + (b - VBase)) * TCount;
  if (a >= SBase && a < SBase + SCount && (a - SBase) % TCount == 0 && b > TBase &&
      b < TBase + TCount)
    return a + (b - TBase);
  uint64_t key = (uint64_t(a) << 21) | b;
  using unicode_data::kComp;
  const auto* end = kComp + unicode_data::kCompCount;
  const auto* it = std::lower_bound(kComp, end, key,
                                    [](const unicode_data::CompEntry& e, uint64_t v) { return e.key < v; });
  return (it != end && it->key == key) ? it->composite : 0;
}

}  // namespace

bool nfc_quick_check(std::string_view s) {
  const auto* u = reinterpret_cast<const unsigned char*>(s.data());
  size_t n = s.size();
  for (size_t i = 0; i < n;) {
    if (u[i] < 0xCC) {  // below U+0300 (or a continuation byte): nothing NFC touches
      ++i;
      continue;
    }
    size_t len;
    uint32_t cp = uni::decode(s.data() + i, n - i, len);
    if (uni::nfc_unsafe(cp)) return false;
    i += len;
  }
  return true;
}

std::string nfc(std::string_view s) {
  std::vector<uint32_t> d;
  d.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    size_t len;
    uint32_t cp = uni::decode(s.data() + i, s.size() - i, len);
    decompose(cp, d);
    i += len;
  }
  // Canonical ordering: stable sort of each run of non-starters by combining class.
  for (size_t i = 0; i < d.size();) {
    if (uni::combining_class(d[i]) == 0) { ++i; continue; }
    size_t j = i;
    while (j < d.size() && uni::combining_class(d[j]) != 0) ++j;
    std::stable_sort(d.begin() + i, d.begin() + j, [](uint32_t a, uint32_t b) {
      return uni::combining_class(a) < uni::combining_class(b);
    });
    i = j;
  }
  // Canonical composition.
  if (!d.empty()) {
    size_t starter = 0, out = 1;
    int last_class = uni::combining_class(d[0]);
    bool have_starter = last_class == 0;
    if (last_class != 0) last_class = 256;
    for (size_t i = 1; i < d.size(); ++i) {
      uint32_t ch = d[i];
      int cls = uni::combining_class(ch);
      uint32_t comp = have_starter ? compose(d[starter], ch) : 0;
      if (comp && (last_class < cls || last_class == 0)) {
        d[starter] = comp;
        continue;
      }
      if (cls == 0) {
        starter = out;
        have_starter = true;
      }
      last_class = cls;
      d[out++] = ch;
    }
    d.resize(out);
  }
  std::string r;
  r.reserve(s.size());
  for (uint32_t cp : d) uni::append_utf8(r, cp);
  return r;
}

}  // namespace spade
