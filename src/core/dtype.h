// Element types of tensors: plain floats and the GGUF block-quantized types that spade
// dequantizes at load time. Block types store `block_elems` values in `block_bytes`.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace spade {

enum class DType : uint8_t { F32, F16, BF16, I32, I8, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K };

struct DTypeInfo {
  const char* name;
  int block_elems;   // elements per block (1 for plain types)
  int block_bytes;   // bytes per block
};

inline const DTypeInfo& dtype_info(DType t) {
  static const DTypeInfo table[] = {
      {"f32", 1, 4},     {"f16", 1, 2},     {"bf16", 1, 2},    {"i32", 1, 4},
      {"i8", 1, 1},      {"q8_0", 32, 34},  {"q4_0", 32, 18},  {"q4_1", 32, 20},
      {"q4_k", 256, 144}, {"q5_k", 256, 176}, {"q6_k", 256, 210},
  };
  return table[static_cast<int>(t)];
}

inline const char* dtype_name(DType t) { return dtype_info(t).name; }

// Bytes for `n` elements; n must be a multiple of the block size (callers check).
inline size_t dtype_bytes(DType t, size_t n) {
  const DTypeInfo& i = dtype_info(t);
  return n / size_t(i.block_elems) * size_t(i.block_bytes);
}

enum class Device : uint8_t { CPU, CUDA };

}  // namespace spade
