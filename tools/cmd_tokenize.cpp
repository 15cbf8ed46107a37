// `spade tokenize --model PATH [--ids] [--no-bos] [--] TEXT`: tokenize text with a model's
// tokenizer (GGUF file, vocabulary-only GGUF, or Hugging Face directory).
#include <cstdio>
#include <iostream>
#include <iterator>
#include <string>

#include "args.h"
#include "command.h"
#include "tokenizer/tokenizer.h"

namespace spade::cli {
namespace {

const char* kHelp = R"(usage: spade tokenize --model PATH [--ids] [--no-bos] [--no-special] [--] TEXT...

  --model PATH   GGUF file (a model or a vocabulary-only file), Hugging Face directory
                 with tokenizer.json (+ tokenizer_config.json), or tokenizer.model
  --ids          print token ids (space-separated) instead of pieces
  --no-bos       do not add BOS/EOS even where the tokenizer's configuration adds them
  --no-special   read special tokens written in TEXT as plain text
  --stdin        read TEXT from standard input (all of it, bytes as given)
  --count        print only the number of tokens

TEXT words are joined with single spaces. Without --ids, each token is printed as its
vocabulary spelling (e.g. "Ġworld" for byte-level BPE, "▁world" for SentencePiece),
separated by spaces.
)";

int run(int argc, char** argv) {
  Args a(argc, argv, {"--model"}, {"--help", "--ids", "--no-bos", "--no-special", "--stdin", "--count"});
  if (a.has("--help")) {
    std::fputs(kHelp, stdout);
    return 0;
  }
  SPADE_CHECK(a.has("--model"), "tokenize needs --model PATH (see --help)");
  std::string text;
  if (a.has("--stdin")) {
    SPADE_CHECK(a.positional().empty(), "tokenize: give TEXT or --stdin, not both");
    text.assign(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
  } else {
    SPADE_CHECK(!a.positional().empty(), "tokenize needs TEXT (or --stdin; see --help)");
    for (size_t i = 0; i < a.positional().size(); ++i) {
      if (i) text += ' ';
      text += a.positional()[i];
    }
  }
  auto tok = Tokenizer::load(a.str("--model"));
  std::vector<int32_t> ids = tok->encode(text, !a.has("--no-bos"), !a.has("--no-special"));
  if (a.has("--count")) {
    std::printf("%zu\n", ids.size());
    return 0;
  }
  std::string out;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) out += ' ';
    out += a.has("--ids") ? std::to_string(ids[i]) : tok->piece(ids[i]);
  }
  out += '\n';
  std::fwrite(out.data(), 1, out.size(), stdout);
  return 0;
}

Registrar reg("tokenize", "tokenize text with a model's tokenizer (ids or pieces)", run);

}  // namespace
}  // namespace spade::cli
