#include "backend/cpu/attention.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "backend/cpu/qgemv.h"
#include "core/thread_pool.h"

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

namespace spade::cpu {

namespace {

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
SPADE_ATT_AVX2 double exp_row_avx2(float* s, int64_t n, float* mx_out) {
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
#endif

}  // namespace

void attend_gathered(const float* Q, const float* K, const float* V, const int64_t* limit,
                     int64_t M, int64_t L, int64_t D, float scale, float* s, float* O) {
  // S = Q K^T (all L columns; columns past a row's limit are ignored below).
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(M), int(L), int(D), scale, Q, int(D),
              K, int(D), 0.f, s, int(L));
#if SPADE_ATT_X86
  const bool avx2 = simd_level() != SimdLevel::Scalar;
#endif
  for (int64_t r = 0; r < M; ++r) {
    float* row = s + r * L;
    const int64_t n = limit[r];
#if SPADE_ATT_X86
    if (avx2) {
      float mx;
      const float inv = float(1.0 / exp_row_avx2(row, n, &mx));
      for (int64_t j = 0; j < n; ++j) row[j] *= inv;
      for (int64_t j = n; j < L; ++j) row[j] = 0.f;
      continue;
    }
#endif
    float mx = -INFINITY;
    for (int64_t j = 0; j < n; ++j) mx = std::max(mx, row[j]);
    double sum = 0;
    for (int64_t j = 0; j < n; ++j) {
      row[j] = std::exp(row[j] - mx);
      sum += row[j];
    }
    const float inv = float(1.0 / sum);
    for (int64_t j = 0; j < n; ++j) row[j] *= inv;
    for (int64_t j = n; j < L; ++j) row[j] = 0.f;
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(M), int(D), int(L), 1.f, s, int(L),
              V, int(D), 0.f, O, int(D));
}

void gather_kv(const KVPool& kv, int layer, const PageTable& pt, int head,
               const int32_t* positions, int64_t n, float* K, float* V) {
  const int64_t D = kv.layout().head_dim;
  for (int64_t i = 0; i < n; ++i) {
    kv.load_k(layer, pt, positions[i], head, 1, K + i * D);
    kv.load_v(layer, pt, positions[i], head, 1, V + i * D);
  }
}

void gather_kv_prefix(const KVPool& kv, int layer, const PageTable& pt, int head, int64_t n,
                      float* K, float* V) {
  kv.load_k(layer, pt, 0, head, n, K);
  kv.load_v(layer, pt, 0, head, n, V);
}

void attention_dense(const KVPool& kv, int layer, const PageTable& pt, const float* q,
                     int64_t p0, int64_t T, int Hq, float scale, float* out,
                     AttentionScratch& sc) {
  const int Hkv = kv.layout().n_kv_heads;
  const int64_t D = kv.layout().head_dim;
  const int G = Hq / Hkv;
  const int64_t L = p0 + T;
  if (T == 1) {  // decode: the in-place kernel attention_selected runs for a dense selection
    sparse::Selection all;
    all.set_dense(Hkv, L);
    decode_attention(kv, layer, pt, q, Hq, scale, all, out, sc);
    return;
  }
  // Every head's K/V history gathered once; then (head, query block) items spread over the
  // pool, each with the calling thread's own scratch. Query blocks bound the score scratch to
  // kBlock*G*L floats per thread.
  const int64_t kBlock = 64;
  float* K = AttentionScratch::ensure(sc.k, size_t(Hkv * L * D));
  float* V = AttentionScratch::ensure(sc.v, size_t(Hkv * L * D));
  ThreadPool& pool = ThreadPool::global();
  pool.parallel_for(Hkv, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; ++h)
      gather_kv_prefix(kv, layer, pt, int(h), L, K + h * L * D, V + h * L * D);
  });
  const int64_t blocks = (T + kBlock - 1) / kBlock;
  pool.parallel_for(Hkv * blocks, 1, [&](int64_t i0, int64_t i1) {
    thread_local AttentionScratch ts;
    for (int64_t item = i0; item < i1; ++item) {
      const int h = int(item / blocks);
      const int64_t t0 = (item % blocks) * kBlock;
      const int64_t tb = std::min(kBlock, T - t0);
      const int64_t M = tb * G;
      float* Q = AttentionScratch::ensure(ts.q, size_t(M * D));
      float* O = AttentionScratch::ensure(ts.o, size_t(M * D));
      int64_t* lim = AttentionScratch::ensure(ts.limit, size_t(M));
      // Keys beyond the block's last token are never visible: shrink L for the block.
      const int64_t Lb = p0 + t0 + tb;
      float* S = AttentionScratch::ensure(ts.s, size_t(M * Lb));
      for (int64_t t = 0; t < tb; ++t)
        for (int g = 0; g < G; ++g) {
          std::memcpy(Q + (t * G + g) * D, q + ((t0 + t) * Hq + h * G + g) * D,
                      sizeof(float) * size_t(D));
          lim[t * G + g] = p0 + t0 + t + 1;
        }
      attend_gathered(Q, K + h * L * D, V + h * L * D, lim, M, Lb, D, scale, S, O);
      for (int64_t t = 0; t < tb; ++t)
        for (int g = 0; g < G; ++g)
          std::memcpy(out + ((t0 + t) * Hq + h * G + g) * D, O + (t * G + g) * D,
                      sizeof(float) * size_t(D));
    }
  });
}

void gather_kv_runs(const KVPool& kv, int layer, const PageTable& pt, int head,
                    const int32_t* positions, int64_t n, float* K, float* V) {
  const int64_t D = kv.layout().head_dim, P = kv.layout().page_size;
  int64_t i = 0;
  while (i < n) {
    // Extend the run while positions stay consecutive and inside the same page.
    const int64_t start = positions[i];
    int64_t len = 1;
    while (i + len < n && positions[i + len] == start + len && (start + len) % P != 0) ++len;
    kv.load_k(layer, pt, start, head, len, K + i * D);
    kv.load_v(layer, pt, start, head, len, V + i * D);
    i += len;
  }
}

namespace {

// One chunk of rows of one KV head: rows' K and V pointers (elements of the cache's dtype), the
// G queries of the head.
// Rows the decode kernel prefetches ahead of the one it reads (K and V).
constexpr int64_t kDecodePrefetch = 32;

struct DecodeChunk {
  const void* const* k;  // [pf_len] row pointers: the chunk's len rows, then rows to prefetch
  const void* const* v;
  int64_t len;
  int64_t pf_len;
  const float* q;  // [G, D]
  int G;
  int64_t D;
  float scale;
  float* s;     // scratch [G, len]
  float* part;  // out: [G, D + 2]: unnormalized sum of p v, then max score, then sum of p
  float* logits;  // optional: scaled scores, row g at logits + g * ld
  int64_t ld;
};

// Softmax pieces of one score row: max, exp in place, sum (double, as attend_gathered).
inline void chunk_softmax(float* s, int64_t len, float* mx_out, float* sum_out) {
  float mx = -INFINITY;
  for (int64_t i = 0; i < len; ++i) mx = std::max(mx, s[i]);
  double sum = 0;
  for (int64_t i = 0; i < len; ++i) {
    s[i] = std::exp(s[i] - mx);
    sum += s[i];
  }
  *mx_out = mx;
  *sum_out = float(sum);
}

// Scalar reference: each row widened to fp32 (exactly) before the same arithmetic.
void chunk_scalar(const DecodeChunk& c, KvDtype dt) {
  const int64_t D = c.D, len = c.len;
  thread_local std::vector<float> kv_row;
  if (kv_row.size() < size_t(D)) kv_row.resize(size_t(D));
  float* k = kv_row.data();
  for (int64_t i = 0; i < len; ++i) {
    kv_to_f32(dt, c.k[i], D, k);
    for (int g = 0; g < c.G; ++g) {
      const float* q = c.q + g * D;
      float a0 = 0, a1 = 0, a2 = 0, a3 = 0;
      int64_t d = 0;
      for (; d + 4 <= D; d += 4) {
        a0 += q[d] * k[d];
        a1 += q[d + 1] * k[d + 1];
        a2 += q[d + 2] * k[d + 2];
        a3 += q[d + 3] * k[d + 3];
      }
      for (; d < D; ++d) a0 += q[d] * k[d];
      c.s[g * len + i] = ((a0 + a1) + (a2 + a3)) * c.scale;
    }
  }
  for (int g = 0; g < c.G; ++g) {
    float* s = c.s + g * len;
    if (c.logits) std::memcpy(c.logits + g * c.ld, s, sizeof(float) * size_t(len));
    float* part = c.part + g * (D + 2);
    chunk_softmax(s, len, part + D, part + D + 1);
    std::fill(part, part + D, 0.f);
    float* v = kv_row.data();
    for (int64_t i = 0; i < len; ++i) {
      const float p = s[i];
      kv_to_f32(dt, c.v[i], D, v);
      for (int64_t d = 0; d < D; ++d) part[d] += p * v[d];
    }
  }
}

#if SPADE_ATT_X86
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

SPADE_ATT_AVX2 inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

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
#endif

// fp8 cache: the n rows at kp / vp (KV head h of `layer`) widened into fp32 rows k / v
// ([n, D] each), times the head's K / V scales, and the pointers moved to them.
// Rows that lie one after another in the cache (a head's rows within a page, K and V alike:
// same offsets) convert as one run.
void widen_fp8_rows(const KVPool& kv, int layer, int h, const void** kp, const void** vp,
                    int64_t n, int64_t D, float* k, float* v) {
  const float ks = kv.k_scale(layer, h), vs = kv.v_scale(layer, h);
  int64_t i = 0;
  while (i < n) {
    const unsigned char* k0 = static_cast<const unsigned char*>(kp[i]);
    const unsigned char* v0 = static_cast<const unsigned char*>(vp[i]);
    int64_t run = 1;
    while (i + run < n && kp[i + run] == k0 + run * D && vp[i + run] == v0 + run * D) ++run;
    kv_to_f32(KvDtype::FP8, k0, run * D, k + i * D, ks);
    kv_to_f32(KvDtype::FP8, v0, run * D, v + i * D, vs);
    for (int64_t j = i; j < i + run; ++j) {
      kp[j] = k + j * D;
      vp[j] = v + j * D;
    }
    i += run;
  }
}

}  // namespace

void decode_attention(const KVPool& kv, int layer, const PageTable& pt, const float* q, int Hq,
                      float scale, const sparse::Selection& sel, float* out,
                      AttentionScratch& sc, float* logits) {
  const int Hkv = kv.layout().n_kv_heads;
  const int64_t D = kv.layout().head_dim, P = kv.layout().page_size;
  const int G = Hq / Hkv;
  const int64_t L = sel.length;
  SPADE_CHECK(sel.n_kv_heads == Hkv && L <= pt.capacity(int(P)),
              "attention_selected: selection for ", sel.n_kv_heads, " heads / ", L,
              " tokens, cache has ", Hkv, " heads / room for ", pt.capacity(int(P)), " tokens");
  SPADE_CHECK(!logits || sel.uniform(), "attention_selected: logits need a uniform selection");
  // Work items: (head, chunk) pairs, head-major; item_base[h] is head h's first.
  int64_t item_base[65];
  SPADE_CHECK(Hkv <= 64, "decode_attention: more than 64 KV heads");
  int64_t items = 0;
  for (int h = 0; h < Hkv; ++h) {
    const int64_t n = sel.count(h);
    SPADE_CHECK(n > 0, "attention_selected: KV head ", h, " of layer ", layer,
                " selects no token");
    item_base[h] = items;
    items += (n + kDecodeChunk - 1) / kDecodeChunk;
  }
  item_base[Hkv] = items;
  const int64_t part_stride = int64_t(G) * (D + 2);
  float* parts = AttentionScratch::ensure(sc.part, size_t(items * part_stride));
#if SPADE_ATT_X86
  const bool avx2 = D % 8 == 0 && simd_level() != SimdLevel::Scalar;
#endif
  const int64_t ld = logits ? sel.count(0) : 0;
  // fp8: each chunk's rows are widened (times their head's scales) into fp32 rows first and the
  // kernels run as on an f32 cache (widen_fp8_rows): the values an f32 cache of the dequantized
  // cache would hold, through the same arithmetic.
  const bool fp8 = kv.dtype() == KvDtype::FP8;
  const KvDtype dt = fp8 ? KvDtype::F32 : kv.dtype();
  const size_t esize = kv.layout().elem_bytes();
#if SPADE_ATT_X86
  const bool avx512_64 = D == 64 && simd_level() == SimdLevel::Avx512;
  auto run_chunk = [&](const HeadsChunk& c) {
    if (avx512_64) {
      switch (dt) {
        case KvDtype::F32:
        case KvDtype::FP8: chunk_heads64_avx512<F32Elems16>(c); break;
        case KvDtype::BF16: chunk_heads64_avx512<Bf16Elems16>(c); break;
        case KvDtype::F16: chunk_heads64_avx512<F16Elems16>(c); break;
      }
      return;
    }
    switch (dt) {
      case KvDtype::F32:
      case KvDtype::FP8: chunk_heads_avx2<F32Elems>(c); break;
      case KvDtype::BF16: chunk_heads_avx2<Bf16Elems>(c); break;
      case KvDtype::F16: chunk_heads_avx2<F16Elems>(c); break;
    }
  };
#endif
  auto run = [&](int64_t it0, int64_t it1) {
    thread_local std::vector<const void*> ptrs;
    thread_local std::vector<float> scores, wide;
    constexpr int64_t kRows = kDecodeChunk + kDecodePrefetch;
    if (ptrs.size() < size_t(2 * kRows)) ptrs.resize(size_t(2 * kRows));
    if (scores.size() < size_t(G * kDecodeChunk)) scores.resize(size_t(G * kDecodeChunk));
    if (fp8 && wide.size() < size_t(2 * kDecodeChunk * D)) wide.resize(size_t(2 * kDecodeChunk * D));
    int h = 0;
    for (int64_t it = it0; it < it1; ++it) {
      while (item_base[h + 1] <= it) ++h;
      const int64_t n = sel.count(h), r0 = (it - item_base[h]) * kDecodeChunk;
      const int64_t len = std::min(kDecodeChunk, n - r0);
      // The chunk's rows, then the next rows of the head, which the kernel only prefetches.
      int64_t pf_len = std::min(kRows, n - r0);
      const void** kp = ptrs.data();
      const void** vp = ptrs.data() + kRows;
      const int64_t head_off = int64_t(h) * P * D;
      if (sel.dense()) {
        // Consecutive positions: walk pages and slots without a division per row.
        int64_t page = r0 / P, slot = r0 % P;
        for (int64_t i = 0; i < pf_len; ++i) {
          const int32_t id = pt.pages[size_t(page)];
          const int64_t e = (head_off + slot * D) * int64_t(esize);
          kp[i] = static_cast<const unsigned char*>(kv.k_page_data(layer, id)) + e;
          vp[i] = static_cast<const unsigned char*>(kv.v_page_data(layer, id)) + e;
          if (++slot == P) slot = 0, ++page;
        }
      } else {
        const int32_t* pos = sel.head(h) + r0;
        for (int64_t i = 0; i < pf_len; ++i) {
          kp[i] = kv.k_row_data(layer, pt, pos[i], h);
          vp[i] = kv.v_row_data(layer, pt, pos[i], h);
        }
      }
      if (fp8) {
        widen_fp8_rows(kv, layer, h, kp, vp, len, D, wide.data(), wide.data() + kDecodeChunk * D);
        pf_len = len;
      }
      DecodeChunk c{kp, vp, len, pf_len, q + int64_t(h) * G * D, G, D, scale, scores.data(),
                    parts + it * part_stride,
                    logits ? logits + int64_t(h) * G * ld + r0 : nullptr, ld};
#if SPADE_ATT_X86
      if (avx2) {
        // The dense path's kernel for one head: the same arithmetic per (head, row).
        HeadsChunk hc{kp, vp, kRows, len, pf_len, 1, G, D, scale, c.q, scores.data(), c.part,
                      part_stride, c.logits, ld};
        run_chunk(hc);
        continue;
      }
#endif
      chunk_scalar(c, dt);
    }
  };
  // Very short histories stay on the calling thread: a hand-off costs more than their work.
  int64_t total_rows = 0;
  for (int h = 0; h < Hkv; ++h) total_rows += sel.count(h);
#if SPADE_ATT_X86
  if (avx2 && sel.dense()) {
    // Dense: a work item is a chunk of every head (chunk_heads_avx2, the cache read in order);
    // its partials land where the head-major items' would, so the merge below is shared.
    const int64_t chunks = item_base[1];
    auto run_heads = [&](int64_t c0, int64_t c1) {
      thread_local std::vector<const void*> ptrs;
      thread_local std::vector<float> scores, wide;
      constexpr int64_t kRows = kDecodeChunk + kDecodePrefetch;
      const size_t need = size_t(2 * Hkv * kRows);
      if (ptrs.size() < need) ptrs.resize(need);
      if (scores.size() < size_t(Hkv * G * kDecodeChunk)) scores.resize(size_t(Hkv * G * kDecodeChunk));
      const size_t wneed = size_t(2 * Hkv * kDecodeChunk * D);
      if (fp8 && wide.size() < wneed) wide.resize(wneed);
      for (int64_t ch = c0; ch < c1; ++ch) {
        const int64_t r0 = ch * kDecodeChunk, len = std::min(kDecodeChunk, L - r0);
        int64_t pf_len = std::min(kRows, L - r0);
        const void** kp = ptrs.data();
        const void** vp = ptrs.data() + Hkv * kRows;
        for (int h = 0; h < Hkv; ++h) {
          const int64_t head_off = int64_t(h) * P * D;
          int64_t page = r0 / P, slot = r0 % P;
          for (int64_t i = 0; i < pf_len; ++i) {
            const int32_t id = pt.pages[size_t(page)];
            const int64_t e = (head_off + slot * D) * int64_t(esize);
            kp[h * kRows + i] = static_cast<const unsigned char*>(kv.k_page_data(layer, id)) + e;
            vp[h * kRows + i] = static_cast<const unsigned char*>(kv.v_page_data(layer, id)) + e;
            if (++slot == P) slot = 0, ++page;
          }
        }
        if (fp8) {
          for (int h = 0; h < Hkv; ++h)
            widen_fp8_rows(kv, layer, h, kp + h * kRows, vp + h * kRows, len, D,
                           wide.data() + h * kDecodeChunk * D,
                           wide.data() + (Hkv + h) * kDecodeChunk * D);
          pf_len = len;
        }
        HeadsChunk c{kp, vp, kRows, len, pf_len, Hkv, G, D, scale, q, scores.data(),
                     parts + ch * part_stride, chunks * part_stride, logits ? logits + r0 : nullptr,
                     ld};
        run_chunk(c);
      }
    };
    if (chunks < 2 || total_rows < 256)
      run_heads(0, chunks);
    else
      ThreadPool::global().parallel_for(chunks, 1, [&run_heads](int64_t a, int64_t b) { run_heads(a, b); });
  } else
#endif
  if (items < 2 || total_rows < 256)
    run(0, items);
  else
    // (Through a one-reference lambda: std::function keeps that without allocating.)
    ThreadPool::global().parallel_for(items, 1, [&run](int64_t a, int64_t b) { run(a, b); });
  // Merge each head's chunks in order.
  for (int h = 0; h < Hkv; ++h)
    for (int g = 0; g < G; ++g) {
      float mx = -INFINITY;
      for (int64_t it = item_base[h]; it < item_base[h + 1]; ++it)
        mx = std::max(mx, parts[it * part_stride + g * (D + 2) + D]);
      float* o = out + (int64_t(h) * G + g) * D;
      std::fill(o, o + D, 0.f);
      double den = 0;
      for (int64_t it = item_base[h]; it < item_base[h + 1]; ++it) {
        const float* part = parts + it * part_stride + g * (D + 2);
        const float w = std::exp(part[D] - mx);
        den += double(w) * double(part[D + 1]);
        for (int64_t d = 0; d < D; ++d) o[d] += w * part[d];
      }
      const float inv = float(1.0 / den);
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
}

void attention_selected(const KVPool& kv, int layer, const PageTable& pt, const float* q, int Hq,
                        float scale, const sparse::Selection& sel, float* out,
                        AttentionScratch& sc, float* logits) {
  decode_attention(kv, layer, pt, q, Hq, scale, sel, out, sc, logits);
}

void attention_weights_full(const KVPool& kv, int layer, const PageTable& pt, const float* q,
                            int Hq, float scale, int64_t L, float* w, AttentionScratch& sc) {
  const int Hkv = kv.layout().n_kv_heads;
  const int64_t D = kv.layout().head_dim;
  const int G = Hq / Hkv;
  float* K = AttentionScratch::ensure(sc.k, size_t(L * D));
  for (int h = 0; h < Hkv; ++h) {
    kv.load_k(layer, pt, 0, h, L, K);
    float* rows = w + int64_t(h) * G * L;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, G, int(L), int(D), scale,
                q + int64_t(h) * G * D, int(D), K, int(D), 0.f, rows, int(L));
    for (int g = 0; g < G; ++g) {
      float* r = rows + int64_t(g) * L;
      float mx = -INFINITY;
      for (int64_t j = 0; j < L; ++j) mx = std::max(mx, r[j]);
      double sum = 0;
      for (int64_t j = 0; j < L; ++j) sum += (r[j] = std::exp(r[j] - mx));
      const float inv = float(1.0 / sum);
      for (int64_t j = 0; j < L; ++j) r[j] *= inv;
    }
  }
}

}  // namespace spade::cpu
