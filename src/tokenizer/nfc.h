// Unicode Normalization Form C (canonical decomposition, canonical ordering, canonical
// composition), for tokenizers whose normalizer is NFC (Qwen2/Qwen3).
#pragma once
#include <string>
#include <string_view>

namespace spade {

// True when NFC certainly leaves `s` (valid UTF-8) unchanged: no character that could
// decompose, reorder or combine. Cheap; most text passes.
bool nfc_quick_check(std::string_view s);
// The NFC form of `s` (valid UTF-8).
std::string nfc(std::string_view s);

}  // namespace spade
