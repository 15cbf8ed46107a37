// llama.cpp's vocabulary tests (strings and the ids Hugging Face tokenizers gives them):
// through the GGUF vocabularies, and the same strings through tokenizer.json.
#include <gtest/gtest.h>

#include "test_tokenizer_common.h"

using namespace spade;
using namespace spade::test;

namespace {

void check_cases(const Tokenizer& tok, const std::string& name, const std::vector<VocabCase>& cases) {
  ASSERT_GT(cases.size(), 40u);
  int bad = 0;
  for (const auto& c : cases) {
    auto ids = tok.encode(c.text, /*add_special=*/false, /*parse_special=*/false);
    EXPECT_EQ(ids, c.ids) << name << ": '" << c.text << "'\n got  " << ids_str(ids)
                          << "\n want " << ids_str(c.ids);
    bad += ids != c.ids;
    // Round trip for valid UTF-8.
    EXPECT_EQ(tok.decode(ids), c.text) << name << ": decode of '" << c.text << "'";
  }
  EXPECT_EQ(bad, 0);
}

class GgufVocab : public ::testing::TestWithParam<std::string> {};

TEST_P(GgufVocab, MatchesHuggingFaceIds) {
  std::string base = tok_shared("gguf-vocab/ggml-vocab-" + GetParam() + ".gguf");
  const Tokenizer& tok = cached_tokenizer(base);
  check_cases(tok, GetParam(), read_vocab_cases(base + ".inp", base + ".out"));
}

INSTANTIATE_TEST_SUITE_P(Tokenizer, GgufVocab,
                         ::testing::Values("llama-bpe", "qwen2", "gpt-2", "llama-spm"));

TEST(TokenizerJson, Llama3MatchesLlamaBpeIds) {
  std::string base = tok_shared("gguf-vocab/ggml-vocab-llama-bpe.gguf");
  check_cases(cached_tokenizer(tok_shared("llama3")), "llama3 tokenizer.json",
              read_vocab_cases(base + ".inp", base + ".out"));
}

TEST(TokenizerJson, Qwen3MatchesQwen2Ids) {
  std::string base = tok_shared("gguf-vocab/ggml-vocab-qwen2.gguf");
  check_cases(cached_tokenizer(tok_shared("qwen3")), "qwen3 tokenizer.json",
              read_vocab_cases(base + ".inp", base + ".out"));
}

// The tokenizer.json vocabularies agree with the GGUF ones they are compared against:
// same spelling for every id of the BPE vocabulary and the first special tokens.
TEST(TokenizerJson, VocabulariesAgreeWithGguf) {
  const Tokenizer& l3 = cached_tokenizer(tok_shared("llama3"));
  const Tokenizer& lb = cached_tokenizer(tok_shared("gguf-vocab/ggml-vocab-llama-bpe.gguf"));
  ASSERT_EQ(l3.vocab_size(), lb.vocab_size());
  for (int32_t i = 0; i < l3.vocab_size(); ++i) ASSERT_EQ(l3.piece(i), lb.piece(i)) << i;

  const Tokenizer& q3 = cached_tokenizer(tok_shared("qwen3"));
  const Tokenizer& q2 = cached_tokenizer(tok_shared("gguf-vocab/ggml-vocab-qwen2.gguf"));
  // Qwen2's GGUF pads to 151,936 with [PAD...] tokens where Qwen3 has its newer added
  // tokens (<tool_call>, <think>, ...); ids below 151,646 are the same.
  EXPECT_EQ(q3.vocab_size(), 151669);
  EXPECT_EQ(q2.vocab_size(), 151936);
  for (int32_t i = 0; i < 151646; ++i) ASSERT_EQ(q3.piece(i), q2.piece(i)) << i;
}

}  // namespace
