// Every method's selection against a brute-force definition written here, on random and
// planted caches: Quest's page bound and top pages, StreamingLLM's window, TidalDecode's
// group-averaged top-k and its reuse until the next selection layer, LessIsMore's
// Algorithm 1 (per-head top-k, cross-head rank merge, recency window, sinks), the oracles,
// budget >= L being full attention, and the recall counters.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <set>
#include <tuple>

#include "sparse/methods/quest.h"
#include "sparse/registry.h"
#include "sparse/session.h"
#include "sparse/topk.h"
#include "test_util.h"

using namespace spade;
using namespace spade::sparse;

namespace {

ModelConfig harness_config(int layers = 5) {
  ModelConfig c;
  c.n_layers = layers;
  c.n_heads = 6;
  c.n_kv_heads = 2;
  c.head_dim = 16;
  c.hidden = 96;
  c.max_context = 1024;
  return c;
}

// A KV cache of L tokens with known keys, and one decode query per layer.
struct Harness {
  ModelConfig cfg;
  int64_t L;
  int page;
  std::vector<float> K, V, Q;  // K/V [layer][pos][h][d], Q [layer][hq][d]
  Harness(ModelConfig c, int64_t L_, int page_, uint32_t seed, float kscale = 1.f)
      : cfg(c), L(L_), page(page_) {
    std::mt19937 rng(seed);
    K.resize(size_t(cfg.n_layers * L * cfg.n_kv_heads * cfg.head_dim));
    V.resize(K.size());
    Q.resize(size_t(cfg.n_layers * cfg.n_heads * cfg.head_dim));
    test::fill_random(K.data(), K.size(), rng, kscale);
    test::fill_random(V.data(), V.size(), rng);
    test::fill_random(Q.data(), Q.size(), rng, 2.f);
  }
  int D() const { return cfg.head_dim; }
  int G() const { return cfg.n_heads / cfg.n_kv_heads; }
  float* k(int l, int64_t p, int h) { return &K[size_t(((l * L + p) * cfg.n_kv_heads + h) * D())]; }
  float* q(int l, int hq) { return &Q[size_t((l * cfg.n_heads + hq) * D())]; }
  double score(int l, int hq, int64_t p) {
    double s = 0;
    for (int d = 0; d < D(); ++d) s += double(q(l, hq)[d]) * k(l, p, hq / G())[d];
    return s / std::sqrt(double(D()));
  }
  // True softmax weights of query head hq at layer l over [0, L).
  std::vector<double> weights(int l, int hq) {
    std::vector<double> w(static_cast<size_t>(L));
    double mx = -1e300, sum = 0;
    for (int64_t p = 0; p < L; ++p) mx = std::max(mx, w[size_t(p)] = score(l, hq, p));
    for (auto& x : w) sum += (x = std::exp(x - mx));
    for (auto& x : w) x /= sum;
    return w;
  }

  struct Run {
    std::vector<Selection> sel;  // per layer
    StepStats stats;
  };
  // One decode step (the token at L-1) through a SparseSession of `spec`.
  Run run(const std::string& spec, bool recall = false) {
    KVPool kv({cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, page}, (L + page - 1) / page + 1);
    PageTable pt;
    kv.reserve(pt, L);
    for (int l = 0; l < cfg.n_layers; ++l)
      for (int64_t p = 0; p < L; ++p)
        kv.write(l, pt, p, k(l, p, 0), &V[size_t((l * L + p) * cfg.n_kv_heads * D())]);
    pt.length = L;
    SparseConfig sc = SparseConfig::parse_spec(spec);
    SparseSession s(make_method(sc, cfg), cfg, kv, {recall, true});
    Run r;
    r.sel.resize(size_t(cfg.n_layers));
    s.on_select = [&](int layer, const Selection& sel) { r.sel[size_t(layer)] = sel; };
    std::vector<float> out(size_t(cfg.n_heads * D()));
    for (int l = 0; l < cfg.n_layers; ++l) s.attend(l, pt, q(l, 0), L - 1, 1, out.data());
    r.stats = s.last_step();
    return r;
  }
};

std::vector<int32_t> positions(const Selection& s, int h) {
  if (s.dense()) {
    std::vector<int32_t> all(static_cast<size_t>(s.length));
    for (int64_t i = 0; i < s.length; ++i) all[size_t(i)] = int32_t(i);
    return all;
  }
  return std::vector<int32_t>(s.head(h), s.head(h) + s.count(h));
}

// Brute-force best-first order: sort everything by (score desc, position asc).
std::vector<int32_t> sorted_by_score(const std::vector<double>& score, int64_t lo, int64_t hi) {
  std::vector<int32_t> idx;
  for (int64_t p = lo; p < hi; ++p) idx.push_back(int32_t(p));
  std::stable_sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) { return score[size_t(a)] > score[size_t(b)]; });
  return idx;
}

std::vector<int32_t> sorted_first(std::vector<int32_t> v, size_t n) {
  v.resize(std::min(n, v.size()));
  std::sort(v.begin(), v.end());
  return v;
}

}  // namespace

TEST(SparseTopK, EqualsStableSortWithTies) {
  std::mt19937 rng(1);
  for (int trial = 0; trial < 20; ++trial) {
    const int n = 1 + int(rng() % 300);
    std::vector<float> s(static_cast<size_t>(n));
    for (auto& x : s) x = float(rng() % 7);  // many ties
    if (trial % 3 == 0) s[size_t(rng() % n)] = NAN;
    std::vector<double> sd(s.begin(), s.end());
    for (auto& x : sd)
      if (x != x) x = -1e300;
    const int lo = int(rng() % n), hi = lo + int(rng() % (n - lo + 1));
    const int k = int(rng() % (n + 2));
    std::vector<int32_t> idx;
    const int64_t got = top_k_range(s.data(), lo, hi, k, idx);
    auto ref = sorted_by_score(sd, lo, hi);
    ASSERT_EQ(got, std::min<int64_t>(k, hi - lo));
    for (int64_t i = 0; i < got; ++i) ASSERT_EQ(idx[size_t(i)], ref[size_t(i)]) << "trial " << trial;
  }
}

TEST(SparseQuest, PageBoundIsAtLeastTheTrueMaxOfEveryPage) {
  for (int planted = 0; planted < 2; ++planted) {
    Harness hz(harness_config(3), 203, 16, 5 + planted);
    if (planted) {
      // Keys aligned with (and against) each query: the bound must still cover them.
      for (int l = 0; l < 3; ++l)
        for (int64_t p = 0; p < hz.L; p += 7)
          for (int d = 0; d < hz.D(); ++d) hz.k(l, p, int(p % 2))[d] = (p % 3 == 0 ? 6.f : -6.f) * hz.q(l, int(p % 2) * 3)[d];
    }
    KVPool kv({3, 2, hz.D(), 16}, 20);
    PageTable pt;
    kv.reserve(pt, hz.L);
    for (int l = 0; l < 3; ++l)
      for (int64_t p = 0; p < hz.L; ++p) kv.write(l, pt, p, hz.k(l, p, 0), hz.k(l, p, 0));
    pt.length = hz.L;
    int checked = 0;
    for (int l = 0; l < 3; ++l)
      for (size_t i = 0; i < pt.pages.size(); ++i)
        for (int hq = 0; hq < 6; ++hq) {
          const int h = hq / 3;
          double true_max = -1e300;
          for (int64_t p = int64_t(i) * 16; p < std::min<int64_t>(hz.L, int64_t(i + 1) * 16); ++p)
            true_max = std::max(true_max, hz.score(l, hq, p) * std::sqrt(double(hz.D())));
          const float b = quest_page_bound(hz.q(l, hq), kv.page_kmin(l, pt.pages[i], h),
                                           kv.page_kmax(l, pt.pages[i], h), hz.D());
          EXPECT_GE(double(b), true_max - 1e-4 * (1 + std::abs(true_max)))
              << "layer " << l << " page " << i << " head " << hq;
          ++checked;
        }
    EXPECT_EQ(checked, 3 * 13 * 6);
  }
}

// Brute-force Quest: page bounds from the raw keys, group aggregation, top pages + last.
std::vector<int32_t> brute_quest(Harness& hz, int l, int h, int64_t budget, int qpage, bool use_max) {
  const int64_t n_pages = (hz.L + qpage - 1) / qpage;
  std::vector<double> score(static_cast<size_t>(n_pages - 1));
  for (int64_t i = 0; i + 1 < n_pages; ++i) {
    std::vector<double> mn(size_t(hz.D()), 1e300), mx(size_t(hz.D()), -1e300);
    for (int64_t p = i * qpage; p < (i + 1) * qpage; ++p)
      for (int d = 0; d < hz.D(); ++d) {
        mn[size_t(d)] = std::min(mn[size_t(d)], double(hz.k(l, p, h)[d]));
        mx[size_t(d)] = std::max(mx[size_t(d)], double(hz.k(l, p, h)[d]));
      }
    double agg = use_max ? -1e300 : 0;
    for (int g = 0; g < hz.G(); ++g) {
      double b = 0;
      const float* q = hz.q(l, h * hz.G() + g);
      for (int d = 0; d < hz.D(); ++d) b += std::max(q[d] * mx[size_t(d)], q[d] * mn[size_t(d)]);
      agg = use_max ? std::max(agg, b) : agg + b;
    }
    score[size_t(i)] = agg;
  }
  auto order = sorted_by_score(score, 0, n_pages - 1);
  auto pages = sorted_first(order, size_t(budget / qpage - 1));
  pages.push_back(int32_t(n_pages - 1));
  std::vector<int32_t> pos;
  for (int32_t pg : pages)
    for (int64_t p = int64_t(pg) * qpage; p < std::min<int64_t>(hz.L, int64_t(pg + 1) * qpage); ++p)
      pos.push_back(int32_t(p));
  return pos;
}

TEST(SparseQuest, SelectionEqualsBruteForceTopPagesPlusTheLastPage) {
  struct Case { int kv_page, qpage; const char* group; int64_t budget; };
  for (Case cs : {Case{16, 16, "max", 64}, Case{8, 16, "max", 80}, Case{16, 32, "max", 96},
                  Case{16, 16, "sum", 64}, Case{4, 16, "max", 16}}) {
    Harness hz(harness_config(4), 203, cs.kv_page, 9);
    auto r = hz.run(cat("quest:budget=", cs.budget, ",page_size=", cs.qpage, ",group=", cs.group));
    const std::string what = cat("kv page ", cs.kv_page, " quest page ", cs.qpage, " ", cs.group);
    EXPECT_TRUE(r.sel[0].dense() && r.sel[1].dense()) << what;  // first 2 layers dense
    for (int l = 2; l < 4; ++l)
      for (int h = 0; h < 2; ++h) {
        auto want = brute_quest(hz, l, h, cs.budget, cs.qpage, std::string(cs.group) == "max");
        EXPECT_EQ(positions(r.sel[size_t(l)], h), want) << what << " layer " << l << " head " << h;
        EXPECT_LE(int64_t(want.size()), cs.budget);
        EXPECT_EQ(want.back(), hz.L - 1);  // the current page is always read
      }
  }
}

TEST(SparseQuest, PlantedNeedlePageIsSelectedByItsHeadOnly) {
  Harness hz(harness_config(3), 300, 16, 21, 0.3f);
  // A key aligned with query head 4 (KV head 1) at position 37 (page 2) of layer 2.
  for (int d = 0; d < hz.D(); ++d) hz.k(2, 37, 1)[d] = 3.f * hz.q(2, 4)[d];
  auto r = hz.run("quest:budget=32");
  auto h1 = positions(r.sel[2], 1), h0 = positions(r.sel[2], 0);
  EXPECT_EQ(h1.size(), 16u + 12u);  // page 2 + the last page (300 = 18*16 + 12)
  EXPECT_EQ(h1.front(), 32);
  EXPECT_TRUE(std::find(h0.begin(), h0.end(), 37) == h0.end());
}

TEST(SparseStreaming, SinksPlusRecentWindowSharedByAllHeads) {
  Harness hz(harness_config(2), 100, 16, 3);
  auto r = hz.run("streaming:budget=20,sinks=4");
  for (int l = 0; l < 2; ++l) {
    ASSERT_EQ(r.sel[size_t(l)].kind, SelKind::Shared);
    std::vector<int32_t> want = {0, 1, 2, 3};
    for (int p = 84; p < 100; ++p) want.push_back(p);
    EXPECT_EQ(positions(r.sel[size_t(l)], 0), want);
    EXPECT_EQ(positions(r.sel[size_t(l)], 1), want);
  }
}

// Brute-force TidalDecode: top-K of the group-mean score per KV head.
std::vector<int32_t> brute_tidal(Harness& hz, int l, int h, int64_t K) {
  std::vector<double> avg(static_cast<size_t>(hz.L), 0.0);
  for (int g = 0; g < hz.G(); ++g)
    for (int64_t p = 0; p < hz.L; ++p) avg[size_t(p)] += hz.score(l, h * hz.G() + g, p) / hz.G();
  return sorted_first(sorted_by_score(avg, 0, hz.L), size_t(K));
}

TEST(SparseTidal, SelectionLayersPickGroupTopKAndLaterLayersReuseIt) {
  Harness hz(harness_config(6), 150, 16, 17);
  auto r = hz.run("tidal:budget=24,dense_layers=1,selection_layers=1,4");
  EXPECT_TRUE(r.sel[0].dense());
  EXPECT_TRUE(r.sel[1].dense());  // a selection layer attends fully
  EXPECT_TRUE(r.sel[4].dense());
  for (int h = 0; h < 2; ++h) {
    auto from1 = brute_tidal(hz, 1, h, 24), from4 = brute_tidal(hz, 4, h, 24);
    EXPECT_EQ(positions(r.sel[2], h), from1) << "head " << h;
    EXPECT_EQ(positions(r.sel[3], h), from1) << "head " << h;  // reused, not recomputed
    EXPECT_EQ(positions(r.sel[5], h), from4) << "head " << h;
    EXPECT_NE(brute_tidal(hz, 3, h, 24), from1);  // layer 3's own scores would differ
  }
  EXPECT_EQ(r.sel[2].kind, SelKind::PerHead);
}

TEST(SparseTidal, PlantedTokensWinForTheirGroup) {
  // Selection at layer 2 (after 2 dense layers), reused at layer 3. Keys aligned with the
  // mean query of each group win that group's top-3 at layer 2.
  Harness hz(harness_config(4), 120, 16, 2, 0.05f);
  for (int h = 0; h < 2; ++h)
    for (int64_t p : {10 + h, 50 + h, 90 + h})
      for (int d = 0; d < hz.D(); ++d) {
        float m = 0;
        for (int g = 0; g < 3; ++g) m += hz.q(2, h * 3 + g)[d] / 3;
        hz.k(2, p, h)[d] = 2.f * m;
      }
  auto r = hz.run("tidal:budget=3,dense_layers=2,selection_layers=2");
  EXPECT_TRUE(r.sel[2].dense());
  EXPECT_EQ(positions(r.sel[3], 0), (std::vector<int32_t>{10, 50, 90}));
  EXPECT_EQ(positions(r.sel[3], 1), (std::vector<int32_t>{11, 51, 91}));
}

// Brute-force LessIsMore Algorithm 1, written as a sort of (rank, head, position) tuples.
std::vector<int32_t> brute_lessismore(Harness& hz, int l, int64_t K, double r, int sinks) {
  const int64_t n_recent = std::llround(K * r), n_uni = K - n_recent - sinks;
  std::vector<std::tuple<int64_t, int, int32_t>> all;
  for (int hq = 0; hq < hz.cfg.n_heads; ++hq) {
    std::vector<double> s(static_cast<size_t>(hz.L));
    for (int64_t p = 0; p < hz.L; ++p) s[size_t(p)] = hz.score(l, hq, p);
    auto order = sorted_by_score(s, sinks, hz.L - n_recent);
    for (int64_t rank = 0; rank < n_uni; ++rank) all.emplace_back(rank, hq, order[size_t(rank)]);
  }
  std::sort(all.begin(), all.end());
  std::set<int32_t> out;
  int64_t taken = 0;
  for (auto& [rank, hq, p] : all) {
    if (taken == n_uni) break;
    if (out.insert(p).second) ++taken;
  }
  for (int p = 0; p < sinks; ++p) out.insert(p);
  for (int64_t p = hz.L - n_recent; p < hz.L; ++p) out.insert(int32_t(p));
  return std::vector<int32_t>(out.begin(), out.end());
}

TEST(SparseLessIsMore, FollowsAlgorithm1OnRandomCaches) {
  for (uint32_t seed : {4u, 5u, 6u}) {
    Harness hz(harness_config(6), 180 + seed, 16, seed);
    auto r = hz.run("lessismore:budget=40,dense_layers=1,selection_layers=1,4");
    auto want1 = brute_lessismore(hz, 1, 40, 0.25, 4), want4 = brute_lessismore(hz, 4, 40, 0.25, 4);
    EXPECT_EQ(want1.size(), 40u);
    EXPECT_TRUE(r.sel[0].dense() && r.sel[1].dense() && r.sel[4].dense());
    for (int l : {2, 3}) {
      ASSERT_EQ(r.sel[size_t(l)].kind, SelKind::Shared);  // one set, stored once
      EXPECT_EQ(r.sel[size_t(l)].positions, want1) << "seed " << seed << " layer " << l;
    }
    EXPECT_EQ(r.sel[5].positions, want4) << "seed " << seed;
  }
  // Other ratios and sink counts.
  Harness hz(harness_config(3), 200, 16, 8);
  auto r = hz.run("lessismore:budget=50,recent_ratio=0.5,sinks=2,dense_layers=0,selection_layers=0");
  EXPECT_EQ(r.sel[1].positions, brute_lessismore(hz, 0, 50, 0.5, 2));
  EXPECT_EQ(r.sel[2].positions, brute_lessismore(hz, 0, 50, 0.5, 2));
}

TEST(SparseLessIsMore, PlantedCrossHeadRankMerge) {
  // Selection layer 0 (dense_layers=0), sparse layer 1. Queries: head g = 10 * e_g.
  Harness hz(harness_config(2), 100, 16, 12, 0.01f);
  for (int hq = 0; hq < 6; ++hq)
    for (int d = 0; d < hz.D(); ++d) hz.q(0, hq)[d] = d == hq ? 10.f : 0.f;
  auto plant = [&](int64_t pos, int hq, float a) { hz.k(0, pos, hq / 3)[hq] += a; };
  // Rank 0 per head: head 0 and 1 share token 50 (a duplicate dropped by the merge).
  plant(50, 0, 5), plant(50, 1, 5), plant(20, 2, 5), plant(70, 3, 5), plant(10, 4, 5), plant(90, 5, 5);
  // Rank 1 per head; head 3's is scored higher than heads 0-2's but comes later in head order.
  plant(60, 0, 4), plant(30, 1, 4), plant(40, 2, 4), plant(80, 3, 4.9f), plant(15, 4, 4), plant(25, 5, 4);
  // Strong tokens inside the sinks and the recency window are not candidates of the top-k.
  plant(2, 0, 9), plant(97, 0, 9);
  auto r = hz.run("lessismore:budget=16,dense_layers=0,selection_layers=0");
  // K=16, r=0.25: 4 recent, 4 sinks, 8 merged: rank 0 of heads 0..5 (50 once) = 5 tokens,
  // then rank 1 of heads 0, 1, 2 -> 60, 30, 40.
  std::vector<int32_t> want = {0, 1, 2, 3, 10, 20, 30, 40, 50, 60, 70, 90, 96, 97, 98, 99};
  EXPECT_EQ(r.sel[1].positions, want);
  EXPECT_EQ(brute_lessismore(hz, 0, 16, 0.25, 4), want);
}

TEST(SparseOracle, TopKEqualsSortingTheGroupWeight) {
  Harness hz(harness_config(3), 190, 16, 33);
  auto r = hz.run("oracle-topk:budget=30");
  for (int l = 0; l < 3; ++l)
    for (int h = 0; h < 2; ++h) {
      std::vector<double> W(static_cast<size_t>(hz.L), 0.0);
      for (int g = 0; g < 3; ++g) {
        auto w = hz.weights(l, h * 3 + g);
        for (int64_t p = 0; p < hz.L; ++p) W[size_t(p)] += w[size_t(p)];
      }
      EXPECT_EQ(positions(r.sel[size_t(l)], h), sorted_first(sorted_by_score(W, 0, hz.L), 30))
          << "layer " << l << " head " << h;
    }
}

TEST(SparseOracle, TopPIsTheSmallestPrefixReachingP) {
  Harness hz(harness_config(2), 160, 16, 34, 1.5f);
  for (const char* group : {"union", "mean"}) {
    auto r = hz.run(cat("oracle-topp:p=0.8,group=", group), true);
    for (int l = 0; l < 2; ++l)
      for (int h = 0; h < 2; ++h) {
        std::set<int32_t> want;
        auto take = [&](const std::vector<double>& w, double target) {
          double acc = 0;
          for (int32_t p : sorted_by_score(w, 0, hz.L)) {
            want.insert(p);
            if ((acc += w[size_t(p)]) >= target) break;
          }
        };
        std::vector<double> W(static_cast<size_t>(hz.L), 0.0);
        for (int g = 0; g < 3; ++g) {
          auto w = hz.weights(l, h * 3 + g);
          if (std::string(group) == "union") take(w, 0.8);
          for (int64_t p = 0; p < hz.L; ++p) W[size_t(p)] += w[size_t(p)] / 3;
        }
        if (std::string(group) == "mean") take(W, 0.8);
        EXPECT_EQ(positions(r.sel[size_t(l)], h), std::vector<int32_t>(want.begin(), want.end()))
            << group << " layer " << l << " head " << h;
        for (int g = 0; g < 3; ++g) {
          const float rec = r.stats.recall[size_t(l * 6 + h * 3 + g)];
          if (std::string(group) == "union") {
            EXPECT_GE(rec, 0.8f - 1e-5f);
          }
        }
      }
  }
}

TEST(SparseMethods, BudgetAtLeastTheContextIsFullAttentionEverywhere) {
  Harness hz(harness_config(5), 64, 16, 40);
  for (const char* spec : {"streaming:budget=64", "quest:budget=64", "tidal:budget=64",
                           "lessismore:budget=64", "oracle-topk:budget=64", "oracle-topp:p=1",
                           "tidal:budget=5000", "quest:budget=4096"}) {
    auto r = hz.run(spec, true);
    for (int l = 0; l < 5; ++l) {
      // oracle-topp with p=1 may stop once float mass rounds to 1: it must read every token
      // that carries weight; the others must be the Dense selection.
      if (std::string(spec).rfind("oracle-topp", 0) == 0) {
        EXPECT_GE(r.stats.recall[size_t(l * 6)], 1.f - 1e-5f);
        continue;
      }
      EXPECT_TRUE(r.sel[size_t(l)].dense()) << spec << " layer " << l;
    }
    if (std::string(spec).rfind("oracle-topp", 0) != 0) {
      EXPECT_EQ(r.stats.density(), 1.0) << spec;
    }
  }
}

TEST(SparseStats, RecallAndDensityEqualBruteForce) {
  Harness hz(harness_config(5), 210, 16, 50);
  const int64_t K = 48;
  std::map<std::string, double> mean_recall;
  for (const char* m : {"streaming", "quest", "tidal", "lessismore", "oracle-topk"}) {
    auto r = hz.run(cat(m, ":budget=", K), true);
    double dens = 0, rec_sum = 0;
    for (int l = 0; l < 5; ++l)
      for (int h = 0; h < 2; ++h) {
        auto pos = positions(r.sel[size_t(l)], h);
        EXPECT_EQ(r.stats.attended[size_t(l * 2 + h)], int64_t(pos.size()));
        EXPECT_LE(int64_t(pos.size()), r.sel[size_t(l)].dense() ? hz.L : K) << m;
        dens += double(pos.size()) / double(hz.L);
        for (int g = 0; g < 3; ++g) {
          auto w = hz.weights(l, h * 3 + g);
          double rec = 0;
          for (int32_t p : pos) rec += w[size_t(p)];
          EXPECT_NEAR(r.stats.recall[size_t(l * 6 + h * 3 + g)], rec, 2e-5) << m << " layer " << l;
          rec_sum += rec;
        }
      }
    EXPECT_NEAR(r.stats.density(), dens / 10, 1e-12) << m;
    EXPECT_NEAR(r.stats.mean_recall(), rec_sum / 30, 1e-5) << m;
    EXPECT_LT(r.stats.sparse_recall(), 1.0) << m;
    mean_recall[m] = r.stats.sparse_recall();
  }
  // Per layer and KV head, the oracle maximizes group recall among sets of <= K tokens.
  for (auto& [m, rec] : mean_recall)
    if (m != "oracle-topk") {
      EXPECT_LE(rec, mean_recall["oracle-topk"] + 1e-6) << m;
    }
}

TEST(SparseConfigErrors, UnknownMethodAndOptionListTheValidOnes) {
  ModelConfig c = harness_config();
  try {
    make_method(SparseConfig::parse_spec("qest"), c);
    FAIL();
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("unknown sparse method 'qest'; valid methods: full, streaming, quest, tidal, lessismore"),
              std::string::npos) << msg;
    EXPECT_NE(msg.find("oracle-topk, oracle-topp"), std::string::npos) << msg;
  }
  try {
    make_method(SparseConfig::parse_spec("quest:budgt=10"), c);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("valid options: budget, page_size, dense_layers, group"),
              std::string::npos) << e.what();
  }
  EXPECT_THROW(make_method(SparseConfig::parse_spec("quest:budget=abc"), c), Error);
  EXPECT_THROW(make_method(SparseConfig::parse_spec("quest:group=avg"), c), Error);
  EXPECT_THROW(make_method(SparseConfig::parse_spec("full:budget=10"), c), Error);
  EXPECT_THROW(make_method(SparseConfig::parse_spec("tidal:selection_layers=9"), c), Error);
  EXPECT_THROW(make_method(SparseConfig::parse_spec("tidal:dense_layers=1,selection_layers=3"), c), Error);
  EXPECT_THROW(make_method(SparseConfig::parse_spec("lessismore:budget=4"), c), Error);
}
