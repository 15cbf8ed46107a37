#include "server/tokenizer_text.h"

namespace spade::server {

namespace {
class DecoderStream : public TextStream {
 public:
  explicit DecoderStream(const Tokenizer& tok) : dec_(tok, /*skip_special=*/true) {}
  std::string push(int32_t id) override { return dec_.push(id); }
  std::string flush() override { return dec_.flush(); }

 private:
  StreamDecoder dec_;
};
}  // namespace

std::unique_ptr<TextStream> TokenizerText::stream(int32_t prev) const {
  auto s = std::make_unique<DecoderStream>(tok_);
  // Decode the continuation the way it reads after the prompt: prime the decoder with the
  // prompt's last token (its text is dropped), so a SentencePiece "▁word" keeps its space.
  if (prev >= 0 && prev < tok_.vocab_size() && !tok_.is_special(prev)) s->push(prev);
  return s;
}

std::string TokenizerText::piece(int32_t id) const {
  if (id < 0 || id >= tok_.vocab_size()) return {};
  return tok_.token_bytes(id);
}

}  // namespace spade::server
