#include "backend/cpu/attention.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace spade::cpu {

void attend_gathered(const float* Q, const float* K, const float* V, const int64_t* limit,
                     int64_t M, int64_t L, int64_t D, float scale, float* s, float* O) {
  // S = Q K^T (all L columns; columns past a row's limit are ignored below).
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(M), int(L), int(D), scale, Q, int(D),
              K, int(D), 0.f, s, int(L));
  for (int64_t r = 0; r < M; ++r) {
    float* row = s + r * L;
    const int64_t n = limit[r];
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
  // Query blocks bound the score scratch to kBlock*G*L floats.
  const int64_t kBlock = 256;
  float* K = AttentionScratch::ensure(sc.k, size_t(L * D));
  float* V = AttentionScratch::ensure(sc.v, size_t(L * D));
  for (int h = 0; h < Hkv; ++h) {
    gather_kv_prefix(kv, layer, pt, h, L, K, V);
    for (int64_t t0 = 0; t0 < T; t0 += kBlock) {
      const int64_t tb = std::min(kBlock, T - t0);
      const int64_t M = tb * G;
      float* Q = AttentionScratch::ensure(sc.q, size_t(M * D));
      float* O = AttentionScratch::ensure(sc.o, size_t(M * D));
      int64_t* lim = AttentionScratch::ensure(sc.limit, size_t(M));
      // Keys beyond the block's last token are never visible: shrink L for the block.
      const int64_t Lb = p0 + t0 + tb;
      float* S = AttentionScratch::ensure(sc.s, size_t(M * Lb));
      for (int64_t t = 0; t < tb; ++t)
        for (int g = 0; g < G; ++g) {
          std::memcpy(Q + (t * G + g) * D, q + ((t0 + t) * Hq + h * G + g) * D,
                      sizeof(float) * size_t(D));
          lim[t * G + g] = p0 + t0 + t + 1;
        }
      attend_gathered(Q, K, V, lim, M, Lb, D, scale, S, O);
      for (int64_t t = 0; t < tb; ++t)
        for (int g = 0; g < G; ++g)
          std::memcpy(out + ((t0 + t) * Hq + h * G + g) * D, O + (t * G + g) * D,
                      sizeof(float) * size_t(D));
    }
  }
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

void attention_selected(const KVPool& kv, int layer, const PageTable& pt, const float* q, int Hq,
                        float scale, const sparse::Selection& sel, float* out,
                        AttentionScratch& sc, float* logits) {
  const int Hkv = kv.layout().n_kv_heads;
  const int64_t D = kv.layout().head_dim;
  const int G = Hq / Hkv;
  const int64_t L = sel.length;
  // (pt.length may lag: the layer loop bumps it after the last layer.)
  SPADE_CHECK(sel.n_kv_heads == Hkv && L <= pt.capacity(kv.layout().page_size),
              "attention_selected: selection for ", sel.n_kv_heads, " heads / ", L,
              " tokens, cache has ", Hkv, " heads / room for ",
              pt.capacity(kv.layout().page_size), " tokens");
  SPADE_CHECK(!logits || sel.uniform(), "attention_selected: logits need a uniform selection");
  int64_t max_n = 0;
  for (int h = 0; h < Hkv; ++h) max_n = std::max(max_n, sel.count(h));
  float* K = AttentionScratch::ensure(sc.k, size_t(std::max<int64_t>(1, max_n) * D));
  float* V = AttentionScratch::ensure(sc.v, size_t(std::max<int64_t>(1, max_n) * D));
  float* Q = AttentionScratch::ensure(sc.q, size_t(G * D));
  float* O = AttentionScratch::ensure(sc.o, size_t(G * D));
  float* S = AttentionScratch::ensure(sc.s, size_t(G * std::max<int64_t>(1, max_n)));
  int64_t* lim = AttentionScratch::ensure(sc.limit, size_t(G));
  for (int h = 0; h < Hkv; ++h) {
    const int64_t n = sel.count(h);
    SPADE_CHECK(n > 0, "attention_selected: KV head ", h, " of layer ", layer,
                " selects no token");
    if (sel.dense())
      gather_kv_prefix(kv, layer, pt, h, n, K, V);
    else
      gather_kv_runs(kv, layer, pt, h, sel.head(h), n, K, V);
    std::memcpy(Q, q + int64_t(h) * G * D, sizeof(float) * size_t(G * D));
    for (int g = 0; g < G; ++g) lim[g] = n;
    if (logits)
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, G, int(n), int(D), scale, Q, int(D), K,
                  int(D), 0.f, logits + int64_t(h) * G * n, int(n));
    attend_gathered(Q, K, V, lim, G, n, D, scale, S, O);
    std::memcpy(out + int64_t(h) * G * D, O, sizeof(float) * size_t(G * D));
  }
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
