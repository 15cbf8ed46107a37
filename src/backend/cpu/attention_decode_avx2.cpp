// The AVX2 / FMA decode kernel (chunk_heads_avx2): scores, softmax pieces and weighted V sums
// of a chunk of cache rows, f32 / bf16 / f16 rows widened in registers.
#include <cstring>
#include <type_traits>

#include "backend/cpu/attention_internal.h"

#if SPADE_ATT_X86
namespace spade::cpu::attn {

namespace {

#define SPADE_ATT_AVX2F __attribute__((target("avx2,fma,f16c")))

// Eight elements of a cache row from element index i, widened to fp32.
struct F32Elems {
  using T = float;
  SPADE_ATT_AVX2F static __m256 load8(const T* p) { return _mm256_loadu_ps(p); }
};
struct Bf16Elems {
  using T = uint16_t;
  SPADE_ATT_AVX2F static __m256 load8(const T* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
};
struct F16Elems {
  using T = uint16_t;
  SPADE_ATT_AVX2F static __m256 load8(const T* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
};

// part[d0, d0 + 8 NV) = sum_i p[i] v[i][d0, d0 + 8 NV).
template <class E, int NV>
SPADE_ATT_AVX2F inline void pv_avx2(const float* p, const void* const* v, int64_t len, int64_t d0,
                                    float* part) {
  __m256 acc[NV];
  for (int j = 0; j < NV; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < len; ++i) {
    const __m256 pi = _mm256_set1_ps(p[i]);
    const typename E::T* vi = static_cast<const typename E::T*>(v[i]) + d0;
    for (int j = 0; j < NV; ++j) acc[j] = _mm256_fmadd_ps(pi, E::load8(vi + 8 * j), acc[j]);
  }
  for (int j = 0; j < NV; ++j) _mm256_storeu_ps(part + d0 + 8 * j, acc[j]);
}

// The same for 64 columns, the eight accumulators written out so they stay in registers (g++
// -O2 does not unroll the loop above, and kept them in memory).
template <class E>
SPADE_ATT_AVX2F inline void pv64_avx2(const float* p, const void* const* v, int64_t len,
                                      int64_t d0, float* part) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (int64_t i = 0; i < len; ++i) {
    const __m256 pi = _mm256_set1_ps(p[i]);
    const typename E::T* vi = static_cast<const typename E::T*>(v[i]) + d0;
    a0 = _mm256_fmadd_ps(pi, E::load8(vi), a0);
    a1 = _mm256_fmadd_ps(pi, E::load8(vi + 8), a1);
    a2 = _mm256_fmadd_ps(pi, E::load8(vi + 16), a2);
    a3 = _mm256_fmadd_ps(pi, E::load8(vi + 24), a3);
    a4 = _mm256_fmadd_ps(pi, E::load8(vi + 32), a4);
    a5 = _mm256_fmadd_ps(pi, E::load8(vi + 40), a5);
    a6 = _mm256_fmadd_ps(pi, E::load8(vi + 48), a6);
    a7 = _mm256_fmadd_ps(pi, E::load8(vi + 56), a7);
  }
  float* o = part + d0;
  _mm256_storeu_ps(o, a0);
  _mm256_storeu_ps(o + 8, a1);
  _mm256_storeu_ps(o + 16, a2);
  _mm256_storeu_ps(o + 24, a3);
  _mm256_storeu_ps(o + 32, a4);
  _mm256_storeu_ps(o + 40, a5);
  _mm256_storeu_ps(o + 48, a6);
  _mm256_storeu_ps(o + 56, a7);
}

SPADE_ATT_AVX2 inline __m256 hsum8x8(const __m256 v[8]);

// Weighted V sums of NG query heads (score rows p[g], outputs part[g]) over 32 columns
// [d0, d0 + 32) in one pass over the V rows: each row widened once for all NG heads (4 * NG
// accumulators, NG broadcasts and one V vector: 16 registers at NG = 3). Per column the sum
// runs over the rows in order, as in pv64_avx2; ACC: added to what part[g] holds.
template <class E, int NG, bool ACC = false>
SPADE_ATT_AVX2F inline void pv32_heads(const float* const* p, const void* const* v, int64_t len,
                                       int64_t d0, float* const* part) {
  // (Unrolled by hand-given pragmas: g++ -O2 keeps small array loops, and so the
  // accumulators, in memory.)
  __m256 acc[NG][4];
#pragma GCC unroll 4
  for (int g = 0; g < NG; ++g)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j)
      acc[g][j] = ACC ? _mm256_loadu_ps(part[g] + d0 + 8 * j) : _mm256_setzero_ps();
  for (int64_t i = 0; i < len; ++i) {
    const typename E::T* vi = static_cast<const typename E::T*>(v[i]) + d0;
    __m256 pg[NG];
#pragma GCC unroll 4
    for (int g = 0; g < NG; ++g) pg[g] = _mm256_broadcast_ss(p[g] + i);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m256 vj = E::load8(vi + 8 * j);
#pragma GCC unroll 4
      for (int g = 0; g < NG; ++g) acc[g][j] = _mm256_fmadd_ps(pg[g], vj, acc[g][j]);
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < NG; ++g)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(part[g] + d0 + 8 * j, acc[g][j]);
}

// Scores of eight fp32 rows k[r] (64 columns) against one query held in registers: one
// accumulator per row, q's eight vectors reused for every row; out[r] = q . k[r] * scale.
SPADE_ATT_AVX2 inline void dot64x8_avx2(const float* q, const float* const* k, float scale,
                                        float* out) {
  const __m256 q0 = _mm256_loadu_ps(q), q1 = _mm256_loadu_ps(q + 8), q2 = _mm256_loadu_ps(q + 16),
               q3 = _mm256_loadu_ps(q + 24), q4 = _mm256_loadu_ps(q + 32),
               q5 = _mm256_loadu_ps(q + 40), q6 = _mm256_loadu_ps(q + 48),
               q7 = _mm256_loadu_ps(q + 56);
  __m256 d[8];
#pragma GCC unroll 8
  for (int r = 0; r < 8; ++r) {
    const float* kr = k[r];
    __m256 a = _mm256_mul_ps(q0, _mm256_loadu_ps(kr));
    __m256 b = _mm256_mul_ps(q1, _mm256_loadu_ps(kr + 8));
    a = _mm256_fmadd_ps(q2, _mm256_loadu_ps(kr + 16), a);
    b = _mm256_fmadd_ps(q3, _mm256_loadu_ps(kr + 24), b);
    a = _mm256_fmadd_ps(q4, _mm256_loadu_ps(kr + 32), a);
    b = _mm256_fmadd_ps(q5, _mm256_loadu_ps(kr + 40), b);
    a = _mm256_fmadd_ps(q6, _mm256_loadu_ps(kr + 48), a);
    b = _mm256_fmadd_ps(q7, _mm256_loadu_ps(kr + 56), b);
    d[r] = _mm256_add_ps(a, b);
  }
  _mm256_storeu_ps(out, _mm256_mul_ps(hsum8x8(d), _mm256_set1_ps(scale)));
}

// Eight vectors' lane sums as one vector: out[r] = sum of v[r]'s lanes.
SPADE_ATT_AVX2 inline __m256 hsum8x8(const __m256 v[8]) {
  const __m256 s01 = _mm256_hadd_ps(v[0], v[1]), s23 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 s45 = _mm256_hadd_ps(v[4], v[5]), s67 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  // s0123 lanes: [r0 r1 r2 r3 | r0 r1 r2 r3] halves; likewise s4567 for r4..r7.
  const __m256 lo = _mm256_permute2f128_ps(s0123, s4567, 0x20);
  const __m256 hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
  return _mm256_add_ps(lo, hi);
}

template <class E>
SPADE_ATT_AVX2F void chunk_heads_avx2(const HeadsChunk& c) {
  using T = typename E::T;
  const int64_t D = c.D, len = c.len;
  const int H = c.H, G = c.G;
  // K rows kDecodePrefetch ahead into L1, V rows as far ahead into L2 (read after the chunk's
  // scores): K and V of a page are fetched together, one forward stream each.
  const int64_t row_bytes = D * int64_t(sizeof(T));
  auto prefetch_rows = [&](int h, int64_t a, int64_t b) SPADE_ATT_AVX2F {
    b = std::min(b, c.pf_len);
    for (int64_t i = a; i < b; ++i) {
      const char* kn = static_cast<const char*>(c.k[h * c.stride + i]);
      const char* vn = static_cast<const char*>(c.v[h * c.stride + i]);
      for (int64_t o = 0; o < row_bytes; o += 64) {
        _mm_prefetch(kn + o, _MM_HINT_T0);
        _mm_prefetch(vn + o, _MM_HINT_T1);
      }
    }
  };
  int64_t i0 = 0;
  if (D == 64) {
    alignas(32) float kb[8 * 64];
    const float* kr8[8];
    for (; i0 + 8 <= len; i0 += 8)
      for (int h = 0; h < H; ++h) {
        prefetch_rows(h, i0 + kDecodePrefetch, i0 + kDecodePrefetch + 8);
        const void* const* kh = c.k + h * c.stride + i0;
#pragma GCC unroll 8
        for (int r = 0; r < 8; ++r) {
          const T* kr = static_cast<const T*>(kh[r]);
          if constexpr (std::is_same_v<E, F32Elems>) {
            kr8[r] = kr;
          } else {
            for (int j = 0; j < 8; ++j) _mm256_store_ps(kb + r * 64 + 8 * j, E::load8(kr + 8 * j));
            kr8[r] = kb + r * 64;
          }
        }
        for (int g = 0; g < G; ++g)
          dot64x8_avx2(c.q + (h * G + g) * D, kr8, c.scale, c.s + (h * G + g) * len + i0);
      }
  }
  for (int64_t i = i0; i < len; ++i)
    for (int h = 0; h < H; ++h) {
      prefetch_rows(h, i + kDecodePrefetch, i + kDecodePrefetch + 1);
      const T* k = static_cast<const T*>(c.k[h * c.stride + i]);
      for (int g = 0; g < G; ++g) {
        const float* q = c.q + (h * G + g) * D;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        int64_t d = 0;
        for (; d + 16 <= D; d += 16) {
          a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), E::load8(k + d), a0);
          a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), E::load8(k + d + 8), a1);
        }
        if (d < D) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), E::load8(k + d), a0);
        c.s[(h * G + g) * len + i] = hsum8(_mm256_add_ps(a0, a1)) * c.scale;
      }
    }
  for (int h = 0; h < H; ++h)
    for (int g = 0; g < G; ++g) {
      float* s = c.s + (h * G + g) * len;
      if (c.logits) std::memcpy(c.logits + (h * G + g) * c.ld, s, sizeof(float) * size_t(len));
      float* part = c.part + h * c.part_stride + g * (D + 2);
      part[D + 1] = float(exp_row_avx2(s, len, part + D));
    }
  if (D % 32 == 0) {
    for (int h = 0; h < H; ++h)
      for (int g = 0; g < G; ++g) std::fill_n(c.part + h * c.part_stride + g * (D + 2), D, 0.f);
    // 16 rows of each head in turn (a page's rows at page size 16), up to three query heads
    // per pass, accumulated in part.
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
          for (int64_t d0 = 0; d0 < D; d0 += 32) {
            if (ng == 3) pv32_heads<E, 3, true>(p, vh, bl, d0, o);
            else if (ng == 2) pv32_heads<E, 2, true>(p, vh, bl, d0, o);
            else pv32_heads<E, 1, true>(p, vh, bl, d0, o);
          }
        }
    }
    return;
  }
  for (int h = 0; h < H; ++h)
    for (int g = 0; g < G; ++g) {
      const float* s = c.s + (h * G + g) * len;
      float* part = c.part + h * c.part_stride + g * (D + 2);
      const void* const* vh = c.v + h * c.stride;
      int64_t d0 = 0;
      for (; d0 + 64 <= D; d0 += 64) pv64_avx2<E>(s, vh, len, d0, part);
      switch ((D - d0) / 8) {
        case 1: pv_avx2<E, 1>(s, vh, len, d0, part); break;
        case 2: pv_avx2<E, 2>(s, vh, len, d0, part); break;
        case 3: pv_avx2<E, 3>(s, vh, len, d0, part); break;
        case 4: pv_avx2<E, 4>(s, vh, len, d0, part); break;
        case 5: pv_avx2<E, 5>(s, vh, len, d0, part); break;
        case 6: pv_avx2<E, 6>(s, vh, len, d0, part); break;
        case 7: pv_avx2<E, 7>(s, vh, len, d0, part); break;
        default: break;
      }
    }
}

}  // namespace

void run_chunk_avx2(const HeadsChunk& c, KvDtype dt) {
  switch (dt) {
    case KvDtype::F32:
    case KvDtype::FP8: chunk_heads_avx2<F32Elems>(c); break;
    case KvDtype::BF16: chunk_heads_avx2<Bf16Elems>(c); break;
    case KvDtype::F16: chunk_heads_avx2<F16Elems>(c); break;
  }
}

}  // namespace spade::cpu::attn
#endif
