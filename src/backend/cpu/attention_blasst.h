// BLASST (Yuan et al., "Dynamic blocked attention sparsity via softmax thresholding",
// Algorithm 1) on the CPU: FlashAttention-style online softmax over tiles of keys, with
// the skip rule
//     skip tile j  <=>  for every row r that sees a key of the tile:
//                       m~_r(j) - m_r(j) < ln(lambda),   m_r(j) = max(m_r(j-1), m~_r(j))
// (m~ = the row's max score in the tile, m = running row max). A skipped tile costs only its
// scores (q.k, the keys are read): no exp, no row sum, no P.V and, in decode, no V read.
// lambda = 0 (ln = -inf) never skips, i.e. exact attention. lambda must be <= 1 (ln <= 0):
// then the tile holding a row's running maximum is never skipped, so every row keeps at
// least one tile and its normalizer is positive.
//
// Layout and work: decode gathers the K rows of the selected positions for one KV head
// (n x D floats, the same K traffic as dense attention over the selection), computes the
// G x n scores with one GEMM, and walks the tiles; a kept tile gathers its V rows (tile x D)
// and adds P.V. So V traffic = (1 - sparsity) of the dense V traffic, and exp work likewise.
// Prefill (dense causal, every method) walks, per query head and block of `q_block` query
// rows, the causal key tiles of `tile` keys; V rows are read from the gathered prefix
// (paper section 4.1: prefill skips softmax and P.V, V loads may stay).
//
// GQA: decode decides per tile for the whole group (the G query heads of a KV head are the
// rows, as a GQA decode kernel packs them); prefill decides per query head and row block
// (as a FlashAttention-3 prefill CTA, 128 query rows of one head).
#pragma once
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kv/kv_pool.h"
#include "sparse/selection.h"

namespace spade::cpu {

// Order in which a row block visits its key tiles (the paper's reordering ablation, sec. 5.6).
enum class TileOrder {
  Sequential,  // 0, 1, ..., n-1 (FlashAttention's order; the paper's default)
  Reverse,     // n-1, ..., 0 (the paper's "reordered cummax": recent tiles first)
  SinkRecent,  // first (sink) tile, last (recent) tile, then 1, ..., n-2
};
const char* tile_order_name(TileOrder o);
// "sequential" | "reverse" | "sink_recent"; throws spade::Error otherwise.
TileOrder parse_tile_order(const std::string& s);

struct BlasstParams {
  float log_lambda = -INFINITY;  // ln(lambda); -inf (lambda = 0): never skip
  int64_t tile = 64;             // keys per tile
  TileOrder order = TileOrder::Sequential;
  // Optional per-row initial running max (M floats): the skip test then starts from scores
  // seen elsewhere (the GPU decode seeds each warp with the sequence's first and last chunk).
  // Decisions only; the softmax of the kept tiles stays exact.
  const float* init_max = nullptr;
};

// Tiles processed / skipped by one call (a tile = one row block x one key tile).
struct TileCounts {
  int64_t tiles = 0, skipped = 0;
  TileCounts& operator+=(const TileCounts& o) {
    tiles += o.tiles;
    skipped += o.skipped;
    return *this;
  }
};

// Optional per-call traces, for tests and calibration. Tiles are numbered by key position
// (tile j holds keys [j*tile, (j+1)*tile) of the row block), not by visiting order.
struct BlasstTrace {
  std::vector<uint8_t>* skipped = nullptr;  // appended: 1/0 per counted tile, in tile order
  // Appended per counted tile: g = max over rows of (m~ - m), the largest lambda that would
  // have skipped it is exp(g). A tile is skipped iff g < ln(lambda); because a skipped tile
  // never moves the running max (lambda <= 1), g does not depend on lambda, so one pass
  // gives the skip decision of every lambda (calibration).
  std::vector<float>* gaps = nullptr;
};

struct BlasstScratch {
  std::vector<float> k, v, s, q, o, m, l, tm, gap;
  std::vector<int64_t> lim, order;
  std::vector<uint8_t> flag;
  template <typename T>
  static T* ensure(std::vector<T>& b, size_t n) {
    if (b.size() < n) b.resize(n);
    return b.data();
  }
};

// Returns V rows [start, start + len) of the row block's keys (len x D, contiguous).
using VRowsFn = std::function<const float*(int64_t start, int64_t len)>;

// The core loop over one row block. S: scaled scores, row r at S + r*s_stride, columns
// [0, n). limit[r] (nullable: n for every row): row r sees columns [0, limit[r]) (causal).
// Writes the normalized output row r to O + r*o_stride (D floats). Rows that see no key
// at all get zeros. S is overwritten (kept tiles hold exp values afterwards).
TileCounts blasst_rows(float* S, int64_t s_stride, int64_t M, int64_t n, const int64_t* limit,
                       int64_t D, const BlasstParams& p, const VRowsFn& v_rows, float* O,
                       int64_t o_stride, BlasstScratch& sc, const BlasstTrace* trace = nullptr);

// Decode: one token's query heads q [Hq, D] (its K/V already cached) over exactly the rows
// of `sel`, skipping tiles of the selected rows. log_lambda[h] is the threshold of KV head
// h (lambda may depend on the head's selected count). counts[h] receives head h's tiles.
void attention_blasst_decode(const KVPool& kv, int layer, const PageTable& pt, const float* q,
                             int Hq, float scale, const sparse::Selection& sel,
                             const float* log_lambda, int64_t tile, TileOrder order, float* out,
                             BlasstScratch& sc, TileCounts* counts,
                             const BlasstTrace* trace = nullptr);

// Prefill: dense causal attention of T new tokens at [p0, p0 + T) (K/V cached), q and out
// [T, Hq, D], with BLASST skipping per (query head, block of q_block rows, key tile).
// counts[g] (g < Hq) accumulates query head g's tiles (only causally visible tiles count).
void attention_blasst_prefill(const KVPool& kv, int layer, const PageTable& pt, const float* q,
                              int64_t p0, int64_t T, int Hq, float scale, float log_lambda,
                              int64_t tile, int64_t q_block, TileOrder order, float* out,
                              BlasstScratch& sc, TileCounts* counts,
                              const BlasstTrace* trace = nullptr);

}  // namespace spade::cpu
