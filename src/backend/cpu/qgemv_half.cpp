// The GEMV over f16 and bf16 weights at AVX2+FMA+F16C and AVX-512, and their prefill tiles'
// conversion. Both widen to fp32 exactly (f16 by the F16C instruction, bf16 by a 16-bit shift),
// so the products are those of the dequantized values, accumulated in fp32 vectors; rows need
// not be a multiple of the vector width (AVX-512: masked loads; AVX2: a scalar tail).
#include <algorithm>
#include <cstring>

#include "backend/cpu/qgemv_internal.h"
#include "core/half.h"

namespace spade::cpu::qgemv_detail {

#if SPADE_QGEMV_X86
namespace {

inline float widen(DType t, uint16_t h) { return t == DType::F16 ? f16_to_f32(h) : bf16_to_f32(h); }

template <DType T>
SPADE_AVX2 inline __m256 widen8(const uint16_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (T == DType::F16) return _mm256_cvtph_ps(v);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

template <DType T>
SPADE_AVX512 inline __m512 widen16(__m256i v) {
  if constexpr (T == DType::F16) return _mm512_cvtph_ps(v);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// MR rows of x from m0; per x row, four accumulators over consecutive 16-value steps.
template <DType T, int MR>
SPADE_AVX512 void rows_avx512(const RowJob& j, int64_t m0, int64_t n0, int64_t n1) {
  const int64_t K = j.K;
  const float* x = j.x + m0 * K;
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* w = reinterpret_cast<const uint16_t*>(j.row(n));
    __m512 acc[MR][4];
    for (int m = 0; m < MR; ++m)
      for (int u = 0; u < 4; ++u) acc[m][u] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64)
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) {
        const __m512 wv = widen16<T>(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k + 16 * u)));
        for (int m = 0; m < MR; ++m)
          acc[m][u] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + m * K + k + 16 * u), acc[m][u]);
      }
    for (; k < K; k += 16) {  // the last < 64 values, 16 at a time, the end masked
      const int64_t left = std::min<int64_t>(16, K - k);
      const __mmask16 mask = __mmask16((1u << left) - 1u);
      const __m512 wv = widen16<T>(_mm256_maskz_loadu_epi16(mask, w + k));
      for (int m = 0; m < MR; ++m)
        acc[m][0] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(mask, x + m * K + k), acc[m][0]);
    }
    for (int m = 0; m < MR; ++m)
      j.y[(m0 + m) * j.ldy + n] = hsum16(_mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]),
                                                       _mm512_add_ps(acc[m][2], acc[m][3])));
  }
}

template <DType T, int MR>
SPADE_AVX2 void rows_avx2(const RowJob& j, int64_t m0, int64_t n0, int64_t n1) {
  const int64_t K = j.K;
  const float* x = j.x + m0 * K;
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* w = reinterpret_cast<const uint16_t*>(j.row(n));
    __m256 acc[MR][4];
    for (int m = 0; m < MR; ++m)
      for (int u = 0; u < 4; ++u) acc[m][u] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32)
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) {
        const __m256 wv = widen8<T>(w + k + 8 * u);
        for (int m = 0; m < MR; ++m)
          acc[m][u] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * K + k + 8 * u), acc[m][u]);
      }
    for (; k + 8 <= K; k += 8) {
      const __m256 wv = widen8<T>(w + k);
      for (int m = 0; m < MR; ++m)
        acc[m][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * K + k), acc[m][0]);
    }
    float tail[MR] = {};
    for (; k < K; ++k) {
      uint16_t h;
      std::memcpy(&h, w + k, 2);
      const float wk = widen(T, h);
      for (int m = 0; m < MR; ++m) tail[m] += wk * x[m * K + k];
    }
    for (int m = 0; m < MR; ++m)
      j.y[(m0 + m) * j.ldy + n] = hsum8(_mm256_add_ps(_mm256_add_ps(acc[m][0], acc[m][1]),
                                                      _mm256_add_ps(acc[m][2], acc[m][3]))) +
                                  tail[m];
  }
}

template <DType T>
void rows_t(const RowJob& j, int64_t n0, int64_t n1, SimdLevel level) {
  for_x_blocks(j.M, [&](int64_t m0, auto rows) {
    if (level == SimdLevel::Avx512)
      rows_avx512<T, decltype(rows)::value>(j, m0, n0, n1);
    else
      rows_avx2<T, decltype(rows)::value>(j, m0, n0, n1);
  });
}

template <DType T>
SPADE_AVX2 void widen_t(const uint8_t* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, widen8<T>(s + i));
  for (; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, s + i, 2);
    dst[i] = widen(T, h);
  }
}

}  // namespace

void rows_half(const RowJob& j, int64_t n0, int64_t n1, SimdLevel level) {
  if (j.w->dtype == DType::F16) return rows_t<DType::F16>(j, n0, n1, level);
  rows_t<DType::BF16>(j, n0, n1, level);
}

void dequant_tile_half(DType t, const uint8_t* src, float* dst, int64_t n) {
  if (t == DType::F16) return widen_t<DType::F16>(src, dst, n);
  widen_t<DType::BF16>(src, dst, n);
}
#endif  // SPADE_QGEMV_X86

}  // namespace spade::cpu::qgemv_detail
