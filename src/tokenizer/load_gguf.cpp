// GGUF tokenizer metadata (llama.cpp's tokenizer.ggml.* keys) -> TokenizerSpec.
// tokenizer.ggml.model "gpt2": byte-level BPE with merges; the pre-tokenizer comes from
// tokenizer.ggml.pre. "llama": SentencePiece-style BPE from scores, byte fallback.
#include <algorithm>

#include "core/error.h"
#include "io/gguf.h"
#include "tokenizer/tokenizer.h"

namespace spade {

using namespace tok;

namespace {

void set_pre(const std::string& src, const std::string& pre, TokenizerSpec& s) {
  auto split = [&](KnownRegex k, const char* re) {
    PreTokStage st;
    st.kind = PreTokStage::Split;
    st.known = k;
    st.pattern = re;
    s.pretok.add(st);
    PreTokStage bl;
    bl.kind = PreTokStage::ByteLevel;
    bl.use_regex = false;
    s.pretok.add(bl);
  };
  auto gpt2 = [&]() {
    PreTokStage bl;
    bl.kind = PreTokStage::ByteLevel;
    bl.use_regex = true;
    s.pretok.add(bl);
  };
  if (pre == "llama-bpe" || pre == "llama3" || pre == "llama-v3") {
    split(KnownRegex::Llama3, kLlama3Regex);
    s.ignore_merges = true;
  } else if (pre == "falcon3" || pre == "pixtral" || pre == "dbrx" || pre == "smaug-bpe") {
    split(KnownRegex::Llama3, kLlama3Regex);
  } else if (pre == "qwen2" || pre == "deepseek-r1-qwen" || pre == "megrez") {
    s.normalizer.add({NormStep::Nfc, "", ""});
    split(KnownRegex::Qwen2, kQwen2Regex);
  } else if (pre == "smollm" || pre == "starcoder" || pre == "refact") {
    PreTokStage d;
    d.kind = PreTokStage::Digits;
    d.individual_digits = true;
    s.pretok.add(d);
    gpt2();
  } else if (pre == "gpt-2" || pre == "gpt2" || pre == "default" || pre == "phi-2") {
    gpt2();
  } else {
    fail(src, ": tokenizer.ggml.pre '", pre, "' is not supported (supported: gpt-2, default, "
         "phi-2, llama-bpe/llama3, falcon3, pixtral, dbrx, smaug-bpe, qwen2, "
         "deepseek-r1-qwen, megrez, smollm, starcoder, refact)");
  }
}

}  // namespace

std::unique_ptr<Tokenizer> Tokenizer::from_gguf(const GgufFile& f) {
  const std::string src = f.path().empty() ? std::string("GGUF") : f.path();
  std::string model = f.get_string("tokenizer.ggml.model");
  const GgufValue* toks = f.find("tokenizer.ggml.tokens");
  SPADE_CHECK(toks && toks->is_array() && toks->elem_type == GgufValueType::STRING, src,
              ": tokenizer.ggml.tokens missing or not an array of strings");
  TokenizerSpec s;
  s.source = src;
  s.pieces = toks->strings;
  size_t n = s.pieces.size();
  SPADE_CHECK(n > 0, src, ": tokenizer.ggml.tokens is empty");
  s.attrs.assign(n, kAttrNormal);
  if (const GgufValue* tt = f.find("tokenizer.ggml.token_type")) {
    SPADE_CHECK(tt->is_array() && tt->numbers.size() == n, src,
                ": tokenizer.ggml.token_type has ", tt->numbers.size(), " entries for ", n, " tokens");
    for (size_t i = 0; i < n; ++i) {
      int t = int(tt->numbers[i]);
      s.attrs[i] = t == 2 ? kAttrUnknown : t == 3 ? kAttrControl : t == 4 ? kAttrUserDefined
                 : t == 5 ? kAttrUnused : t == 6 ? kAttrByte : kAttrNormal;
    }
  }
  auto id_key = [&](const char* key) -> int32_t {
    auto v = f.get_int_opt(key);
    return (v && *v >= 0 && size_t(*v) < n) ? int32_t(*v) : -1;
  };
  s.bos_id = id_key("tokenizer.ggml.bos_token_id");
  s.eos_id = id_key("tokenizer.ggml.eos_token_id");
  s.unk_id = id_key("tokenizer.ggml.unknown_token_id");
  for (const char* k : {"tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"})
    if (int32_t id = id_key(k); id >= 0) s.extra_eos_ids.push_back(id);
  auto flag = [&](const char* key) -> std::optional<bool> {
    const GgufValue* v = f.find(key);
    if (!v || v->is_array()) return std::nullopt;
    return v->as_int() != 0;
  };

  std::string pre = f.get_string_opt("tokenizer.ggml.pre").value_or("default");
  if (model == "gpt2") {
    s.kind = ModelKind::ByteLevelBpe;
    const GgufValue* mg = f.find("tokenizer.ggml.merges");
    SPADE_CHECK(mg && mg->is_array() && mg->elem_type == GgufValueType::STRING, src,
                ": tokenizer.ggml.merges missing (needed by a gpt2 vocabulary)");
    s.merges.reserve(mg->strings.size());
    for (const auto& m : mg->strings) {
      size_t sp = m.find(' ');
      SPADE_CHECK(sp != std::string::npos, src, ": merge '", m, "' has no space");
      s.merges.emplace_back(m.substr(0, sp), m.substr(sp + 1));
    }
    set_pre(src, pre, s);
    bool llama3 = pre == "llama-bpe" || pre == "llama3" || pre == "llama-v3";
    s.add_bos = flag("tokenizer.ggml.add_bos_token").value_or(llama3);
  } else if (model == "llama") {
    s.kind = ModelKind::CharBpe;
    const GgufValue* sc = f.find("tokenizer.ggml.scores");
    SPADE_CHECK(sc && sc->is_array() && sc->numbers.size() == n, src,
                ": tokenizer.ggml.scores missing or of the wrong length");
    s.scores.assign(sc->numbers.begin(), sc->numbers.end());
    s.byte_fallback = true;
    bool prefix = flag("tokenizer.ggml.add_space_prefix").value_or(true);
    if (prefix) s.normalizer.add({NormStep::Prepend, "\xE2\x96\x81", ""});
    s.normalizer.add({NormStep::Replace, " ", "\xE2\x96\x81"});
    s.strip_leading_space = prefix ? 1 : 0;
    s.add_bos = flag("tokenizer.ggml.add_bos_token").value_or(true);
  } else {
    fail(src, ": tokenizer.ggml.model '", model,
         "' is not supported (supported: gpt2 byte-level BPE, llama SentencePiece BPE)");
  }
  s.add_eos = flag("tokenizer.ggml.add_eos_token").value_or(false);
  for (size_t i = 0; i < n; ++i) {
    if (!(s.attrs[i] & (kAttrControl | kAttrUserDefined | kAttrUnknown))) continue;
    AddedToken a;
    a.id = int32_t(i);
    a.content = s.pieces[i];
    a.special = (s.attrs[i] & kAttrUserDefined) == 0;
    s.added.push_back(std::move(a));
  }
  s.chat_template = f.get_string_opt("tokenizer.chat_template").value_or("");
  auto name = [&](int32_t id) { return id >= 0 ? s.pieces[id] : std::string(); };
  if (s.bos_id >= 0) s.template_tokens["bos_token"] = name(s.bos_id);
  if (s.eos_id >= 0) s.template_tokens["eos_token"] = name(s.eos_id);
  if (s.unk_id >= 0) s.template_tokens["unk_token"] = name(s.unk_id);
  if (int32_t pad = id_key("tokenizer.ggml.padding_token_id"); pad >= 0)
    s.template_tokens["pad_token"] = name(pad);
  return build(std::move(s));
}

}  // namespace spade
