// Internals the qgemv files share (not a public header): the x86 SIMD setup, the row job every
// GEMV kernel gets, horizontal sums, and the entry points of the per-type kernel files
// (qgemv_kquant.cpp: Q4_K / Q5_K / Q6_K; qgemv_half.cpp: f16 / bf16; qgemv_neon.cpp: aarch64).
#pragma once
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "backend/cpu/qgemv.h"

#if defined(__x86_64__) || defined(__i386__)
#define SPADE_QGEMV_X86 1
// g++ 12 warns inside its own AVX-512 headers (_mm512_undefined_* used as a pass-through
// operand, GCC bug 105593); the warning's location is the header, so it is silenced there.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <cpuid.h>
#include <immintrin.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
// The same bug reported where those intrinsics inline into the kernels.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#define SPADE_AVX2 __attribute__((target("avx2,fma,f16c")))
#define SPADE_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
// The prefill tiles' dequantization: the scalar code's values, so a product and the sum after
// it stay two instructions (no contraction into an FMA).
#if defined(__clang__)
#define SPADE_NO_CONTRACT SPADE_AVX2
#else
#define SPADE_NO_CONTRACT __attribute__((target("avx2,fma,f16c"), optimize("fp-contract=off")))
#endif
#endif
#if defined(__aarch64__) && defined(__ARM_NEON)
#define SPADE_QGEMV_NEON 1
#endif

namespace spade::cpu::qgemv_detail {

// What every row kernel gets.
struct RowJob {
  const QuantMatrix* w;
  const float* x;   // [M, K]
  int64_t M, K, nb;  // nb = K / 32
  const float* xs;  // sums of x per 32 values [M, nb] (Q4_0 / Q4_1 / Q4_K / Q5_K)
  float* y;
  int64_t ldy;
  const uint8_t* wdata;  // w->data, and w->row_bytes() computed once (not per row)
  int64_t wrow_bytes;
  const uint8_t* row(int64_t n) const { return wdata + n * wrow_bytes; }
};

#if SPADE_QGEMV_X86
SPADE_AVX2 inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The sum of 16 lanes (the upper half brought down by a shuffle: g++ 12 warns inside
// _mm512_reduce_add_ps's extract of an undefined register, GCC bug 105593).
SPADE_AVX512 inline float hsum16(__m512 v) {
  const __m512 hi = _mm512_shuffle_f32x4(v, v, 0xEE);
  return hsum8(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_castps512_ps256(hi)));
}

// Output rows [n0, n1) of j at AVX2 or AVX-512 (level is not Scalar).
void rows_kquant(const RowJob& j, int64_t n0, int64_t n1, SimdLevel level);  // Q4_K/Q5_K/Q6_K
void rows_half(const RowJob& j, int64_t n0, int64_t n1, SimdLevel level);    // F16 / BF16

// n elements (whole blocks) -> fp32 with AVX2, the values dequantize_serial gives (bit for bit).
void dequant_tile_kquant(DType t, const uint8_t* src, float* dst, int64_t n);
void dequant_tile_half(DType t, const uint8_t* src, float* dst, int64_t n);
#endif

#if SPADE_QGEMV_NEON
// qgemv_neon.cpp: output rows [n0, n1) of j at the NEON level; false (nothing written) for a
// type without a fused kernel. dot_neon: the dot of n floats (the unfused types' rows).
bool rows_neon(const RowJob& j, int64_t n0, int64_t n1);
float dot_neon(const float* a, const float* b, int64_t n);
#endif

// The x rows of a GEMV in blocks of up to four (each weight block decoded once for a block):
// f(m0, std::integral_constant<int, R>{}) for the block of R rows from row m0, R in 1..4 (the
// kernels' row count is a template argument).
template <class F>
inline void for_x_blocks(int64_t M, F&& f) {
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    switch (std::min<int64_t>(4, M - m0)) {
      case 1: f(m0, std::integral_constant<int, 1>{}); break;
      case 2: f(m0, std::integral_constant<int, 2>{}); break;
      case 3: f(m0, std::integral_constant<int, 3>{}); break;
      default: f(m0, std::integral_constant<int, 4>{}); break;
    }
  }
}

}  // namespace spade::cpu::qgemv_detail
