#include "backend/cpu/attention.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "backend/cpu/qgemv.h"
#include "core/thread_pool.h"

#if defined(__x86_64__) || defined(__i386__)
#define SPADE_ATT_X86 1
#include <immintrin.h>
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
    std::memcpy(K + i * D, kv.k_row(layer, pt, positions[i], head), sizeof(float) * size_t(D));
    std::memcpy(V + i * D, kv.v_row(layer, pt, positions[i], head), sizeof(float) * size_t(D));
  }
}

void gather_kv_prefix(const KVPool& kv, int layer, const PageTable& pt, int head, int64_t n,
                      float* K, float* V) {
  const int64_t D = kv.layout().head_dim, P = kv.layout().page_size;
  for (int64_t start = 0; start < n; start += P) {
    int64_t cnt = std::min(P, n - start);
    // Within a page and head, slots are contiguous: copy the run at once.
    std::memcpy(K + start * D, kv.k_row(layer, pt, start, head), sizeof(float) * size_t(cnt * D));
    std::memcpy(V + start * D, kv.v_row(layer, pt, start, head), sizeof(float) * size_t(cnt * D));
  }
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
    std::memcpy(K + i * D, kv.k_row(layer, pt, start, head), sizeof(float) * size_t(len * D));
    std::memcpy(V + i * D, kv.v_row(layer, pt, start, head), sizeof(float) * size_t(len * D));
    i += len;
  }
}

namespace {

// One chunk of rows of one KV head: rows' K and V pointers, the G queries of the head.
struct DecodeChunk {
  const float* const* k;  // [len] row pointers
  const float* const* v;
  int64_t len;
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

void chunk_scalar(const DecodeChunk& c) {
  const int64_t D = c.D, len = c.len;
  for (int64_t i = 0; i < len; ++i)
    for (int g = 0; g < c.G; ++g) {
      const float* q = c.q + g * D;
      const float* k = c.k[i];
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
  for (int g = 0; g < c.G; ++g) {
    float* s = c.s + g * len;
    if (c.logits) std::memcpy(c.logits + g * c.ld, s, sizeof(float) * size_t(len));
    float* part = c.part + g * (D + 2);
    chunk_softmax(s, len, part + D, part + D + 1);
    std::fill(part, part + D, 0.f);
    for (int64_t i = 0; i < len; ++i) {
      const float p = s[i];
      const float* v = c.v[i];
      for (int64_t d = 0; d < D; ++d) part[d] += p * v[d];
    }
  }
}

#if SPADE_ATT_X86
SPADE_ATT_AVX2 inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// part[d0, d0 + 8 NV) = sum_i p[i] v[i][d0, d0 + 8 NV).
template <int NV>
SPADE_ATT_AVX2 inline void pv_avx2(const float* p, const float* const* v, int64_t len, int64_t d0,
                                   float* part) {
  __m256 acc[NV];
  for (int j = 0; j < NV; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < len; ++i) {
    const __m256 pi = _mm256_set1_ps(p[i]);
    const float* vi = v[i] + d0;
    for (int j = 0; j < NV; ++j) acc[j] = _mm256_fmadd_ps(pi, _mm256_loadu_ps(vi + 8 * j), acc[j]);
  }
  for (int j = 0; j < NV; ++j) _mm256_storeu_ps(part + d0 + 8 * j, acc[j]);
}

// The same for 64 columns, the eight accumulators written out so they stay in registers (g++
// -O2 does not unroll the loop above, and kept them in memory).
SPADE_ATT_AVX2 inline void pv64_avx2(const float* p, const float* const* v, int64_t len,
                                     int64_t d0, float* part) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (int64_t i = 0; i < len; ++i) {
    const __m256 pi = _mm256_set1_ps(p[i]);
    const float* vi = v[i] + d0;
    a0 = _mm256_fmadd_ps(pi, _mm256_loadu_ps(vi), a0);
    a1 = _mm256_fmadd_ps(pi, _mm256_loadu_ps(vi + 8), a1);
    a2 = _mm256_fmadd_ps(pi, _mm256_loadu_ps(vi + 16), a2);
    a3 = _mm256_fmadd_ps(pi, _mm256_loadu_ps(vi + 24), a3);
    a4 = _mm256_fmadd_ps(pi, _mm256_loadu_ps(vi + 32), a4);
    a5 = _mm256_fmadd_ps(pi, _mm256_loadu_ps(vi + 40), a5);
    a6 = _mm256_fmadd_ps(pi, _mm256_loadu_ps(vi + 48), a6);
    a7 = _mm256_fmadd_ps(pi, _mm256_loadu_ps(vi + 56), a7);
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

// q . k over 64 columns, four accumulators.
SPADE_ATT_AVX2 inline __m256 dot64_avx2(const float* q, const float* k) {
  __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(k));
  __m256 a1 = _mm256_mul_ps(_mm256_loadu_ps(q + 8), _mm256_loadu_ps(k + 8));
  __m256 a2 = _mm256_mul_ps(_mm256_loadu_ps(q + 16), _mm256_loadu_ps(k + 16));
  __m256 a3 = _mm256_mul_ps(_mm256_loadu_ps(q + 24), _mm256_loadu_ps(k + 24));
  a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 32), _mm256_loadu_ps(k + 32), a0);
  a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 40), _mm256_loadu_ps(k + 40), a1);
  a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 48), _mm256_loadu_ps(k + 48), a2);
  a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 56), _mm256_loadu_ps(k + 56), a3);
  return _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
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

// D a multiple of 8.
SPADE_ATT_AVX2 void chunk_avx2(const DecodeChunk& c) {
  const int64_t D = c.D, len = c.len;
  // The history sits in pages of page_size rows per head (4 KB for 16 rows of D = 64), which
  // the hardware prefetchers do not follow from one to the next: rows kPrefetchRows ahead
  // are prefetched by hand, K and V (V is read right after, in the weighted sum).
  constexpr int64_t kPrefetchRows = 8;
  const int64_t row_bytes = D * int64_t(sizeof(float));
  auto prefetch_row = [&](int64_t i) SPADE_ATT_AVX2 {
    if (i >= len) return;
    const char* kn = reinterpret_cast<const char*>(c.k[i]);
    const char* vn = reinterpret_cast<const char*>(c.v[i]);
    for (int64_t b = 0; b < row_bytes; b += 64) {
      _mm_prefetch(kn + b, _MM_HINT_T0);
      _mm_prefetch(vn + b, _MM_HINT_T0);
    }
  };
  int64_t i0 = 0;
  if (D == 64) {
    // Eight rows at a time: eight dot vectors reduced together (no horizontal sum per row).
    for (; i0 + 8 <= len; i0 += 8) {
      for (int64_t r = 0; r < 8; ++r) prefetch_row(i0 + r + kPrefetchRows);
      for (int g = 0; g < c.G; ++g) {
        const float* q = c.q + g * D;
        __m256 d[8];
        for (int r = 0; r < 8; ++r) d[r] = dot64_avx2(q, c.k[i0 + r]);
        _mm256_storeu_ps(c.s + g * len + i0,
                         _mm256_mul_ps(hsum8x8(d), _mm256_set1_ps(c.scale)));
      }
    }
  }
  for (int64_t i = i0; i < len; ++i) {
    const float* k = c.k[i];
    prefetch_row(i + kPrefetchRows);
    for (int g = 0; g < c.G; ++g) {
      const float* q = c.q + g * D;
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
      int64_t d = 0;
      for (; d + 16 <= D; d += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), _mm256_loadu_ps(k + d + 8), a1);
      }
      if (d < D) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), a0);
      c.s[g * len + i] = hsum8(_mm256_add_ps(a0, a1)) * c.scale;
    }
  }
  for (int g = 0; g < c.G; ++g) {
    float* s = c.s + g * len;
    if (c.logits) std::memcpy(c.logits + g * c.ld, s, sizeof(float) * size_t(len));
    float* part = c.part + g * (D + 2);
    part[D + 1] = float(exp_row_avx2(s, len, part + D));
    // Weighted V sum, 64 columns at a time in registers.
    int64_t d0 = 0;
    for (; d0 + 64 <= D; d0 += 64) pv64_avx2(s, c.v, len, d0, part);
    switch ((D - d0) / 8) {
      case 1: pv_avx2<1>(s, c.v, len, d0, part); break;
      case 2: pv_avx2<2>(s, c.v, len, d0, part); break;
      case 3: pv_avx2<3>(s, c.v, len, d0, part); break;
      case 4: pv_avx2<4>(s, c.v, len, d0, part); break;
      case 5: pv_avx2<5>(s, c.v, len, d0, part); break;
      case 6: pv_avx2<6>(s, c.v, len, d0, part); break;
      case 7: pv_avx2<7>(s, c.v, len, d0, part); break;
      default: break;
    }
  }
}
#endif

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
  auto run = [&](int64_t it0, int64_t it1) {
    thread_local std::vector<const float*> ptrs;
    thread_local std::vector<float> scores;
    if (ptrs.size() < size_t(2 * kDecodeChunk)) ptrs.resize(size_t(2 * kDecodeChunk));
    if (scores.size() < size_t(G * kDecodeChunk)) scores.resize(size_t(G * kDecodeChunk));
    int h = 0;
    for (int64_t it = it0; it < it1; ++it) {
      while (item_base[h + 1] <= it) ++h;
      const int64_t n = sel.count(h), r0 = (it - item_base[h]) * kDecodeChunk;
      const int64_t len = std::min(kDecodeChunk, n - r0);
      const float** kp = ptrs.data();
      const float** vp = ptrs.data() + kDecodeChunk;
      const int64_t head_off = int64_t(h) * P * D;
      if (sel.dense()) {
        // Consecutive positions: walk pages and slots without a division per row.
        int64_t page = r0 / P, slot = r0 % P;
        for (int64_t i = 0; i < len; ++i) {
          const int32_t id = pt.pages[size_t(page)];
          kp[i] = kv.k_page(layer, id) + head_off + slot * D;
          vp[i] = kv.v_page(layer, id) + head_off + slot * D;
          if (++slot == P) slot = 0, ++page;
        }
      } else {
        const int32_t* pos = sel.head(h) + r0;
        for (int64_t i = 0; i < len; ++i) {
          kp[i] = kv.k_row(layer, pt, pos[i], h);
          vp[i] = kv.v_row(layer, pt, pos[i], h);
        }
      }
      DecodeChunk c{kp, vp, len, q + int64_t(h) * G * D, G, D, scale, scores.data(),
                    parts + it * part_stride,
                    logits ? logits + int64_t(h) * G * ld + r0 : nullptr, ld};
#if SPADE_ATT_X86
      if (avx2) {
        chunk_avx2(c);
        continue;
      }
#endif
      chunk_scalar(c);
    }
  };
  // Very short histories stay on the calling thread: a hand-off costs more than their work.
  int64_t total_rows = 0;
  for (int h = 0; h < Hkv; ++h) total_rows += sel.count(h);
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
  const int64_t P = kv.layout().page_size;
  float* K = AttentionScratch::ensure(sc.k, size_t(L * D));
  for (int h = 0; h < Hkv; ++h) {
    for (int64_t start = 0; start < L; start += P)
      std::memcpy(K + start * D, kv.k_row(layer, pt, start, h),
                  sizeof(float) * size_t(std::min(P, L - start) * D));
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
