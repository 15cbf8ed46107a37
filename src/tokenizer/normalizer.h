// Normalizers of tokenizer.json (NFC, Prepend, Replace, Sequence) plus SentencePiece's
// whitespace collapsing, applied to each piece of text between added tokens.
#pragma once
#include <string>
#include <string_view>
#include <vector>

namespace spade::tok {

struct NormStep {
  enum Kind { Nfc, Prepend, Replace, CollapseSpaces } kind = Nfc;
  std::string a, b;  // Prepend: a = text; Replace: a -> b
};

class Normalizer {
 public:
  void add(NormStep s) { steps_.push_back(std::move(s)); }
  bool empty() const { return steps_.empty(); }
  // Returns `text` itself (no copy) when nothing changes, else a view of `buf`.
  std::string_view apply(std::string_view text, std::string& buf) const;

 private:
  std::vector<NormStep> steps_;
};

}  // namespace spade::tok
