// Structure-aware chunking of a token sequence (LycheeCluster, lycheecluster.md section 4.3
// and appendix B, table 4; docs/lycheecluster.md). Works on the decoded text of each token
// (Tokenizer::token_bytes), so it is tokenizer-agnostic.
//
// Rule, from a chunk start s:
//   1. accumulate greedily to at least `min_tokens` (8) tokens;
//   2. among the cuts after s+min_tokens .. s+max_tokens tokens (window up to 16), take the
//      one with the strongest delimiter level (1 strongest .. 4 weakest, below); equal
//      levels: the last one in the window (tie = Last, default) or the first (tie = First);
//   3. no delimiter in the window: forced cut at `max_tokens` (16).
// Text without any delimiter therefore falls back to fixed chunks of 16 tokens.
//
// Level of the cut between tokens i-1 and i, computed on the concatenated text around it:
//   P = the text before the cut with its trailing whitespace run W removed,
//   R = the text after the cut.
//   1 structural: W holds >= 2 newlines (blank line / paragraph); P ends with a markdown
//     fence or rule ("```", "---", "***"); P ends with '}' or ']' or '>' (not "->", "=>"),
//     or with one of them followed by ',' or ';' ("}," "];": the closer and its separator).
//   2 sentence:  P ends with '.', '?' or '!' followed by whitespace (W non-empty or R
//     starting with whitespace) or the end of the text (so "3.14" and "a.b" do not count);
//     P ends with a CJK terminator (。？！); W holds exactly one newline.
//   3 phrase:    P ends with ',', ';', ':' or CJK (，；：、).
//   4 whitespace: W non-empty, or R starts with whitespace (BPE attaches the space to the
//     next token: "fox" | " jumps").
//   none otherwise (the cut would split a word or a symbol run).
// A newline only counts where it ends (W): the cut after "\n" ranks above the cut before it,
// so chunks start at the beginning of a line. A multi-byte CJK mark split across tokens by a
// byte-level tokenizer is not recognised (it reads as no delimiter).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace spade::sparse {

enum class ChunkTie { Last, First };

struct ChunkerOptions {
  int min_tokens = 8;    // paper appendix A: minimum chunk length
  int max_tokens = 16;   // paper appendix A: maximum chunk length (forced split)
  ChunkTie tie = ChunkTie::Last;
  // Ablation (paper section 5.4): ignore the text and cut every `fixed_tokens` tokens.
  bool fixed = false;
  int fixed_tokens = 16;
};

// Delimiter levels; kLevelNone for a cut with no delimiter, kLevelEnd for the end of text.
constexpr int kLevelEnd = 0;
constexpr int kLevelStructural = 1;
constexpr int kLevelSentence = 2;
constexpr int kLevelPhrase = 3;
constexpr int kLevelWhitespace = 4;
constexpr int kLevelNone = 5;

// Token texts of positions [0, n); a position without text reads as "".
class TokenTextView {
 public:
  TokenTextView(const std::vector<std::string>* text, int64_t n) : text_(text), n_(n) {}
  int64_t size() const { return n_; }
  std::string_view at(int64_t i) const {
    if (!text_ || i < 0 || i >= int64_t(text_->size())) return {};
    return (*text_)[size_t(i)];
  }

 private:
  const std::vector<std::string>* text_;
  int64_t n_;
};

// Level of the cut before token i (between i-1 and i), 1 <= i <= n; i == n is kLevelEnd.
int cut_level(const TokenTextView& t, int64_t i);

// Chunks positions [begin, end) of `t` (end <= t.size()) and appends each chunk's first
// position to `starts`; returns the position where chunking stopped. final = true: the
// text ends at `end`, the tail (<= max_tokens tokens) becomes the last chunk and the
// return value is `end`. final = false (streaming): a chunk is only cut once its whole
// window and the token after it are visible, so the return value r leaves r..end (at most
// max_tokens tokens, fixed mode: fewer than fixed_tokens) for a later call.
int64_t chunk_tokens(const TokenTextView& t, int64_t begin, int64_t end, bool final,
                     const ChunkerOptions& opt, std::vector<int32_t>& starts);

// Chunk boundaries of a growing token sequence (LycheeCluster's per-request chunks, CPU and
// GPU): chunks close over [sink, L) as L grows (chunk_tokens with final = false); the open
// tail waits for more tokens. Chunk c covers [starts()[c], starts()[c + 1]); the last entry
// is where the next chunk will start (empty before the first extend).
class StreamingChunks {
 public:
  // Closes the chunks that tokens [0, L) allow (text[pos]: the token's decoded bytes; missing
  // text reads as ""). A repeated L does nothing.
  void extend(const std::vector<std::string>& text, int64_t L, int sink, const ChunkerOptions& opt);
  const std::vector<int32_t>& starts() const { return starts_; }
  int32_t n_chunks() const { return starts_.empty() ? 0 : int32_t(starts_.size()) - 1; }

 private:
  std::vector<int32_t> starts_;
  int64_t chunked_for_ = -1;  // L of the last extend
};

// Convenience for tests and tools: chunk lengths of a whole token list (final = true).
std::vector<int> chunk_lengths(const std::vector<std::string>& tokens, const ChunkerOptions& opt);

// Checks min/max/fixed sizes; throws spade::Error.
void validate(const ChunkerOptions& opt);

}  // namespace spade::sparse
