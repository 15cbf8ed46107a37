// SentencePiece ModelProto (tokenizer.model) -> TokenizerSpec, for BPE models (Llama-2,
// Mistral, llama2.c's stories models). Reads the protobuf wire format directly:
// ModelProto.pieces (1) {piece (1), score (2), type (3)}, trainer_spec (2) {model_type (3)},
// normalizer_spec (3) {add_dummy_prefix (3), remove_extra_whitespaces (4)}.
#include <cstring>

#include "core/error.h"
#include "tokenizer/tokenizer.h"

namespace spade {

using namespace tok;

namespace {

class Wire {
 public:
  Wire(std::string_view d, const std::string& src) : d_(d), src_(src) {}
  bool done() const { return p_ >= d_.size(); }
  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      SPADE_CHECK(p_ < d_.size(), src_, ": truncated protobuf varint");
      uint8_t b = uint8_t(d_[p_++]);
      v |= uint64_t(b & 0x7F) << shift;
      if (!(b & 0x80)) return v;
    }
    fail(src_, ": protobuf varint too long");
  }
  std::string_view bytes() {
    uint64_t n = varint();
    SPADE_CHECK(n <= d_.size() - p_, src_, ": protobuf field length ", n, " past the end");
    auto r = d_.substr(p_, n);
    p_ += n;
    return r;
  }
  uint32_t fixed32() {
    SPADE_CHECK(d_.size() - p_ >= 4, src_, ": truncated protobuf fixed32");
    uint32_t v;
    std::memcpy(&v, d_.data() + p_, 4);
    p_ += 4;
    return v;
  }
  void skip(int wt) {
    if (wt == 0) varint();
    else if (wt == 1) { SPADE_CHECK(d_.size() - p_ >= 8, src_, ": truncated"); p_ += 8; }
    else if (wt == 2) bytes();
    else if (wt == 5) fixed32();
    else fail(src_, ": unsupported protobuf wire type ", wt);
  }

 private:
  std::string_view d_;
  size_t p_ = 0;
  const std::string& src_;
};

}  // namespace

std::unique_ptr<Tokenizer> Tokenizer::from_sentencepiece(std::string_view proto,
                                                         const std::string& source) {
  TokenizerSpec s;
  s.source = source;
  s.kind = ModelKind::CharBpe;
  bool add_dummy_prefix = true, remove_extra_ws = true;
  int model_type = 1;  // UNIGRAM is the protobuf default
  Wire w(proto, source);
  while (!w.done()) {
    uint64_t tag = w.varint();
    int field = int(tag >> 3), wt = int(tag & 7);
    if (field == 1 && wt == 2) {
      Wire p(w.bytes(), source);
      std::string piece;
      float score = 0;
      int type = 1;
      while (!p.done()) {
        uint64_t t = p.varint();
        int f = int(t >> 3), pw = int(t & 7);
        if (f == 1 && pw == 2) piece = std::string(p.bytes());
        else if (f == 2 && pw == 5) { uint32_t u = p.fixed32(); std::memcpy(&score, &u, 4); }
        else if (f == 3 && pw == 0) type = int(p.varint());
        else p.skip(pw);
      }
      uint8_t attr = type == 2 ? kAttrUnknown : type == 3 ? kAttrControl : type == 4 ? kAttrUserDefined
                   : type == 5 ? kAttrUnused : type == 6 ? kAttrByte : kAttrNormal;
      int32_t id = int32_t(s.pieces.size());
      if (attr & (kAttrControl | kAttrUnknown | kAttrUserDefined)) {
        AddedToken a;
        a.id = id;
        a.content = piece;
        a.special = attr != kAttrUserDefined;
        s.added.push_back(a);
        if (attr == kAttrUnknown) s.unk_id = id;
        if (piece == "<s>") s.bos_id = id;
        if (piece == "</s>") s.eos_id = id;
      }
      if (attr == kAttrByte) s.byte_fallback = true;
      s.pieces.push_back(std::move(piece));
      s.attrs.push_back(attr);
      s.scores.push_back(score);
    } else if (field == 2 && wt == 2) {
      Wire t(w.bytes(), source);
      while (!t.done()) {
        uint64_t tg = t.varint();
        if ((tg >> 3) == 3 && (tg & 7) == 0) model_type = int(t.varint());
        else t.skip(int(tg & 7));
      }
    } else if (field == 3 && wt == 2) {
      Wire n(w.bytes(), source);
      while (!n.done()) {
        uint64_t tg = n.varint();
        int f = int(tg >> 3);
        if (f == 3 && (tg & 7) == 0) add_dummy_prefix = n.varint() != 0;
        else if (f == 4 && (tg & 7) == 0) remove_extra_ws = n.varint() != 0;
        else n.skip(int(tg & 7));
      }
    } else {
      w.skip(wt);
    }
  }
  SPADE_CHECK(!s.pieces.empty(), source, ": no pieces (not a SentencePiece model?)");
  SPADE_CHECK(model_type == 2, source, ": SentencePiece model type ", model_type,
              " is not supported (only BPE = 2; Unigram is not)");
  if (remove_extra_ws) s.normalizer.add({NormStep::CollapseSpaces, "", ""});
  if (add_dummy_prefix) s.normalizer.add({NormStep::Prepend, "\xE2\x96\x81", ""});
  s.normalizer.add({NormStep::Replace, " ", "\xE2\x96\x81"});
  s.strip_leading_space = add_dummy_prefix ? 1 : 0;
  s.add_bos = s.bos_id >= 0;
  if (s.bos_id >= 0) s.template_tokens["bos_token"] = s.pieces[s.bos_id];
  if (s.eos_id >= 0) s.template_tokens["eos_token"] = s.pieces[s.eos_id];
  return build(std::move(s));
}

}  // namespace spade
