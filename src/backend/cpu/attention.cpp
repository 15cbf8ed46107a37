// CPU attention over gathered rows: attend_gathered, the gathers, dense (prefill) attention and
// the full-attention weights; decode attention is in attention_decode.cpp.
#include "backend/cpu/attention.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "backend/cpu/attention_internal.h"
#include "backend/cpu/qgemv.h"
#include "core/thread_pool.h"

namespace spade::cpu {

using namespace attn;

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
