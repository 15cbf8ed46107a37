// Generated Unicode tables (see python/gen_unicode_tables.py): per code point a property
// byte (general category in the low 5 bits, White_Space 0x20, "NFC may change text here"
// 0x40), canonical combining classes, canonical decompositions and primary compositions.
#pragma once
#include <cstddef>
#include <cstdint>

namespace spade::unicode_data {

struct DecompEntry {
  uint32_t cp;
  uint32_t offset;  // into kDecompPool
  uint32_t len;
};
struct CompEntry {
  uint64_t key;  // (first << 21) | second
  uint32_t composite;
};

extern const uint16_t kPropStage1[];
extern const uint8_t kPropStage2[];
extern const uint16_t kCccStage1[];
extern const uint8_t kCccStage2[];
extern const uint32_t kDecompPool[];
extern const DecompEntry kDecomp[];
extern const size_t kDecompCount;
extern const CompEntry kComp[];
extern const size_t kCompCount;

}  // namespace spade::unicode_data
