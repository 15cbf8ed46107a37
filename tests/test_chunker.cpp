// Structure-aware chunking (sparse/chunker.h) on hand-checked fixtures
// (tests/fixtures/chunker/*.json: prose, code, JSON, text without delimiters), the cut
// levels of table 4 one by one, the fixed-size ablation, and streaming == one-shot.
//
// Hand check of the fixtures (min 8, max 16, cut i = before token i; window i in s+8..s+16):
//  prose: s=0: best cut before " It" (P ends ".", then a space: level 2) -> 10 tokens.
//         s=10: cuts 22 ("." then "\n": 2), 23 (one newline: 2), 24 (W = "\n\n": 1) -> 14.
//         s=24: ";" at 30 and "," at 35, 39 (level 3); tie last -> 39 (first -> 35); the
//         rest (11 / 15 tokens <= 16) is the final chunk.
//  code:  s=0: cut 11 (W = "\n ", one newline: 2; "{" is not a delimiter) -> 11.
//         s=11: cuts 19 (P ends "}": 1) and 20 ("}\n\n": 1), last -> 20.
//         s=20: cut 35 (";\n ": 2) beats "," and ";" (3) -> 15.  s=35: cut 43 (newline: 2;
//         the "x >" cut at 39 is before the window) -> 8.  s=43: cuts 53, 54, 59 after "}"
//         (1), last -> 59 (16 tokens); "\n" is the 1-token final chunk.
//  json:  s=0: ":" / "," cuts (3) at 9, 11, 14, last -> 14.  s=14: cut 23 after "],"
//         (closer + separator: 1) -> 9.  s=23: cuts 31 (",") and 34 (":") level 3, last -> 34
//         ("b.c": "." without whitespace after is no sentence end).  Rest final.
//  nodelim: no cut has a level -> forced 16, 16, then the final 8.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "sparse/chunker.h"
#include "test_util.h"

using namespace spade;
using namespace spade::sparse;

namespace {

nlohmann::json load_fixture(const std::string& name) {
  std::ifstream f(test::source_dir() + "/tests/fixtures/chunker/" + name + ".json");
  EXPECT_TRUE(f.good()) << name;
  std::stringstream ss;
  ss << f.rdbuf();
  return nlohmann::json::parse(ss.str());
}

std::vector<std::string> chunk_texts(const std::vector<std::string>& toks, const ChunkerOptions& o) {
  std::vector<std::string> out;
  size_t p = 0;
  for (int n : chunk_lengths(toks, o)) {
    std::string s;
    for (int i = 0; i < n; ++i) s += toks[p++];
    out.push_back(s);
  }
  return out;
}

int level_between(std::vector<std::string> toks, size_t cut) {
  TokenTextView v(&toks, int64_t(toks.size()));
  return cut_level(v, int64_t(cut));
}

}  // namespace

TEST(Chunker, FixturesMatchHandCheckedChunks) {
  int cases = 0;
  for (const char* name : {"prose", "code", "json", "nodelim"}) {
    auto j = load_fixture(name);
    auto toks = j["tokens"].get<std::vector<std::string>>();
    for (const auto& c : j["cases"]) {
      ChunkerOptions o;
      if (c.contains("fixed")) {
        o.fixed = true;
        o.fixed_tokens = c["fixed"].get<int>();
      }
      if (c.contains("tie")) o.tie = c["tie"] == "first" ? ChunkTie::First : ChunkTie::Last;
      if (c.contains("chunks")) {
        EXPECT_EQ(chunk_texts(toks, o), c["chunks"].get<std::vector<std::string>>()) << name;
      }
      if (c.contains("lengths")) {
        EXPECT_EQ(chunk_lengths(toks, o), c["lengths"].get<std::vector<int>>()) << name;
      }
      ++cases;
    }
  }
  EXPECT_EQ(cases, 7);
}

TEST(Chunker, CutLevelsOfTable4) {
  // Structural: blank line, fences/rules, closers (not arrows), closer + separator.
  EXPECT_EQ(level_between({"a", ".\n\n", "B"}, 2), kLevelStructural);
  EXPECT_EQ(level_between({"x", "\n", "\n", "y"}, 3), kLevelStructural);
  EXPECT_EQ(level_between({"```", "\n", "code"}, 1), kLevelStructural);  // P ends with ```
  EXPECT_EQ(level_between({"---", "x"}, 1), kLevelStructural);
  EXPECT_EQ(level_between({"}", "x"}, 1), kLevelStructural);
  EXPECT_EQ(level_between({"a", "]", "x"}, 2), kLevelStructural);
  EXPECT_EQ(level_between({"</b", ">", "x"}, 2), kLevelStructural);
  EXPECT_EQ(level_between({"p", "->", "x"}, 2), kLevelNone);   // member access
  EXPECT_EQ(level_between({"f", " =>", " x"}, 2), kLevelWhitespace);  // arrow: only the space
  EXPECT_EQ(level_between({"1", "},", "2"}, 2), kLevelStructural);
  // Sentence: terminators followed by whitespace or the end, one newline, CJK.
  EXPECT_EQ(level_between({"end", ".", " Next"}, 2), kLevelSentence);
  EXPECT_EQ(level_between({"end", "?", "\n"}, 2), kLevelSentence);
  EXPECT_EQ(level_between({"3", ".", "14"}, 2), kLevelNone);   // decimal point
  EXPECT_EQ(level_between({"a", ".", "b"}, 2), kLevelNone);
  EXPECT_EQ(level_between({"line", "\n", "next"}, 2), kLevelSentence);
  EXPECT_EQ(level_between({"\xE5\xA5\xBD", "\xE3\x80\x82", "\xE6\x98\xAF"}, 2), kLevelSentence);  // 好。是
  // Phrase: , ; : and CJK.
  EXPECT_EQ(level_between({"a", ",", "b"}, 2), kLevelPhrase);
  EXPECT_EQ(level_between({"a", ";", "b"}, 2), kLevelPhrase);
  EXPECT_EQ(level_between({"key", "\":", "1"}, 2), kLevelPhrase);
  EXPECT_EQ(level_between({"\xE5\xA5\xBD", "\xEF\xBC\x8C", "\xE6\x98\xAF"}, 2), kLevelPhrase);  // ，
  EXPECT_EQ(level_between({"\xE5\xA5\xBD", "\xE3\x80\x81", "\xE6\x98\xAF"}, 2), kLevelPhrase);  // 、
  // Whitespace: the space usually starts the next token.
  EXPECT_EQ(level_between({"fox", " jumps"}, 1), kLevelWhitespace);
  EXPECT_EQ(level_between({"fox ", "jumps"}, 1), kLevelWhitespace);
  EXPECT_EQ(level_between({"a\tb", "\tc"}, 1), kLevelWhitespace);
  // Newlines count where they end: before "\n" is only whitespace, after it a sentence cut.
  EXPECT_EQ(level_between({"word", "\n", "next"}, 1), kLevelWhitespace);
  // None inside a word; the end of the text.
  EXPECT_EQ(level_between({"abc", "def"}, 1), kLevelNone);
  EXPECT_EQ(level_between({"abc", "def"}, 2), kLevelEnd);
}

TEST(Chunker, LengthsStayInRangeAndFixedFallback) {
  // Random token soup from a small vocabulary with every delimiter kind.
  const std::vector<std::string> vocab = {" the", "cat", ",", ".", "\n", "\n\n", "}", "x", "yz",
                                          " ", ":", "```", "\xE3\x80\x82", "abc", "(", ")"};
  std::mt19937 rng(3);
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<std::string> toks(size_t(20 + rng() % 400));
    for (auto& t : toks) t = vocab[rng() % vocab.size()];
    for (ChunkTie tie : {ChunkTie::Last, ChunkTie::First}) {
      ChunkerOptions o;
      o.tie = tie;
      auto len = chunk_lengths(toks, o);
      int total = 0;
      for (size_t i = 0; i < len.size(); ++i) {
        total += len[i];
        if (i + 1 < len.size()) {
          EXPECT_GE(len[i], 8);
          EXPECT_LE(len[i], 16);
        } else {
          EXPECT_GE(len[i], 1);
          EXPECT_LE(len[i], 16);
        }
      }
      EXPECT_EQ(total, int(toks.size()));
    }
  }
  // No text at all (positions without text): fixed 16.
  std::vector<std::string> empty(50);
  EXPECT_EQ(chunk_lengths(empty, {}), (std::vector<int>{16, 16, 16, 2}));
  // The fixed ablation ignores delimiters.
  ChunkerOptions f;
  f.fixed = true;
  f.fixed_tokens = 16;
  std::vector<std::string> prose(40, " word.");
  EXPECT_EQ(chunk_lengths(prose, f), (std::vector<int>{16, 16, 8}));
  f.fixed_tokens = 10;
  EXPECT_EQ(chunk_lengths(prose, f), (std::vector<int>{10, 10, 10, 10}));
}

TEST(Chunker, StreamingMatchesOneShot) {
  // Chunking a growing prefix in streaming mode and finishing once gives the same chunks
  // as chunking everything at once: boundaries never depend on where a call stopped.
  auto j = load_fixture("code");
  auto base = j["tokens"].get<std::vector<std::string>>();
  std::vector<std::string> toks;
  for (int r = 0; r < 6; ++r) toks.insert(toks.end(), base.begin(), base.end());
  const int64_t n = int64_t(toks.size());
  TokenTextView v(&toks, n);
  for (bool fixed : {false, true}) {
    ChunkerOptions o;
    o.fixed = fixed;
    std::vector<int32_t> ref;
    chunk_tokens(v, 0, n, true, o, ref);
    std::mt19937 rng(9);
    for (int trial = 0; trial < 20; ++trial) {
      std::vector<int32_t> got;
      int64_t at = 0, end = 0;
      while (end < n) {
        end = std::min<int64_t>(n, end + 1 + int64_t(rng() % 40));
        // Streaming sees the text up to `end` only.
        TokenTextView part(&toks, end);
        at = chunk_tokens(part, at, end, false, o, got);
        EXPECT_LE(end - at, fixed ? 15 : 16);
      }
      chunk_tokens(v, at, n, true, o, got);
      EXPECT_EQ(got, ref) << "trial " << trial << " fixed " << fixed;
    }
  }
}
