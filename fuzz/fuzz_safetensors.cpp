// libFuzzer target: SafetensorsFile::parse on arbitrary bytes, then a view and an fp32
// conversion of every readable tensor. Any outcome other than success or spade::Error is
// a bug.
#include <cstdint>
#include <vector>

#include "core/error.h"
#include "io/dequant.h"
#include "io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace spade;
  std::unique_ptr<SafetensorsFile> f;
  try {
    f = SafetensorsFile::parse(data, size, "fuzz.safetensors");
  } catch (const Error&) {
    return 0;
  }
  std::vector<float> out;
  for (const SafetensorsTensor& t : f->tensors()) {
    try {
      TensorView v = f->view(t);
      if (v.dtype == DType::I32 || v.dtype == DType::I8) continue;
      out.resize(size_t(t.numel()));
      dequantize_serial(v.dtype, v.data, out.data(), t.numel());
    } catch (const Error&) {
    }
  }
  return 0;
}
