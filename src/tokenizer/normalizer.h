// Normalizers of tokenizer.json (NFC, Prepend, Replace with a string or a regex, Sequence) plus SentencePiece's
// whitespace collapsing, applied to each piece of text between added tokens.
#pragma once
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/pretokenize_pcre.h"

namespace spade::tok {

struct NormStep {
  enum Kind { Nfc, Prepend, Replace, ReplaceRegex, CollapseSpaces } kind = Nfc;
  std::string a, b;  // Prepend: a = text; Replace: a -> b; ReplaceRegex: matches of `re` -> b
};

class Normalizer {
 public:
  void add(NormStep s, std::shared_ptr<const Pcre2Regex> re = nullptr) {
    steps_.push_back(std::move(s));
    regexes_.push_back(std::move(re));
  }
  bool empty() const { return steps_.empty(); }
  // Returns `text` itself (no copy) when nothing changes, else a view of `buf`.
  std::string_view apply(std::string_view text, std::string& buf) const;

 private:
  std::vector<NormStep> steps_;
  std::vector<std::shared_ptr<const Pcre2Regex>> regexes_;  // per step (ReplaceRegex only)
};

}  // namespace spade::tok
