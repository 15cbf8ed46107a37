// What a loader (tokenizer.json, GGUF, SentencePiece .model) hands to Tokenizer::build:
// the vocabulary as the source spells it, merges or scores, added tokens, the
// normalizer / pre-tokenizer pipeline, and BOS/EOS policy. Internal to src/tokenizer.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "tokenizer/added_tokens.h"
#include "tokenizer/normalizer.h"
#include "tokenizer/pretokenize.h"

namespace spade::tok {

enum class ModelKind {
  ByteLevelBpe,  // GPT-2 style: vocabulary in the byte-to-unicode alphabet, merges by rank
  CharBpe,       // SentencePiece style: characters (U+2581 for space), byte fallback
};

// Token attributes (GGUF token_type / SentencePiece piece types / added tokens).
enum TokenAttr : uint8_t {
  kAttrNormal = 0,
  kAttrControl = 1,   // special: matched only when parsing specials, skippable in decode
  kAttrUserDefined = 2,  // added but not special: always matched as a whole
  kAttrByte = 4,      // <0xXX>
  kAttrUnknown = 8,
  kAttrUnused = 16,
};

struct TokenizerSpec {
  std::string source;  // for messages
  ModelKind kind = ModelKind::ByteLevelBpe;
  std::vector<std::string> pieces;  // id -> spelling in the vocabulary
  std::vector<uint8_t> attrs;       // id -> TokenAttr bits
  std::vector<std::pair<std::string, std::string>> merges;  // rank order
  std::vector<float> scores;  // SentencePiece: merges come from scores when merges is empty
  std::vector<AddedToken> added;
  Normalizer normalizer;
  PreTokenizer pretok;
  bool ignore_merges = false;
  bool byte_fallback = false;
  bool fuse_unk = false;
  int32_t unk_id = -1;
  bool add_bos = false, add_eos = false;
  int32_t bos_id = -1, eos_id = -1;
  std::vector<int32_t> extra_eos_ids;  // eot / eom ids named by the source
  int strip_leading_space = 0;  // decode drops this many leading spaces (SentencePiece)
  std::string chat_template;
  std::map<std::string, std::string> template_tokens;  // bos_token, eos_token, ... for templates
};

}  // namespace spade::tok
