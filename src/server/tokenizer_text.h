// TokenText (engine/request.h) over spade's Tokenizer: streaming detokenization that never
// splits a UTF-8 character and writes no text for special tokens.
#pragma once
#include "engine/request.h"
#include "tokenizer/tokenizer.h"

namespace spade::server {

class TokenizerText : public TokenText {
 public:
  explicit TokenizerText(const Tokenizer& tok) : tok_(tok) {}
  std::unique_ptr<TextStream> stream(int32_t prev) const override;
  std::string piece(int32_t id) const override;

 private:
  const Tokenizer& tok_;
};

}  // namespace spade::server
