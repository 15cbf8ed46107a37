// The ggml tensor type ids that can appear in a GGUF file, with their block geometry.
// Knowing the geometry of every id lets the GGUF reader bound-check tensors of types spade
// cannot dequantize (those raise an error only when their data is requested).
#pragma once
#include <cstdint>
#include <string>

#include "core/dtype.h"

namespace spade {

struct GgmlTypeInfo {
  const char* name;
  int block_elems;
  int block_bytes;
  bool has_dtype;  // spade can dequantize it
  DType dtype;     // valid when has_dtype
};

// nullptr for ids ggml never defined (or has retired).
const GgmlTypeInfo* ggml_type_info(uint32_t id);

// "q4_k", or "ggml_type_<id>" for an id without a name.
std::string ggml_type_name(uint32_t id);

}  // namespace spade
