// CPU reference attention. The primitive is attention over gathered rows: the caller (dense
// or a sparse selection) gathers the K/V rows a query may read into contiguous scratch and
// this computes exact softmax(q.k * scale) . v over exactly those rows. No masks over dense
// scores: the only limit is causality (row r sees the first limit[r] gathered keys).
#pragma once
#include <cstdint>
#include <vector>

#include "kv/kv_pool.h"
#include "sparse/selection.h"

namespace spade::cpu {

// Reused buffers; they grow to the largest size seen and are never shrunk, so steady-state
// decode allocates nothing.
struct AttentionScratch {
  std::vector<float> q, k, v, s, o;
  std::vector<float> part;  // decode: per (head, chunk) softmax partials
  std::vector<int64_t> limit;
  template <typename T>
  static T* ensure(std::vector<T>& b, size_t n) {
    if (b.size() < n) b.resize(n);
    return b.data();
  }
};

// O[M,D] = softmax_rows(Q[M,D] K[0:limit[r],D]^T * scale) V[0:limit[r],D].
// limit[r] in [1, L]. s is scratch of M*L floats.
void attend_gathered(const float* Q, const float* K, const float* V, const int64_t* limit,
                     int64_t M, int64_t L, int64_t D, float scale, float* s, float* O);

// Dense causal attention for T new tokens of one sequence at positions [p0, p0+T) (their
// K/V already written to the cache), query heads [T, Hq, D] -> out [T, Hq, D].
void attention_dense(const KVPool& kv, int layer, const PageTable& pt, const float* q,
                     int64_t p0, int64_t T, int Hq, float scale, float* out,
                     AttentionScratch& scratch);

// Gathers rows `positions[0..n)` of one KV head into K[n,D], V[n,D].
void gather_kv(const KVPool& kv, int layer, const PageTable& pt, int head,
               const int32_t* positions, int64_t n, float* K, float* V);
// Gathers rows [0, n) of one KV head.
void gather_kv_prefix(const KVPool& kv, int layer, const PageTable& pt, int head, int64_t n,
                      float* K, float* V);

// ---- Decode attention over a sparse selection (docs/sparse.md) ----

// Gathers rows `positions[0..n)` of one KV head like gather_kv, copying each run of
// consecutive positions inside one page with a single memcpy (pages, windows).
void gather_kv_runs(const KVPool& kv, int layer, const PageTable& pt, int head,
                    const int32_t* positions, int64_t n, float* K, float* V);

// Attention of one decode token (query heads q [Hq, D], its K/V already in the cache) over
// exactly the rows `sel` names, read in place from the paged cache (no copy of the history):
// decode_attention_rows per KV head. out [Hq, D]. Every selection, dense or listed, runs the
// same arithmetic for the same rows, and attention_dense for T = 1 runs it too
// (bit-identical).
// `logits` (optional, only for a uniform selection of n rows per head): receives the
// scaled scores q.k*scale [Hq, n] before the softmax, column j = j-th selected row.
void attention_selected(const KVPool& kv, int layer, const PageTable& pt, const float* q, int Hq,
                        float scale, const sparse::Selection& sel, float* out,
                        AttentionScratch& scratch, float* logits = nullptr);

// The decode kernel: the G query heads of KV head `head` (q [G, D]) attend rows i in [0, n)
// of the cache, row i at position positions[i] (positions null: position i), with exact
// softmax in fp32 (sums in double). Rows are taken in fixed chunks of kDecodeChunk (scores,
// their max, exp, the weighted V sum per chunk), then the chunks merge in order, so the result
// depends only on the rows, never on the thread count. Chunks of all heads are spread over
// ThreadPool::global(). `logits` (optional) receives the scaled scores [G, n] per head at
// logits + head * G * ld.
constexpr int64_t kDecodeChunk = 128;
void decode_attention(const KVPool& kv, int layer, const PageTable& pt, const float* q, int Hq,
                      float scale, const sparse::Selection& sel, float* out,
                      AttentionScratch& scratch, float* logits = nullptr);

// Measurement, not attention: the true full-attention softmax weights w [Hq, L] of one
// decode query over every cached position [0, L) of `pt`. Used by the oracle methods and
// recall counters only when asked; independent of the attention that produces outputs.
void attention_weights_full(const KVPool& kv, int layer, const PageTable& pt, const float* q,
                            int Hq, float scale, int64_t L, float* w, AttentionScratch& scratch);

}  // namespace spade::cpu
