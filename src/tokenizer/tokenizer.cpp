#include "tokenizer/tokenizer.h"

#include <cctype>
#include <algorithm>
#include <atomic>
#include <cstdio>

#include "core/error.h"
#include "tokenizer/byte_level.h"
#include "tokenizer/unicode.h"

namespace spade {

using namespace tok;

namespace {

std::atomic<uint64_t> g_instances{1};

// Per-thread cache of word -> ids for the tokenizer used last on this thread.
struct WordCache {
  uint64_t owner = 0;
  std::unordered_map<std::string, std::pair<uint32_t, uint32_t>, StrHash, StrEq> map;
  std::vector<int32_t> pool;
  void reset(uint64_t o) {
    owner = o;
    map.clear();
    pool.clear();
  }
};
thread_local WordCache t_cache;
constexpr size_t kCacheMaxWord = 64, kCacheMaxEntries = 1 << 17, kCacheMaxPool = 1 << 21;

// The names that end a turn in the chat formats spade knows; counted as EOS when special.
const char* const kEndMarkers[] = {"<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|endoftext|>",
                                   "<|end_of_text|>", "<end_of_turn>", "<|end|>", "</s>",
                                   "<|return|>"};

}  // namespace

Tokenizer::~Tokenizer() = default;

std::unique_ptr<Tokenizer> Tokenizer::build(TokenizerSpec spec) {
  std::unique_ptr<Tokenizer> t(new Tokenizer());
  size_t n = spec.pieces.size();
  SPADE_CHECK(n > 0, spec.source, ": empty vocabulary");
  SPADE_CHECK(n < (size_t(1) << 31), spec.source, ": vocabulary too large");
  spec.attrs.resize(n, kAttrNormal);
  t->source_ = spec.source;
  t->kind_ = spec.kind;
  t->instance_ = g_instances.fetch_add(1);
  // Added tokens may extend the vocabulary (tokenizer.json lists them apart).
  const size_t max_id = n + spec.added.size() + 4096;  // added ids follow the vocabulary
  for (const auto& a : spec.added) {
    SPADE_CHECK(a.id >= 0 && size_t(a.id) < max_id, spec.source, ": added token '", a.content,
                "' has id ", a.id, " (vocabulary of ", n, ")");
    if (size_t(a.id) >= spec.pieces.size()) {
      spec.pieces.resize(a.id + 1);
      spec.attrs.resize(a.id + 1, kAttrUnused);
    }
    if (spec.pieces[a.id].empty()) spec.pieces[a.id] = a.content;
    spec.attrs[a.id] = a.special ? kAttrControl : kAttrUserDefined;
  }
  n = spec.pieces.size();
  // tokenizer.json has no token types: with byte_fallback, its <0xXX> pieces are the
  // fallback bytes (decoded as raw bytes, as the ByteFallback decoder does).
  if (spec.kind != ModelKind::ByteLevelBpe && spec.byte_fallback)
    for (size_t i = 0; i < n; ++i) {
      const std::string& p = spec.pieces[i];
      if (spec.attrs[i] == kAttrNormal && p.size() == 6 && p.compare(0, 3, "<0x") == 0 &&
          p[5] == '>' && std::isxdigit(uint8_t(p[3])) && std::isxdigit(uint8_t(p[4])))
        spec.attrs[i] = kAttrByte;
    }
  t->pieces_ = std::move(spec.pieces);
  t->attrs_ = std::move(spec.attrs);
  t->piece_to_id_.reserve(n);
  for (size_t i = 0; i < n; ++i)
    if (!t->pieces_[i].empty()) t->piece_to_id_.emplace(t->pieces_[i], int32_t(i));
  for (const auto& a : spec.added) t->piece_to_id_[a.content] = a.id;

  // Decoded bytes of every token.
  t->bytes_.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const std::string& p = t->pieces_[i];
    uint8_t at = t->attrs_[i];
    if (at & (kAttrControl | kAttrUserDefined)) {
      t->bytes_[i] = p;
    } else if (spec.kind == ModelKind::ByteLevelBpe) {
      std::string b;
      t->bytes_[i] = byte_level_decode(p, b) ? b : p;
    } else if (at & kAttrByte) {
      unsigned v = 0;
      if (p.size() == 6 && p.compare(0, 3, "<0x") == 0 && p[5] == '>' &&
          std::sscanf(p.c_str() + 3, "%2x", &v) == 1)
        t->bytes_[i] = std::string(1, char(v));
      else
        t->bytes_[i] = p;
    } else {
      std::string b;
      b.reserve(p.size());
      for (size_t k = 0; k < p.size(); ++k) {
        if (p.compare(k, 3, "\xE2\x96\x81") == 0) {
          b.push_back(' ');
          k += 2;
        } else {
          b.push_back(p[k]);
        }
      }
      t->bytes_[i] = std::move(b);
    }
  }

  // Initial symbols.
  for (int b = 0; b < 256; ++b) {
    t->byte_sym_[b] = -1;
    t->byte_fallback_[b] = -1;
  }
  if (spec.kind == ModelKind::ByteLevelBpe) {
    for (int b = 0; b < 256; ++b) {
      auto it = t->piece_to_id_.find(byte_level_char(uint8_t(b)));
      if (it != t->piece_to_id_.end()) t->byte_sym_[b] = it->second;
    }
  } else {
    char name[8];
    for (int b = 0; b < 256; ++b) {
      std::snprintf(name, sizeof name, "<0x%02X>", b);
      auto it = t->piece_to_id_.find(std::string_view(name, 6));
      if (it != t->piece_to_id_.end()) t->byte_fallback_[b] = it->second;
    }
  }

  // Merges: from the list (rank = position) or from SentencePiece scores.
  if (!spec.merges.empty()) {
    t->merges_.reserve(spec.merges.size());
    uint32_t rank = 0;
    std::string joined;
    for (const auto& [a, b] : spec.merges) {
      auto ia = t->piece_to_id_.find(a), ib = t->piece_to_id_.find(b);
      joined.assign(a).append(b);
      auto ij = t->piece_to_id_.find(joined);
      if (ia != t->piece_to_id_.end() && ib != t->piece_to_id_.end() &&
          ij != t->piece_to_id_.end())
        t->merges_.add(ia->second, ib->second, rank, ij->second);
      ++rank;
    }
  } else if (!spec.scores.empty()) {
    SPADE_CHECK(spec.scores.size() >= t->pieces_.size() - spec.added.size() ||
                    spec.scores.size() == n,
                spec.source, ": ", spec.scores.size(), " scores for ", n, " tokens");
    std::vector<float> distinct;
    for (size_t i = 0; i < spec.scores.size() && i < n; ++i) distinct.push_back(spec.scores[i]);
    std::sort(distinct.begin(), distinct.end(), std::greater<float>());
    distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
    t->merges_.reserve(n * 4);
    for (size_t i = 0; i < spec.scores.size() && i < n; ++i) {
      if (t->attrs_[i] & (kAttrControl | kAttrByte | kAttrUnknown | kAttrUnused)) continue;
      const std::string& p = t->pieces_[i];
      uint32_t rank = uint32_t(std::lower_bound(distinct.begin(), distinct.end(), spec.scores[i],
                                                std::greater<float>()) - distinct.begin());
      for (size_t k = uni::utf8_len(uint8_t(p[0])); k < p.size();
           k += uni::utf8_len(uint8_t(p[k]))) {
        auto ia = t->piece_to_id_.find(std::string_view(p).substr(0, k));
        auto ib = t->piece_to_id_.find(std::string_view(p).substr(k));
        if (ia == t->piece_to_id_.end() || ib == t->piece_to_id_.end()) continue;
        if ((t->attrs_[ia->second] | t->attrs_[ib->second]) & (kAttrControl | kAttrByte))
          continue;
        t->merges_.add(ia->second, ib->second, rank, int32_t(i));
      }
    }
  }

  t->ignore_merges_ = spec.ignore_merges;
  if (t->ignore_merges_) {
    for (size_t i = 0; i < n; ++i) {
      if (t->attrs_[i] != kAttrNormal) continue;
      t->word_to_id_.emplace(spec.kind == ModelKind::ByteLevelBpe ? t->bytes_[i] : t->pieces_[i],
                             int32_t(i));
    }
  }
  t->byte_fallback_on_ = spec.byte_fallback;
  t->fuse_unk_ = spec.fuse_unk;
  t->unk_id_ = spec.unk_id;
  t->added_.build(spec.added);
  t->normalizer_ = std::move(spec.normalizer);
  t->pretok_ = std::move(spec.pretok);
  t->add_bos_ = spec.add_bos && spec.bos_id >= 0;
  t->add_eos_ = spec.add_eos && spec.eos_id >= 0;
  t->bos_id_ = spec.bos_id;
  t->eos_id_ = spec.eos_id;
  auto add_eos_id = [&](int32_t id) {
    if (id >= 0 && size_t(id) < n &&
        std::find(t->eos_ids_.begin(), t->eos_ids_.end(), id) == t->eos_ids_.end())
      t->eos_ids_.push_back(id);
  };
  add_eos_id(spec.eos_id);
  for (int32_t id : spec.extra_eos_ids) add_eos_id(id);
  for (const char* m : kEndMarkers) {
    auto it = t->piece_to_id_.find(std::string_view(m));
    if (it != t->piece_to_id_.end() && (t->attrs_[it->second] & kAttrControl))
      add_eos_id(it->second);
  }
  t->strip_leading_space_ = spec.strip_leading_space;
  if (spec.kind == ModelKind::CharBpe && t->pretok_.empty()) {
    static const std::string kSp = "\xE2\x96\x81";
    bool ok = true;
    for (size_t i = 0; i < n && ok; ++i) {
      if (t->attrs_[i] & (kAttrControl | kAttrByte | kAttrUnknown | kAttrUnused)) continue;
      const std::string& p = t->pieces_[i];
      for (size_t k = p.find(kSp, 1); k != std::string::npos && ok; k = p.find(kSp, k + 1))
        if (k < 3 || p.compare(k - 3, 3, kSp) != 0) ok = false;
    }
    t->split_at_spaces_ = ok;
  }
  t->template_tokens_ = spec.template_tokens;
  if (!spec.chat_template.empty())
    t->chat_template_ = std::make_unique<ChatTemplate>(spec.chat_template, spec.template_tokens);
  return t;
}

void Tokenizer::check_id(int32_t id) const {
  SPADE_CHECK(id >= 0 && size_t(id) < pieces_.size(), "token id ", id,
              " out of range (vocabulary of ", pieces_.size(), ")");
}

std::string Tokenizer::piece(int32_t id) const {
  check_id(id);
  return pieces_[id];
}

const std::string& Tokenizer::token_bytes(int32_t id) const {
  check_id(id);
  return bytes_[id];
}

int32_t Tokenizer::token_id(std::string_view p) const {
  auto it = piece_to_id_.find(p);
  return it == piece_to_id_.end() ? -1 : it->second;
}

bool Tokenizer::is_special(int32_t id) const {
  return id >= 0 && size_t(id) < attrs_.size() && (attrs_[id] & kAttrControl);
}

void Tokenizer::initial_symbols(std::string_view w, std::vector<int32_t>& syms) const {
  syms.clear();
  if (kind_ == ModelKind::ByteLevelBpe) {
    // A byte the vocabulary lacks is dropped before merging, as tokenizers does when a
    // character is not in the vocabulary and there is no unk token.
    for (unsigned char c : w)
      if (byte_sym_[c] >= 0) syms.push_back(byte_sym_[c]);
    return;
  }
  for (size_t i = 0; i < w.size();) {
    size_t len = uni::utf8_len(uint8_t(w[i]));
    if (i + len > w.size()) len = w.size() - i;
    auto it = piece_to_id_.find(w.substr(i, len));
    if (it != piece_to_id_.end() && !(attrs_[it->second] & (kAttrControl | kAttrUserDefined))) {
      syms.push_back(it->second);
    } else if (byte_fallback_on_) {
      for (size_t k = 0; k < len; ++k) {
        int32_t b = byte_fallback_[uint8_t(w[i + k])];
        if (b >= 0 || unk_id_ >= 0) syms.push_back(b >= 0 ? b : unk_id_);
      }
    } else if (unk_id_ >= 0) {
      if (!(fuse_unk_ && !syms.empty() && syms.back() == -2)) syms.push_back(-2);
    }
    i += len;
  }
  for (auto& s : syms)
    if (s == -2) s = -(unk_id_ + 3);  // keep unknowns out of merges; restored below
}

void Tokenizer::encode_word(std::string_view w, std::vector<int32_t>& out) const {
  if (w.empty()) return;
  if (ignore_merges_) {
    auto it = word_to_id_.find(w);
    if (it != word_to_id_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  WordCache& c = t_cache;
  bool cacheable = w.size() <= kCacheMaxWord;
  if (cacheable) {
    if (c.owner != instance_) c.reset(instance_);
    auto it = c.map.find(w);
    if (it != c.map.end()) {
      out.insert(out.end(), c.pool.begin() + it->second.first,
                 c.pool.begin() + it->second.first + it->second.second);
      return;
    }
  }
  thread_local std::vector<int32_t> syms;
  initial_symbols(w, syms);
  merges_.apply(syms);
  size_t start = out.size();
  for (int32_t s : syms) {
    if (s >= 0)
      out.push_back(s);
    else if (s <= -3)
      out.push_back(-s - 3);  // an unknown character: unk_id
  }
  if (cacheable) {
    if (c.map.size() >= kCacheMaxEntries || c.pool.size() >= kCacheMaxPool) c.reset(instance_);
    uint32_t off = uint32_t(c.pool.size());
    c.pool.insert(c.pool.end(), out.begin() + start, out.end());
    c.map.emplace(std::string(w), std::make_pair(off, uint32_t(out.size() - start)));
  }
}

void Tokenizer::encode_text(std::string_view text, bool at_start, std::vector<int32_t>& out) const {
  std::string nbuf;
  std::string_view norm = normalizer_.apply(text, nbuf);
  thread_local std::vector<std::string_view> pieces;
  PieceArena arena;
  pieces.clear();
  if (split_at_spaces_) {
    // Cut before each U+2581 that follows another character.
    size_t start = 0;
    for (size_t k = norm.find("\xE2\x96\x81", 1); k != std::string_view::npos;
         k = norm.find("\xE2\x96\x81", k + 3)) {
      if (k >= 3 && norm.compare(k - 3, 3, "\xE2\x96\x81") == 0) continue;
      pieces.push_back(norm.substr(start, k - start));
      start = k;
    }
    if (start < norm.size()) pieces.push_back(norm.substr(start));
  } else {
    pretok_.split(norm, at_start, pieces, arena);
  }
  for (auto p : pieces) encode_word(p, out);
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special,
                                       bool parse_special) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 4);
  if (add_special && add_bos_) out.push_back(bos_id_);
  std::string repaired;
  if (!uni::is_valid(text)) {
    repaired = uni::repair(text);
    text = repaired;
  }
  std::vector<Segment> segs;
  added_.split(text, parse_special, segs);
  bool at_start = true;
  for (const auto& s : segs) {
    if (s.id >= 0)
      out.push_back(s.id);
    else
      encode_text(s.text, at_start, out);
    at_start = false;
  }
  if (add_special && add_eos_) out.push_back(eos_id_);
  return out;
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids, bool skip_special) const {
  std::string out;
  if (kind_ == ModelKind::ByteLevelBpe) {
    for (int32_t id : ids) {
      check_id(id);
      if (skip_special && (attrs_[id] & kAttrControl)) continue;
      out += bytes_[id];
    }
    if (!uni::is_valid(out)) out = uni::repair(out);
  } else {
    // ByteFallback: a run of byte tokens that is not valid UTF-8 becomes one U+FFFD per byte.
    std::string run;
    auto flush_run = [&]() {
      if (run.empty()) return;
      if (uni::is_valid(run))
        out += run;
      else
        for (size_t k = 0; k < run.size(); ++k) out += "\xEF\xBF\xBD";
      run.clear();
    };
    for (int32_t id : ids) {
      check_id(id);
      if (skip_special && (attrs_[id] & kAttrControl)) continue;
      if (attrs_[id] & kAttrByte) {
        run += bytes_[id];
      } else {
        flush_run();
        out += bytes_[id];
      }
    }
    flush_run();
    if (!uni::is_valid(out)) out = uni::repair(out);
  }
  for (int k = 0; k < strip_leading_space_ && !out.empty() && out[0] == ' '; ++k) out.erase(0, 1);
  return out;
}

StreamDecoder::StreamDecoder(const Tokenizer& tok, bool skip_special)
    : tok_(tok), skip_special_(skip_special) {}

std::string StreamDecoder::push(int32_t id) {
  tok_.check_id(id);
  if (skip_special_ && tok_.is_special(id)) return {};
  pending_ += tok_.bytes_[id];
  if (first_ && !pending_.empty()) {
    for (int k = 0; k < tok_.strip_leading_space_ && !pending_.empty() && pending_[0] == ' '; ++k)
      pending_.erase(0, 1);
    first_ = false;
  }
  std::string out;
  size_t keep = uni::incomplete_tail(pending_);
  std::string_view ready(pending_.data(), pending_.size() - keep);
  out = uni::is_valid(ready) ? std::string(ready) : uni::repair(ready);
  pending_.erase(0, pending_.size() - keep);
  return out;
}

std::string StreamDecoder::flush() {
  std::string out = uni::repair(pending_);
  pending_.clear();
  return out;
}

}  // namespace spade
