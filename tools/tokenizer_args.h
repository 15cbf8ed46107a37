// --tokenizer PATH of `spade generate` and `spade chat`: the model's own tokenizer, or the one
// given (any form Tokenizer::load takes: tokenizer.json, tokenizer.model, a GGUF model or
// vocabulary-only file, or a directory holding one); a bad path is an error naming the option.
#pragma once
#include <memory>
#include <string>

#include "args.h"
#include "core/error.h"
#include "tokenizer/tokenizer.h"

namespace spade::cli {

inline std::unique_ptr<Tokenizer> tokenizer_from_args(const Args& a) {
  if (!a.has("--tokenizer")) return Tokenizer::load(a.str("--model"));
  SPADE_CHECK(!a.str("--tokenizer").empty(), "--tokenizer needs a path");
  try {
    return Tokenizer::load(a.str("--tokenizer"));
  } catch (const Error& e) {
    fail("--tokenizer: ", e.what());
  }
}

// Every id of `ids` must index the model's embeddings: another model's tokenizer shows here.
inline void check_token_ids(const std::vector<int32_t>& ids, int64_t vocab, const Args& a) {
  for (int32_t id : ids)
    SPADE_CHECK(id >= 0 && id < vocab, "the prompt has token id ", id, ", outside the model's ",
                "vocabulary of ", vocab, " tokens: ",
                a.has("--tokenizer") ? "--tokenizer is not this model's tokenizer"
                                     : "the tokenizer does not match the model");
}

}  // namespace spade::cli
