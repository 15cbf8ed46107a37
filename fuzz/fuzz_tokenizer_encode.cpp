// libFuzzer: encode arbitrary bytes with a byte-level BPE tokenizer (Llama-3 split, NFC,
// added tokens) and a SentencePiece-style one (byte fallback, Metaspace, a PCRE2 split),
// then check what must hold for any input:
//  - ids are in range; decode and streaming decode agree, and never emit invalid UTF-8;
//  - valid UTF-8 round-trips (through NFC for the normalizing tokenizer);
//  - the hand-written split equals PCRE2 running the same regex, on text built from an
//    alphabet whose character classes are the same in both Unicode versions.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "tokenizer/byte_level.h"
#include "tokenizer/nfc.h"
#include "tokenizer/pretokenize.h"
#include "tokenizer/pretokenize_pcre.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/unicode.h"

namespace {

std::string byte_level_json() {
  // All 256 byte symbols, a few merges, two added tokens.
  std::string vocab, merges = "\"\\u0120 t\", \"\\u0120t h\", \"h e\", \"\\u0120th e\", \"i n\", \"1 2\"";
  for (int b = 0; b < 256; ++b) {
    std::string c = spade::tok::byte_level_encode(std::string(1, char(b)));
    nlohmann::json k = c;
    vocab += k.dump() + ": " + std::to_string(b) + ", ";
  }
  vocab += "\"\\u0120t\": 256, \"\\u0120th\": 257, \"he\": 258, \"\\u0120the\": 259, \"in\": 260, \"12\": 261";
  return R"({"normalizer": {"type": "NFC"},
    "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
      {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}, "behavior": "Isolated", "invert": false},
      {"type": "ByteLevel", "add_prefix_space": false, "use_regex": false}]},
    "decoder": {"type": "ByteLevel"},
    "added_tokens": [{"id": 262, "content": "<|eot|>", "special": true}, {"id": 263, "content": "<think>", "special": false}],
    "model": {"type": "BPE", "ignore_merges": true, "vocab": {)" + vocab + R"(}, "merges": [)" + merges + "]}}";
}

std::string spm_json() {
  std::string vocab = "\"<unk>\": 0, \"<s>\": 1, \"</s>\": 2";
  char buf[16];
  for (int b = 0; b < 256; ++b) {
    std::snprintf(buf, sizeof buf, "<0x%02X>", b);
    vocab += ", \"" + std::string(buf) + "\": " + std::to_string(3 + b);
  }
  vocab += ", \"\\u2581\": 259, \"a\": 260, \"b\": 261, \"\\u2581a\": 262, \"ab\": 263, \"\\u2581ab\": 264";
  return R"({"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
      {"type": "Split", "pattern": {"Regex": "\\d+|\\D+"}, "behavior": "Isolated", "invert": false},
      {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": true}]},
    "decoder": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first"},
    "added_tokens": [{"id": 0, "content": "<unk>", "special": true}, {"id": 1, "content": "<s>", "special": true},
                     {"id": 2, "content": "</s>", "special": true}],
    "post_processor": {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                       "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
    "model": {"type": "BPE", "byte_fallback": true, "unk_token": "<unk>", "vocab": {)" + vocab +
         R"(}, "merges": ["a b", "\u2581 a", "\u2581 ab"]}})";
}

const char* const kAlphabet[] = {"a", "Z", "s", "S", "l", "e", "v", "d", "0", "7", " ", " ", "\t",
                                 "\n", "\r", "'", "!", ".", "(", "-", "é", "漢", "١", "²", "\u00a0",
                                 "\u2028", "\u0085", "🦙", "\u0301", "ſ", "\u3000", "«", "€"};

void check(bool ok) {
  if (!ok) __builtin_trap();
}

void exercise(const spade::Tokenizer& t, const std::string& s, bool nfc_norm) {
  auto ids = t.encode(s);
  for (int32_t id : ids) check(id >= 0 && id < t.vocab_size());
  std::string dec = t.decode(ids);
  check(spade::uni::is_valid(dec));
  spade::StreamDecoder sd(t);
  std::string streamed;
  for (int32_t id : ids) {
    std::string part = sd.push(id);
    check(spade::uni::is_valid(part));
    streamed += part;
  }
  streamed += sd.flush();
  check(streamed == dec);
  if (spade::uni::is_valid(s) && s.find('<') == std::string::npos) {
    std::string want = nfc_norm ? spade::nfc(s) : s;
    check(t.decode(ids, /*skip_special=*/true) == (ids.empty() ? std::string() : want));
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const auto bl = spade::Tokenizer::from_hf_json(byte_level_json(), "", "fuzz-bytelevel");
  static const auto spm = spade::Tokenizer::from_hf_json(spm_json(), "", "fuzz-spm");
  static spade::tok::Pcre2Regex re_gpt2(spade::tok::kGpt2Regex), re_llama3(spade::tok::kLlama3Regex),
      re_qwen2(spade::tok::kQwen2Regex);
  if (size > 4096) return 0;
  std::string s(reinterpret_cast<const char*>(data), size);
  exercise(*bl, s, true);
  spm->encode(s);
  spm->decode(spm->encode(s, false));

  // Differential split check on alphabet text.
  std::string a;
  for (size_t i = 0; i < size; ++i) a += kAlphabet[data[i] % (sizeof kAlphabet / sizeof *kAlphabet)];
  struct K {
    spade::tok::KnownRegex k;
    spade::tok::Pcre2Regex* re;
  } ks[] = {{spade::tok::KnownRegex::Gpt2, &re_gpt2},
            {spade::tok::KnownRegex::Llama3, &re_llama3},
            {spade::tok::KnownRegex::Qwen2, &re_qwen2}};
  for (const auto& k : ks) {
    std::vector<std::pair<size_t, size_t>> m;
    k.re->find_all(a, m);
    size_t pos = 0, mi = 0;
    for (size_t i = 0; i < a.size();) {
      size_t n = k.k == spade::tok::KnownRegex::Gpt2
                     ? spade::tok::match_gpt2(a.data() + i, a.size() - i)
                     : spade::tok::match_llama3(a.data() + i, a.size() - i,
                                                k.k == spade::tok::KnownRegex::Llama3 ? 3 : 1);
      check(mi < m.size() && m[mi].first == i && m[mi].second == i + n);
      i += n;
      ++mi;
      pos = i;
    }
    check(mi == m.size() && pos == a.size());
  }
  return 0;
}
