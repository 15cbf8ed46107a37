// Internals the CPU attention files share (not a public header): the x86 SIMD setup, the
// vectorized softmax row, and the decode kernels' chunk and entry points.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kv/kv_dtype.h"

#if defined(__x86_64__) || defined(__i386__)
#define SPADE_ATT_X86 1
// g++ 12 warns inside its own AVX-512 headers (_mm512_undefined_* as a pass-through operand,
// GCC bug 105593), where the header and where the intrinsics inline: silenced as in qgemv.cpp.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#define SPADE_ATT_AVX2 __attribute__((target("avx2,fma")))
#endif

namespace spade::cpu::attn {

// Rows the decode kernel prefetches ahead of the one it reads (K and V).
constexpr int64_t kDecodePrefetch = 32;

#if SPADE_ATT_X86
// exp of 8 floats: x = n ln2 + r (|r| <= ln2 / 2, ln2 in two parts), a degree-5 polynomial for
// e^r (Cephes expf, within 2 ulp of the true value), 2^n built in the exponent bits. Inputs
// below -88.38 (and -inf) give 0, as the softmax wants for masked scores.
SPADE_ATT_AVX2 inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f));
  x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
  const __m256 fx = _mm256_floor_ps(
      _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// One softmax row's pieces: its max (returned in *mx), exp(s - max) in place, the sum in
// double. The tail goes through the same vector code (padded with -inf), so every element's
// value is the same wherever it sits in the row.
SPADE_ATT_AVX2 inline double exp_row_avx2(float* s, int64_t n, float* mx_out) {
  __m256 m8 = _mm256_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(s + i));
  float mx = -INFINITY;
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m8);
  for (float v : lanes) mx = std::max(mx, v);
  for (int64_t k = i; k < n; ++k) mx = std::max(mx, s[k]);
  *mx_out = mx;
  const __m256 m = _mm256_set1_ps(mx);
  __m256d d0 = _mm256_setzero_pd(), d1 = _mm256_setzero_pd();
  auto step = [&](__m256 v) SPADE_ATT_AVX2 {
    const __m256 e = exp8(_mm256_sub_ps(v, m));
    d0 = _mm256_add_pd(d0, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
    d1 = _mm256_add_pd(d1, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
    return e;
  };
  for (i = 0; i + 8 <= n; i += 8) _mm256_storeu_ps(s + i, step(_mm256_loadu_ps(s + i)));
  if (i < n) {
    alignas(32) float tail[8];
    for (int k = 0; k < 8; ++k) tail[k] = i + k < n ? s[i + k] : -INFINITY;
    _mm256_store_ps(tail, step(_mm256_load_ps(tail)));
    for (int64_t k = i; k < n; ++k) s[k] = tail[k - i];
  }
  alignas(32) double acc[4];
  _mm256_store_pd(acc, _mm256_add_pd(d0, d1));
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

SPADE_ATT_AVX2 inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The decode kernel (AVX2 / AVX-512): a chunk of rows of H KV heads. Dense selections take
// every head at once: the rows of all heads of a page lie together in the cache (HND within
// a page), so taking 8 rows of each head in turn reads the cache as one forward stream, which
// the hardware prefetchers follow at full bandwidth; a head at a time strides through it
// (measured on a 2-core EPYC: 2.6x slower for the same bytes). Listed selections take one
// head (H = 1). The arithmetic per (head, row) does not depend on H, so a dense selection and
// the same rows listed give bit-identical outputs.
struct HeadsChunk {
  const void* const* k;  // row pointers of head h at k + h * stride, [pf_len]: the chunk's len
  const void* const* v;  // rows, then rows only prefetched
  int64_t stride;
  int64_t len, pf_len;
  int H, G;
  int64_t D;
  float scale;
  const float* q;  // [H * G, D]
  float* s;        // scratch [H * G, len]
  float* part;     // head h's [G, D + 2] at part + h * part_stride
  int64_t part_stride;
  float* logits;   // optional: row (h, g) at logits + (h * G + g) * ld
  int64_t ld;
};

// The decode kernel over one HeadsChunk for a cache of type dt (FP8: rows already widened to
// f32): AVX2 / FMA for any D % 8 == 0 (attention_decode_avx2.cpp), AVX-512 for D = 64
// (attention_decode_avx512.cpp).
void run_chunk_avx2(const HeadsChunk& c, KvDtype dt);
void run_chunk64_avx512(const HeadsChunk& c, KvDtype dt);
#endif

}  // namespace spade::cpu::attn
