// libFuzzer: the Jinja subset parser and interpreter on arbitrary templates. Anything it
// does not support, or a runtime error, must be a spade::Error; expensive templates hit
// the interpreter's step and output bounds instead of hanging.
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/error.h"
#include "tokenizer/chat_template.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > 8192) return 0;
  std::string src(reinterpret_cast<const char*>(data), size);
  try {
    spade::ChatTemplate t(src, {{"bos_token", "<s>"}, {"eos_token", "</s>"}});
    nlohmann::ordered_json ctx = {
        {"messages", {{{"role", "system"}, {"content", "sys"}},
                      {{"role", "user"}, {"content", "Hi <think>x</think> 1 2"}},
                      {{"role", "assistant"}, {"content", "ok"}, {"tool_calls", nlohmann::ordered_json::array()}}}},
        {"add_generation_prompt", true},
        {"tools", {{{"type", "function"}, {"function", {{"name", "f"}}}}}}};
    t.render_context(ctx);
  } catch (const spade::Error&) {
  }
  return 0;
}
