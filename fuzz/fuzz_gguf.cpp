// libFuzzer target: GgufFile::parse on arbitrary bytes, then everything a loader would do
// with the result (metadata getters, config, tensor views, dequantization). Any outcome
// other than success or spade::Error is a bug.
#include <cstdint>
#include <vector>

#include "core/error.h"
#include "io/dequant.h"
#include "io/gguf.h"
#include "io/gguf_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace spade;
  std::unique_ptr<GgufFile> g;
  try {
    g = GgufFile::parse(data, size, "fuzz.gguf");
  } catch (const Error&) {
    return 0;
  }
  try {
    config_from_gguf(*g);
  } catch (const Error&) {
  }
  for (const auto& [key, v] : g->metadata()) {
    try {
      if (!v.is_array()) v.as_float();
      g->get_int(key);
    } catch (const Error&) {
    }
  }
  std::vector<float> out;
  for (const GgufTensorInfo& t : g->tensors()) {
    try {
      TensorView v = g->view(t);
      out.resize(size_t(t.numel()));
      dequantize_serial(v.dtype, v.data, out.data(), t.numel());
    } catch (const Error&) {
    }
  }
  return 0;
}
