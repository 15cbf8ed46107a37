// libFuzzer: the tokenizer.json loader on arbitrary input. Malformed or unsupported input
// must raise spade::Error (never crash, hang or exhaust memory); whatever loads must
// encode and decode its own input.
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/error.h"
#include "tokenizer/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > (1 << 16)) return 0;
  std::string s(reinterpret_cast<const char*>(data), size);
  try {
    auto t = spade::Tokenizer::from_hf_json(s, "", "fuzz");
    auto ids = t->encode(s.substr(0, 256));
    t->decode(ids);
    spade::StreamDecoder sd(*t);
    for (int32_t id : ids) sd.push(id);
    sd.flush();
    if (t->chat_template()) t->chat_template()->render({{"user", "hi"}}, true);
  } catch (const spade::Error&) {
  }
  return 0;
}
