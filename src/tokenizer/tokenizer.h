// spade's tokenizer: produces exactly the ids Hugging Face `tokenizers` produces for the
// supported models (byte-level BPE: GPT-2, Llama-3, Qwen2/3, SmolLM2; SentencePiece-style
// BPE with byte fallback: Llama-2, Mistral, stories260k), from tokenizer.json (+
// tokenizer_config.json), from GGUF metadata (tokenizer.ggml.*), or from a SentencePiece
// tokenizer.model. See docs/tokenizer.md.
//
// Thread safety: a loaded Tokenizer is immutable; encode/decode may run concurrently.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "tokenizer/bpe.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/hash.h"
#include "tokenizer/spec.h"

namespace spade {

class GgufFile;

class Tokenizer {
 public:
  // A .gguf file (a model or a vocabulary-only file), a tokenizer.json / tokenizer.model
  // file, or a Hugging Face directory holding tokenizer.json (and tokenizer_config.json,
  // chat_template.jinja) or tokenizer.model. Throws spade::Error naming the path.
  static std::unique_ptr<Tokenizer> load(const std::string& path);
  static std::unique_ptr<Tokenizer> from_gguf(const GgufFile& f);
  // tokenizer.json text, and tokenizer_config.json text ("" when absent).
  static std::unique_ptr<Tokenizer> from_hf_json(const std::string& tokenizer_json,
                                                 const std::string& config_json = "",
                                                 const std::string& source = "tokenizer.json");
  // The bytes of a SentencePiece ModelProto (tokenizer.model); BPE models only.
  static std::unique_ptr<Tokenizer> from_sentencepiece(std::string_view model_proto,
                                                       const std::string& source = "tokenizer.model");
  static std::unique_ptr<Tokenizer> build(tok::TokenizerSpec spec);
  ~Tokenizer();

  // add_special: BOS/EOS as the configuration says. parse_special: special tokens written
  // in the text become their ids (otherwise they are tokenized as text). Invalid UTF-8 in
  // `text` is read as U+FFFD, as Python's errors="replace" does.
  std::vector<int32_t> encode(std::string_view text, bool add_special = true,
                              bool parse_special = true) const;
  // Lossy like Hugging Face: invalid UTF-8 in the joined bytes becomes U+FFFD.
  std::string decode(const std::vector<int32_t>& ids, bool skip_special = false) const;

  std::string piece(int32_t id) const;  // the token as the vocabulary spells it ("Ġthe", "▁the")
  const std::string& token_bytes(int32_t id) const;  // the bytes it decodes to (" the")
  int32_t token_id(std::string_view piece) const;    // -1 when not in the vocabulary
  int32_t bos_id() const { return bos_id_; }
  int32_t eos_id() const { return eos_id_; }
  const std::vector<int32_t>& eos_ids() const { return eos_ids_; }
  int32_t vocab_size() const { return int32_t(pieces_.size()); }
  bool is_special(int32_t id) const;  // control tokens (skipped by decode(skip_special))
  bool add_bos() const { return add_bos_; }
  const ChatTemplate* chat_template() const { return chat_template_.get(); }
  tok::ModelKind kind() const { return kind_; }
  const std::string& source() const { return source_; }

 private:
  friend class StreamDecoder;
  Tokenizer() = default;
  void encode_text(std::string_view text, bool at_start, std::vector<int32_t>& out) const;
  void encode_word(std::string_view word, std::vector<int32_t>& out) const;
  void initial_symbols(std::string_view word, std::vector<int32_t>& syms) const;
  void check_id(int32_t id) const;

  std::string source_;
  tok::ModelKind kind_ = tok::ModelKind::ByteLevelBpe;
  std::vector<std::string> pieces_;
  std::vector<std::string> bytes_;  // id -> decoded bytes
  std::vector<uint8_t> attrs_;
  std::unordered_map<std::string, int32_t, tok::StrHash, tok::StrEq> piece_to_id_;
  // Whole-word lookup for ignore_merges (byte-level: raw bytes; char: spelling).
  std::unordered_map<std::string, int32_t, tok::StrHash, tok::StrEq> word_to_id_;
  int32_t byte_sym_[256];   // ByteLevelBpe: byte -> initial symbol
  int32_t byte_fallback_[256];  // CharBpe: byte -> <0xXX> id, or -1
  tok::BpeMerges merges_;
  tok::AddedTokenMatcher added_;
  tok::Normalizer normalizer_;
  tok::PreTokenizer pretok_;
  bool ignore_merges_ = false, byte_fallback_on_ = false, fuse_unk_ = false;
  int32_t unk_id_ = -1;
  bool add_bos_ = false, add_eos_ = false;
  int32_t bos_id_ = -1, eos_id_ = -1;
  std::vector<int32_t> eos_ids_;
  int strip_leading_space_ = 0;
  // CharBpe without a pre-tokenizer: no token has U+2581 right after another character,
  // so no merge crosses such a point and the text may be cut there (same ids, faster).
  bool split_at_spaces_ = false;
  std::unique_ptr<ChatTemplate> chat_template_;
  std::map<std::string, std::string> template_tokens_;
  uint64_t instance_ = 0;  // keys the per-thread word cache
};

// Incremental decoding for streaming generation: push() returns the text that the new
// token completes; bytes of a character not yet complete are held back, so the output
// never contains a partial UTF-8 sequence. flush() returns what is left (lossy).
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tok, bool skip_special = false);
  std::string push(int32_t id);
  std::string flush();

 private:
  const Tokenizer& tok_;
  bool skip_special_;
  bool first_ = true;
  std::string pending_;
};

}  // namespace spade
