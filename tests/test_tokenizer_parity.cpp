// Parity with Hugging Face `tokenizers` on ~170 KB of varied text (prose, code, JSON, CJK,
// emoji, whitespace runs, long numbers, combining marks, random code points, invalid UTF-8):
// reference ids written by python/make_tokenizer_fixtures.py, compared exactly. Also
// decode(encode(x)) == x for every valid-UTF-8 record.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "test_tokenizer_common.h"
#include "tokenizer/byte_level.h"
#include "tokenizer/nfc.h"
#include "tokenizer/unicode.h"

using namespace spade;
using namespace spade::test;

namespace {

uint64_t read_varint(const std::string& s, size_t& p) {
  uint64_t v = 0;
  for (int shift = 0; p < s.size(); shift += 7) {
    uint8_t b = uint8_t(s[p++]);
    v |= uint64_t(b & 0x7F) << shift;
    if (!(b & 0x80)) break;
  }
  return v;
}

const std::vector<std::string>& corpus() {
  static const std::vector<std::string> recs = [] {
    std::string d = read_all(tok_fixture("parity/corpus.bin"));
    std::vector<std::string> r;
    for (size_t p = 0; p < d.size();) {
      size_t n = read_varint(d, p);
      r.push_back(d.substr(p, n));
      p += n;
    }
    return r;
  }();
  return recs;
}

std::vector<std::vector<int32_t>> reference(const std::string& model) {
  std::string d = read_all(tok_fixture("parity/" + model + ".ids"));
  std::vector<std::vector<int32_t>> r;
  for (size_t p = 0; p < d.size();) {
    size_t n = read_varint(d, p);
    std::vector<int32_t> ids(n);
    for (auto& x : ids) x = int32_t(read_varint(d, p));
    r.push_back(std::move(ids));
  }
  return r;
}

// Every byte has a token (SmolLM2's vocabulary lacks a few control bytes; tokenizers
// drops those, so such text cannot round-trip).
bool representable(const Tokenizer& tok, const std::string& s) {
  if (tok.kind() != tok::ModelKind::ByteLevelBpe) return true;
  for (unsigned char c : s)
    if (tok.token_id(tok::byte_level_encode(std::string(1, char(c)))) < 0) return false;
  return true;
}

// stories260k-hf's normalizer: Replace(\A +, ""), Replace( {2,}, " "), Replace( +\z, "").
std::string squeeze_spaces(const std::string& s) {
  std::string r;
  for (char ch : s)
    if (ch != ' ' || (!r.empty() && r.back() != ' ')) r.push_back(ch);
  while (!r.empty() && r.back() == ' ') r.pop_back();
  return r;
}

struct Case {
  std::string model;  // reference file
  std::string path;   // what spade loads
};
std::ostream& operator<<(std::ostream& os, const Case& c) { return os << c.model << " via " << c.path; }

class Parity : public ::testing::TestWithParam<Case> {};

TEST_P(Parity, CorpusMatchesReferenceIds) {
  const Case& c = GetParam();
  if (!exists(c.path)) GTEST_SKIP() << c.path << " not present (scripts/fetch_model.sh fetches it)";
  const Tokenizer& tok = cached_tokenizer(c.path);
  const auto& recs = corpus();
  auto ref = reference(c.model);
  ASSERT_EQ(ref.size(), recs.size());
  ASSERT_GT(recs.size(), 300u);
  size_t mismatches = 0, tokens = 0, round_trips = 0;
  for (size_t i = 0; i < recs.size(); ++i) {
    auto ids = tok.encode(recs[i], /*add_special=*/false, /*parse_special=*/true);
    tokens += ids.size();
    if (ids != ref[i]) {
      if (++mismatches <= 5)
        ADD_FAILURE() << c << ": record " << i << " '" << recs[i].substr(0, 120) << "'\n got  "
                      << ids_str(ids).substr(0, 400) << "\n want " << ids_str(ref[i]).substr(0, 400);
    }
    if (uni::is_valid(recs[i]) && representable(tok, recs[i])) {
      std::string want = tok.source().find("qwen") != std::string::npos ? nfc(recs[i]) : recs[i];
      if (c.model == "stories260k-hf") want = squeeze_spaces(want);
      if (tok.decode(ids) != want) {
        ADD_FAILURE() << c << ": round trip of record " << i << " '" << recs[i].substr(0, 80) << "' got '" << tok.decode(ids).substr(0, 80) << "'";
      } else {
        ++round_trips;
      }
    }
  }
  EXPECT_EQ(mismatches, 0u) << c << ": of " << recs.size() << " records";
  EXPECT_GT(round_trips, 250u);
  RecordProperty("tokens", int(tokens));
}

const std::string kModel = std::string(SPADE_SOURCE_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";

INSTANTIATE_TEST_SUITE_P(
    Tokenizer, Parity,
    ::testing::Values(Case{"gpt2", tok_shared("gguf-vocab/ggml-vocab-gpt-2.gguf")},
                      Case{"llama3", tok_shared("llama3")},
                      Case{"llama3", tok_shared("gguf-vocab/ggml-vocab-llama-bpe.gguf")},
                      Case{"qwen3", tok_shared("qwen3")},
                      Case{"qwen3", tok_shared("gguf-vocab/ggml-vocab-qwen2.gguf")},
                      Case{"llama-spm", tok_shared("gguf-vocab/ggml-vocab-llama-spm.gguf")},
                      Case{"smollm2", kModel},
                      Case{"stories260k", std::string(SPADE_SOURCE_DIR) +
                                              "/../shared/fixtures/models/stories260k/tokenizer.model"},
                      // tokenizer.json with regex Replace normalizers
                      Case{"stories260k-hf", std::string(SPADE_SOURCE_DIR) +
                                                 "/tests/fixtures/models/stories260k-hf"}),
    [](const auto& info) {
      std::string n = info.param.model + "_" + std::to_string(info.index);
      for (auto& ch : n)
        if (!isalnum(uint8_t(ch))) ch = '_';
      return n;
    });

// Special tokens written in the text, and BOS/EOS per configuration.
TEST(TokenizerParity, SpecialTokensAndBos) {
  auto j = nlohmann::json::parse(read_all(tok_fixture("parity/special.json")));
  std::map<std::string, std::string> paths = {
      {"gpt2", tok_shared("gguf-vocab/ggml-vocab-gpt-2.gguf")},
      {"llama3", tok_shared("llama3")},
      {"qwen3", tok_shared("qwen3")},
      {"llama-spm", tok_shared("gguf-vocab/ggml-vocab-llama-spm.gguf")},
      {"smollm2", kModel},
      {"stories260k", std::string(SPADE_SOURCE_DIR) + "/../shared/fixtures/models/stories260k/tokenizer.model"},
      {"stories260k-hf", std::string(SPADE_SOURCE_DIR) + "/tests/fixtures/models/stories260k-hf"},
  };
  int checked = 0;
  for (auto& [model, path] : paths) {
    if (!exists(path) || !j.contains(model)) continue;
    const Tokenizer& tok = cached_tokenizer(path);
    for (const auto& c : j[model]["parse_special"]) {
      auto ids = tok.encode(c["text"].get<std::string>(), false, true);
      EXPECT_EQ(ids, c["ids"].get<std::vector<int32_t>>()) << model << ": " << c["text"];
      ++checked;
    }
    for (const auto& c : j[model]["add_special"]) {
      auto ids = tok.encode(c["text"].get<std::string>(), true, true);
      EXPECT_EQ(ids, c["ids"].get<std::vector<int32_t>>()) << model << " (add_special): " << c["text"];
      ++checked;
    }
  }
  EXPECT_GT(checked, 20);
}

}  // namespace
