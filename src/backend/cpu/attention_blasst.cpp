#include "backend/cpu/attention_blasst.h"

#include <cblas.h>

#include <algorithm>
#include <cstring>

#include "backend/cpu/attention.h"
#include "core/error.h"

namespace spade::cpu {

const char* tile_order_name(TileOrder o) {
  switch (o) {
    case TileOrder::Sequential: return "sequential";
    case TileOrder::Reverse: return "reverse";
    case TileOrder::SinkRecent: return "sink_recent";
  }
  return "?";
}

TileOrder parse_tile_order(const std::string& s) {
  if (s == "sequential") return TileOrder::Sequential;
  if (s == "reverse") return TileOrder::Reverse;
  if (s == "sink_recent") return TileOrder::SinkRecent;
  fail("tile order '", s, "' is not one of sequential, reverse, sink_recent");
}

namespace {

void tile_visit_order(TileOrder o, int64_t nt, int64_t* ord) {
  switch (o) {
    case TileOrder::Sequential:
      for (int64_t j = 0; j < nt; ++j) ord[j] = j;
      break;
    case TileOrder::Reverse:
      for (int64_t j = 0; j < nt; ++j) ord[j] = nt - 1 - j;
      break;
    case TileOrder::SinkRecent: {
      int64_t i = 0;
      ord[i++] = 0;
      if (nt > 1) ord[i++] = nt - 1;
      for (int64_t j = 1; j + 1 < nt; ++j) ord[i++] = j;
      break;
    }
  }
}

// Copies rows [start, start + len) of the selection (positions, or the prefix when null) of
// one KV head into dst, one memcpy per run of consecutive positions inside a page.
void gather_rows(const KVPool& kv, int layer, const PageTable& pt, int head, const int32_t* pos,
                 int64_t start, int64_t len, bool keys, float* dst) {
  const int64_t D = kv.layout().head_dim, P = kv.layout().page_size;
  int64_t i = 0;
  while (i < len) {
    const int64_t p = pos ? pos[start + i] : start + i;
    int64_t run = 1;
    while (i + run < len && (p + run) % P != 0 &&
           (pos ? pos[start + i + run] == p + run : true))
      ++run;
    if (keys) kv.load_k(layer, pt, p, head, run, dst + i * D);
    else kv.load_v(layer, pt, p, head, run, dst + i * D);
    i += run;
  }
}

}  // namespace

TileCounts blasst_rows(float* S, int64_t ss, int64_t M, int64_t n, const int64_t* limit,
                       int64_t D, const BlasstParams& p, const VRowsFn& v_rows, float* O,
                       int64_t os, BlasstScratch& sc, const BlasstTrace* trace) {
  SPADE_CHECK(p.tile > 0, "blasst: tile must be positive");
  SPADE_CHECK(!(p.log_lambda > 0.f), "blasst: lambda must be <= 1 (ln lambda = ", p.log_lambda,
              ")");
  const int64_t tile = p.tile, nt = n / tile + (n % tile != 0);  // no overflow for any tile
  float* m = BlasstScratch::ensure(sc.m, size_t(M));
  float* l = BlasstScratch::ensure(sc.l, size_t(M));
  float* tm = BlasstScratch::ensure(sc.tm, size_t(M));
  int64_t* ord = BlasstScratch::ensure(sc.order, size_t(std::max<int64_t>(nt, 1)));
  uint8_t* flag = nullptr;  // per tile: 0 not visible, 1 kept, 2 skipped (traces only)
  float* gap = nullptr;
  if (trace) {
    flag = BlasstScratch::ensure(sc.flag, size_t(std::max<int64_t>(nt, 1)));
    gap = BlasstScratch::ensure(sc.gap, size_t(std::max<int64_t>(nt, 1)));
    std::fill_n(flag, nt, uint8_t(0));
  }
  tile_visit_order(p.order, nt, ord);
  for (int64_t r = 0; r < M; ++r) {
    m[r] = p.init_max ? p.init_max[r] : -INFINITY;
    l[r] = 0.f;
    std::fill_n(O + r * os, D, 0.f);
  }
  TileCounts c;
  for (int64_t it = 0; it < nt; ++it) {
    const int64_t j = ord[it], c0 = j * tile, c1 = c0 + std::min(tile, n - c0);
    // Skip decision (Algorithm 1, lines 5-9) from the tile's row maxima.
    bool visible = false, skip = true;
    float g = -INFINITY;
    for (int64_t r = 0; r < M; ++r) {
      const int64_t e = limit ? std::min(c1, limit[r]) : c1;
      if (e <= c0) {
        tm[r] = -INFINITY;
        continue;
      }
      visible = true;
      const float* row = S + r * ss;
      float x = row[c0];
      for (int64_t k = c0 + 1; k < e; ++k) x = std::max(x, row[k]);
      tm[r] = x;
      const float d = x - std::max(m[r], x);
      g = std::max(g, d);
      if (!(d < p.log_lambda)) skip = false;
    }
    if (!visible) continue;
    ++c.tiles;
    if (trace) {
      flag[j] = skip ? 2 : 1;
      gap[j] = g;
    }
    if (skip) {  // no exp, no row sum, no P.V, no V read; the running max does not move
      ++c.skipped;
      continue;
    }
    // Online softmax update (lines 10-12).
    for (int64_t r = 0; r < M; ++r) {
      float* row = S + r * ss;
      const int64_t e = limit ? std::max(c0, std::min(c1, limit[r])) : c1;
      if (e == c0) {
        std::fill(row + c0, row + c1, 0.f);
        continue;
      }
      const float mn = std::max(m[r], tm[r]);
      const float alpha = std::exp(m[r] - mn);
      if (alpha != 1.f) {
        l[r] *= alpha;
        float* o = O + r * os;
        for (int64_t d = 0; d < D; ++d) o[d] *= alpha;
      }
      float sum = 0.f;
      for (int64_t k = c0; k < e; ++k) sum += (row[k] = std::exp(row[k] - mn));
      std::fill(row + e, row + c1, 0.f);
      l[r] += sum;
      m[r] = mn;
    }
    const float* V = v_rows(c0, c1 - c0);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(M), int(D), int(c1 - c0), 1.f,
                S + c0, int(ss), V, int(D), 1.f, O, int(os));
  }
  for (int64_t r = 0; r < M; ++r) {
    if (!(l[r] > 0.f)) continue;  // the row saw no key: zeros
    const float inv = 1.f / l[r];
    float* o = O + r * os;
    for (int64_t d = 0; d < D; ++d) o[d] *= inv;
  }
  if (trace)
    for (int64_t j = 0; j < nt; ++j) {
      if (!flag[j]) continue;
      if (trace->skipped) trace->skipped->push_back(flag[j] == 2);
      if (trace->gaps) trace->gaps->push_back(gap[j]);
    }
  return c;
}

void attention_blasst_decode(const KVPool& kv, int layer, const PageTable& pt, const float* q,
                             int Hq, float scale, const sparse::Selection& sel,
                             const float* log_lambda, int64_t tile, TileOrder order, float* out,
                             BlasstScratch& sc, TileCounts* counts, const BlasstTrace* trace) {
  const int Hkv = kv.layout().n_kv_heads;
  const int64_t D = kv.layout().head_dim;
  const int G = Hq / Hkv;
  // (pt.length may lag: the layer loop bumps it after the last layer.)
  SPADE_CHECK(sel.n_kv_heads == Hkv && sel.length <= pt.capacity(kv.layout().page_size),
              "blasst decode: selection for ", sel.n_kv_heads, " heads / ", sel.length,
              " tokens, cache has ", Hkv, " heads / ", pt.capacity(kv.layout().page_size),
              " token slots");
  SPADE_CHECK(tile > 0, "blasst decode: tile ", tile, " must be positive");
  int64_t max_n = 1;
  for (int h = 0; h < Hkv; ++h) max_n = std::max(max_n, sel.count(h));
  float* K = BlasstScratch::ensure(sc.k, size_t(max_n * D));
  // A tile never holds more than the selected rows: the V buffer is bounded by the selection,
  // whatever `tile` is (so tile * D cannot overflow).
  float* Vt = BlasstScratch::ensure(sc.v, size_t(std::min(tile, max_n) * D));
  float* S = BlasstScratch::ensure(sc.s, size_t(G * max_n));
  for (int h = 0; h < Hkv; ++h) {
    const int64_t n = sel.count(h);
    SPADE_CHECK(n > 0, "blasst decode: KV head ", h, " of layer ", layer, " selects no token");
    const int32_t* pos = sel.head(h);  // nullptr: the prefix [0, n)
    gather_rows(kv, layer, pt, h, pos, 0, n, true, K);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, G, int(n), int(D), scale,
                q + int64_t(h) * G * D, int(D), K, int(D), 0.f, S, int(n));
    // V rows are read here, only for the tiles that are kept.
    VRowsFn v_rows = [&](int64_t start, int64_t len) -> const float* {
      gather_rows(kv, layer, pt, h, pos, start, len, false, Vt);
      return Vt;
    };
    BlasstParams p{log_lambda[h], tile, order};
    TileCounts tc = blasst_rows(S, n, G, n, nullptr, D, p, v_rows, out + int64_t(h) * G * D, D,
                                sc, trace);
    if (counts) counts[h] = tc;
  }
}

void attention_blasst_prefill(const KVPool& kv, int layer, const PageTable& pt, const float* q,
                              int64_t p0, int64_t T, int Hq, float scale, float log_lambda,
                              int64_t tile, int64_t q_block, TileOrder order, float* out,
                              BlasstScratch& sc, TileCounts* counts, const BlasstTrace* trace) {
  const int Hkv = kv.layout().n_kv_heads;
  const int64_t D = kv.layout().head_dim;
  const int G = Hq / Hkv;
  const int64_t L = p0 + T;
  SPADE_CHECK(L <= pt.capacity(kv.layout().page_size), "blasst prefill: ", L,
              " tokens, cache has ", pt.capacity(kv.layout().page_size), " token slots");
  SPADE_CHECK(q_block > 0, "blasst prefill: q_block must be positive");
  float* K = BlasstScratch::ensure(sc.k, size_t(L * D));
  float* V = BlasstScratch::ensure(sc.v, size_t(L * D));
  const BlasstParams p{log_lambda, tile, order};
  VRowsFn v_rows = [&](int64_t start, int64_t) -> const float* { return V + start * D; };
  for (int h = 0; h < Hkv; ++h) {
    gather_kv_prefix(kv, layer, pt, h, L, K, V);
    for (int64_t t0 = 0; t0 < T; t0 += q_block) {
      const int64_t tb = std::min(q_block, T - t0), M = tb * G, Lb = p0 + t0 + tb;
      float* Q = BlasstScratch::ensure(sc.q, size_t(M * D));
      float* O = BlasstScratch::ensure(sc.o, size_t(M * D));
      float* S = BlasstScratch::ensure(sc.s, size_t(M * Lb));
      int64_t* lim = BlasstScratch::ensure(sc.lim, size_t(tb));
      for (int64_t t = 0; t < tb; ++t) {
        std::memcpy(Q + t * G * D, q + ((t0 + t) * Hq + h * G) * D, sizeof(float) * size_t(G * D));
        lim[t] = p0 + t0 + t + 1;
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(M), int(Lb), int(D), scale, Q,
                  int(D), K, int(D), 0.f, S, int(Lb));
      // Rows of query head g are t*G + g: stride G*Lb in S and G*D in O.
      for (int g = 0; g < G; ++g) {
        TileCounts tc = blasst_rows(S + g * Lb, G * Lb, tb, Lb, lim, D, p, v_rows, O + g * D,
                                    G * D, sc, trace);
        if (counts) counts[h * G + g] += tc;
      }
      for (int64_t t = 0; t < tb; ++t)
        std::memcpy(out + ((t0 + t) * Hq + h * G) * D, O + t * G * D, sizeof(float) * size_t(G * D));
    }
  }
}

}  // namespace spade::cpu
