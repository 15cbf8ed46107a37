// Tokenizer parts in isolation: the hand-written split matchers against PCRE2 running the
// same regexes, NFC, UTF-8 repair, streaming decode, BOS/EOS and special-token handling,
// and the errors loaders give.
#include <gtest/gtest.h>

#include <random>

#include "core/error.h"
#include "test_tokenizer_common.h"
#include "tokenizer/nfc.h"
#include "tokenizer/pretokenize.h"
#include "tokenizer/pretokenize_pcre.h"
#include "tokenizer/unicode.h"

using namespace spade;
using namespace spade::test;

namespace {

std::vector<std::string> split_known(tok::KnownRegex k, const std::string& s) {
  std::vector<std::string> out;
  for (size_t i = 0; i < s.size();) {
    size_t n = k == tok::KnownRegex::Gpt2 ? tok::match_gpt2(s.data() + i, s.size() - i)
                                          : tok::match_llama3(s.data() + i, s.size() - i,
                                                              k == tok::KnownRegex::Llama3 ? 3 : 1);
    out.push_back(s.substr(i, n));
    i += n;
  }
  return out;
}

std::vector<std::string> split_pcre(const tok::Pcre2Regex& re, const std::string& s) {
  std::vector<std::pair<size_t, size_t>> m;
  re.find_all(s, m);
  std::vector<std::string> out;
  size_t pos = 0;
  for (auto [b, e] : m) {
    if (b > pos) out.push_back(s.substr(pos, b - pos));
    out.push_back(s.substr(b, e - b));
    pos = e;
  }
  if (pos < s.size()) out.push_back(s.substr(pos));
  return out;
}

// Characters whose classes are the same in Unicode 14 (PCRE2 here) and 16 (our tables).
const std::vector<std::string> kAlphabet = {
    "a", "Z", "s", "S", "t", "l", "L", "e", "v", "d", "m", "0", "7", " ", " ", " ", "\t", "\n",
    "\r", "\x0b", "'", "'", "!", ".", "(", "-", "_", "é", "ß", "漢", "字", "ひ", "한", "١", "²",
    "½", "Ⅻ", "\u00a0", "\u2028", "\u3000", "\u0085", "🦙", "😀", "\u0301", "\u200d", "ſ",
    "\u2003", "«", "€", "ǅ", "ʰ",
};

TEST(TokenizerSplit, HandWrittenMatchersEqualPcre2) {
  struct K {
    tok::KnownRegex k;
    const char* re;
  } ks[] = {{tok::KnownRegex::Gpt2, tok::kGpt2Regex},
            {tok::KnownRegex::Llama3, tok::kLlama3Regex},
            {tok::KnownRegex::Qwen2, tok::kQwen2Regex}};
  std::mt19937 rng(7);
  for (const auto& k : ks) {
    tok::Pcre2Regex re(k.re);
    for (int it = 0; it < 3000; ++it) {
      std::string s;
      int n = 1 + int(rng() % 24);
      for (int j = 0; j < n; ++j) s += kAlphabet[rng() % kAlphabet.size()];
      auto a = split_known(k.k, s), b = split_pcre(re, s);
      ASSERT_EQ(a, b) << k.re << "\n on '" << s << "'";
    }
  }
}

TEST(TokenizerSplit, OnigurumaSpecifics) {
  // \s includes U+0085 (Oniguruma's White_Space); (?i) folds U+017F to 's'.
  using V = std::vector<std::string>;
  EXPECT_EQ(split_known(tok::KnownRegex::Gpt2, "a\u0085\u0085b"), (V{"a", "\u0085", "\u0085", "b"}));
  EXPECT_EQ(split_known(tok::KnownRegex::Llama3, "1'\u017fx"), (V{"1", "'\u017f", "x"}));
  EXPECT_EQ(split_known(tok::KnownRegex::Llama3, "12345 x'LL"), (V{"123", "45", " x", "'LL"}));
  EXPECT_EQ(split_known(tok::KnownRegex::Qwen2, "12 \r\n\t b"), (V{"1", "2", " \r\n", "\t", " b"}));
}

TEST(TokenizerUnicode, NfcAndRepair) {
  EXPECT_EQ(nfc("e\u0301"), "\u00e9");
  EXPECT_EQ(nfc("\u1100\u1161\u11a8"), "\uac01");                 // Hangul L V T
  EXPECT_EQ(nfc("a\u0301\u0323"), "\u1ea1\u0301");                // reordered, then composed
  EXPECT_EQ(nfc("\u212b"), "\u00c5");                              // singleton
  EXPECT_EQ(nfc("\u0958"), "\u0915\u093c");                        // composition exclusion
  EXPECT_TRUE(nfc_quick_check("plain ASCII and \u00e9 and \u6f22"));
  EXPECT_FALSE(nfc_quick_check("e\u0301"));
  EXPECT_EQ(uni::repair("a\xff" "b\xe2\x82" "c\xf0\x9f\x98"), "a\uFFFDb\uFFFDc\uFFFD");
  EXPECT_EQ(uni::repair("\xed\xa0\x80"), "\uFFFD\uFFFD\uFFFD");  // surrogate: 3 maximal subparts
  EXPECT_EQ(uni::incomplete_tail("ab\xf0\x9f"), 2u);
  EXPECT_EQ(uni::incomplete_tail("ab\xff"), 0u);
}

TEST(TokenizerDecode, StreamingNeverSplitsCharacters) {
  const std::string text = "Grüße 🦙🚀 漢字 ½ — done.\n\t ok";
  for (std::string path : {tok_shared("gguf-vocab/ggml-vocab-llama-spm.gguf"), tok_shared("llama3"),
                           tok_shared("gguf-vocab/ggml-vocab-gpt-2.gguf")}) {
    const Tokenizer& tok = cached_tokenizer(path);
    auto ids = tok.encode(text, /*add_special=*/true);
    StreamDecoder sd(tok);
    std::string joined;
    int pieces = 0;
    for (int32_t id : ids) {
      std::string s = sd.push(id);
      EXPECT_TRUE(uni::is_valid(s)) << path;
      joined += s;
      pieces += !s.empty();
    }
    joined += sd.flush();
    EXPECT_EQ(joined, tok.decode(ids)) << path;
    EXPECT_GT(pieces, 5);
    StreamDecoder sd2(tok, /*skip_special=*/true);
    std::string plain;
    for (int32_t id : ids) plain += sd2.push(id);
    plain += sd2.flush();
    EXPECT_EQ(plain, text) << path;
  }
  // Byte-fallback tokens of one emoji join across pushes.
  const Tokenizer& spm = cached_tokenizer(tok_shared("gguf-vocab/ggml-vocab-llama-spm.gguf"));
  auto ids = spm.encode("🦙", false);
  ASSERT_EQ(ids, (std::vector<int32_t>{29871, 243, 162, 169, 156}));
  StreamDecoder sd(spm);
  EXPECT_EQ(sd.push(ids[0]), "");
  EXPECT_EQ(sd.push(ids[1]), "");
  EXPECT_EQ(sd.push(ids[2]), "");
  EXPECT_EQ(sd.push(ids[3]), "");
  EXPECT_EQ(sd.push(ids[4]), "🦙");
  EXPECT_EQ(spm.decode({243, 162}), "\uFFFD\uFFFD");  // incomplete: one U+FFFD per byte (ByteFallback)
}

TEST(TokenizerApi, SpecialsBosAndPieces) {
  const Tokenizer& spm = cached_tokenizer(tok_shared("gguf-vocab/ggml-vocab-llama-spm.gguf"));
  EXPECT_EQ(spm.encode("Hello"), (std::vector<int32_t>{1, 15043}));
  EXPECT_EQ(spm.encode("Hello", false), (std::vector<int32_t>{15043}));
  EXPECT_EQ(spm.bos_id(), 1);
  EXPECT_EQ(spm.eos_id(), 2);
  EXPECT_EQ(spm.vocab_size(), 32000);
  EXPECT_EQ(spm.piece(15043), "\u2581Hello");
  EXPECT_EQ(spm.token_bytes(15043), " Hello");
  EXPECT_EQ(spm.decode({1, 15043}), "<s> Hello");
  EXPECT_EQ(spm.decode({1, 15043}, true), "Hello");

  const Tokenizer& l3 = cached_tokenizer(tok_shared("llama3"));
  EXPECT_TRUE(l3.is_special(128009));
  EXPECT_FALSE(l3.is_special(9906));
  EXPECT_EQ(l3.piece(22691), "\u0120Hello");
  // parse_special=false: the special token's text is tokenized as text.
  auto as_text = l3.encode("<|eot_id|>", false, false);
  EXPECT_GT(as_text.size(), 1u);
  EXPECT_EQ(l3.decode(as_text), "<|eot_id|>");
  EXPECT_EQ(l3.encode("<|eot_id|>", false, true), (std::vector<int32_t>{128009}));
  EXPECT_EQ(l3.decode({9906, 128009, 1917}, true), "Hello world");

  // Qwen3: non-special added tokens (<think>) match even with parse_special=false.
  const Tokenizer& q3 = cached_tokenizer(tok_shared("qwen3"));
  EXPECT_EQ(q3.encode("<think>", false, false), (std::vector<int32_t>{151667}));
  EXPECT_FALSE(q3.is_special(151667));
  EXPECT_EQ(q3.bos_id(), -1);
  EXPECT_EQ(q3.encode("hi", true), q3.encode("hi", false));  // add_bos_token false
  EXPECT_THROW(q3.piece(-1), Error);
  EXPECT_THROW(q3.decode({1 << 30}), Error);
}

TEST(TokenizerLoad, ErrorsNameTheProblem) {
  auto msg = [](auto&& f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(msg([] { Tokenizer::load("/nonexistent/tok"); }).find("no such file"), std::string::npos);
  EXPECT_NE(msg([] { Tokenizer::from_hf_json("{not json"); }).find("invalid JSON"), std::string::npos);
  EXPECT_NE(msg([] { Tokenizer::from_hf_json(R"({"model": {"type": "Unigram", "vocab": []}})"); })
                .find("model type 'Unigram' is not supported"),
            std::string::npos);
  EXPECT_NE(msg([] {
              Tokenizer::from_hf_json(
                  R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []},
                      "pre_tokenizer": {"type": "BertPreTokenizer"}})");
            }).find("pre-tokenizer 'BertPreTokenizer' is not supported"),
            std::string::npos);
  EXPECT_NE(msg([] { Tokenizer::from_sentencepiece("\x0a\x03\x0a\x01" "a"); }).find("model type"),
            std::string::npos);
}

TEST(TokenizerLoad, SmallTokenizerJsonWithPcreSplitAndMetaspace) {
  // A tokenizer.json whose split regex has no hand-written matcher runs through PCRE2.
  auto t = Tokenizer::from_hf_json(R"({
    "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2, "\u2581": 3, "\u2581ab": 4, "<unk>": 5},
              "merges": ["a b", "\u2581 ab"], "unk_token": "<unk>", "fuse_unk": true},
    "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "[ab]+|[^ab]+"}, "behavior": "Isolated", "invert": false},
        {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": true}]},
    "decoder": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first"},
    "added_tokens": [{"id": 6, "content": "<x>", "special": true, "lstrip": true, "rstrip": false,
                      "single_word": false, "normalized": false}]})");
  EXPECT_EQ(t->encode("ab zz<x>ab", false), (std::vector<int32_t>{4, 3, 5, 6, 2}));
  EXPECT_EQ(t->encode("ab zz <x> ab", false), (std::vector<int32_t>{4, 3, 5, 6, 3, 2}));  // lstrip
  EXPECT_EQ(t->decode({4, 2}), "abab");
}

}  // namespace
