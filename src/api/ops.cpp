// spade's kernels as free functions on raw buffers (ops.h): the CPU reference paths and the
// argument checks both devices share (ops_checks.h); the CUDA entry points are in ops_cuda.cpp.
#include "api/ops.h"
#include "api/ops_checks.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <limits>

#include "backend/cpu/attention.h"
#include "core/error.h"
#include "core/half.h"
#include "kv/int4_keys.h"
#include "sparse/methods/quest.h"
#include "sparse/methods/twilight.h"
#include "sparse/topk.h"


namespace spade::api::ops {
namespace {

size_t dsize(DType dt) { return dt == DType::F32 ? 4 : 2; }

// n elements of dtype dt at src -> fp32.
void load(DType dt, const void* src, int64_t n, float* dst) {
  if (dt == DType::F32) {
    std::memcpy(dst, src, sizeof(float) * size_t(n));
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
  }
}

void store(DType dt, const float* src, int64_t n, void* dst) {
  if (dt == DType::F32) {
    std::memcpy(dst, src, sizeof(float) * size_t(n));
  } else {
    uint16_t* d = static_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(src[i]);
  }
}

}  // namespace

namespace detail {
int64_t pages_of(int64_t len, int P) { return (len + P - 1) / P; }

void check_paged(const Paged& kv) {
  SPADE_CHECK(kv.B >= 0 && kv.Hkv > 0 && kv.P > 0 && kv.D > 0, "paged KV: bad sizes (B ", kv.B,
              ", Hkv ", kv.Hkv, ", page_size ", kv.P, ", D ", kv.D, ")");
  SPADE_CHECK(kv.indptr[0] == 0, "kv_indptr[0] must be 0 (got ", kv.indptr[0], ")");
  for (int b = 0; b < kv.B; ++b) {
    const int64_t n = int64_t(kv.indptr[b + 1]) - kv.indptr[b];
    SPADE_CHECK(n >= 0, "kv_indptr must be non-decreasing (kv_indptr[", b + 1, "] = ",
                kv.indptr[b + 1], " < kv_indptr[", b, "] = ", kv.indptr[b], ")");
    SPADE_CHECK(kv.lens[b] >= 1, "kv_lens[", b, "] = ", kv.lens[b], ": a request needs >= 1 token");
    SPADE_CHECK(pages_of(kv.lens[b], kv.P) <= n, "request ", b, " holds ", kv.lens[b],
                " tokens but has ", n, " pages of ", kv.P);
    for (int64_t i = kv.indptr[b]; i < kv.indptr[b + 1]; ++i)
      SPADE_CHECK(kv.indices[i] >= 0 && kv.indices[i] < kv.n_pages, "kv_indices[", i, "] = ",
                  kv.indices[i], " is outside the cache's ", kv.n_pages, " pages");
  }
}

void check_starts(const int32_t* starts, int32_t n_starts, int64_t L) {
  SPADE_CHECK(n_starts >= 2, "chunk_starts needs at least 2 entries (one chunk)");
  SPADE_CHECK(starts[0] >= 0, "chunk_starts[0] = ", starts[0], " is negative");
  for (int32_t c = 0; c + 1 < n_starts; ++c)
    SPADE_CHECK(starts[c + 1] > starts[c], "chunk_starts must increase strictly (chunk_starts[",
                c + 1, "] = ", starts[c + 1], " after ", starts[c], ")");
  SPADE_CHECK(starts[n_starts - 1] <= L, "chunk_starts[-1] = ", starts[n_starts - 1],
              " is past the keys' ", L, " positions");
}
}  // namespace detail

using namespace detail;

namespace {

// Tokens entry e of a list names for a request of `len` tokens: [lo, hi).
void entry_span(int32_t e, int gran, int64_t len, int64_t& lo, int64_t& hi) {
  lo = int64_t(e) * gran;
  hi = std::min<int64_t>(lo + gran, len);
}

void check_lists(const Paged& kv, const Lists& l) {
  SPADE_CHECK(l.lists_per_req == kv.Hkv || l.lists_per_req == 1, "lists per request must be ",
              kv.Hkv, " (one per KV head) or 1 (shared), not ", l.lists_per_req);
  SPADE_CHECK(l.gran >= 1, "list granularity must be >= 1 token");
  const int64_t n_lists = int64_t(kv.B) * l.lists_per_req;
  SPADE_CHECK(l.off[0] == 0, "sel_indptr[0] must be 0 (got ", l.off[0], ")");
  for (int64_t i = 0; i < n_lists; ++i) {
    const int b = int(i / l.lists_per_req);
    SPADE_CHECK(l.off[i + 1] > l.off[i], "selection list ", i, " (request ", b, ", ",
                l.lists_per_req == 1 ? "shared" : cat("KV head ", i % l.lists_per_req),
                ") is empty (sel_indptr[", i, "] = ", l.off[i], ", sel_indptr[", i + 1,
                "] = ", l.off[i + 1], ")");
    for (int64_t j = l.off[i]; j < l.off[i + 1]; ++j) {
      int64_t lo, hi;
      entry_span(l.idx[j], l.gran, kv.lens[b], lo, hi);
      SPADE_CHECK(l.idx[j] >= 0 && lo < hi, "sel_indices[", j, "] = ", l.idx[j],
                  " is outside request ", b, "'s ", kv.lens[b], " tokens",
                  l.gran > 1 ? cat(" (entries of ", l.gran, " tokens)") : std::string());
    }
  }
}

// Address of token t's row (KV head h) of request b.
const char* row(const void* base, const Paged& kv, int b, int h, int64_t t, DType dt) {
  const int64_t page = kv.indices[kv.indptr[b] + t / kv.P];
  const int64_t el = ((page * kv.Hkv + h) * kv.P + t % kv.P) * kv.D;
  return static_cast<const char*>(base) + el * int64_t(dsize(dt));
}

}  // namespace

bool have_cuda() {
#if SPADE_HAVE_CUDA
  return true;
#else
  return false;
#endif
}

void cpu_attention(DType dt, const void* q, int Hq, const Paged& kv, const Lists* lists,
                   float scale, void* out) {
  check_paged(kv);
  SPADE_CHECK(Hq > 0 && Hq % kv.Hkv == 0, "query heads (", Hq,
              ") must be a multiple of the KV heads (", kv.Hkv, ")");
  if (lists) check_lists(kv, *lists);
  const int G = Hq / kv.Hkv, D = kv.D;
  const size_t es = dsize(dt);
  std::vector<int32_t> pos;
  const size_t gd = static_cast<size_t>(G) * static_cast<size_t>(D);
  std::vector<float> K, V, Q(gd), O(gd), S;
  std::vector<int64_t> limit(static_cast<size_t>(G));
  for (int b = 0; b < kv.B; ++b) {
    const int64_t len = kv.lens[b];
    for (int h = 0; h < kv.Hkv; ++h) {
      pos.clear();
      if (!lists) {
        for (int64_t t = 0; t < len; ++t) pos.push_back(int32_t(t));
      } else {
        const int64_t li = int64_t(b) * lists->lists_per_req + (lists->lists_per_req == 1 ? 0 : h);
        for (int64_t j = lists->off[li]; j < lists->off[li + 1]; ++j) {
          int64_t lo, hi;
          entry_span(lists->idx[j], lists->gran, len, lo, hi);
          for (int64_t t = lo; t < hi; ++t) pos.push_back(int32_t(t));
        }
      }
      const int64_t n = int64_t(pos.size());
      K.resize(size_t(n * D));
      V.resize(size_t(n * D));
      S.resize(size_t(n * G));
      for (int64_t i = 0; i < n; ++i) {
        load(dt, row(kv.k, kv, b, h, pos[size_t(i)], dt), D, K.data() + i * D);
        load(dt, row(kv.v, kv, b, h, pos[size_t(i)], dt), D, V.data() + i * D);
      }
      const size_t qoff = (size_t(b) * Hq + size_t(h) * G) * D;
      load(dt, static_cast<const char*>(q) + qoff * es, int64_t(G) * D, Q.data());
      std::fill(limit.begin(), limit.end(), n);
      cpu::attend_gathered(Q.data(), K.data(), V.data(), limit.data(), G, n, D, scale, S.data(),
                           O.data());
      store(dt, O.data(), int64_t(G) * D, static_cast<char*>(out) + qoff * es);
    }
  }
}

void cpu_quest_meta(DType dt, const void* k, int64_t n_pages, int Hkv, int P, int D,
                    const int32_t* page_ids, const int32_t* n_valid, int n, void* meta) {
  const size_t es = dsize(dt);
  const size_t nd = static_cast<size_t>(D);
  std::vector<float> row_f(nd), mn(nd), mx(nd);
  for (int i = 0; i < n; ++i) {
    SPADE_CHECK(page_ids[i] >= 0 && page_ids[i] < n_pages, "page_ids[", i, "] = ", page_ids[i],
                " is outside the cache's ", n_pages, " pages");
    SPADE_CHECK(n_valid[i] >= 0 && n_valid[i] <= P, "n_valid[", i, "] = ", n_valid[i],
                " is outside [0, ", P, "]");
    for (int h = 0; h < Hkv; ++h) {
      std::fill(mn.begin(), mn.end(), INFINITY);
      std::fill(mx.begin(), mx.end(), -INFINITY);
      for (int r = 0; r < n_valid[i]; ++r) {
        const int64_t el = ((int64_t(page_ids[i]) * Hkv + h) * P + r) * D;
        load(dt, static_cast<const char*>(k) + el * int64_t(es), D, row_f.data());
        for (int d = 0; d < D; ++d) {
          mn[size_t(d)] = std::min(mn[size_t(d)], row_f[size_t(d)]);
          mx[size_t(d)] = std::max(mx[size_t(d)], row_f[size_t(d)]);
        }
      }
      char* m = static_cast<char*>(meta) + (int64_t(page_ids[i]) * Hkv + h) * 2 * D * int64_t(es);
      store(dt, mn.data(), D, m);
      store(dt, mx.data(), D, m + int64_t(D) * int64_t(es));
    }
  }
}

void cpu_quest_select(DType dt, const void* q, int Hq, const void* meta, const Paged& kv,
                      int k_pages, int32_t* sel_off, int32_t* sel_idx) {
  check_paged(kv);
  SPADE_CHECK(Hq > 0 && Hq % kv.Hkv == 0, "query heads (", Hq,
              ") must be a multiple of the KV heads (", kv.Hkv, ")");
  SPADE_CHECK(k_pages >= 1, "quest_select: k_pages must be >= 1 (got ", k_pages, ")");
  const int G = Hq / kv.Hkv, D = kv.D;
  const size_t es = dsize(dt);
  const size_t nd = static_cast<size_t>(D);
  std::vector<float> qf(nd * size_t(G)), mn(nd), mx(nd), score;
  std::vector<int32_t> top;
  int64_t w = 0;
  sel_off[0] = 0;
  for (int b = 0; b < kv.B; ++b) {
    const int64_t np = pages_of(kv.lens[b], kv.P);
    score.resize(size_t(np));
    for (int h = 0; h < kv.Hkv; ++h) {
      load(dt, static_cast<const char*>(q) + (size_t(b) * Hq + size_t(h) * G) * D * es,
           int64_t(G) * D, qf.data());
      if (np <= k_pages) {
        for (int64_t i = 0; i < np; ++i) sel_idx[w++] = int32_t(i);
      } else {
        for (int64_t i = 0; i + 1 < np; ++i) {  // the last page is always taken
          const int64_t page = kv.indices[kv.indptr[b] + i];
          const char* m = static_cast<const char*>(meta) + (page * kv.Hkv + h) * 2 * D * int64_t(es);
          load(dt, m, D, mn.data());
          load(dt, m + int64_t(D) * int64_t(es), D, mx.data());
          float s = -INFINITY;
          for (int g = 0; g < G; ++g)
            s = std::max(s, sparse::quest_page_bound(qf.data() + int64_t(g) * D, mn.data(),
                                                     mx.data(), D));
          score[size_t(i)] = s;
        }
        const int64_t k = sparse::top_k_range(score.data(), 0, int32_t(np - 1), k_pages - 1, top);
        std::sort(top.begin(), top.begin() + k);
        for (int64_t j = 0; j < k; ++j) sel_idx[w++] = top[size_t(j)];
        sel_idx[w++] = int32_t(np - 1);
      }
      sel_off[int64_t(b) * kv.Hkv + h + 1] = int32_t(w);
    }
  }
}

void cpu_topk_rows(const float* scores, int64_t ld, const int32_t* n, int n_rows, int64_t k,
                   int32_t* sel_off, int32_t* sel_idx) {
  SPADE_CHECK(k >= 1, "top-k: k must be >= 1 (got ", k, ")");
  std::vector<int32_t> top;
  int64_t w = 0;
  sel_off[0] = 0;
  for (int r = 0; r < n_rows; ++r) {
    SPADE_CHECK(n[r] >= 0 && n[r] <= ld, "top-k: row ", r, " has ", n[r],
                " entries, outside [0, ", ld, "]");
    const int64_t got = sparse::top_k_range(scores + int64_t(r) * ld, 0, n[r], k, top);
    std::sort(top.begin(), top.begin() + got);
    for (int64_t j = 0; j < got; ++j) sel_idx[w++] = top[size_t(j)];
    sel_off[r + 1] = int32_t(w);
  }
}

void cpu_lessismore_select(const float* scores, int64_t ld, const int32_t* lens, int B, int Hq,
                           int64_t budget, int64_t n_recent, int64_t sinks, int32_t* sel_off,
                           int32_t* sel_idx) {
  const int64_t n_uni = budget - n_recent - sinks;
  SPADE_CHECK(n_recent >= 0 && sinks >= 0 && n_uni >= 1, "lessismore_select: budget (", budget,
              ") must exceed n_recent (", n_recent, ") + sinks (", sinks, ")");
  std::vector<int32_t> top, lists, uni;
  std::vector<uint8_t> mark;
  int64_t w = 0;
  sel_off[0] = 0;
  for (int b = 0; b < B; ++b) {
    const int64_t L = lens[b];
    SPADE_CHECK(L >= 1 && L <= ld, "lessismore_select: kv_lens[", b, "] = ", L,
                " is outside [1, ", ld, "] (the scores' last dimension)");
    if (L <= budget) {
      for (int64_t p = 0; p < L; ++p) sel_idx[w++] = int32_t(p);
      sel_off[b + 1] = int32_t(w);
      continue;
    }
    const int64_t hi = L - n_recent;
    // Per query head: its top n_uni of [sinks, hi), rank order.
    lists.assign(size_t(Hq * n_uni), 0);
    int64_t k = 0;
    for (int hq = 0; hq < Hq; ++hq) {
      k = sparse::top_k_range(scores + (int64_t(b) * Hq + hq) * ld, int32_t(sinks), int32_t(hi),
                              n_uni, top);
      std::copy_n(top.begin(), k, lists.begin() + int64_t(hq) * n_uni);
    }
    // Merge by (rank within head, head), without duplicates.
    mark.assign(size_t(L), 0);
    uni.clear();
    for (int64_t r = 0; r < k && int64_t(uni.size()) < n_uni; ++r)
      for (int hq = 0; hq < Hq && int64_t(uni.size()) < n_uni; ++hq) {
        const int32_t p = lists[size_t(int64_t(hq) * n_uni + r)];
        if (!mark[size_t(p)]) {
          mark[size_t(p)] = 1;
          uni.push_back(p);
        }
      }
    std::sort(uni.begin(), uni.end());
    for (int64_t p = 0; p < sinks; ++p) sel_idx[w++] = int32_t(p);
    for (int32_t p : uni) sel_idx[w++] = p;
    for (int64_t p = hi; p < L; ++p) sel_idx[w++] = int32_t(p);
    sel_off[b + 1] = int32_t(w);
  }
}

void cpu_twilight_prune(DType dt, const void* q, int Hq, const Paged& kv, const Lists& lists,
                        double p, double eps, float scale, int32_t* kept_off, int32_t* kept_idx) {
  check_paged(kv);
  SPADE_CHECK(Hq > 0 && Hq % kv.Hkv == 0, "query heads (", Hq,
              ") must be a multiple of the KV heads (", kv.Hkv, ")");
  SPADE_CHECK(lists.lists_per_req == kv.Hkv, "twilight_prune needs one list per (request, KV "
              "head): ", int64_t(kv.B) * kv.Hkv + 1, " sel_indptr entries");
  SPADE_CHECK(kv.D % 2 == 0, "twilight_prune: head dim ", kv.D, " must be even (INT4 pairs)");
  SPADE_CHECK(p > 0 && p <= 1 && eps > 0, "twilight_prune: p must be in (0, 1] and eps > 0");
  check_lists(kv, lists);
  const int G = Hq / kv.Hkv, D = kv.D;
  const size_t es = dsize(dt);
  std::vector<int32_t> pos;
  std::vector<float> qf(static_cast<size_t>(G) * static_cast<size_t>(D)), qs(static_cast<size_t>(G));
  std::vector<float> krow(static_cast<size_t>(D)), w;
  std::vector<uint8_t> code(static_cast<size_t>(D / 2)), mark;
  int64_t wr = 0;
  kept_off[0] = 0;
  for (int b = 0; b < kv.B; ++b) {
    const int64_t len = kv.lens[b];
    for (int h = 0; h < kv.Hkv; ++h) {
      const int64_t li = int64_t(b) * kv.Hkv + h;
      pos.clear();
      for (int64_t j = lists.off[li]; j < lists.off[li + 1]; ++j) {
        int64_t lo, hi;
        entry_span(lists.idx[j], lists.gran, len, lo, hi);
        for (int64_t t = lo; t < hi; ++t) pos.push_back(int32_t(t));
      }
      const int64_t n = int64_t(pos.size());
      load(dt, static_cast<const char*>(q) + (size_t(b) * Hq + size_t(h) * G) * D * es,
           int64_t(G) * D, qf.data());
      for (int g = 0; g < G; ++g) {
        float s = 0;
        for (int d = 0; d < D; ++d) s += qf[size_t(g * D + d)];
        qs[size_t(g)] = s;
      }
      w.resize(size_t(G) * size_t(n));
      for (int64_t i = 0; i < n; ++i) {
        load(dt, row(kv.k, kv, b, h, pos[size_t(i)], dt), D, krow.data());
        uint16_t sc16, z16;
        int4_quantize_row(krow.data(), D, code.data(), &sc16, &z16);
        const float sc = f16_to_f32(sc16), z = f16_to_f32(z16);
        for (int g = 0; g < G; ++g)
          w[size_t(g * n + i)] = scale * int4_dot(qf.data() + g * D, qs[size_t(g)], code.data(), sc, z, D);
      }
      mark.assign(size_t(n), 0);
      for (int g = 0; g < G; ++g) {
        float* r = w.data() + int64_t(g) * n;
        sparse::softmax_weights(r, n);
        const float t = sparse::topp_binary_search(r, n, p, eps).threshold;
        for (int64_t i = 0; i < n; ++i) mark[size_t(i)] |= r[i] >= t;
      }
      for (int64_t i = 0; i < n; ++i)
        if (mark[size_t(i)]) kept_idx[wr++] = pos[size_t(i)];
      kept_off[li + 1] = int32_t(wr);
    }
  }
}


void ClusterIndexOp::build(const float* keys, int64_t L, int D, const int32_t* starts,
                           int32_t n_chunks, const sparse::ClusterIndexOptions& opt) {
  SPADE_CHECK(D > 0, "ClusterIndex: head dim must be positive");
  check_starts(starts, n_chunks + 1, L);
  ix_.build(D, [&](int64_t pos) { return keys + pos * D; }, starts, n_chunks, opt);
}

void ClusterIndexOp::insert(const float* keys, int64_t L, int D, const int32_t* starts,
                            int32_t n_starts) {
  SPADE_CHECK(ix_.built(), "ClusterIndex.insert before build");
  SPADE_CHECK(D == ix_.D(), "ClusterIndex.insert: head dim ", D, " differs from the index's ", ix_.D());
  SPADE_CHECK(n_starts == ix_.n_chunks() + 2, "ClusterIndex.insert: chunk_starts must have ",
              ix_.n_chunks() + 2, " entries (the built chunks and the new one), not ", n_starts);
  check_starts(starts, n_starts, L);
  ix_.insert([&](int64_t pos) { return keys + pos * D; }, starts, ix_.n_chunks());
}

std::vector<int32_t> ClusterIndexOp::search(const float* q, int G, int D,
                                            const sparse::SearchParams& p, const int32_t* starts,
                                            int32_t n_starts) const {
  SPADE_CHECK(ix_.built(), "ClusterIndex.search before build");
  SPADE_CHECK(D == ix_.D(), "ClusterIndex.search: head dim ", D, " differs from the index's ", ix_.D());
  SPADE_CHECK(G >= 1, "ClusterIndex.search: no query head");
  SPADE_CHECK(n_starts == ix_.n_chunks() + 1, "ClusterIndex.search: chunk_starts must have ",
              ix_.n_chunks() + 1, " entries, not ", n_starts);
  check_starts(starts, n_starts, INT32_MAX);
  std::vector<int32_t> chunks;
  sparse::SearchScratch scratch;
  ix_.search(q, G, p, starts, chunks, nullptr, scratch);
  std::sort(chunks.begin(), chunks.end());
  std::vector<int32_t> pos;
  for (int32_t c : chunks)
    for (int32_t t = starts[c]; t < starts[c + 1]; ++t) pos.push_back(t);
  return pos;
}

}  // namespace spade::api::ops
