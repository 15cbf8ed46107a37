// Pre-tokenization: splitting normalized text into the pieces BPE works on, as Hugging Face
// `tokenizers` pre-tokenizers do (Split with a regex, ByteLevel, Digits, Metaspace, and a
// Sequence of them). The split regexes of GPT-2, Llama-3 and Qwen2 have hand-written
// matchers equal to the regex (as Oniguruma runs it, with Unicode 16 tables); any other
// regex runs through PCRE2 (UTF + UCP, JIT).
#pragma once
#include <deque>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace spade::tok {

enum class KnownRegex { None, Gpt2, Llama3, Qwen2 };

// The regexes the hand-written splitters implement.
extern const char* const kGpt2Regex;
extern const char* const kLlama3Regex;
extern const char* const kQwen2Regex;
KnownRegex identify_regex(std::string_view pattern);

// Length of the regex match starting at s[0] (n > 0, valid UTF-8). Every character is
// matched by some alternative of these regexes, so the result is always >= 1.
size_t match_gpt2(const char* s, size_t n);
size_t match_llama3(const char* s, size_t n, int max_digits);  // 3: Llama-3, 1: Qwen2

class Pcre2Regex;  // pretokenize_pcre.cpp

enum class SplitBehavior { Isolated, Removed, MergedWithPrevious, MergedWithNext, Contiguous };

struct PreTokStage {
  enum Kind { Split, Digits, ByteLevel, Metaspace } kind = Split;
  // Split
  KnownRegex known = KnownRegex::None;
  std::string pattern;           // regex, or a literal string when `literal`
  bool literal = false;
  std::shared_ptr<Pcre2Regex> re;
  SplitBehavior behavior = SplitBehavior::Isolated;
  bool invert = false;
  // Digits
  bool individual_digits = false;
  // ByteLevel
  bool add_prefix_space = false;
  bool use_regex = true;
  // Metaspace
  std::string replacement = "\xE2\x96\x81";  // U+2581
  enum Prepend { Always, First, Never } prepend = Always;
  bool split = true;
};

// Owned storage for pieces that differ from the input text (prefix spaces, Metaspace).
using PieceArena = std::deque<std::string>;

class PreTokenizer {
 public:
  void add(PreTokStage s);
  bool empty() const { return stages_.empty(); }
  // Appends the pieces of `text` to `out`. `at_start`: the text begins the input (for
  // Metaspace's prepend_scheme "first").
  void split(std::string_view text, bool at_start, std::vector<std::string_view>& out,
             PieceArena& arena) const;

 private:
  std::vector<PreTokStage> stages_;
};

// Splits by a single stage; exposed for tests.
void split_stage(const PreTokStage& st, std::string_view piece, bool at_start,
                 std::vector<std::string_view>& out, PieceArena& arena);

}  // namespace spade::tok
