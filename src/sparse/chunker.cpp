#include "sparse/chunker.h"

#include <algorithm>

#include "core/error.h"

namespace spade::sparse {

namespace {

bool is_ws(unsigned char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

// How far back (in tokens) the trailing-whitespace / P scan may look.
constexpr int64_t kMaxScanTokens = 64;

bool ends_with(std::string_view s, std::string_view suf) {
  return s.size() >= suf.size() && s.substr(s.size() - suf.size()) == suf;
}

}  // namespace

void validate(const ChunkerOptions& o) {
  SPADE_CHECK(o.min_tokens >= 1 && o.max_tokens >= o.min_tokens, "chunker: need 1 <= min_chunk (",
              o.min_tokens, ") <= max_chunk (", o.max_tokens, ")");
  SPADE_CHECK(o.fixed_tokens >= 1, "chunker: fixed chunk size must be positive");
}

int cut_level(const TokenTextView& t, int64_t i) {
  if (i >= t.size()) return kLevelEnd;
  if (i <= 0) return kLevelNone;
  // Scan back: W = trailing whitespace run before the cut, then the last bytes of P.
  bool w_nonempty = false;
  int newlines = 0;
  char tail[4] = {0, 0, 0, 0};  // last 4 bytes of P, tail[3] = last byte
  int have = 0;
  bool in_w = true;
  for (int64_t j = i - 1; j >= 0 && j >= i - kMaxScanTokens && have < 4; --j) {
    std::string_view s = t.at(j);
    for (size_t k = s.size(); k-- > 0 && have < 4;) {
      const unsigned char c = static_cast<unsigned char>(s[k]);
      if (in_w && is_ws(c)) {
        w_nonempty = true;
        newlines += c == '\n';
        continue;
      }
      in_w = false;
      tail[3 - have] = char(c);
      ++have;
    }
  }
  // R: the first byte after the cut (skipping empty tokens), 0 at the end of the text.
  unsigned char r0 = 0;
  bool r_end = true;
  for (int64_t j = i; j < t.size() && j < i + kMaxScanTokens; ++j) {
    std::string_view s = t.at(j);
    if (!s.empty()) {
      r0 = static_cast<unsigned char>(s[0]);
      r_end = false;
      break;
    }
  }
  const bool r_ws = !r_end && is_ws(r0);
  const std::string_view p(tail + (4 - have), size_t(have));

  // Level 1: structural.
  if (newlines >= 2) return kLevelStructural;
  if (ends_with(p, "```") || ends_with(p, "---") || ends_with(p, "***")) return kLevelStructural;
  if (have >= 1) {
    const char last = tail[3];
    const char prev = have >= 2 ? tail[2] : 0;
    if (last == '}' || last == ']') return kLevelStructural;
    // "}," "];" and the like: the closer plus its trailing separator.
    if ((last == ',' || last == ';') && (prev == '}' || prev == ']')) return kLevelStructural;
    if (last == '>' && prev != '-' && prev != '=') return kLevelStructural;
  }
  // Level 2: sentence ends and single newlines.
  if (have >= 1) {
    const char last = tail[3];
    if ((last == '.' || last == '?' || last == '!') && (w_nonempty || r_ws || r_end))
      return kLevelSentence;
  }
  if (ends_with(p, "\xE3\x80\x82") || ends_with(p, "\xEF\xBC\x9F") || ends_with(p, "\xEF\xBC\x81"))
    return kLevelSentence;  // 。 ？ ！
  if (newlines == 1) return kLevelSentence;
  // Level 3: phrase separators.
  if (have >= 1) {
    const char last = tail[3];
    if (last == ',' || last == ';' || last == ':') return kLevelPhrase;
  }
  if (ends_with(p, "\xEF\xBC\x8C") || ends_with(p, "\xEF\xBC\x9B") || ends_with(p, "\xEF\xBC\x9A") ||
      ends_with(p, "\xE3\x80\x81"))
    return kLevelPhrase;  // ， ； ： 、
  // Level 4: whitespace.
  if (w_nonempty || r_ws) return kLevelWhitespace;
  return kLevelNone;
}

int64_t chunk_tokens(const TokenTextView& t, int64_t begin, int64_t end, bool final,
                     const ChunkerOptions& o, std::vector<int32_t>& starts) {
  SPADE_CHECK(begin >= 0 && begin <= end && end <= t.size(), "chunk_tokens: bad range [", begin,
              ", ", end, ") of ", t.size(), " tokens");
  int64_t s = begin;
  if (o.fixed) {
    const int64_t f = o.fixed_tokens;
    while (s < end) {
      if (end - s < f && !final) break;
      starts.push_back(int32_t(s));
      s = std::min(end, s + f);
    }
    return s;
  }
  while (s < end) {
    const int64_t remaining = end - s;
    if (remaining <= o.max_tokens) {
      if (!final) break;
      starts.push_back(int32_t(s));
      s = end;
      break;
    }
    int best_level = kLevelNone;
    int64_t best_n = o.max_tokens;
    for (int64_t n = o.min_tokens; n <= o.max_tokens; ++n) {
      // Cut levels look at the real neighbours in `t` (which may continue past `end`).
      const int lv = cut_level(t, s + n);
      if (lv == kLevelNone) continue;
      if (lv < best_level || (lv == best_level && o.tie == ChunkTie::Last)) {
        best_level = lv;
        best_n = n;
      }
    }
    starts.push_back(int32_t(s));
    s += best_n;
  }
  return s;
}

void StreamingChunks::extend(const std::vector<std::string>& text, int64_t L, int sink,
                             const ChunkerOptions& opt) {
  if (L == chunked_for_) return;
  chunked_for_ = L;
  int64_t from = sink;
  if (!starts_.empty()) {
    from = starts_.back();
    starts_.pop_back();
  }
  if (from >= L) {
    starts_.push_back(int32_t(from));
    return;
  }
  TokenTextView view(&text, L);
  starts_.push_back(int32_t(chunk_tokens(view, from, L, false, opt, starts_)));
}

std::vector<int> chunk_lengths(const std::vector<std::string>& tokens, const ChunkerOptions& opt) {
  validate(opt);
  TokenTextView t(&tokens, int64_t(tokens.size()));
  std::vector<int32_t> starts;
  chunk_tokens(t, 0, t.size(), true, opt, starts);
  std::vector<int> len;
  for (size_t i = 0; i < starts.size(); ++i)
    len.push_back((i + 1 < starts.size() ? starts[i + 1] : int32_t(tokens.size())) - starts[i]);
  return len;
}

}  // namespace spade::sparse
