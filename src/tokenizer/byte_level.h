// GPT-2's byte-to-unicode alphabet: byte-level BPE vocabularies spell every byte as a
// printable character (e.g. space as U+0120 'Ġ'). spade runs BPE on raw bytes and maps
// vocabulary spellings back to bytes once, at load.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>

namespace spade::tok {

// The UTF-8 spelling of byte b in the alphabet.
const std::string& byte_level_char(uint8_t b);
// Raw bytes of a vocabulary spelling; false when a character is outside the alphabet.
bool byte_level_decode(std::string_view piece, std::string& out);
// Spelling of raw bytes in the alphabet.
std::string byte_level_encode(std::string_view bytes);

}  // namespace spade::tok
