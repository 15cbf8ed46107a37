// Lexer of the Jinja subset (parser.h): template text -> tokens, with the whitespace handling
// transformers uses (trim_blocks, lstrip_blocks, '-' / '+' markers, newlines normalized, one
// trailing newline dropped). Internal to tokenizer/jinja.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace spade::jinja::lex {

struct Tok {
  enum K { Text, VarBegin, VarEnd, BlockBegin, BlockEnd, Name, String, Int, Float, Op, Eof } k;
  std::string s;
  int64_t i = 0;
  double f = 0;
  int line = 0;
};

// Throws spade::Error "chat template: line N: msg".
[[noreturn]] void syntax(int line, const std::string& msg);

std::vector<Tok> tokenize(const std::string& source);

}  // namespace spade::jinja::lex
