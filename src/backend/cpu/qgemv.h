// Matrix products over weights as stored (ggml block-quantized, f16, bf16) for the CPU decode
// path: no fp32 copy of the weights. A GEMV for a few rows of x (decode: one token per
// sequence) decodes each weight block in registers and accumulates in fp32 against fp32
// activations (x is never quantized); larger M (prefill) dequantizes a tile of weight rows at a
// time and runs BLAS sgemm on it. The SIMD level (scalar, AVX2+FMA+F16C, AVX-512) is chosen at
// run time from the CPU's features, so one binary runs on every x86-64; tests force lower levels
// through set_simd_level. On aarch64 the level is NEON (qgemv_neon.cpp). Tested against
// dequantize-then-dot in tests/test_qgemv.cpp (NEON: under qemu, scripts/check_neon.sh).
#pragma once
#include <cstdint>

#include "core/dtype.h"

namespace spade::cpu {

// A row-major [rows, cols] weight in its stored type: each row is cols / block_elems blocks.
struct QuantMatrix {
  DType dtype = DType::F32;
  const void* data = nullptr;  // null: none (the caller uses its fp32 tensor)
  int64_t rows = 0, cols = 0;
  explicit operator bool() const { return data != nullptr; }
  int64_t row_bytes() const;
  const uint8_t* row(int64_t r) const {
    return static_cast<const uint8_t*>(data) + r * row_bytes();
  }
};

// x86 levels are ordered (a CPU with one runs those below it). Neon (aarch64, qgemv_neon.cpp)
// stands apart: negative, so code comparing x86 levels by number never takes it for one; a CPU
// with it runs Neon and Scalar.
enum class SimdLevel : int { Scalar = 0, Avx2 = 1, Avx512 = 2, Neon = -1 };
const char* simd_level_name(SimdLevel l);
SimdLevel detected_simd_level();  // the best this CPU (and compiler) supports
SimdLevel simd_level();           // the one in use: detected unless forced
// Whether this CPU runs l: Scalar, the detected level, and (x86) the levels below it.
bool simd_level_supported(SimdLevel l);
// Forces a level (tests, benchmarks); throws spade::Error where !simd_level_supported(l).
// Returns the previous one. Not thread-safe against running products.
SimdLevel set_simd_level(SimdLevel l);

// Types with a fused kernel at AVX2 / AVX-512: Q8_0, Q4_0, Q4_1 (qgemv.cpp), Q4_K, Q5_K, Q6_K
// (qgemv_kquant.cpp), f16, bf16 (qgemv_half.cpp); the same at NEON (qgemv_neon.cpp). The
// others, and every type at the scalar level, decode a row, then dot it.
bool qgemv_fused(DType t);

// y[M,N] = x[M,K] * W[N,K]^T (+ bias[N]); any stored type dequantize() reads. M <= kGemvMaxM
// takes the GEMV (threaded over output rows), larger M dequantizes tiles of rows and calls
// sgemm. Allocates only on first use of a larger shape (grow-only scratch).
constexpr int64_t kGemvMaxM = 8;
void qmatmul(const float* x, const QuantMatrix& w, const float* bias, float* y, int64_t M);

// The GEMV over output rows [n0, n1) on the calling thread at `level` (tests compare levels):
// y[m * ldy + n] for m < M. x rows are K = w.cols floats apart.
void qgemv_rows(const float* x, int64_t M, const QuantMatrix& w, int64_t n0, int64_t n1,
                float* y, int64_t ldy, SimdLevel level);

// One row of a stored matrix (embedding lookup): out[cols] = dequantize(w.row(r)).
void dequantize_row(const QuantMatrix& w, int64_t r, float* out);

}  // namespace spade::cpu
