#include "tokenizer/added_tokens.h"

#include "tokenizer/unicode.h"

namespace spade::tok {

void AddedTokenMatcher::build(const std::vector<AddedToken>& tokens) {
  tokens_.clear();
  nodes_.assign(1, Node{});
  for (auto& b : first_byte_) b = false;
  for (const auto& t : tokens) {
    if (t.content.empty() || t.id < 0) continue;
    int32_t node = 0;
    for (unsigned char c : t.content) {
      int32_t child = -1;
      for (auto& [b, nx] : nodes_[node].next)
        if (b == c) child = nx;
      if (child < 0) {
        child = int32_t(nodes_.size());
        nodes_[node].next.push_back({c, child});
        nodes_.push_back(Node{});
      }
      node = child;
    }
    if (nodes_[node].token >= 0) continue;  // duplicate content: the first one wins
    nodes_[node].token = int32_t(tokens_.size());
    tokens_.push_back(t);
    first_byte_[static_cast<unsigned char>(t.content[0])] = true;
  }
}

int32_t AddedTokenMatcher::longest_at(std::string_view text, size_t i, bool parse_special,
                                      size_t& len) const {
  int32_t node = 0, best = -1;
  for (size_t k = i; k < text.size(); ++k) {
    auto c = static_cast<unsigned char>(text[k]);
    int32_t child = -1;
    for (auto& [b, nx] : nodes_[node].next)
      if (b == c) {
        child = nx;
        break;
      }
    if (child < 0) break;
    node = child;
    int32_t t = nodes_[node].token;
    if (t >= 0 && (parse_special || !tokens_[t].special)) {
      best = t;
      len = k + 1 - i;
    }
  }
  return best;
}

namespace {

bool is_word_char(uint32_t cp) { return cp == '_' || uni::is_letter(cp) || uni::is_number(cp); }

// The code point ending at text[end) (end > 0).
uint32_t cp_before(std::string_view text, size_t end, size_t& start) {
  start = end - 1;
  while (start > 0 && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80 && end - start < 4)
    --start;
  size_t len;
  return uni::decode(text.data() + start, end - start, len);
}

}  // namespace

void AddedTokenMatcher::split(std::string_view text, bool parse_special,
                              std::vector<Segment>& out) const {
  if (tokens_.empty()) {
    out.push_back({text, -1});
    return;
  }
  size_t seg_start = 0, i = 0;
  while (i < text.size()) {
    if (!first_byte_[static_cast<unsigned char>(text[i])]) {
      ++i;
      continue;
    }
    size_t len = 0;
    int32_t t = longest_at(text, i, parse_special, len);
    if (t < 0) {
      ++i;
      continue;
    }
    const AddedToken& tok = tokens_[t];
    size_t b = i, e = i + len;
    if (tok.single_word) {
      size_t s, l;
      bool ok = (b == 0 || !is_word_char(cp_before(text, b, s))) &&
                (e == text.size() || !is_word_char(uni::decode(text.data() + e, text.size() - e, l)));
      if (!ok) {
        ++i;
        continue;
      }
    }
    if (tok.lstrip) {
      while (b > seg_start) {
        size_t s;
        if (!uni::is_space(cp_before(text, b, s))) break;
        b = s;
      }
    }
    if (tok.rstrip) {
      while (e < text.size()) {
        size_t l;
        if (!uni::is_space(uni::decode(text.data() + e, text.size() - e, l))) break;
        e += l;
      }
    }
    if (b > seg_start) out.push_back({text.substr(seg_start, b - seg_start), -1});
    out.push_back({text.substr(b, e - b), tok.id});
    seg_start = i = e;
  }
  if (seg_start < text.size()) out.push_back({text.substr(seg_start), -1});
}

}  // namespace spade::tok
