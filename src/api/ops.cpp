// spade's kernels as free functions on raw buffers (ops.h): the CPU reference paths, and the
// CUDA kernels behind SPADE_HAVE_CUDA.
#include "api/ops.h"

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

#if SPADE_HAVE_CUDA
#include "backend/cuda/attention.h"
#include "backend/cuda/cluster_index.h"
#include "backend/cuda/cuda_common.h"
#include "backend/cuda/sparse_attention.h"
#include "backend/cuda/twilight.h"
#endif

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

// Pages of a request of `len` tokens.
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

namespace {
void check_starts(const int32_t* starts, int32_t n_starts, int64_t L) {
  SPADE_CHECK(n_starts >= 2, "chunk_starts needs at least 2 entries (one chunk)");
  SPADE_CHECK(starts[0] >= 0, "chunk_starts[0] = ", starts[0], " is negative");
  for (int32_t c = 0; c + 1 < n_starts; ++c)
    SPADE_CHECK(starts[c + 1] > starts[c], "chunk_starts must increase strictly (chunk_starts[",
                c + 1, "] = ", starts[c + 1], " after ", starts[c], ")");
  SPADE_CHECK(starts[n_starts - 1] <= L, "chunk_starts[-1] = ", starts[n_starts - 1],
              " is past the keys' ", L, " positions");
}
}  // namespace

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

// ---------------------------------------------------------------------------------------
#if SPADE_HAVE_CUDA
namespace {

// Makes `device` current for the scope (restores the caller's device after).
struct DeviceScope {
  int prev = 0;
  explicit DeviceScope(int device) {
    SPADE_CUDA(cudaGetDevice(&prev));
    if (prev != device) SPADE_CUDA(cudaSetDevice(device));
  }
  ~DeviceScope() {
    int cur = 0;
    if (cudaGetDevice(&cur) == cudaSuccess && cur != prev) cudaSetDevice(prev);
  }
};

cudaStream_t as_stream(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

void host_batch(const Paged& kv, std::vector<cuda::AttnSeq>& out) {
  check_paged(kv);
  out.resize(size_t(kv.B));
  for (int b = 0; b < kv.B; ++b) {
    cuda::AttnSeq& s = out[size_t(b)];
    s.pages = kv.indices + kv.indptr[b];
    s.n_pages = int(pages_of(kv.lens[b], kv.P));
    s.kv_len = kv.lens[b];
    s.q_len = 1;
  }
}

}  // namespace

struct CudaDecode::Impl {
  int device, max_batch, Hq, Hkv, D, P;
  int64_t max_pages;
  std::unique_ptr<cuda::DeviceArena> arena;
  std::unique_ptr<cuda::AttentionWorkspace> ws;
  std::vector<cuda::AttnSeq> seqs;
  int B = -1;
};

CudaDecode::CudaDecode(int device, int max_batch, int64_t max_pages, int Hq, int Hkv, int D, int P)
    : impl_(std::make_unique<Impl>()) {
  SPADE_CHECK(max_batch >= 1 && max_pages >= 1, "DecodeAttention: max_batch and max_pages must be >= 1");
  SPADE_CHECK(Hq > 0 && Hkv > 0 && Hq % Hkv == 0, "query heads (", Hq,
              ") must be a multiple of the KV heads (", Hkv, ")");
  DeviceScope ds(device);
  cuda::check_device_supported();
  Impl& m = *impl_;
  m.device = device, m.max_batch = max_batch, m.Hq = Hq, m.Hkv = Hkv, m.D = D, m.P = P;
  m.max_pages = max_pages;
  cuda::AttnLimits lim;
  lim.max_batch = max_batch;
  lim.max_q_tokens = max_batch;  // decode: one query token per request
  lim.max_pages = max_pages;
  m.arena = std::make_unique<cuda::DeviceArena>(cuda::AttentionWorkspace::arena_bytes(lim, Hq, Hkv, D));
  m.ws = std::make_unique<cuda::AttentionWorkspace>(*m.arena, lim, Hq, Hkv, D, P);
}

CudaDecode::~CudaDecode() {
  if (impl_) {
    DeviceScope ds(impl_->device);
    impl_->ws.reset();
    impl_->arena.reset();
  }
}

void CudaDecode::plan(const Paged& kv, uintptr_t stream) {
  Impl& m = *impl_;
  SPADE_CHECK(kv.B >= 1 && kv.B <= m.max_batch, "DecodeAttention.plan: batch ", kv.B,
              " is outside [1, max_batch = ", m.max_batch, "]");
  SPADE_CHECK(kv.Hkv == m.Hkv && kv.P == m.P && kv.D == m.D, "DecodeAttention.plan: KV shape differs from the constructor's");
  host_batch(kv, m.seqs);
  int64_t total = 0;
  for (const auto& s : m.seqs) total += s.n_pages;
  SPADE_CHECK(total <= m.max_pages, "DecodeAttention.plan: the batch reads ", total,
              " pages, more than max_pages = ", m.max_pages);
  DeviceScope ds(m.device);
  m.ws->plan(m.seqs, as_stream(stream));
  m.B = kv.B;
}

void CudaDecode::run(const void* q, const void* k, const void* v, void* out, float scale,
                     uintptr_t stream) const {
  const Impl& m = *impl_;
  SPADE_CHECK(m.B >= 1, "DecodeAttention.run before plan()");
  DeviceScope ds(m.device);
  m.ws->run(static_cast<const cuda::bf16*>(q), static_cast<const cuda::bf16*>(k),
            static_cast<const cuda::bf16*>(v), static_cast<cuda::bf16*>(out), scale,
            as_stream(stream));
}

int CudaDecode::batch() const { return impl_->B; }
size_t CudaDecode::arena_bytes() const { return impl_->arena->capacity(); }

struct CudaSparse::Impl {
  int device, max_batch, Hq, Hkv, D, P;
  int64_t max_pages;
  std::unique_ptr<cuda::DeviceArena> arena;
  std::unique_ptr<cuda::SparseAttention> sp;
  std::vector<cuda::SparseSeq> seqs;
  int B = -1;
};

CudaSparse::CudaSparse(int device, int max_batch, int64_t max_pages, int Hq, int Hkv, int D, int P)
    : impl_(std::make_unique<Impl>()) {
  SPADE_CHECK(max_batch >= 1 && max_pages >= 1, "SparseAttention: max_batch and max_pages must be >= 1");
  SPADE_CHECK(Hq > 0 && Hkv > 0 && Hq % Hkv == 0, "query heads (", Hq,
              ") must be a multiple of the KV heads (", Hkv, ")");
  DeviceScope ds(device);
  cuda::check_device_supported();
  Impl& m = *impl_;
  m.device = device, m.max_batch = max_batch, m.Hq = Hq, m.Hkv = Hkv, m.D = D, m.P = P;
  m.max_pages = max_pages;
  m.arena = std::make_unique<cuda::DeviceArena>(
      cuda::SparseAttention::arena_bytes(max_batch, max_pages, Hq, Hkv, D));
  m.sp = std::make_unique<cuda::SparseAttention>(*m.arena, max_batch, max_pages, Hq, Hkv, D, P);
}

CudaSparse::~CudaSparse() {
  if (impl_) {
    DeviceScope ds(impl_->device);
    impl_->sp.reset();
    impl_->arena.reset();
  }
}

void CudaSparse::plan(const Paged& kv, int gran, int lists_per_req,
                      const std::vector<int>& max_entries, uintptr_t stream) {
  Impl& m = *impl_;
  SPADE_CHECK(kv.B >= 1 && kv.B <= m.max_batch, "SparseAttention.plan: batch ", kv.B,
              " is outside [1, max_batch = ", m.max_batch, "]");
  SPADE_CHECK(kv.Hkv == m.Hkv && kv.P == m.P && kv.D == m.D, "SparseAttention.plan: KV shape differs from the constructor's");
  SPADE_CHECK(lists_per_req == m.Hkv || lists_per_req == 1, "lists per request must be ", m.Hkv,
              " or 1, not ", lists_per_req);
  SPADE_CHECK(int64_t(max_entries.size()) == int64_t(kv.B) * lists_per_req,
              "SparseAttention.plan: ", max_entries.size(), " list bounds for ",
              int64_t(kv.B) * lists_per_req, " lists");
  cuda::SelGran g;
  if (gran == 1) g = cuda::SelGran::Token;
  else if (gran == 16) g = cuda::SelGran::Chunk16;
  else if (gran == 64) g = cuda::SelGran::Block64;
  else fail("the CUDA sparse attention reads lists of tokens, 16-token or 64-token units, not ", gran, "-token units");
  check_paged(kv);
  m.seqs.resize(size_t(kv.B));
  int64_t total = 0;
  for (int b = 0; b < kv.B; ++b) {
    cuda::SparseSeq& s = m.seqs[size_t(b)];
    s.pages = kv.indices + kv.indptr[b];
    s.n_pages = int(pages_of(kv.lens[b], kv.P));
    s.kv_len = kv.lens[b];
    total += s.n_pages;
  }
  SPADE_CHECK(total <= m.max_pages, "SparseAttention.plan: the batch reads ", total,
              " pages, more than max_pages = ", m.max_pages);
  DeviceScope ds(m.device);
  m.sp->plan(m.seqs, g, lists_per_req, max_entries, nullptr, as_stream(stream));
  SPADE_CUDA(cudaStreamSynchronize(as_stream(stream)));
  m.B = kv.B;
}

void CudaSparse::run(const void* q, const void* k, const void* v, const int32_t* sel_off,
                     const int32_t* sel_idx, void* out, float scale, uintptr_t stream) const {
  const Impl& m = *impl_;
  SPADE_CHECK(m.B >= 1, "SparseAttention.run before plan()");
  DeviceScope ds(m.device);
  m.sp->run(static_cast<const cuda::bf16*>(q), static_cast<const cuda::bf16*>(k),
            static_cast<const cuda::bf16*>(v), sel_off, sel_idx, static_cast<cuda::bf16*>(out),
            scale, as_stream(stream));
}

int CudaSparse::batch() const { return impl_->B; }

void cuda_quest_meta(int device, const void* k, int Hkv, int P, int D, const int32_t* page_ids,
                     const int32_t* n_valid, int n, void* meta, uintptr_t stream) {
  if (n == 0) return;
  DeviceScope ds(device);
  cuda::quest_update_meta(static_cast<const cuda::bf16*>(k), static_cast<cuda::bf16*>(meta),
                          page_ids, n_valid, n, Hkv, P, D, as_stream(stream));
}

void cuda_quest_select(int device, const void* q, int Hq, const void* meta, const Paged& kv,
                       int max_pages, int k_pages, float* scores, int32_t* sel_off,
                       int32_t* sel_idx, uintptr_t stream) {
  SPADE_CHECK(kv.P == 16, "the CUDA quest_select works on pages of 16 tokens (page_size ", kv.P, ")");
  SPADE_CHECK(k_pages >= 1 && max_pages >= 1, "quest_select: k_pages and max_pages must be >= 1");
  DeviceScope ds(device);
  cuda::QuestArgs a{static_cast<const cuda::bf16*>(q), static_cast<const cuda::bf16*>(meta),
                    kv.indices, kv.indptr, kv.lens, scores, sel_idx, kv.B, Hq, kv.Hkv, kv.D,
                    max_pages, k_pages};
  a.csr_off = sel_off;
  cuda::quest_select(a, as_stream(stream));
}

void cuda_topk_rows(int device, const float* scores, int64_t ld, const int32_t* lens, int B,
                    int H, int k, int32_t* row_n, int32_t* strided, int32_t* sel_off,
                    int32_t* sel_idx, uintptr_t stream) {
  SPADE_CHECK(k >= 1, "top-k: k must be >= 1 (got ", k, ")");
  DeviceScope ds(device);
  cudaStream_t s = as_stream(stream);
  cuda::row_lengths(lens, B, H, row_n, s);
  cuda::topk_rows(scores, ld, row_n, B * H, k, strided, s);
  cuda::token_compact_lists(strided, lens, B, H, k, sel_off, sel_idx, s);
}

void cuda_twilight_prune(int device, const void* q, int Hq, const Paged& kv,
                         const int32_t* page_ids, const int32_t* n_valid, int n, uint8_t* codes,
                         uint32_t* sz, const int32_t* sel_off, const int32_t* sel_idx, int gran,
                         int max_slots, double p, double eps, float scale, int32_t* kept_off,
                         int32_t* kept_idx, uintptr_t stream) {
  SPADE_CHECK(gran == 1 || gran == 16, "the CUDA twilight_prune reads token lists or 16-token "
              "pages, not ", gran, "-token units");
  SPADE_CHECK(max_slots >= 1 && kv.B >= 1, "twilight_prune: bad sizes");
  DeviceScope ds(device);
  cudaStream_t s = as_stream(stream);
  if (n > 0)
    cuda::int4_quantize_pages(static_cast<const cuda::bf16*>(kv.k), codes, sz, page_ids, n_valid,
                              n, kv.Hkv, kv.P, kv.D, s);
  cuda::DeviceArena arena(cuda::TwilightPruner::arena_bytes(kv.B, Hq, kv.Hkv, max_slots));
  cuda::TwilightPruner pr(arena, kv.B, Hq, kv.Hkv, kv.D, kv.P, max_slots, p, eps);
  cuda::TwilightStep st;
  st.q = static_cast<const cuda::bf16*>(q);
  st.codes = codes;
  st.sz = sz;
  st.page_table = kv.indices, st.page_off = kv.indptr, st.kv_len = kv.lens;
  st.base_off = sel_off, st.base_idx = sel_idx;
  st.gran = gran == 1 ? cuda::SelGran::Token : cuda::SelGran::Chunk16;
  st.B = kv.B;
  st.scale = scale;
  pr.run(st, s);
  pr.compact(st, s);
  const size_t lists = size_t(kv.B) * size_t(kv.Hkv);
  SPADE_CUDA(cudaMemcpyAsync(kept_off, pr.kept_off(), sizeof(int32_t) * (lists + 1),
                             cudaMemcpyDeviceToDevice, s));
  SPADE_CUDA(cudaMemcpyAsync(kept_idx, pr.kept_idx(), sizeof(int32_t) * lists * size_t(max_slots),
                             cudaMemcpyDeviceToDevice, s));
  SPADE_CUDA(cudaStreamSynchronize(s));  // the arena goes with this call
}

struct CudaClusterIndex::Impl {
  int device;
  std::unique_ptr<cuda::DeviceArena> arena;
  std::unique_ptr<cuda::LcIndexGpu> ix;
};

CudaClusterIndex::CudaClusterIndex(int device, int slots, int Hkv, int D, int P, int max_chunks,
                                   double chunks_per_fine, int max_coarse, int iterations)
    : impl_(std::make_unique<Impl>()) {
  SPADE_CHECK(slots >= 1 && Hkv >= 1 && max_chunks >= 1, "CudaClusterIndex: bad sizes");
  DeviceScope ds(device);
  cuda::check_device_supported();
  cuda::LcIndexConfig c;
  c.slots = slots, c.Hkv = Hkv, c.D = D, c.P = P, c.max_chunks = max_chunks;
  c.chunks_per_fine = chunks_per_fine, c.max_coarse = max_coarse, c.iterations = iterations;
  impl_->device = device;
  impl_->arena = std::make_unique<cuda::DeviceArena>(cuda::LcIndexGpu::arena_bytes(c));
  impl_->ix = std::make_unique<cuda::LcIndexGpu>(*impl_->arena, c);
}

CudaClusterIndex::~CudaClusterIndex() {
  if (impl_) {
    DeviceScope ds(impl_->device);
    impl_->ix.reset();
    impl_->arena.reset();
  }
}

void CudaClusterIndex::reset(int slot, uintptr_t stream) {
  SPADE_CHECK(slot >= 0 && slot < impl_->ix->config().slots, "CudaClusterIndex: slot ", slot,
              " outside [0, ", impl_->ix->config().slots, ")");
  DeviceScope ds(impl_->device);
  impl_->ix->reset(slot, as_stream(stream));
}

void CudaClusterIndex::build(int slot, const void* k_cache, const int32_t* page_table,
                             const int32_t* starts, int n_chunks, uintptr_t stream) {
  const cuda::LcIndexConfig& c = impl_->ix->config();
  SPADE_CHECK(slot >= 0 && slot < c.slots, "CudaClusterIndex: slot ", slot, " outside [0, ",
              c.slots, ")");
  SPADE_CHECK(n_chunks >= 1 && n_chunks <= c.max_chunks, "CudaClusterIndex.build: ", n_chunks,
              " chunks, outside [1, max_chunks = ", c.max_chunks, "]");
  check_starts(starts, n_chunks + 1, INT32_MAX);
  DeviceScope ds(impl_->device);
  impl_->ix->build(slot, static_cast<const cuda::bf16*>(k_cache), page_table, starts, n_chunks,
                   as_stream(stream));
  SPADE_CUDA(cudaStreamSynchronize(as_stream(stream)));
}

void CudaClusterIndex::insert(int slot, const void* k_cache, const int32_t* page_table, int n_old,
                              const int32_t* new_ends, int n_new, uintptr_t stream) {
  const cuda::LcIndexConfig& c = impl_->ix->config();
  SPADE_CHECK(slot >= 0 && slot < c.slots, "CudaClusterIndex: slot ", slot, " outside [0, ",
              c.slots, ")");
  SPADE_CHECK(n_new >= 1 && n_old >= 1 && n_old + n_new <= c.max_chunks,
              "CudaClusterIndex.insert: ", n_old, " + ", n_new, " chunks, past max_chunks = ",
              c.max_chunks, " (or nothing to insert)");
  for (int i = 1; i < n_new; ++i)
    SPADE_CHECK(new_ends[i] > new_ends[i - 1], "CudaClusterIndex.insert: new chunk ends must "
                "increase strictly");
  DeviceScope ds(impl_->device);
  impl_->ix->insert(slot, static_cast<const cuda::bf16*>(k_cache), page_table, n_old, new_ends,
                    n_new, as_stream(stream));
  SPADE_CUDA(cudaStreamSynchronize(as_stream(stream)));
}

void CudaClusterIndex::search(const void* q, const int32_t* slot, const int32_t* kv_len, int B,
                              int Hq, int64_t budget, int coarse_topk, double coarse_cover,
                              int sink, int cap, int32_t* lists, int32_t* counts,
                              int32_t* sel_off, int32_t* sel_idx, uintptr_t stream) const {
  const cuda::LcIndexConfig& c = impl_->ix->config();
  SPADE_CHECK(B >= 1 && Hq >= c.Hkv && Hq % c.Hkv == 0, "CudaClusterIndex.search: bad batch / heads");
  DeviceScope ds(impl_->device);
  cuda::LcSearchArgs a;
  a.q = static_cast<const cuda::bf16*>(q);
  a.slot = slot, a.kv_len = kv_len, a.B = B, a.Hq = Hq;
  a.budget = budget, a.coarse_topk = coarse_topk, a.coarse_cover = coarse_cover;
  a.sink = sink, a.cap = cap, a.lists = lists, a.counts = counts;
  impl_->ix->search(a, as_stream(stream));
  cuda::LcIndexGpu::compact(lists, counts, B * c.Hkv, cap, sel_off, sel_idx, as_stream(stream));
}

size_t CudaClusterIndex::arena_bytes() const { return impl_->arena->capacity(); }

namespace {
struct LimScratch {
  size_t row_n, head_top, keys, merged, topk, total;
};
LimScratch lim_scratch(int B, int Hq, int64_t ld, int64_t n_uni) {
  LimScratch s{};
  size_t o = 0;
  auto take = [&](size_t bytes) {
    const size_t at = o;
    o = cuda::align_up(o + bytes, 256);
    return at;
  };
  s.row_n = take(sizeof(int32_t) * size_t(B * Hq + B));
  s.head_top = take(sizeof(int32_t) * size_t(B * Hq) * size_t(n_uni));
  s.keys = take(sizeof(float) * size_t(B) * size_t(ld));
  s.merged = take(sizeof(int32_t) * size_t(B) * size_t(n_uni));
  s.topk = cuda::topk_long_applies(ld, int(n_uni))
               ? take(cuda::topk_long_scratch_bytes(B * Hq, ld, int(n_uni)))
               : SIZE_MAX;
  s.total = o;
  return s;
}
}  // namespace

size_t cuda_lessismore_scratch_bytes(int B, int Hq, int64_t ld, int64_t n_uni) {
  return lim_scratch(B, Hq, ld, n_uni).total;
}

void cuda_lessismore_select(int device, const float* scores, int64_t ld, const int32_t* lens,
                            int B, int Hq, int budget, int n_recent, int sinks, void* scratch,
                            int32_t* sel_off, int32_t* sel_idx, uintptr_t stream) {
  const int n_uni = budget - n_recent - sinks;
  SPADE_CHECK(n_recent >= 0 && sinks >= 0 && n_uni >= 1, "lessismore_select: budget (", budget,
              ") must exceed n_recent (", n_recent, ") + sinks (", sinks, ")");
  const LimScratch sc = lim_scratch(B, Hq, ld, n_uni);
  char* base = static_cast<char*>(scratch);
  cuda::LessIsMoreArgs a;
  a.scores = scores, a.ld = ld, a.kv_len = lens, a.B = B, a.Hq = Hq;
  a.budget = budget, a.n_recent = n_recent, a.sinks = sinks, a.n_uni = n_uni;
  a.row_n = reinterpret_cast<int32_t*>(base + sc.row_n);
  a.head_top = reinterpret_cast<int32_t*>(base + sc.head_top);
  a.keys = reinterpret_cast<float*>(base + sc.keys);
  a.merged_top = reinterpret_cast<int32_t*>(base + sc.merged);
  a.topk_scratch = sc.topk == SIZE_MAX ? nullptr : base + sc.topk;
  a.sel_off = sel_off, a.sel_idx = sel_idx;
  DeviceScope ds(device);
  cuda::lessismore_select(a, as_stream(stream));
}

#else  // !SPADE_HAVE_CUDA

namespace {
[[noreturn]] void no_cuda() {
  fail("this spade build has no CUDA backend (built without nvcc): CUDA tensors are not supported");
}
}  // namespace

struct CudaDecode::Impl {};
CudaDecode::CudaDecode(int, int, int64_t, int, int, int, int) { no_cuda(); }
CudaDecode::~CudaDecode() = default;
void CudaDecode::plan(const Paged&, uintptr_t) { no_cuda(); }
void CudaDecode::run(const void*, const void*, const void*, void*, float, uintptr_t) const { no_cuda(); }
int CudaDecode::batch() const { return -1; }
size_t CudaDecode::arena_bytes() const { return 0; }
struct CudaSparse::Impl {};
CudaSparse::CudaSparse(int, int, int64_t, int, int, int, int) { no_cuda(); }
CudaSparse::~CudaSparse() = default;
void CudaSparse::plan(const Paged&, int, int, const std::vector<int>&, uintptr_t) { no_cuda(); }
void CudaSparse::run(const void*, const void*, const void*, const int32_t*, const int32_t*, void*,
                     float, uintptr_t) const {
  no_cuda();
}
int CudaSparse::batch() const { return -1; }
void cuda_quest_meta(int, const void*, int, int, int, const int32_t*, const int32_t*, int, void*,
                     uintptr_t) {
  no_cuda();
}
void cuda_quest_select(int, const void*, int, const void*, const Paged&, int, int, float*,
                       int32_t*, int32_t*, uintptr_t) {
  no_cuda();
}
void cuda_topk_rows(int, const float*, int64_t, const int32_t*, int, int, int, int32_t*,
                    int32_t*, int32_t*, int32_t*, uintptr_t) {
  no_cuda();
}
void cuda_twilight_prune(int, const void*, int, const Paged&, const int32_t*, const int32_t*, int,
                         uint8_t*, uint32_t*, const int32_t*, const int32_t*, int, int, double,
                         double, float, int32_t*, int32_t*, uintptr_t) {
  no_cuda();
}
struct CudaClusterIndex::Impl {};
CudaClusterIndex::CudaClusterIndex(int, int, int, int, int, int, double, int, int) { no_cuda(); }
CudaClusterIndex::~CudaClusterIndex() = default;
void CudaClusterIndex::reset(int, uintptr_t) { no_cuda(); }
void CudaClusterIndex::build(int, const void*, const int32_t*, const int32_t*, int, uintptr_t) {
  no_cuda();
}
void CudaClusterIndex::insert(int, const void*, const int32_t*, int, const int32_t*, int,
                              uintptr_t) {
  no_cuda();
}
void CudaClusterIndex::search(const void*, const int32_t*, const int32_t*, int, int, int64_t, int,
                              double, int, int, int32_t*, int32_t*, int32_t*, int32_t*,
                              uintptr_t) const {
  no_cuda();
}
size_t CudaClusterIndex::arena_bytes() const { return 0; }
size_t cuda_lessismore_scratch_bytes(int, int, int64_t, int64_t) { return 0; }
void cuda_lessismore_select(int, const float*, int64_t, const int32_t*, int, int, int, int, int,
                            void*, int32_t*, int32_t*, uintptr_t) {
  no_cuda();
}

#endif

}  // namespace spade::api::ops
