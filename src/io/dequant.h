// Conversion of stored tensor data (plain floats and ggml block-quantized types) to fp32.
// Block layouts follow ggml's definitions; each type's layout is described next to its
// decoder in dequant.cpp.
#pragma once
#include <cstdint>

#include "core/dtype.h"

namespace spade {

// Converts `n` elements of type `t` at `src` to fp32 in `dst`. `n` must be a multiple of
// the type's block size; large inputs are split over ThreadPool::global(). Throws
// spade::Error for types that are not floating point (i32, i8).
void dequantize(DType t, const void* src, float* dst, int64_t n);

// Single-threaded form of dequantize (same result).
void dequantize_serial(DType t, const void* src, float* dst, int64_t n);

}  // namespace spade
