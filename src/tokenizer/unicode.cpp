#include "tokenizer/unicode.h"

namespace spade::uni {

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out.push_back(char(cp));
  } else if (cp < 0x800) {
    out.push_back(char(0xC0 | (cp >> 6)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(char(0xE0 | (cp >> 12)));
    out.push_back(char(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(char(0xF0 | (cp >> 18)));
    out.push_back(char(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(char(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  }
}

namespace {

// Allowed range of the second byte after `lead`, and the total length; len 0: bad lead.
struct Lead {
  unsigned char lo, hi;
  int len;
};
Lead lead_info(unsigned char c) {
  if (c >= 0xC2 && c <= 0xDF) return {0x80, 0xBF, 2};
  if (c == 0xE0) return {0xA0, 0xBF, 3};
  if ((c >= 0xE1 && c <= 0xEC) || c == 0xEE || c == 0xEF) return {0x80, 0xBF, 3};
  if (c == 0xED) return {0x80, 0x9F, 3};
  if (c == 0xF0) return {0x90, 0xBF, 4};
  if (c >= 0xF1 && c <= 0xF3) return {0x80, 0xBF, 4};
  if (c == 0xF4) return {0x80, 0x8F, 4};
  return {0, 0, 0};
}

// Number of bytes of s (starting at a lead byte >= 0x80) forming a valid prefix of a
// sequence, and the sequence's full length.
size_t matched(std::string_view s, int& full) {
  auto* u = reinterpret_cast<const unsigned char*>(s.data());
  Lead l = lead_info(u[0]);
  full = l.len;
  if (!l.len) return 0;
  size_t k = 1;
  if (k < s.size() && u[k] >= l.lo && u[k] <= l.hi) {
    ++k;
    while (k < size_t(l.len) && k < s.size() && (u[k] & 0xC0) == 0x80) ++k;
  }
  return k;
}

}  // namespace

size_t valid_prefix(std::string_view s) {
  size_t i = 0, n = s.size();
  auto* u = reinterpret_cast<const unsigned char*>(s.data());
  while (i < n) {
    // ASCII fast path, 8 bytes at a time.
    while (i + 8 <= n) {
      uint64_t w;
      __builtin_memcpy(&w, u + i, 8);
      if (w & 0x8080808080808080ull) break;
      i += 8;
    }
    if (i >= n) break;
    if (u[i] < 0x80) { ++i; continue; }
    int full = 0;
    size_t k = matched(s.substr(i), full);
    if (!full || k != size_t(full)) return i;
    i += k;
  }
  return n;
}

size_t invalid_run(std::string_view s) {
  int full = 0;
  size_t k = matched(s, full);
  return k == 0 ? 1 : k;
}

std::string repair(std::string_view s) {
  std::string out;
  out.reserve(s.size() + 8);
  while (!s.empty()) {
    size_t ok = valid_prefix(s);
    out.append(s.data(), ok);
    s.remove_prefix(ok);
    if (s.empty()) break;
    out.append("\xEF\xBF\xBD");
    s.remove_prefix(invalid_run(s));
  }
  return out;
}

size_t incomplete_tail(std::string_view s) {
  size_t n = s.size();
  for (size_t back = 1; back <= 3 && back <= n; ++back) {
    auto c = static_cast<unsigned char>(s[n - back]);
    if ((c & 0xC0) == 0x80) continue;  // continuation byte: keep looking for the lead
    if (c < 0x80) return 0;
    int full = 0;
    size_t k = matched(s.substr(n - back), full);
    return (full && k == back && size_t(full) > back) ? back : 0;
  }
  return 0;
}

}  // namespace spade::uni
