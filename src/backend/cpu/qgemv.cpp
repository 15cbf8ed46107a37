#include "backend/cpu/qgemv.h"

#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#include "backend/cpu/qgemv_internal.h"
#include "core/error.h"
#include "core/half.h"
#include "core/thread_pool.h"
#include "io/dequant.h"

namespace spade::cpu {

int64_t QuantMatrix::row_bytes() const { return int64_t(dtype_bytes(dtype, size_t(cols))); }

const char* simd_level_name(SimdLevel l) {
  switch (l) {
    case SimdLevel::Scalar: return "scalar";
    case SimdLevel::Avx2: return "avx2";
    case SimdLevel::Avx512: return "avx512";
    case SimdLevel::Neon: return "neon";
  }
  return "?";
}

SimdLevel detected_simd_level() {
#if SPADE_QGEMV_X86
  static const SimdLevel level = [] {
    __builtin_cpu_init();
    // F16C from CPUID leaf 1 (ECX bit 29): clang 14's __builtin_cpu_supports lacks "f16c".
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & (1u << 29));
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
    const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
    return avx512 ? SimdLevel::Avx512 : avx2 ? SimdLevel::Avx2 : SimdLevel::Scalar;
  }();
  return level;
#elif SPADE_QGEMV_NEON
  return SimdLevel::Neon;  // Advanced SIMD is part of every aarch64 CPU
#else
  return SimdLevel::Scalar;
#endif
}

bool simd_level_supported(SimdLevel l) {
  const SimdLevel d = detected_simd_level();
  if (l == SimdLevel::Scalar || l == d) return true;
  return d != SimdLevel::Neon && l != SimdLevel::Neon && int(l) <= int(d);
}

namespace {
constexpr int kNotForced = -100;
std::atomic<int> g_forced{kNotForced};
}

SimdLevel simd_level() {
  int f = g_forced.load(std::memory_order_relaxed);
  return f == kNotForced ? detected_simd_level() : SimdLevel(f);
}

SimdLevel set_simd_level(SimdLevel l) {
  SPADE_CHECK(simd_level_supported(l), "SIMD level ", simd_level_name(l),
              " is not supported by this CPU (best: ", simd_level_name(detected_simd_level()), ")");
  SimdLevel prev = simd_level();
  g_forced.store(int(l), std::memory_order_relaxed);
  return prev;
}

bool qgemv_fused(DType t) {
  switch (t) {
    case DType::Q8_0:
    case DType::Q4_0:
    case DType::Q4_1:
    case DType::Q4_K:
    case DType::Q5_K:
    case DType::Q6_K:
    case DType::F16:
    case DType::BF16: return true;
    default: return false;
  }
}

namespace {

using namespace qgemv_detail;

inline float f16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_to_f32(h);
}

// Per x row and 32-value block, the sum of x (the min / offset term of Q4_0 and Q4_1):
// xs[m * nb + b].
void block_sums(const float* x, int64_t M, int64_t K, float* xs) {
  const int64_t nb = K / 32;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      const float* p = x + m * K + b * 32;
      float s = 0;
      for (int j = 0; j < 32; ++j) s += p[j];
      xs[m * nb + b] = s;
    }
}

// Block geometry and scale / offset of the fused types. For every one, value j of a block is
// d * code_j + off, with off = min (Q4_1), -8 d (Q4_0), 0 (Q8_0); so the block's dot is
// d * sum(code_j x_j) + off * sum(x_j).
template <DType T>
struct Fused;
template <>
struct Fused<DType::Q8_0> {
  static constexpr int kBytes = 34;
  static float d(const uint8_t* b) { return f16_at(b); }
  static float off(const uint8_t*, float) { return 0.f; }
  static float code(const uint8_t* b, int j) { return float(int8_t(b[2 + j])); }
};
template <>
struct Fused<DType::Q4_0> {
  static constexpr int kBytes = 18;
  static float d(const uint8_t* b) { return f16_at(b); }
  static float off(const uint8_t*, float d) { return -8.f * d; }
  static float code(const uint8_t* b, int j) {
    return float(j < 16 ? (b[2 + j] & 0xF) : (b[2 + j - 16] >> 4));
  }
};
template <>
struct Fused<DType::Q4_1> {
  static constexpr int kBytes = 20;
  static float d(const uint8_t* b) { return f16_at(b); }
  static float off(const uint8_t* b, float) { return f16_at(b + 2); }
  static float code(const uint8_t* b, int j) {
    return float(j < 16 ? (b[4 + j] & 0xF) : (b[4 + j - 16] >> 4));
  }
};

template <DType T>
void rows_scalar(const RowJob& j, int64_t n0, int64_t n1) {
  using F = Fused<T>;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = j.row(n);
    for (int64_t m = 0; m < j.M; ++m) {
      const float* x = j.x + m * j.K;
      float acc = 0, macc = 0;
      for (int64_t b = 0; b < j.nb; ++b) {
        const uint8_t* blk = w + b * F::kBytes;
        const float* xb = x + b * 32;
        float qx = 0;
        for (int k = 0; k < 32; ++k) qx += F::code(blk, k) * xb[k];
        const float d = F::d(blk);
        acc += d * qx;
        if (T != DType::Q8_0) macc += F::off(blk, d) * j.xs[m * j.nb + b];
      }
      j.y[m * j.ldy + n] = acc + macc;
    }
  }
}

float dot_scalar(const float* a, const float* b, int64_t n) {
  float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  int64_t k = 0;
  for (; k + 4 <= n; k += 4) {
    s0 += a[k] * b[k];
    s1 += a[k + 1] * b[k + 1];
    s2 += a[k + 2] * b[k + 2];
    s3 += a[k + 3] * b[k + 3];
  }
  for (; k < n; ++k) s0 += a[k] * b[k];
  return (s0 + s1) + (s2 + s3);
}

#if SPADE_QGEMV_X86

SPADE_AVX2 float dot_avx2(const float* a, const float* b, int64_t n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 8), _mm256_loadu_ps(b + k + 8), s1);
  }
  float s = hsum8(_mm256_add_ps(s0, s1));
  for (; k < n; ++k) s += a[k] * b[k];
  return s;
}

// The 32 codes of a block as four vectors of 8 floats (values 0-7, 8-15, 16-23, 24-31).
template <DType T>
SPADE_AVX2 inline void codes_avx2(const uint8_t* blk, __m256 c[4]) {
  if constexpr (T == DType::Q8_0) {
    for (int i = 0; i < 4; ++i)
      c[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * i))));
  } else {
    const uint8_t* qs = blk + (T == DType::Q4_1 ? 4 : 2);
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(v, mask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
    c[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    c[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    c[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    c[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
  }
}

SPADE_AVX2 inline float f16_at_avx2(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// MR rows of x at once: each weight block is decoded once for all of them.
template <DType T, int MR>
SPADE_AVX2 void rows_avx2(const RowJob& j, int64_t m0, int64_t n0, int64_t n1) {
  using F = Fused<T>;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = j.row(n);
    __m256 acc[MR], acc2[MR];
    float macc[MR];
    for (int m = 0; m < MR; ++m) acc[m] = acc2[m] = _mm256_setzero_ps(), macc[m] = 0;
    for (int64_t b = 0; b < j.nb; ++b) {
      const uint8_t* blk = w + b * F::kBytes;
      __m256 c[4];
      codes_avx2<T>(blk, c);
      const float d = f16_at_avx2(blk);
      const __m256 dv = _mm256_set1_ps(d);
      float off = 0;
      if constexpr (T == DType::Q4_1) off = f16_at_avx2(blk + 2);
      if constexpr (T == DType::Q4_0) off = -8.f * d;
      for (int m = 0; m < MR; ++m) {
        const float* xb = j.x + (m0 + m) * j.K + b * 32;
        __m256 p0 = _mm256_mul_ps(c[0], _mm256_loadu_ps(xb));
        __m256 p1 = _mm256_mul_ps(c[1], _mm256_loadu_ps(xb + 8));
        p0 = _mm256_fmadd_ps(c[2], _mm256_loadu_ps(xb + 16), p0);
        p1 = _mm256_fmadd_ps(c[3], _mm256_loadu_ps(xb + 24), p1);
        if (b & 1)
          acc2[m] = _mm256_fmadd_ps(dv, _mm256_add_ps(p0, p1), acc2[m]);
        else
          acc[m] = _mm256_fmadd_ps(dv, _mm256_add_ps(p0, p1), acc[m]);
        if constexpr (T != DType::Q8_0) macc[m] += off * j.xs[(m0 + m) * j.nb + b];
      }
    }
    for (int m = 0; m < MR; ++m)
      j.y[(m0 + m) * j.ldy + n] = hsum8(_mm256_add_ps(acc[m], acc2[m])) + macc[m];
  }
}

template <DType T>
SPADE_AVX512 inline void codes_avx512(const uint8_t* blk, __m512 c[2]) {
  if constexpr (T == DType::Q8_0) {
    c[0] = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2))));
    c[1] = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18))));
  } else {
    const uint8_t* qs = blk + (T == DType::Q4_1 ? 4 : 2);
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    const __m128i mask = _mm_set1_epi8(0x0F);
    c[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v, mask)));
    c[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), mask)));
  }
}

SPADE_AVX512 inline float f16_at_avx512(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

template <DType T, int MR>
SPADE_AVX512 void rows_avx512(const RowJob& j, int64_t m0, int64_t n0, int64_t n1) {
  using F = Fused<T>;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = j.row(n);
    __m512 acc[MR], acc2[MR];
    float macc[MR];
    for (int m = 0; m < MR; ++m) acc[m] = acc2[m] = _mm512_setzero_ps(), macc[m] = 0;
    for (int64_t b = 0; b < j.nb; ++b) {
      const uint8_t* blk = w + b * F::kBytes;
      __m512 c[2];
      codes_avx512<T>(blk, c);
      const float d = f16_at_avx512(blk);
      const __m512 dv = _mm512_set1_ps(d);
      float off = 0;
      if constexpr (T == DType::Q4_1) off = f16_at_avx512(blk + 2);
      if constexpr (T == DType::Q4_0) off = -8.f * d;
      for (int m = 0; m < MR; ++m) {
        const float* xb = j.x + (m0 + m) * j.K + b * 32;
        __m512 p = _mm512_mul_ps(c[0], _mm512_loadu_ps(xb));
        p = _mm512_fmadd_ps(c[1], _mm512_loadu_ps(xb + 16), p);
        if (b & 1)
          acc2[m] = _mm512_fmadd_ps(dv, p, acc2[m]);
        else
          acc[m] = _mm512_fmadd_ps(dv, p, acc[m]);
        if constexpr (T != DType::Q8_0) macc[m] += off * j.xs[(m0 + m) * j.nb + b];
      }
    }
    for (int m = 0; m < MR; ++m)
      j.y[(m0 + m) * j.ldy + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m], acc2[m])) + macc[m];
  }
}

// One x row (decode), NR weight rows at a time. Per weight row: two vector accumulators and two
// offset sums, for even and odd blocks, so no add waits on the one before it. Each row's
// arithmetic is the same whatever NR, so a row's value never depends on its neighbours.
// d and the Q4_1 offset (two f16 side by side) convert in one instruction.
template <DType T>
SPADE_AVX2 inline void scale_off_avx2(const uint8_t* blk, float& d, float& off) {
  if constexpr (T == DType::Q4_1) {
    uint32_t dm;
    std::memcpy(&dm, blk, 4);
    const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(int(dm)));
    d = _mm_cvtss_f32(f);
    off = _mm_cvtss_f32(_mm_movehdup_ps(f));
  } else {
    d = f16_at_avx2(blk);
    off = T == DType::Q4_0 ? -8.f * d : 0.f;
  }
}

template <DType T, int NR>
SPADE_AVX512 void rows1_avx512(const RowJob& j, int64_t n) {
  using F = Fused<T>;
  const uint8_t* w[NR];
  __m512 acc0[NR], acc1[NR];
  float macc0[NR], macc1[NR];
  for (int r = 0; r < NR; ++r) {
    w[r] = j.row(n + r);
    acc0[r] = acc1[r] = _mm512_setzero_ps();
    macc0[r] = macc1[r] = 0.f;
  }
  // Separate accumulator arrays (not one indexed by a run-time u) stay in registers.
  auto block = [&](int64_t b, __m512* acc, float* macc) SPADE_AVX512 {
    const __m512 x0 = _mm512_loadu_ps(j.x + b * 32), x1 = _mm512_loadu_ps(j.x + b * 32 + 16);
    const float xsb = T != DType::Q8_0 ? j.xs[b] : 0.f;
    for (int r = 0; r < NR; ++r) {
      const uint8_t* blk = w[r] + b * F::kBytes;
      __m512 c[2];
      codes_avx512<T>(blk, c);
      float d, off;
      scale_off_avx2<T>(blk, d, off);
      __m512 p = _mm512_mul_ps(c[0], x0);
      p = _mm512_fmadd_ps(c[1], x1, p);
      acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(d), p, acc[r]);
      if constexpr (T != DType::Q8_0) macc[r] += off * xsb;
    }
  };
  int64_t b = 0;
  for (; b + 2 <= j.nb; b += 2) {
    block(b, acc0, macc0);
    block(b + 1, acc1, macc1);
  }
  if (b < j.nb) block(b, acc0, macc0);
  for (int r = 0; r < NR; ++r)
    j.y[n + r] = hsum16(_mm512_add_ps(acc0[r], acc1[r])) + (macc0[r] + macc1[r]);
}

template <DType T, int NR>
SPADE_AVX2 void rows1_avx2(const RowJob& j, int64_t n) {
  using F = Fused<T>;
  const uint8_t* w[NR];
  __m256 acc0[NR], acc1[NR];
  float macc0[NR], macc1[NR];
  for (int r = 0; r < NR; ++r) {
    w[r] = j.row(n + r);
    acc0[r] = acc1[r] = _mm256_setzero_ps();
    macc0[r] = macc1[r] = 0.f;
  }
  auto block = [&](int64_t b, __m256* acc, float* macc) SPADE_AVX2 {
    const float* xb = j.x + b * 32;
    const float xsb = T != DType::Q8_0 ? j.xs[b] : 0.f;
    for (int r = 0; r < NR; ++r) {
      const uint8_t* blk = w[r] + b * F::kBytes;
      __m256 c[4];
      codes_avx2<T>(blk, c);
      float d, off;
      scale_off_avx2<T>(blk, d, off);
      __m256 p0 = _mm256_mul_ps(c[0], _mm256_loadu_ps(xb));
      __m256 p1 = _mm256_mul_ps(c[1], _mm256_loadu_ps(xb + 8));
      p0 = _mm256_fmadd_ps(c[2], _mm256_loadu_ps(xb + 16), p0);
      p1 = _mm256_fmadd_ps(c[3], _mm256_loadu_ps(xb + 24), p1);
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_add_ps(p0, p1), acc[r]);
      if constexpr (T != DType::Q8_0) macc[r] += off * xsb;
    }
  };
  int64_t b = 0;
  for (; b + 2 <= j.nb; b += 2) {
    block(b, acc0, macc0);
    block(b + 1, acc1, macc1);
  }
  if (b < j.nb) block(b, acc0, macc0);
  for (int r = 0; r < NR; ++r)
    j.y[n + r] = hsum8(_mm256_add_ps(acc0[r], acc1[r])) + (macc0[r] + macc1[r]);
}

// One weight row at a time: the rows stream through memory in order. (Two rows interleaved,
// NR = 2, shared the x loads but ran 30% slower on SmolLM2 Q4_1 decode: 62 against 89 tok/s,
// one thread, AMD EPYC with AVX-512.)
template <DType T>
void rows1_simd(const RowJob& j, int64_t n0, int64_t n1, SimdLevel level) {
  if (level == SimdLevel::Avx512)
    for (int64_t n = n0; n < n1; ++n) rows1_avx512<T, 1>(j, n);
  else
    for (int64_t n = n0; n < n1; ++n) rows1_avx2<T, 1>(j, n);
}

template <DType T>
void rows_simd(const RowJob& j, int64_t n0, int64_t n1, SimdLevel level) {
  if (j.M == 1) return rows1_simd<T>(j, n0, n1, level);
  for_x_blocks(j.M, [&](int64_t m0, auto rows) {
    if (level == SimdLevel::Avx512)
      rows_avx512<T, decltype(rows)::value>(j, m0, n0, n1);
    else
      rows_avx2<T, decltype(rows)::value>(j, m0, n0, n1);
  });
}
#endif  // SPADE_QGEMV_X86

// Types without a fused kernel: decode the row into thread-local scratch, then dot it with
// every x row.
void rows_generic(const RowJob& j, int64_t n0, int64_t n1, SimdLevel level) {
  thread_local std::vector<float> row;
  if (int64_t(row.size()) < j.K) row.resize(size_t(j.K));
  for (int64_t n = n0; n < n1; ++n) {
    dequantize_serial(j.w->dtype, j.row(n), row.data(), j.K);
    for (int64_t m = 0; m < j.M; ++m) {
#if SPADE_QGEMV_X86
      if (level != SimdLevel::Scalar) {
        j.y[m * j.ldy + n] = dot_avx2(row.data(), j.x + m * j.K, j.K);
        continue;
      }
#elif SPADE_QGEMV_NEON
      if (level == SimdLevel::Neon) {
        j.y[m * j.ldy + n] = dot_neon(row.data(), j.x + m * j.K, j.K);
        continue;
      }
#endif
      j.y[m * j.ldy + n] = dot_scalar(row.data(), j.x + m * j.K, j.K);
    }
  }
}

#if SPADE_QGEMV_X86
// Prefill tiles: n consecutive blocks dequantized with AVX2, the scalar dequantize's values
// (Q8_0: d * q; Q4_0: d * (q - 8); Q4_1: d * q + m, two roundings as the scalar code: the
// product and the sum stay separate instructions: no contraction into an FMA).
template <DType T>
SPADE_NO_CONTRACT void dequant_blocks_avx2(const uint8_t* src, float* dst, int64_t n) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
  constexpr int64_t kBytes = Fused<T>::kBytes;
  for (int64_t b = 0; b < n; ++b) {
    const uint8_t* blk = src + b * kBytes;
    __m256 c[4];
    codes_avx2<T>(blk, c);
    float d, off;
    scale_off_avx2<T>(blk, d, off);
    const __m256 dv = _mm256_set1_ps(d);
    float* y = dst + b * 32;
    for (int i = 0; i < 4; ++i) {
      __m256 v;
      if constexpr (T == DType::Q4_0)
        v = _mm256_mul_ps(_mm256_sub_ps(c[i], _mm256_set1_ps(8.f)), dv);
      else if constexpr (T == DType::Q4_1)
        v = _mm256_add_ps(_mm256_mul_ps(c[i], dv), _mm256_set1_ps(off));
      else
        v = _mm256_mul_ps(c[i], dv);
      _mm256_storeu_ps(y + 8 * i, v);
    }
  }
}
#endif

// n elements (whole blocks) of a stored matrix's consecutive rows -> fp32 (the sgemm tiles).
void dequant_tile(DType t, const void* src, float* dst, int64_t n, SimdLevel level) {
#if SPADE_QGEMV_X86
  if (level != SimdLevel::Scalar) {
    const uint8_t* s = static_cast<const uint8_t*>(src);
    switch (t) {
      case DType::Q8_0: return dequant_blocks_avx2<DType::Q8_0>(s, dst, n / 32);
      case DType::Q4_0: return dequant_blocks_avx2<DType::Q4_0>(s, dst, n / 32);
      case DType::Q4_1: return dequant_blocks_avx2<DType::Q4_1>(s, dst, n / 32);
      case DType::Q4_K:
      case DType::Q5_K:
      case DType::Q6_K: return dequant_tile_kquant(t, s, dst, n);
      case DType::F16:
      case DType::BF16: return dequant_tile_half(t, s, dst, n);
      default: break;
    }
  }
#endif
  dequantize_serial(t, src, dst, n);
}

void rows_dispatch(const RowJob& j, int64_t n0, int64_t n1, SimdLevel level) {
#if SPADE_QGEMV_X86
  if (level != SimdLevel::Scalar) {
    switch (j.w->dtype) {
      case DType::Q8_0: return rows_simd<DType::Q8_0>(j, n0, n1, level);
      case DType::Q4_0: return rows_simd<DType::Q4_0>(j, n0, n1, level);
      case DType::Q4_1: return rows_simd<DType::Q4_1>(j, n0, n1, level);
      case DType::Q4_K:
      case DType::Q5_K:
      case DType::Q6_K: return rows_kquant(j, n0, n1, level);
      case DType::F16:
      case DType::BF16: return rows_half(j, n0, n1, level);
      default: return rows_generic(j, n0, n1, level);
    }
  }
#elif SPADE_QGEMV_NEON
  if (level == SimdLevel::Neon && rows_neon(j, n0, n1)) return;
#endif
  switch (j.w->dtype) {
    case DType::Q8_0: return rows_scalar<DType::Q8_0>(j, n0, n1);
    case DType::Q4_0: return rows_scalar<DType::Q4_0>(j, n0, n1);
    case DType::Q4_1: return rows_scalar<DType::Q4_1>(j, n0, n1);
    default: return rows_generic(j, n0, n1, level);
  }
}

void check_matrix(const QuantMatrix& w) {
  SPADE_CHECK(w.data && w.rows >= 0 && w.cols > 0, "qmatmul: empty weight");
  SPADE_CHECK(w.cols % dtype_info(w.dtype).block_elems == 0, "qmatmul: ", w.cols,
              " columns are not whole blocks of ", dtype_name(w.dtype));
}

RowJob make_job(const float* x, int64_t M, const QuantMatrix& w, float* y, int64_t ldy,
                std::vector<float>& xs) {
  RowJob j{&w, x, M, w.cols, w.cols / 32, nullptr, y, ldy,
           static_cast<const uint8_t*>(w.data), w.row_bytes()};
  if (w.dtype == DType::Q4_0 || w.dtype == DType::Q4_1 || w.dtype == DType::Q4_K ||
      w.dtype == DType::Q5_K) {
    if (int64_t(xs.size()) < M * j.nb) xs.resize(size_t(M * j.nb));
    block_sums(x, M, w.cols, xs.data());
    j.xs = xs.data();
  }
  return j;
}

}  // namespace

void qgemv_rows(const float* x, int64_t M, const QuantMatrix& w, int64_t n0, int64_t n1,
                float* y, int64_t ldy, SimdLevel level) {
  check_matrix(w);
  SPADE_CHECK(simd_level_supported(level), "qgemv_rows: SIMD level ",
              simd_level_name(level), " is not supported here");
  std::vector<float> xs;
  rows_dispatch(make_job(x, M, w, y, ldy, xs), n0, n1, level);
}

void qmatmul(const float* x, const QuantMatrix& w, const float* bias, float* y, int64_t M) {
  check_matrix(w);
  const int64_t N = w.rows, K = w.cols;
  if (M <= kGemvMaxM) {
    thread_local std::vector<float> xs;
    const RowJob j = make_job(x, M, w, y, N, xs);
    const SimdLevel level = simd_level();
    ThreadPool::global().parallel_for(N, 64, [&](int64_t n0, int64_t n1) {
      rows_dispatch(j, n0, n1, level);
    });
  } else {
    // Prefill: each thread takes a range of output rows and runs sgemm over tiles of ~1 MB of
    // its dequantized rows (never the whole matrix; BLAS itself single-threaded).
    const int64_t tile_rows = std::clamp<int64_t>((int64_t(1) << 18) / K, 16, N);
    const SimdLevel level = simd_level();
    ThreadPool::global().parallel_for(N, 16, [&](int64_t r0, int64_t r1) {
      thread_local std::vector<float> tile;
      if (int64_t(tile.size()) < tile_rows * K) tile.resize(size_t(tile_rows * K));
      for (int64_t n0 = r0; n0 < r1; n0 += tile_rows) {
        const int64_t nt = std::min(tile_rows, r1 - n0);
        dequant_tile(w.dtype, w.row(n0), tile.data(), nt * K, level);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(M), int(nt), int(K), 1.f, x,
                    int(K), tile.data(), int(K), 0.f, y + n0, int(N));
      }
    });
  }
  if (bias)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) y[m * N + n] += bias[n];
}

void dequantize_row(const QuantMatrix& w, int64_t r, float* out) {
  SPADE_CHECK(r >= 0 && r < w.rows, "dequantize_row: row ", r, " outside [0, ", w.rows, ")");
  dequantize_serial(w.dtype, w.row(r), out, w.cols);
}

}  // namespace spade::cpu
