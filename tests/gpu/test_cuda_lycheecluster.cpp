// LycheeCluster on the GPU (backend/cuda/cluster_index.h) against the CPU reference
// (sparse/cluster_index.h) on the same bf16 keys, read through a shuffled paged K cache:
//   BuildExactSeparated  keys where chunks 2i and 2i+1 share a direction (no k-means near-ties):
//                        fine membership, renumbering, coarse ranges, per-fine chunk lists,
//                        fp16 centers, radii, token counters all EXACTLY equal to the CPU's
//   BuildStructured      RoPE-like structured keys (near-ties possible): index invariants,
//                        every member token within its nodes' radius (exact double check),
//                        k-means objective of the GPU partition within 2% of the CPU's
//   SearchMatchesCpu     Token lists (sink + chunks + tail) equal to the CPU selection built
//                        from ClusterIndex::search, several budgets / k_g / GQA groups;
//                        data without near-ties (random q); ties rank the lower id first on
//                        both sides
//   SearchMatchesCpuFromGlobalMemory  the same with the build's block sorts and the search's
//                        working arrays in global memory (LcIndexConfig::spill_smem: the path
//                        of GPUs with too little shared memory per block for them)
//   InsertMatchesCpu     lazy updates (several batches of new chunks) leave an index EXACTLY
//                        equal to the CPU's after the same inserts; searches still agree;
//                        D = 128, 64, 256
//   CompactCsr           strided lists -> CSR
//   SearchBatchSlots     a decode batch over several slots, then insert_batch
//   BuildBatchAcrossRequestsAndLayers  build_batch over (request, layer) slots in sequences
//                        that mix requests and layers, then insert_batch with per-layer K
//                        caches: every slot EXACTLY equal to the CPU's
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "backend/cuda/cluster_index.h"
#include "gpu_util.h"
#include "sparse/cluster_index.h"

using namespace spade;
using namespace spade::test;
using spade::cuda::bf16;

namespace {

struct Keys {
  int Hkv, D, P;
  int64_t L;
  std::vector<float> k;  // [h][L][D] bf16-rounded
  const float* row(int h, int64_t p) const { return k.data() + (size_t(h) * L + p) * D; }
};

// Chunk starts: sink, then lengths in [8, 16] from the rng, up to L (last chunk may be short).
std::vector<int32_t> make_starts(int64_t L, int sink, std::mt19937& rng) {
  std::vector<int32_t> s{int32_t(sink)};
  std::uniform_int_distribution<int> len(8, 16);
  while (s.back() < L) s.push_back(int32_t(std::min<int64_t>(L, s.back() + len(rng))));
  return s;
}

// Chunk c = 2i or 2i + 1 of the first `paired` chunks has its tokens around direction i
// (random unit * 6, token noise 0.15, per-token scale 0.8..1.2); other tokens random.
Keys separated_keys(int Hkv, int D, int P, const std::vector<int32_t>& st, int64_t L, uint32_t seed) {
  Keys K{Hkv, D, P, L, std::vector<float>(size_t(Hkv) * L * D)};
  std::mt19937 rng(seed);
  std::normal_distribution<float> n01(0.f, 1.f);
  std::uniform_real_distribution<float> sc(0.8f, 1.2f);
  const int M = int(st.size()) - 1;
  for (int h = 0; h < Hkv; ++h) {
    std::vector<float> dir(static_cast<size_t>(D));
    for (int c = 0; c < M; ++c) {
      if (c % 2 == 0) {
        double n = 0;
        for (auto& x : dir) { x = n01(rng); n += double(x) * x; }
        for (auto& x : dir) x = float(6.0 * x / std::sqrt(n));
      }
      for (int p = st[size_t(c)]; p < st[size_t(c) + 1]; ++p) {
        const float s = sc(rng);
        for (int d = 0; d < D; ++d)
          K.k[(size_t(h) * L + p) * D + d] = round_bf16(s * (dir[size_t(d)] + 0.15f * n01(rng)));
      }
    }
    for (int p = 0; p < st[0]; ++p)
      for (int d = 0; d < D; ++d) K.k[(size_t(h) * L + p) * D + d] = round_bf16(n01(rng));
    for (int64_t p = st.back(); p < L; ++p)
      for (int d = 0; d < D; ++d) K.k[(size_t(h) * L + p) * D + d] = round_bf16(n01(rng));
  }
  return K;
}

// Structured keys: offset + drifting topics + noise, RoPE-like pair rotation, varying norms.
Keys structured_keys(int Hkv, int D, int P, int64_t L, uint32_t seed) {
  Keys K{Hkv, D, P, L, std::vector<float>(size_t(Hkv) * L * D)};
  std::mt19937 rng(seed);
  std::normal_distribution<float> n01(0.f, 1.f);
  for (int h = 0; h < Hkv; ++h) {
    std::vector<float> off(static_cast<size_t>(D)), topic(size_t(8) * D);
    for (auto& x : off) x = 3.f * n01(rng);
    for (auto& x : topic) x = 2.f * n01(rng);
    for (int64_t p = 0; p < L; ++p) {
      float* k = K.k.data() + (size_t(h) * L + p) * D;
      const int t = int((p / 40) % 8);
      const float scale = 0.5f + 1.5f * float((p * 7919) % 101) / 100.f;
      for (int d = 0; d < D; ++d) k[d] = scale * (off[size_t(d)] + topic[size_t(t) * D + d] + 0.7f * n01(rng));
      for (int d = 0; d + 1 < D; d += 2) {
        const double th = double(p) * std::pow(10000.0, -double(d) / D);
        const float a = k[d], b = k[d + 1];
        k[d] = float(a * std::cos(th) - b * std::sin(th));
        k[d + 1] = float(a * std::sin(th) + b * std::cos(th));
      }
      for (int d = 0; d < D; ++d) k[d] = round_bf16(k[d]);
    }
  }
  return K;
}

// Paged cache [page][Hkv][P][D] with shuffled page ids (plus unused pages).
struct Paged {
  std::vector<int32_t> pages;
  std::unique_ptr<DevBuf<bf16>> cache;
  std::unique_ptr<DevBuf<int32_t>> pt;
};
Paged upload(const Keys& K, std::mt19937& rng) {
  const int64_t np = (K.L + K.P - 1) / K.P, total = np + 5;
  std::vector<int32_t> ids(static_cast<size_t>(total));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  Paged o;
  o.pages.assign(ids.begin(), ids.begin() + np);
  std::vector<float> host(size_t(total) * K.Hkv * K.P * K.D, 0.f);
  for (int h = 0; h < K.Hkv; ++h)
    for (int64_t p = 0; p < K.L; ++p)
      std::copy_n(K.row(h, p), K.D,
                  host.data() + ((size_t(o.pages[size_t(p / K.P)]) * K.Hkv + h) * K.P + p % K.P) * K.D);
  o.cache = std::make_unique<DevBuf<bf16>>(to_bf16(host));
  o.pt = std::make_unique<DevBuf<int32_t>>(o.pages);
  return o;
}

std::vector<sparse::ClusterIndex> cpu_build(const Keys& K, const std::vector<int32_t>& st, int M) {
  std::vector<sparse::ClusterIndex> ix(static_cast<size_t>(K.Hkv));
  sparse::ClusterIndexOptions opt;  // defaults: Token space, fp16 centers, mean pooling
  for (int h = 0; h < K.Hkv; ++h)
    ix[size_t(h)].build(K.D, [&](int64_t p) { return K.row(h, p); }, st.data(), M, opt);
  return ix;
}

// Exact equality of the GPU index of (slot, h) with the CPU's.
void expect_same_index(const cuda::LcIndexGpu& g, int slot, int h, const sparse::ClusterIndex& c, int D) {
  using L = sparse::ClusterIndex;
  const auto o = g.download(slot, h);
  ASSERT_EQ(o.n_fine, c.n_fine());
  ASSERT_EQ(o.n_coarse, c.n_coarse());
  ASSERT_EQ(o.n_chunks, c.n_chunks());
  for (int gg = 0; gg <= c.n_coarse(); ++gg) EXPECT_EQ(o.coarse_first[size_t(gg)], c.fine_begin(gg)) << gg;
  std::vector<float> cc(static_cast<size_t>(D));
  int bad_c = 0, bad_r = 0, bad_l = 0;
  for (int f = 0; f < c.n_fine(); ++f) {
    c.center(L::kFine, f, cc.data());
    for (int d = 0; d < D; ++d) bad_c += cc[size_t(d)] != o.fine_c[size_t(f) * D + d];
    bad_r += c.radius(L::kFine, f) != o.fine_r[size_t(f)];
    EXPECT_EQ(c.tokens(L::kFine, f), o.fine_tokens[size_t(f)]);
    std::vector<int32_t> lst;
    for (int32_t ch = c.first_chunk(f); ch >= 0; ch = c.next_chunk(ch)) lst.push_back(ch);
    bad_l += lst != o.fine_chunks[size_t(f)];
  }
  for (int gg = 0; gg < c.n_coarse(); ++gg) {
    c.center(L::kCoarse, gg, cc.data());
    for (int d = 0; d < D; ++d) bad_c += cc[size_t(d)] != o.coarse_c[size_t(gg) * D + d];
    bad_r += c.radius(L::kCoarse, gg) != o.coarse_r[size_t(gg)];
    EXPECT_EQ(c.tokens(L::kCoarse, gg), o.coarse_tokens[size_t(gg)]);
  }
  EXPECT_EQ(bad_c, 0) << "center values differing (head " << h << ")";
  EXPECT_EQ(bad_r, 0) << "radii differing (head " << h << ")";
  EXPECT_EQ(bad_l, 0) << "fine chunk lists differing (head " << h << ")";
}

// CPU selection as the method composes it: sink + chosen chunks + [max(starts[M], sink), L).
std::vector<int32_t> cpu_selection(const sparse::ClusterIndex& ix, const float* q, int G,
                                   const sparse::SearchParams& sp, const std::vector<int32_t>& st,
                                   int sink, int64_t L) {
  std::vector<int32_t> out, chunks;
  sparse::SearchScratch scr;
  for (int p = 0; p < std::min<int64_t>(sink, L); ++p) out.push_back(p);
  ix.search(q, G, sp, st.data(), chunks, nullptr, scr);
  for (int32_t c : chunks)
    for (int32_t p = st[size_t(c)]; p < st[size_t(c) + 1]; ++p) out.push_back(p);
  const int M = ix.n_chunks();
  for (int64_t p = std::max<int64_t>(st[size_t(M)], sink); p < L; ++p) out.push_back(int32_t(p));
  std::sort(out.begin(), out.end());
  return out;
}

// Runs the GPU search for one request (slot 0 -> request 0) and compares with the CPU.
void check_search(cuda::LcIndexGpu& g, const std::vector<sparse::ClusterIndex>& cpu,
                  const std::vector<int32_t>& st, int64_t L, int Hq, int D, int sink,
                  std::mt19937& rng, int64_t budget, int topk, int reps) {
  const int Hkv = int(cpu.size()), G = Hq / Hkv;
  const int cap = sink + int(budget) + int(L - st.back()) + 64;
  DevBuf<int32_t> slot(std::vector<int32_t>{0}), len(std::vector<int32_t>{int32_t(L)});
  DevBuf<int32_t> lists(size_t(Hkv) * cap), counts(static_cast<size_t>(Hkv)), chosen(static_cast<size_t>(Hkv));
  for (int r = 0; r < reps; ++r) {
    const auto qf = round_bf16(randn(size_t(Hq) * D, rng, 1.f, 0.3f));
    DevBuf<bf16> q(to_bf16(qf));
    cuda::LcSearchArgs a;
    a.q = q.p;
    a.slot = slot.p;
    a.kv_len = len.p;
    a.B = 1;
    a.Hq = Hq;
    a.budget = budget;
    a.coarse_topk = topk;
    a.sink = sink;
    a.cap = cap;
    a.lists = lists.p;
    a.counts = counts.p;
    a.chosen = chosen.p;
    g.search(a, nullptr);
    const auto hl = lists.download();
    const auto hc = counts.download();
    sparse::SearchParams sp;
    sp.budget = budget;
    sp.coarse_topk = topk;
    for (int h = 0; h < Hkv; ++h) {
      auto want = cpu_selection(cpu[size_t(h)], qf.data() + size_t(h) * G * D, G, sp, st, sink, L);
      ASSERT_LT(hc[size_t(h)], cap);
      std::vector<int32_t> got(hl.begin() + size_t(h) * cap, hl.begin() + size_t(h) * cap + hc[size_t(h)]);
      EXPECT_TRUE(std::is_sorted(got.begin(), got.end()));
      std::sort(got.begin(), got.end());
      EXPECT_EQ(got, want) << "head " << h << " rep " << r << " budget " << budget << " topk " << topk
                           << " (gpu " << got.size() << " tokens, cpu " << want.size() << ")";
    }
  }
}

cuda::LcIndexConfig cfg_for(int Hkv, int D, int P, int max_chunks) {
  cuda::LcIndexConfig c;
  c.slots = 2;
  c.Hkv = Hkv;
  c.D = D;
  c.P = P;
  c.max_chunks = max_chunks;
  return c;
}

}  // namespace

TEST(CudaLycheeCluster, BuildExactSeparated) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(11);
  const int Hkv = 2, D = 128, P = 16, sink = 16;
  const int64_t L = 6000;
  auto st = make_starts(L - 40, sink, rng);  // leave a 40-token un-indexed tail
  if (st.size() % 2 == 0) st.pop_back();     // an even chunk count: one seed per pair
  const int M = int(st.size()) - 1;
  const auto K = separated_keys(Hkv, D, P, st, L, 5);
  auto pg = upload(K, rng);
  const auto cpu = cpu_build(K, st, M);
  cuda::DeviceArena arena(size_t(512) << 20);
  cuda::LcIndexGpu g(arena, cfg_for(Hkv, D, P, 1024));
  g.build(1, pg.cache->p, pg.pt->p, st.data(), M, nullptr);
  SPADE_CUDA(cudaDeviceSynchronize());
  for (int h = 0; h < Hkv; ++h) expect_same_index(g, 1, h, cpu[size_t(h)], D);
}

TEST(CudaLycheeCluster, BuildStructured) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(12);
  const int Hkv = 2, D = 128, P = 16, sink = 16;
  const int64_t L = 8192;
  auto st = make_starts(L, sink, rng);
  const int M = int(st.size()) - 1;
  const auto K = structured_keys(Hkv, D, P, L, 9);
  auto pg = upload(K, rng);
  const auto cpu = cpu_build(K, st, M);
  cuda::DeviceArena arena(size_t(512) << 20);
  cuda::LcIndexGpu g(arena, cfg_for(Hkv, D, P, 1024));
  g.build(0, pg.cache->p, pg.pt->p, st.data(), M, nullptr);
  for (int h = 0; h < Hkv; ++h) {
    const auto o = g.download(0, h);
    const auto& c = cpu[size_t(h)];
    EXPECT_EQ(o.n_fine, c.n_fine());    // no empty fine cluster on either side here
    EXPECT_EQ(o.n_coarse, c.n_coarse());
    // Invariants: lists partition the chunks in position order; counters; coarse ranges.
    std::vector<int> seen(static_cast<size_t>(M), 0);
    int64_t tok_total = 0;
    for (int f = 0; f < o.n_fine; ++f) {
      const auto& l = o.fine_chunks[size_t(f)];
      EXPECT_FALSE(l.empty());
      EXPECT_TRUE(std::is_sorted(l.begin(), l.end()));
      int64_t tok = 0;
      for (int32_t ch : l) {
        ++seen[size_t(ch)];
        EXPECT_EQ(o.fine_of[size_t(ch)], f);
        tok += st[size_t(ch) + 1] - st[size_t(ch)];
      }
      EXPECT_EQ(tok, o.fine_tokens[size_t(f)]);
      tok_total += tok;
    }
    for (int ch = 0; ch < M; ++ch) EXPECT_EQ(seen[size_t(ch)], 1) << ch;
    EXPECT_EQ(tok_total, st.back() - st.front());
    EXPECT_EQ(o.coarse_first[0], 0);
    EXPECT_EQ(o.coarse_first[size_t(o.n_coarse)], o.n_fine);
    // Covering radii: every member token within r of its fine and coarse centers (double).
    int viol = 0;
    for (int gg = 0; gg < o.n_coarse; ++gg)
      for (int f = o.coarse_first[size_t(gg)]; f < o.coarse_first[size_t(gg) + 1]; ++f)
        for (int32_t ch : o.fine_chunks[size_t(f)])
          for (int32_t p = st[size_t(ch)]; p < st[size_t(ch) + 1]; ++p) {
            double df = 0, dg = 0;
            for (int d = 0; d < D; ++d) {
              const double x = K.row(h, p)[d];
              df += (x - o.fine_c[size_t(f) * D + d]) * (x - o.fine_c[size_t(f) * D + d]);
              dg += (x - o.coarse_c[size_t(gg) * D + d]) * (x - o.coarse_c[size_t(gg) * D + d]);
            }
            viol += std::sqrt(df) > o.fine_r[size_t(f)];
            viol += std::sqrt(dg) > o.coarse_r[size_t(gg)];
          }
    EXPECT_EQ(viol, 0);
    // k-means objective (sum over chunks of x . normalized cluster mean, chunk keys as the CPU
    // pools them) of the two partitions: within 2% (near-ties may send Lloyd elsewhere).
    auto objective = [&](const std::vector<int32_t>& fine_of, int nf) {
      std::vector<double> x(size_t(M) * D), s(size_t(nf) * D, 0.0);
      for (int ch = 0; ch < M; ++ch) {
        double n = 0;
        for (int d = 0; d < D; ++d) {
          double m = 0;
          for (int32_t p = st[size_t(ch)]; p < st[size_t(ch) + 1]; ++p) m += K.row(h, p)[d];
          x[size_t(ch) * D + d] = m;
          n += m * m;
        }
        for (int d = 0; d < D; ++d) x[size_t(ch) * D + d] /= std::sqrt(n);
        for (int d = 0; d < D; ++d) s[size_t(fine_of[size_t(ch)]) * D + d] += x[size_t(ch) * D + d];
      }
      double obj = 0;
      for (int ch = 0; ch < M; ++ch) {
        const double* c = s.data() + size_t(fine_of[size_t(ch)]) * D;
        double dot = 0, n = 0;
        for (int d = 0; d < D; ++d) { dot += x[size_t(ch) * D + d] * c[d]; n += c[d] * c[d]; }
        obj += dot / std::sqrt(n);
      }
      return obj;
    };
    std::vector<int32_t> cpu_of(static_cast<size_t>(M));
    for (int f = 0; f < c.n_fine(); ++f)
      for (int32_t ch = c.first_chunk(f); ch >= 0; ch = c.next_chunk(ch)) cpu_of[size_t(ch)] = f;
    const double og = objective(o.fine_of, o.n_fine), oc = objective(cpu_of, c.n_fine());
    EXPECT_NEAR(og / oc, 1.0, 0.02) << "gpu " << og << " cpu " << oc;
    int same = 0;
    for (int ch = 0; ch < M; ++ch) same += o.fine_of[size_t(ch)] == cpu_of[size_t(ch)];
    std::printf("  head %d: %d chunks, %d fine, %d coarse; same fine id %d/%d; objective gpu %.4f cpu %.4f\n",
                h, M, o.n_fine, o.n_coarse, same, M, og, oc);
  }
}

namespace {
// spill: the build's block sorts and the search's working arrays in global memory (the path of
// GPUs whose shared memory per block is too small for them, e.g. sm_86 / 89 past ~4K chunks).
void search_matches_cpu(bool spill) {
  SCOPED_TRACE(spill ? "working arrays in global memory" : "working arrays in shared memory");
  std::mt19937 rng(13);
  const int Hkv = 2, D = 128, P = 16, sink = 16;
  const int64_t L = 12000;
  auto st = make_starts(L - 70, sink, rng);
  if (st.size() % 2 == 0) st.pop_back();
  const int M = int(st.size()) - 1;
  const auto K = separated_keys(Hkv, D, P, st, L, 6);
  auto pg = upload(K, rng);
  const auto cpu = cpu_build(K, st, M);
  cuda::DeviceArena arena(size_t(512) << 20);
  cuda::LcIndexConfig cfg = cfg_for(Hkv, D, P, 2048);
  cfg.spill_smem = spill;
  cuda::LcIndexGpu g(arena, cfg);
  g.build(0, pg.cache->p, pg.pt->p, st.data(), M, nullptr);
  for (int h = 0; h < Hkv; ++h) expect_same_index(g, 0, h, cpu[size_t(h)], D);
  for (int Hq : {2, 8})
    for (int64_t budget : {int64_t(128), int64_t(1024), int64_t(4000)})
      for (int topk : {0, 3}) check_search(g, cpu, st, L, Hq, D, sink, rng, budget, topk, 3);
}
}  // namespace

TEST(CudaLycheeCluster, SearchMatchesCpu) {
  SKIP_WITHOUT_GPU();
  search_matches_cpu(false);
}

TEST(CudaLycheeCluster, SearchMatchesCpuFromGlobalMemory) {
  SKIP_WITHOUT_GPU();
  search_matches_cpu(true);
}

namespace {
// Head dim D: 64 (SmolLM2), 128 (Llama-3, Qwen3), 256 (the kernels' limit: two 128-dim rounds
// of center loads, 128 KB of staged K rows).
void insert_matches_cpu(int D) {
  SCOPED_TRACE(testing::Message() << "D = " << D);
  std::mt19937 rng(14);
  const int Hkv = 2, P = 16, sink = 16;
  const int64_t L = 9000;
  auto all = make_starts(L, sink, rng);
  const auto K = separated_keys(Hkv, D, P, all, L, 7);
  const int M_total = int(all.size()) - 1;
  // (even) build over the first chunks, insert the rest in batches; the last batch (40 chunks of
  // 8-16 tokens: > 32 chunks, two rounds, each > 256 rows) reads K from global memory, the
  // others from the kernel's staged rows.
  int M = (M_total - 60) & ~1;
  std::vector<int32_t> st(all.begin(), all.begin() + M + 1);
  auto pg = upload(K, rng);
  auto cpu = cpu_build(K, st, M);
  cuda::DeviceArena arena(size_t(512) << 20);
  cuda::LcIndexGpu g(arena, cfg_for(Hkv, D, P, 2048));
  g.build(0, pg.cache->p, pg.pt->p, st.data(), M, nullptr);
  for (int batch : {1, 7, 12, 40}) {
    std::vector<int32_t> ends(all.begin() + M + 1, all.begin() + M + 1 + batch);
    g.insert(0, pg.cache->p, pg.pt->p, M, ends.data(), batch, nullptr);
    for (int i = 0; i < batch; ++i) {
      st.push_back(all[size_t(M + 1 + i)]);
      for (int h = 0; h < Hkv; ++h)
        cpu[size_t(h)].insert([&](int64_t p) { return K.row(h, p); }, st.data(), M + i);
    }
    M += batch;
    for (int h = 0; h < Hkv; ++h) expect_same_index(g, 0, h, cpu[size_t(h)], D);
    check_search(g, cpu, st, L, 8, D, sink, rng, 1024, 0, 2);
  }
}
}  // namespace

TEST(CudaLycheeCluster, InsertMatchesCpu) {
  SKIP_WITHOUT_GPU();
  for (int D : {128, 64, 256}) insert_matches_cpu(D);
}

TEST(CudaLycheeCluster, CompactCsr) {
  SKIP_WITHOUT_GPU();
  const int n = 5, cap = 7;
  std::vector<int32_t> lists(size_t(n) * cap), counts{3, 0, 7, 1, 5};
  for (size_t i = 0; i < lists.size(); ++i) lists[i] = int32_t(100 + i);
  DevBuf<int32_t> dl(lists), dc(counts), off(size_t(n) + 1), idx(16);
  cuda::LcIndexGpu::compact(dl.p, dc.p, n, cap, off.p, idx.p, nullptr);
  const auto ho = off.download(), hi = idx.download();
  EXPECT_EQ(ho, (std::vector<int32_t>{0, 3, 3, 10, 11, 16}));
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < counts[size_t(i)]; ++j) EXPECT_EQ(hi[size_t(ho[size_t(i)] + j)], lists[size_t(i) * cap + j]);
}

// A decode batch over several slots in one shared paged cache: request b reads slot[b] (here
// permuted), its own kv_len (un-indexed tails of different lengths), G = 4; lists equal to each
// request's CPU selection. Then one insert_batch of 2 chunks per request (from the tails) and
// the same inserts on the CPU: indexes and selections still equal.
TEST(CudaLycheeCluster, SearchBatchSlots) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(15);
  const int Hkv = 2, D = 128, P = 16, sink = 16, Hq = 8, G = Hq / Hkv, NS = 3;
  const int64_t budget = 512;
  cuda::DeviceArena arena(size_t(512) << 20);
  cuda::LcIndexConfig cfg = cfg_for(Hkv, D, P, 2048);
  cfg.slots = NS;
  cuda::LcIndexGpu g(arena, cfg);
  std::vector<std::vector<int32_t>> st(NS);
  std::vector<Keys> keys;
  std::vector<std::vector<sparse::ClusterIndex>> cpu;
  const std::vector<int64_t> L = {5000, 7300, 3100};
  // One cache: request s owns pages [base_s, base_s + np_s) of a shuffled id pool.
  int64_t total = 0;
  std::vector<int64_t> base;
  for (int s = 0; s < NS; ++s) {
    base.push_back(total);
    total += (L[size_t(s)] + P - 1) / P;
  }
  std::vector<int32_t> ids(static_cast<size_t>(total));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  std::vector<float> host(size_t(total) * Hkv * P * D, 0.f);
  std::vector<std::unique_ptr<DevBuf<int32_t>>> pts;
  for (int s = 0; s < NS; ++s) {
    st[size_t(s)] = make_starts(L[size_t(s)] - 30 - 100 * s, sink, rng);
    if (st[size_t(s)].size() % 2 == 0) st[size_t(s)].pop_back();
    keys.push_back(separated_keys(Hkv, D, P, st[size_t(s)], L[size_t(s)], 30 + s));
    const Keys& K = keys.back();
    std::vector<int32_t> pages(ids.begin() + base[size_t(s)], ids.begin() + base[size_t(s)] + (K.L + P - 1) / P);
    for (int h = 0; h < Hkv; ++h)
      for (int64_t p = 0; p < K.L; ++p)
        std::copy_n(K.row(h, p), D, host.data() + ((size_t(pages[size_t(p / P)]) * Hkv + h) * P + p % P) * D);
    pts.push_back(std::make_unique<DevBuf<int32_t>>(pages));
    const int M = int(st[size_t(s)].size()) - 1;
    cpu.push_back(cpu_build(K, st[size_t(s)], M));
  }
  DevBuf<bf16> cache(to_bf16(host));
  for (int s = 0; s < NS; ++s)
    g.build(s, cache.p, pts[size_t(s)]->p, st[size_t(s)].data(), int(st[size_t(s)].size()) - 1, nullptr);
  const std::vector<int32_t> slot = {2, 0, 1};
  std::vector<int32_t> len;
  for (int32_t s : slot) len.push_back(int32_t(L[size_t(s)]));
  const int B = NS, cap = sink + int(budget) + 400;
  DevBuf<int32_t> dslot(slot), dlen(len), lists(size_t(B) * Hkv * cap), counts(size_t(B) * Hkv);
  auto check = [&](const char* when) {
    const auto qf = round_bf16(randn(size_t(B) * Hq * D, rng, 1.f, 0.3f));
    DevBuf<bf16> q(to_bf16(qf));
    cuda::LcSearchArgs a;
    a.q = q.p;
    a.slot = dslot.p;
    a.kv_len = dlen.p;
    a.B = B;
    a.Hq = Hq;
    a.budget = budget;
    a.sink = sink;
    a.cap = cap;
    a.lists = lists.p;
    a.counts = counts.p;
    g.search(a, nullptr);
    const auto hl = lists.download();
    const auto hc = counts.download();
    sparse::SearchParams sp;
    sp.budget = budget;
    for (int b = 0; b < B; ++b) {
      const int s = slot[size_t(b)];
      for (int h = 0; h < Hkv; ++h) {
        const auto want = cpu_selection(cpu[size_t(s)][size_t(h)], qf.data() + (size_t(b) * Hq + size_t(h) * G) * D,
                                        G, sp, st[size_t(s)], sink, L[size_t(s)]);
        const size_t li = size_t(b) * Hkv + h;
        ASSERT_LT(hc[li], cap);
        std::vector<int32_t> got(hl.begin() + li * cap, hl.begin() + li * cap + hc[li]);
        EXPECT_EQ(got, want) << when << ": request " << b << " head " << h;
      }
    }
  };
  check("after build");
  std::vector<std::vector<int32_t>> ends(NS);
  std::vector<cuda::LcInsert> reqs;
  for (int s = 0; s < NS; ++s) {
    const int M = int(st[size_t(s)].size()) - 1;
    ends[size_t(s)] = {st[size_t(s)].back() + 10, st[size_t(s)].back() + 20};
    reqs.push_back({s, pts[size_t(s)]->p, M, ends[size_t(s)].data(), 2});
  }
  g.insert_batch(reqs, cache.p, nullptr);
  for (int s = 0; s < NS; ++s) {
    const int M = int(st[size_t(s)].size()) - 1;
    for (int i = 0; i < 2; ++i) {
      st[size_t(s)].push_back(ends[size_t(s)][size_t(i)]);
      for (int h = 0; h < Hkv; ++h)
        cpu[size_t(s)][size_t(h)].insert([&](int64_t p) { return keys[size_t(s)].row(h, p); }, st[size_t(s)].data(), M + i);
    }
    for (int h = 0; h < Hkv; ++h) expect_same_index(g, s, h, cpu[size_t(s)][size_t(h)], D);
  }
  check("after insert_batch");
}

// build_batch over (request, layer) slots as the GPU method issues it at a request's first
// sparse step: 3 requests of different lengths x 2 layers (each layer its own K cache, the
// request's one page table and one host starts array shared by its layers), in sequences of
// 2 slots (build_heads = 2 * Hkv: groups mixing requests and layers): every slot EXACTLY equal
// to the CPU build of its keys. Then one insert_batch over every slot with per-entry K caches
// (the layers') and the same inserts on the CPU: still exactly equal.
TEST(CudaLycheeCluster, BuildBatchAcrossRequestsAndLayers) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(21);
  const int Hkv = 2, D = 64, P = 16, sink = 16, NS = 3, NL = 2;
  cuda::DeviceArena arena(size_t(512) << 20);
  cuda::LcIndexConfig cfg = cfg_for(Hkv, D, P, 512);
  cfg.slots = NS * NL;
  EXPECT_EQ(cuda::LcIndexGpu::build_heads_within(cfg, 1), Hkv);  // at least one slot
  EXPECT_EQ(cuda::LcIndexGpu::build_heads_within(cfg, size_t(1) << 40), NS * NL * Hkv);
  cfg.build_heads = 2 * Hkv;
  cuda::LcIndexGpu g(arena, cfg);
  EXPECT_EQ(g.build_heads(), 2 * Hkv);
  const std::vector<int64_t> L = {2000, 3100, 2600};
  std::vector<std::vector<int32_t>> st(NS);
  std::vector<int64_t> base;
  int64_t total = 0;
  for (int s = 0; s < NS; ++s) {
    base.push_back(total);
    total += (L[size_t(s)] + P - 1) / P;
    st[size_t(s)] = make_starts(L[size_t(s)] - 60, sink, rng);
    if (st[size_t(s)].size() % 2 == 0) st[size_t(s)].pop_back();
  }
  std::vector<int32_t> ids(static_cast<size_t>(total));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  std::vector<std::unique_ptr<DevBuf<int32_t>>> pts;
  for (int s = 0; s < NS; ++s)
    pts.push_back(std::make_unique<DevBuf<int32_t>>(std::vector<int32_t>(
        ids.begin() + base[size_t(s)], ids.begin() + base[size_t(s)] + (L[size_t(s)] + P - 1) / P)));
  std::vector<Keys> keys;  // [s * NL + l]
  std::vector<std::vector<sparse::ClusterIndex>> cpu;
  std::vector<std::unique_ptr<DevBuf<bf16>>> caches;  // [l]
  std::vector<std::vector<float>> host(NL, std::vector<float>(size_t(total) * Hkv * P * D, 0.f));
  for (int s = 0; s < NS; ++s)
    for (int l = 0; l < NL; ++l) {
      keys.push_back(separated_keys(Hkv, D, P, st[size_t(s)], L[size_t(s)], uint32_t(40 + 7 * s + l)));
      const Keys& K = keys.back();
      for (int h = 0; h < Hkv; ++h)
        for (int64_t p = 0; p < K.L; ++p)
          std::copy_n(K.row(h, p), D,
                      host[size_t(l)].data() +
                          ((size_t(ids[size_t(base[size_t(s)] + p / P)]) * Hkv + h) * P + p % P) * D);
      cpu.push_back(cpu_build(K, st[size_t(s)], int(st[size_t(s)].size()) - 1));
    }
  for (int l = 0; l < NL; ++l) caches.push_back(std::make_unique<DevBuf<bf16>>(to_bf16(host[size_t(l)])));
  std::vector<cuda::LcBuild> builds;
  for (int l = 0; l < NL; ++l)  // layer-major, as a step lists them: groups mix requests
    for (int s = 0; s < NS; ++s)
      builds.push_back({s * NL + l, caches[size_t(l)]->p, pts[size_t(s)]->p, st[size_t(s)].data(),
                        int(st[size_t(s)].size()) - 1});
  g.build_batch(builds, nullptr);
  SPADE_CUDA(cudaDeviceSynchronize());
  for (int s = 0; s < NS; ++s)
    for (int l = 0; l < NL; ++l)
      for (int h = 0; h < Hkv; ++h) expect_same_index(g, s * NL + l, h, cpu[size_t(s * NL + l)][size_t(h)], D);
  // Lazy update of every slot in one insert_batch (per-entry K caches).
  std::vector<std::vector<int32_t>> ends(NS);
  std::vector<cuda::LcInsert> reqs;
  for (int s = 0; s < NS; ++s) {
    const int M = int(st[size_t(s)].size()) - 1;
    ends[size_t(s)] = {st[size_t(s)].back() + 12, st[size_t(s)].back() + 25};
    for (int l = 0; l < NL; ++l)
      reqs.push_back({s * NL + l, pts[size_t(s)]->p, M, ends[size_t(s)].data(), 2, caches[size_t(l)]->p});
  }
  g.insert_batch(reqs, nullptr, nullptr);
  for (int s = 0; s < NS; ++s) {
    const int M = int(st[size_t(s)].size()) - 1;
    for (int i = 0; i < 2; ++i) {
      st[size_t(s)].push_back(ends[size_t(s)][size_t(i)]);
      for (int l = 0; l < NL; ++l)
        for (int h = 0; h < Hkv; ++h)
          cpu[size_t(s * NL + l)][size_t(h)].insert([&](int64_t p) { return keys[size_t(s * NL + l)].row(h, p); },
                                                    st[size_t(s)].data(), M + i);
    }
    for (int l = 0; l < NL; ++l)
      for (int h = 0; h < Hkv; ++h) expect_same_index(g, s * NL + l, h, cpu[size_t(s * NL + l)][size_t(h)], D);
  }
}
