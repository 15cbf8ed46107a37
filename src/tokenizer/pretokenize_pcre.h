// A split regex from tokenizer.json that has no hand-written matcher runs through PCRE2
// (UTF + UCP, JIT when available). Oniguruma's \s also matches U+0085, PCRE2's does not;
// the pattern is rewritten so that they agree.
#pragma once
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace spade::tok {

class Pcre2Regex {
 public:
  explicit Pcre2Regex(const std::string& pattern);  // throws spade::Error on a bad pattern
  ~Pcre2Regex();
  Pcre2Regex(const Pcre2Regex&) = delete;
  Pcre2Regex& operator=(const Pcre2Regex&) = delete;
  // All non-overlapping matches [begin, end) in `s`, left to right (empty matches skipped).
  void find_all(std::string_view s, std::vector<std::pair<size_t, size_t>>& out) const;

 private:
  void* code_ = nullptr;  // pcre2_code_8*
};

// \s -> [\s\x{85}] (outside classes) / \s\x{85} (inside), \S -> [^\s\x{85}].
std::string onig_to_pcre2(const std::string& pattern);

}  // namespace spade::tok
