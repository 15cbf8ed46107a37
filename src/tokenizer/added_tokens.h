// Added tokens (special and not) are found in the text before any normalization or
// splitting, leftmost-longest like Hugging Face's AddedVocabulary, with its lstrip /
// rstrip / single_word options. `parse_special = false` leaves special tokens as text;
// non-special added tokens (e.g. Qwen's <think>) still match.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace spade::tok {

struct AddedToken {
  std::string content;
  int32_t id = -1;
  bool special = false;
  bool lstrip = false, rstrip = false, single_word = false;
};

struct Segment {
  std::string_view text;  // plain text when id < 0
  int32_t id = -1;
};

class AddedTokenMatcher {
 public:
  void build(const std::vector<AddedToken>& tokens);
  bool empty() const { return tokens_.empty(); }
  void split(std::string_view text, bool parse_special, std::vector<Segment>& out) const;

 private:
  struct Node {
    std::vector<std::pair<uint8_t, int32_t>> next;
    int32_t token = -1;  // index into tokens_ when a token ends here
  };
  // Longest allowed token starting at text[i]: returns its index, sets `len`.
  int32_t longest_at(std::string_view text, size_t i, bool parse_special, size_t& len) const;
  std::vector<AddedToken> tokens_;
  std::vector<Node> nodes_;
  bool first_byte_[256] = {};
};

}  // namespace spade::tok
