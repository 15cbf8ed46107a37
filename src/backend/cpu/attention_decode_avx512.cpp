// The AVX-512 decode kernel for head dim 64 (chunk_heads64_avx512): the AVX2 kernel's data
// flow with a row in four zmm registers, widened once for up to three query heads.
#include <cstring>

#include "backend/cpu/attention_internal.h"

#if SPADE_ATT_X86
namespace spade::cpu::attn {

namespace {

// ---- AVX-512 (D = 64): a row in four zmm registers, widened once for up to three query
// heads; the same data flow as chunk_heads_avx2 with half the instructions. ----
#define SPADE_ATT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

struct F32Elems16 {
  using T = float;
  SPADE_ATT_AVX512 static __m512 load16(const T* p) { return _mm512_loadu_ps(p); }
};
struct Bf16Elems16 {
  using T = uint16_t;
  SPADE_ATT_AVX512 static __m512 load16(const T* p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
};
struct F16Elems16 {
  using T = uint16_t;
  SPADE_ATT_AVX512 static __m512 load16(const T* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
};

SPADE_ATT_AVX512 inline __m256 fold512(__m512 v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v),
                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

// Lane sums of four vectors: out[r] = sum of v_r's lanes.
SPADE_ATT_AVX512 inline __m128 hsum4x8(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
  const __m256 abcd = _mm256_hadd_ps(ab, cd);
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// Scores of four rows k[r] (64 columns) for NG query heads q + g * 64: s[g * ls + r].
template <class E, int NG>
SPADE_ATT_AVX512 inline void qk64x4_avx512(const float* q, const void* const* k, float scale,
                                           float* s, int64_t ls) {
  __m512 qv[NG][4];
#pragma GCC unroll 4
  for (int g = 0; g < NG; ++g)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) qv[g][j] = _mm512_loadu_ps(q + g * 64 + 16 * j);
  __m256 d[NG][4];
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r) {
    const typename E::T* kr = static_cast<const typename E::T*>(k[r]);
    const __m512 k0 = E::load16(kr), k1 = E::load16(kr + 16), k2 = E::load16(kr + 32),
                 k3 = E::load16(kr + 48);
#pragma GCC unroll 4
    for (int g = 0; g < NG; ++g) {
      __m512 a = _mm512_mul_ps(qv[g][0], k0);
      __m512 b = _mm512_mul_ps(qv[g][1], k1);
      a = _mm512_fmadd_ps(qv[g][2], k2, a);
      b = _mm512_fmadd_ps(qv[g][3], k3, b);
      d[g][r] = fold512(_mm512_add_ps(a, b));
    }
  }
  const __m128 sc = _mm_set1_ps(scale);
#pragma GCC unroll 4
  for (int g = 0; g < NG; ++g)
    _mm_storeu_ps(s + g * ls, _mm_mul_ps(hsum4x8(d[g][0], d[g][1], d[g][2], d[g][3]), sc));
}

// part[g][0, 64) += sum_i p[g][i] v[i] for NG query heads, one pass over the rows.
template <class E, int NG>
SPADE_ATT_AVX512 inline void pv64_heads_avx512(const float* const* p, const void* const* v,
                                               int64_t len, float* const* part) {
  __m512 acc[NG][4];
#pragma GCC unroll 4
  for (int g = 0; g < NG; ++g)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) acc[g][j] = _mm512_loadu_ps(part[g] + 16 * j);
  for (int64_t i = 0; i < len; ++i) {
    const typename E::T* vi = static_cast<const typename E::T*>(v[i]);
    __m512 pg[NG];
#pragma GCC unroll 4
    for (int g = 0; g < NG; ++g) pg[g] = _mm512_set1_ps(p[g][i]);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512 vj = E::load16(vi + 16 * j);
#pragma GCC unroll 4
      for (int g = 0; g < NG; ++g) acc[g][j] = _mm512_fmadd_ps(pg[g], vj, acc[g][j]);
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < NG; ++g)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(part[g] + 16 * j, acc[g][j]);
}

// chunk_heads_avx2 for D = 64 on AVX-512.
template <class E>
SPADE_ATT_AVX512 void chunk_heads64_avx512(const HeadsChunk& c) {
  using T = typename E::T;
  constexpr int64_t D = 64;
  const int64_t len = c.len;
  const int H = c.H, G = c.G;
  auto prefetch_rows = [&](int h, int64_t a, int64_t b) SPADE_ATT_AVX512 {
    b = std::min(b, c.pf_len);
    for (int64_t i = a; i < b; ++i) {
      const char* kn = static_cast<const char*>(c.k[h * c.stride + i]);
      const char* vn = static_cast<const char*>(c.v[h * c.stride + i]);
      for (int64_t o = 0; o < D * int64_t(sizeof(T)); o += 64) {
        _mm_prefetch(kn + o, _MM_HINT_T0);
        _mm_prefetch(vn + o, _MM_HINT_T1);
      }
    }
  };
  int64_t i0 = 0;
  for (; i0 + 4 <= len; i0 += 4)
    for (int h = 0; h < H; ++h) {
      prefetch_rows(h, i0 + kDecodePrefetch, i0 + kDecodePrefetch + 4);
      const void* const* kh = c.k + h * c.stride + i0;
      for (int g0 = 0; g0 < G; g0 += 3) {
        const float* q = c.q + (h * G + g0) * D;
        float* s = c.s + (h * G + g0) * len + i0;
        switch (std::min(3, G - g0)) {
          case 3: qk64x4_avx512<E, 3>(q, kh, c.scale, s, len); break;
          case 2: qk64x4_avx512<E, 2>(q, kh, c.scale, s, len); break;
          default: qk64x4_avx512<E, 1>(q, kh, c.scale, s, len); break;
        }
      }
    }
  for (int64_t i = i0; i < len; ++i)
    for (int h = 0; h < H; ++h) {
      const T* kr = static_cast<const T*>(c.k[h * c.stride + i]);
      const __m512 k0 = E::load16(kr), k1 = E::load16(kr + 16), k2 = E::load16(kr + 32),
                   k3 = E::load16(kr + 48);
      for (int g = 0; g < G; ++g) {
        const float* q = c.q + (h * G + g) * D;
        __m512 a = _mm512_mul_ps(_mm512_loadu_ps(q), k0);
        __m512 b = _mm512_mul_ps(_mm512_loadu_ps(q + 16), k1);
        a = _mm512_fmadd_ps(_mm512_loadu_ps(q + 32), k2, a);
        b = _mm512_fmadd_ps(_mm512_loadu_ps(q + 48), k3, b);
        c.s[(h * G + g) * len + i] = hsum8(fold512(_mm512_add_ps(a, b))) * c.scale;
      }
    }
  for (int h = 0; h < H; ++h)
    for (int g = 0; g < G; ++g) {
      float* s = c.s + (h * G + g) * len;
      if (c.logits) std::memcpy(c.logits + (h * G + g) * c.ld, s, sizeof(float) * size_t(len));
      float* part = c.part + h * c.part_stride + g * (D + 2);
      part[D + 1] = float(exp_row_avx2(s, len, part + D));
      std::fill_n(part, D, 0.f);
    }
  for (int64_t b0 = 0; b0 < len; b0 += 16) {
    const int64_t bl = std::min<int64_t>(16, len - b0);
    for (int h = 0; h < H; ++h)
      for (int g0 = 0; g0 < G; g0 += 3) {
        const int ng = std::min(3, G - g0);
        const float* p[3];
        float* o[3];
        for (int j = 0; j < ng; ++j) {
          p[j] = c.s + (h * G + g0 + j) * len + b0;
          o[j] = c.part + h * c.part_stride + (g0 + j) * (D + 2);
        }
        const void* const* vh = c.v + h * c.stride + b0;
        if (ng == 3) pv64_heads_avx512<E, 3>(p, vh, bl, o);
        else if (ng == 2) pv64_heads_avx512<E, 2>(p, vh, bl, o);
        else pv64_heads_avx512<E, 1>(p, vh, bl, o);
      }
  }
}

}  // namespace

void run_chunk64_avx512(const HeadsChunk& c, KvDtype dt) {
  switch (dt) {
    case KvDtype::F32:
    case KvDtype::FP8: chunk_heads64_avx512<F32Elems16>(c); break;
    case KvDtype::BF16: chunk_heads64_avx512<Bf16Elems16>(c); break;
    case KvDtype::F16: chunk_heads64_avx512<F16Elems16>(c); break;
  }
}

}  // namespace spade::cpu::attn
#endif
