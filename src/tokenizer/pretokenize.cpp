#include "tokenizer/pretokenize.h"

#include "core/error.h"
#include "tokenizer/pretokenize_pcre.h"
#include "tokenizer/unicode.h"

namespace spade::tok {

const char* const kGpt2Regex =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
const char* const kLlama3Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
const char* const kQwen2Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

KnownRegex identify_regex(std::string_view p) {
  if (p == kGpt2Regex) return KnownRegex::Gpt2;
  if (p == kLlama3Regex) return KnownRegex::Llama3;
  if (p == kQwen2Regex) return KnownRegex::Qwen2;
  return KnownRegex::None;
}

namespace {

// Character classes of the split regexes: \p{L}, \p{N}, \s (White_Space), [\r\n].
enum : uint8_t { kL = 1, kN = 2, kS = 4, kNL = 8 };

struct AsciiTable {
  uint8_t c[128];
  constexpr AsciiTable() : c() {
    for (int i = 0; i < 128; ++i) {
      uint8_t v = 0;
      if ((i >= 'a' && i <= 'z') || (i >= 'A' && i <= 'Z')) v = kL;
      if (i >= '0' && i <= '9') v = kN;
      if (i == ' ' || (i >= 9 && i <= 13)) v = kS;
      if (i == '\r' || i == '\n') v |= kNL;
      c[i] = v;
    }
  }
};
constexpr AsciiTable kAscii;

inline uint8_t cls(const char* s, size_t n, size_t& len) {
  auto c = static_cast<unsigned char>(s[0]);
  if (c < 0x80) {
    len = 1;
    return kAscii.c[c];
  }
  uint32_t cp = uni::decode(s, n, len);
  uint8_t p = uni::props(cp);
  uint8_t cat = p & 0x1F;
  uint8_t v = (cat >= uni::Lu && cat <= uni::Lo) ? kL : (cat >= uni::Nd && cat <= uni::No) ? kN : 0;
  if (p & 0x20) v |= kS;
  return v;
}
inline bool other(uint8_t c) { return (c & (kL | kN | kS)) == 0; }

// End of the run of characters whose class has any of `mask` (want=true) or none of
// kL|kN|kS (want=false), starting at i.
inline size_t run_of(const char* s, size_t n, size_t i, uint8_t mask) {
  while (i < n) {
    size_t l;
    uint8_t c = cls(s + i, n - i, l);
    if (!(c & mask)) break;
    i += l;
  }
  return i;
}
inline size_t run_other(const char* s, size_t n, size_t i) {
  while (i < n) {
    size_t l;
    uint8_t c = cls(s + i, n - i, l);
    if (!other(c)) break;
    i += l;
  }
  return i;
}

// \s+(?!\S) | \s+ at a whitespace character; also reports the end of the last [\r\n].
inline size_t whitespace_tail(const char* s, size_t n, size_t& nl_end) {
  size_t i = 0, last_start = 0;
  nl_end = 0;
  while (i < n) {
    size_t l;
    uint8_t c = cls(s + i, n - i, l);
    if (!(c & kS)) break;
    last_start = i;
    i += l;
    if (c & kNL) nl_end = i;
  }
  if (i == n) return i;          // \s+ up to the end: (?!\S) holds
  if (last_start > 0) return last_start;  // give back one to satisfy (?!\S)
  return i;                      // single whitespace before \S: plain \s+
}

inline bool ieq(char c, char lower) { return c == lower || c == lower - 32; }

}  // namespace

size_t match_gpt2(const char* s, size_t n) {
  if (s[0] == '\'' && n >= 2) {
    char a = s[1];
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
    if (n >= 3 && ((a == 'r' && s[2] == 'e') || (a == 'v' && s[2] == 'e') ||
                   (a == 'l' && s[2] == 'l')))
      return 3;
  }
  size_t l0;
  uint8_t c = cls(s, n, l0);
  size_t start = 0, l = l0;
  if (s[0] == ' ' && n > 1) {
    size_t l1;
    uint8_t c1 = cls(s + 1, n - 1, l1);
    if (!(c1 & kS)) {
      start = 1;
      c = c1;
      l = l1;
    }
  }
  if (c & kL) return run_of(s, n, start + l, kL);
  if (c & kN) return run_of(s, n, start + l, kN);
  if (other(c)) return run_other(s, n, start + l);
  size_t nl_end;
  return whitespace_tail(s, n, nl_end);
}

size_t match_llama3(const char* s, size_t n, int max_digits) {
  if (s[0] == '\'' && n >= 2) {
    char a = s[1];
    if (ieq(a, 's') || ieq(a, 't') || ieq(a, 'm') || ieq(a, 'd')) return 2;
    if (n >= 3 && ((ieq(a, 'r') && ieq(s[2], 'e')) || (ieq(a, 'v') && ieq(s[2], 'e')) ||
                   (ieq(a, 'l') && ieq(s[2], 'l'))))
      return 3;
    // (?i) also folds U+017F LATIN SMALL LETTER LONG S to 's'.
    if (n >= 3 && static_cast<unsigned char>(s[1]) == 0xC5 &&
        static_cast<unsigned char>(s[2]) == 0xBF)
      return 3;
  }
  size_t l0;
  uint8_t c0 = cls(s, n, l0);
  if (c0 & kL) return run_of(s, n, l0, kL);
  if (!(c0 & (kN | kNL)) && l0 < n) {  // [^\r\n\p{L}\p{N}]?\p{L}+
    size_t l1;
    uint8_t c1 = cls(s + l0, n - l0, l1);
    if (c1 & kL) return run_of(s, n, l0 + l1, kL);
  }
  if (c0 & kN) {  // \p{N}{1,max}
    size_t i = l0;
    for (int k = 1; k < max_digits && i < n; ++k) {
      size_t l;
      if (!(cls(s + i, n - i, l) & kN)) break;
      i += l;
    }
    return i;
  }
  //  ?[^\s\p{L}\p{N}]+[\r\n]*
  size_t start = 0, l = l0;
  uint8_t c = c0;
  if (s[0] == ' ' && n > 1) {
    size_t l1;
    uint8_t c1 = cls(s + 1, n - 1, l1);
    if (other(c1)) {
      start = 1;
      c = c1;
      l = l1;
    }
  }
  if (other(c)) {
    size_t i = run_other(s, n, start + l);
    while (i < n && (s[i] == '\r' || s[i] == '\n')) ++i;
    return i;
  }
  // Whitespace: \s*[\r\n]+ | \s+(?!\S) | \s+
  size_t nl_end;
  size_t e = whitespace_tail(s, n, nl_end);
  return nl_end ? nl_end : e;
}

void PreTokenizer::add(PreTokStage s) {
  if (s.kind == PreTokStage::Split && !s.literal && s.known == KnownRegex::None)
    s.known = identify_regex(s.pattern);
  if (s.kind == PreTokStage::Split && s.known == KnownRegex::None && !s.literal && !s.re)
    s.re = std::make_shared<Pcre2Regex>(s.pattern);
  if (s.kind == PreTokStage::ByteLevel && s.use_regex) s.known = KnownRegex::Gpt2;
  stages_.push_back(std::move(s));
}

namespace {

// Splits `piece` at the [begin, end) matches, laid out per `behavior`.
void emit_by_matches(std::string_view piece, const std::vector<std::pair<size_t, size_t>>& m,
                     SplitBehavior behavior, std::vector<std::string_view>& out) {
  // Alternating segments: (text, is_match).
  std::vector<std::pair<std::string_view, bool>> seg;
  size_t pos = 0;
  for (auto [b, e] : m) {
    if (b > pos) seg.push_back({piece.substr(pos, b - pos), false});
    if (e > b) seg.push_back({piece.substr(b, e - b), true});
    pos = e;
  }
  if (pos < piece.size()) seg.push_back({piece.substr(pos), false});
  switch (behavior) {
    case SplitBehavior::Isolated:
      for (auto& [t, _] : seg) out.push_back(t);
      break;
    case SplitBehavior::Removed:
      for (auto& [t, is_m] : seg)
        if (!is_m) out.push_back(t);
      break;
    case SplitBehavior::Contiguous: {
      for (size_t i = 0; i < seg.size();) {
        size_t j = i + 1;
        const char* b = seg[i].first.data();
        size_t len = seg[i].first.size();
        while (j < seg.size() && seg[j].second && seg[i].second) len += seg[j++].first.size();
        out.push_back(std::string_view(b, len));
        i = j;
      }
      break;
    }
    case SplitBehavior::MergedWithPrevious: {
      std::string_view cur;
      for (auto& [t, is_m] : seg) {
        if (is_m && !cur.empty()) {
          cur = std::string_view(cur.data(), cur.size() + t.size());
          out.push_back(cur);
          cur = {};
        } else {
          if (!cur.empty()) out.push_back(cur);
          cur = t;
        }
      }
      if (!cur.empty()) out.push_back(cur);
      break;
    }
    case SplitBehavior::MergedWithNext: {
      std::string_view cur;
      for (auto& [t, is_m] : seg) {
        if (is_m) {
          if (!cur.empty()) out.push_back(cur);
          cur = t;
        } else if (!cur.empty()) {
          cur = std::string_view(cur.data(), cur.size() + t.size());
          out.push_back(cur);
          cur = {};
        } else {
          out.push_back(t);
        }
      }
      if (!cur.empty()) out.push_back(cur);
      break;
    }
  }
}

void split_known(KnownRegex k, std::string_view p, std::vector<std::string_view>& out) {
  const char* s = p.data();
  size_t n = p.size(), i = 0;
  while (i < n) {
    size_t m = k == KnownRegex::Gpt2     ? match_gpt2(s + i, n - i)
               : k == KnownRegex::Llama3 ? match_llama3(s + i, n - i, 3)
                                         : match_llama3(s + i, n - i, 1);
    out.push_back(std::string_view(s + i, m));
    i += m;
  }
}

}  // namespace

void split_stage(const PreTokStage& st, std::string_view piece, bool at_start,
                 std::vector<std::string_view>& out, PieceArena& arena) {
  if (piece.empty()) return;
  switch (st.kind) {
    case PreTokStage::Split: {
      if (st.known != KnownRegex::None && !st.invert &&
          st.behavior == SplitBehavior::Isolated) {
        split_known(st.known, piece, out);
        return;
      }
      std::vector<std::pair<size_t, size_t>> m;
      if (st.literal) {
        if (st.pattern.empty()) {
          out.push_back(piece);
          return;
        }
        for (size_t pos = 0; (pos = piece.find(st.pattern, pos)) != std::string_view::npos;
             pos += st.pattern.size())
          m.push_back({pos, pos + st.pattern.size()});
      } else if (st.re) {
        st.re->find_all(piece, m);
      } else {
        size_t i = 0;
        while (i < piece.size()) {
          size_t len = st.known == KnownRegex::Gpt2
                           ? match_gpt2(piece.data() + i, piece.size() - i)
                           : match_llama3(piece.data() + i, piece.size() - i,
                                          st.known == KnownRegex::Llama3 ? 3 : 1);
          m.push_back({i, i + len});
          i += len;
        }
      }
      if (st.invert) {  // the matches become the gaps
        std::vector<std::pair<size_t, size_t>> inv;
        size_t pos = 0;
        for (auto [b, e] : m) {
          if (b > pos) inv.push_back({pos, b});
          pos = e;
        }
        if (pos < piece.size()) inv.push_back({pos, piece.size()});
        m.swap(inv);
      }
      emit_by_matches(piece, m, st.behavior, out);
      return;
    }
    case PreTokStage::Digits: {
      std::vector<std::pair<size_t, size_t>> m;
      for (size_t i = 0; i < piece.size();) {
        size_t len;
        uint32_t cp = uni::decode(piece.data() + i, piece.size() - i, len);
        if (uni::is_number(cp)) {
          if (!st.individual_digits && !m.empty() && m.back().second == i)
            m.back().second = i + len;
          else
            m.push_back({i, i + len});
        }
        i += len;
      }
      emit_by_matches(piece, m, SplitBehavior::Isolated, out);
      return;
    }
    case PreTokStage::ByteLevel: {
      std::string_view p = piece;
      if (st.add_prefix_space && p[0] != ' ') {
        arena.push_back(" " + std::string(p));
        p = arena.back();
      }
      if (st.use_regex)
        split_known(KnownRegex::Gpt2, p, out);
      else
        out.push_back(p);
      return;
    }
    case PreTokStage::Metaspace: {
      std::string t;
      t.reserve(piece.size() + 3);
      bool prepend = st.prepend == PreTokStage::Always ||
                     (st.prepend == PreTokStage::First && at_start);
      if (prepend && piece.substr(0, st.replacement.size()) != st.replacement &&
          piece[0] != ' ')
        t += st.replacement;
      for (char c : piece) {
        if (c == ' ')
          t += st.replacement;
        else
          t.push_back(c);
      }
      arena.push_back(std::move(t));
      std::string_view p = arena.back();
      if (!st.split) {
        out.push_back(p);
        return;
      }
      std::vector<std::pair<size_t, size_t>> m;
      for (size_t pos = 0; (pos = p.find(st.replacement, pos)) != std::string_view::npos;
           pos += st.replacement.size())
        m.push_back({pos, pos + st.replacement.size()});
      emit_by_matches(p, m, SplitBehavior::MergedWithNext, out);
      return;
    }
  }
}

void PreTokenizer::split(std::string_view text, bool at_start,
                         std::vector<std::string_view>& out, PieceArena& arena) const {
  if (text.empty()) return;
  if (stages_.empty()) {
    out.push_back(text);
    return;
  }
  if (stages_.size() == 1) {
    split_stage(stages_[0], text, at_start, out, arena);
    return;
  }
  std::vector<std::string_view> cur{text}, next;
  for (size_t k = 0; k < stages_.size(); ++k) {
    auto& dst = (k + 1 == stages_.size()) ? out : next;
    bool first = at_start;
    for (auto p : cur) {
      split_stage(stages_[k], p, first, dst, arena);
      first = false;
    }
    if (k + 1 < stages_.size()) {
      cur.swap(next);
      next.clear();
    }
  }
}

}  // namespace spade::tok
