// BLASST: lambda = 0 is exact attention; the skip decisions equal a brute-force
// re-implementation of Algorithm 1 (every tile order, decode over selections and causal
// prefill); the output error is bounded by the skipped mass; V rows are read only for kept
// tiles; the one-pass gap trace predicts every lambda's sparsity; sessions and stacks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <numeric>
#include <random>

#include "backend/cpu/attention.h"
#include "backend/cpu/attention_blasst.h"
#include "sparse/blasst_calibration.h"
#include "sparse/methods/blasst.h"
#include "sparse/registry.h"
#include "sparse/session.h"
#include "test_util.h"

using namespace spade;
using namespace spade::sparse;
using cpu::TileOrder;

namespace {

// Cache with integer-valued keys and queries (D = 16, scale 1/4): every score is exact in
// float whatever the summation order, so skip decisions can be compared bit for bit.
struct IntCache {
  int Hkv = 2, G = 3, D = 16, page = 16;
  int64_t L;
  std::vector<float> K, V, Q;  // K/V [pos][h][D], Q [Hq][D]
  KVPool kv;
  PageTable pt;
  IntCache(int64_t L_, uint32_t seed, bool integer = true)
      : L(L_), kv(KVLayout{1, 2, 16, 16}, (L_ + 15) / 16 + 1) {
    std::mt19937 rng(seed);
    K.resize(size_t(L * Hkv * D));
    V.resize(K.size());
    Q.resize(size_t(Hkv * G * D));
    auto ri = [&](int lo, int hi) { return float(lo + int(rng() % uint32_t(hi - lo + 1))); };
    std::normal_distribution<float> nd(0.f, 1.f);
    for (int h = 0; h < Hkv; ++h) {
      std::vector<float> base(static_cast<size_t>(D));
      for (auto& x : base) x = integer ? ri(-2, 2) : nd(rng);
      for (int g = 0; g < G; ++g)
        for (int d = 0; d < D; ++d)
          Q[size_t((h * G + g) * D + d)] = base[size_t(d)] + (integer ? ri(-1, 1) : 0.3f * nd(rng));
    }
    for (auto& x : K) x = integer ? ri(-1, 1) : nd(rng);
    for (auto& x : V) x = nd(rng);
    // Planted keys along the group's queries: tiles after them fall far below the max.
    for (int h = 0; h < Hkv; ++h)
      for (int j = 0; j < 4; ++j) {
        const int64_t p = int64_t(rng() % uint32_t(L));
        for (int d = 0; d < D; ++d) {
          const float s = Q[size_t((h * G) * D + d)];
          K[size_t((p * Hkv + h) * D + d)] = 3.f * float((s > 0) - (s < 0));
        }
      }
    kv.reserve(pt, L);
    for (int64_t p = 0; p < L; ++p)
      kv.write(0, pt, p, &K[size_t(p * Hkv * D)], &V[size_t(p * Hkv * D)]);
    pt.length = L;
  }
  double score(const float* q, int64_t p, int h) const {
    double s = 0;
    for (int d = 0; d < D; ++d) s += double(q[d]) * K[size_t((p * Hkv + h) * D + d)];
    return s * 0.25;
  }
  const float* v(int64_t p, int h) const { return &V[size_t((p * Hkv + h) * D)]; }
};

std::vector<int64_t> visit_order(TileOrder o, int64_t nt) {
  std::vector<int64_t> ord;
  if (o == TileOrder::Sequential)
    for (int64_t j = 0; j < nt; ++j) ord.push_back(j);
  else if (o == TileOrder::Reverse)
    for (int64_t j = nt - 1; j >= 0; --j) ord.push_back(j);
  else {
    ord.push_back(0);
    if (nt > 1) ord.push_back(nt - 1);
    for (int64_t j = 1; j + 1 < nt; ++j) ord.push_back(j);
  }
  return ord;
}

// Brute-force Algorithm 1 for one row block: s[r][c] scores, row r sees c < lim[r]. Returns
// the skip flag per visible tile (tile order) and the output rows: softmax over the kept
// tiles' visible keys (the online softmax of the kept tiles is exact).
struct Brute {
  std::vector<uint8_t> skipped;
  std::vector<std::vector<double>> out;
};
Brute brute(const std::vector<std::vector<double>>& s, const std::vector<int64_t>& lim, int64_t n,
            int64_t tile, TileOrder order, double loglam,
            const std::function<const float*(int64_t)>& vrow, int D) {
  const size_t M = s.size();
  const int64_t nt = (n + tile - 1) / tile;
  std::vector<double> m(M, -INFINITY);
  std::vector<int> state(static_cast<size_t>(nt), 0);  // 0 invisible, 1 kept, 2 skipped
  for (int64_t j : visit_order(order, nt)) {
    const int64_t c0 = j * tile, c1 = std::min(n, c0 + tile);
    bool vis = false, skip = true;
    std::vector<double> tm(M, -INFINITY);
    for (size_t r = 0; r < M; ++r) {
      for (int64_t c = c0; c < std::min(c1, lim[r]); ++c) tm[r] = std::max(tm[r], s[r][size_t(c)]);
      if (tm[r] == -INFINITY) continue;
      vis = true;
      if (!(tm[r] - std::max(m[r], tm[r]) < loglam)) skip = false;
    }
    if (!vis) continue;
    state[size_t(j)] = skip ? 2 : 1;
    if (!skip)
      for (size_t r = 0; r < M; ++r) m[r] = std::max(m[r], tm[r]);
  }
  Brute b;
  for (int64_t j = 0; j < nt; ++j)
    if (state[size_t(j)]) b.skipped.push_back(state[size_t(j)] == 2);
  for (size_t r = 0; r < M; ++r) {
    std::vector<double> o(static_cast<size_t>(D), 0.0);
    double z = 0;
    for (int64_t c = 0; c < std::min(n, lim[r]); ++c) {
      if (state[size_t(c / tile)] != 1) continue;
      const double e = std::exp(s[r][size_t(c)] - m[r]);
      z += e;
      for (int d = 0; d < D; ++d) o[size_t(d)] += e * vrow(c)[d];
    }
    for (auto& x : o) x = z > 0 ? x / z : 0.0;
    b.out.push_back(o);
  }
  return b;
}

std::vector<int32_t> random_subset(int64_t L, int64_t n, std::mt19937& rng) {
  std::vector<int32_t> all(static_cast<size_t>(L));
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(size_t(n));
  std::sort(all.begin(), all.end());
  return all;
}

Selection per_head(const std::vector<std::vector<int32_t>>& pos, int64_t L) {
  Selection s;
  s.begin_per_head(int(pos.size()), L);
  for (const auto& h : pos) {
    for (int32_t p : h) s.push(p);
    s.close_head();
  }
  return s;
}

}  // namespace

// ---------------------------------------------------------------- lambda = 0

TEST(Blasst, LambdaZeroIsExactAttentionInDecodeAndPrefill) {
  IntCache c(301, 1, false);
  const int Hq = c.Hkv * c.G;
  const float scale = 0.25f;
  std::mt19937 rng(2);
  cpu::BlasstScratch bs;
  cpu::AttentionScratch as;
  std::vector<float> out(size_t(Hq * c.D)), ref(out.size());
  const float ll[2] = {-INFINITY, -INFINITY};
  for (int variant = 0; variant < 3; ++variant) {
    Selection sel;
    if (variant == 0)
      sel.set_dense(c.Hkv, c.L);
    else
      sel = per_head({random_subset(c.L, 97 + variant, rng), random_subset(c.L, 150, rng)}, c.L);
    cpu::TileCounts counts[2];
    cpu::attention_blasst_decode(c.kv, 0, c.pt, c.Q.data(), Hq, scale, sel, ll, 32,
                                 TileOrder(variant), out.data(), bs, counts);
    cpu::attention_selected(c.kv, 0, c.pt, c.Q.data(), Hq, scale, sel, ref.data(), as);
    for (int h = 0; h < c.Hkv; ++h) {
      EXPECT_EQ(counts[h].skipped, 0);
      EXPECT_EQ(counts[h].tiles, (sel.count(h) + 31) / 32);
    }
    for (size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out[i], ref[i], 2e-6f) << variant;
  }
  // Prefill: the last 90 tokens of the cache as a chunk, vs dense causal attention.
  const int64_t p0 = 211, T = 90;
  std::vector<float> q(size_t(T * Hq * c.D));
  test::fill_random(q.data(), q.size(), rng);
  std::vector<float> o1(q.size()), o2(q.size());
  std::vector<cpu::TileCounts> counts(static_cast<size_t>(Hq));
  cpu::attention_blasst_prefill(c.kv, 0, c.pt, q.data(), p0, T, Hq, scale, -INFINITY, 32, 40,
                                TileOrder::Sequential, o1.data(), bs, counts.data());
  cpu::attention_dense(c.kv, 0, c.pt, q.data(), p0, T, Hq, scale, o2.data(), as);
  for (size_t i = 0; i < o1.size(); ++i) ASSERT_NEAR(o1[i], o2[i], 2e-6f);
  // Row blocks [0,40), [40,80), [80,90): visible tiles ceil((p0 + block end) / 32).
  const int64_t want = (p0 + 40 + 31) / 32 + (p0 + 80 + 31) / 32 + (p0 + 90 + 31) / 32;
  for (int g = 0; g < Hq; ++g) {
    EXPECT_EQ(counts[size_t(g)].skipped, 0);
    EXPECT_EQ(counts[size_t(g)].tiles, want);
  }
}

// ---------------------------------------------------------------- decisions vs brute force

TEST(Blasst, DecodeSkipDecisionsAndOutputEqualBruteForce) {
  IntCache c(517, 3);
  const int Hq = c.Hkv * c.G;
  std::mt19937 rng(4);
  cpu::BlasstScratch bs;
  std::vector<float> out(size_t(Hq * c.D));
  int64_t total_skipped = 0;
  for (TileOrder order : {TileOrder::Sequential, TileOrder::Reverse, TileOrder::SinkRecent})
    for (double lam : {0.003, 0.05, 0.2, 0.9})
      for (int dense = 0; dense < 2; ++dense) {
        Selection sel = dense ? Selection{}
                              : per_head({random_subset(c.L, 300, rng), random_subset(c.L, 77, rng)},
                                         c.L);
        if (dense) sel.set_dense(c.Hkv, c.L);
        const float ll[2] = {float(std::log(lam)), float(std::log(lam))};
        std::vector<uint8_t> skipped;
        cpu::BlasstTrace tr;
        tr.skipped = &skipped;
        cpu::TileCounts counts[2];
        cpu::attention_blasst_decode(c.kv, 0, c.pt, c.Q.data(), Hq, 0.25f, sel, ll, 16, order,
                                     out.data(), bs, counts, &tr);
        std::vector<uint8_t> want;
        for (int h = 0; h < c.Hkv; ++h) {
          const int64_t n = sel.count(h);
          auto pos = [&](int64_t i) { return sel.dense() ? i : int64_t(sel.head(h)[i]); };
          std::vector<std::vector<double>> s(size_t(c.G), std::vector<double>(size_t(n)));
          for (int g = 0; g < c.G; ++g)
            for (int64_t i = 0; i < n; ++i)
              s[size_t(g)][size_t(i)] = c.score(&c.Q[size_t((h * c.G + g) * c.D)], pos(i), h);
          Brute b = brute(s, std::vector<int64_t>(size_t(c.G), n), n, 16, order, std::log(lam),
                          [&](int64_t i) { return c.v(pos(i), h); }, c.D);
          want.insert(want.end(), b.skipped.begin(), b.skipped.end());
          int64_t sk = 0;
          for (uint8_t x : b.skipped) sk += x;
          EXPECT_EQ(counts[h].skipped, sk);
          EXPECT_EQ(counts[h].tiles, int64_t(b.skipped.size()));
          total_skipped += sk;
          for (int g = 0; g < c.G; ++g)
            for (int d = 0; d < c.D; ++d)
              ASSERT_NEAR(out[size_t((h * c.G + g) * c.D + d)], b.out[size_t(g)][size_t(d)], 1e-5)
                  << "lambda " << lam << " order " << int(order);
        }
        ASSERT_EQ(skipped, want) << "lambda " << lam << " order " << int(order) << " dense " << dense;
      }
  EXPECT_GT(total_skipped, 50);  // the planted peaks make the test meaningful
}

TEST(Blasst, PrefillSkipDecisionsAndOutputEqualBruteForce) {
  IntCache c(300, 5);
  const int Hq = c.Hkv * c.G;
  const int64_t p0 = 100, T = 200, tile = 16, qb = 48;
  std::mt19937 rng(6);
  // Integer queries for the chunk, near the planted directions.
  std::vector<float> q(size_t(T * Hq * c.D));
  for (int64_t t = 0; t < T; ++t)
    for (int hq = 0; hq < Hq; ++hq)
      for (int d = 0; d < c.D; ++d)
        q[size_t((t * Hq + hq) * c.D + d)] = c.Q[size_t(hq * c.D + d)] + float(int(rng() % 3) - 1);
  cpu::BlasstScratch bs;
  std::vector<float> out(q.size());
  int64_t total_skipped = 0;
  for (TileOrder order : {TileOrder::Sequential, TileOrder::Reverse, TileOrder::SinkRecent})
    for (double lam : {0.01, 0.3}) {
      std::vector<uint8_t> skipped;
      cpu::BlasstTrace tr;
      tr.skipped = &skipped;
      std::vector<cpu::TileCounts> counts(static_cast<size_t>(Hq));
      cpu::attention_blasst_prefill(c.kv, 0, c.pt, q.data(), p0, T, Hq, 0.25f, float(std::log(lam)),
                                    tile, qb, order, out.data(), bs, counts.data(), &tr);
      std::vector<uint8_t> want;
      for (int h = 0; h < c.Hkv; ++h)
        for (int64_t t0 = 0; t0 < T; t0 += qb)
          for (int g = 0; g < c.G; ++g) {
            const int64_t tb = std::min(qb, T - t0), n = p0 + t0 + tb;
            std::vector<std::vector<double>> s;
            std::vector<int64_t> lim;
            for (int64_t t = 0; t < tb; ++t) {
              std::vector<double> row(static_cast<size_t>(n));
              for (int64_t p = 0; p < n; ++p)
                row[size_t(p)] = c.score(&q[size_t(((t0 + t) * Hq + h * c.G + g) * c.D)], p, h);
              s.push_back(row);
              lim.push_back(p0 + t0 + t + 1);
            }
            Brute b = brute(s, lim, n, tile, order, std::log(lam),
                            [&](int64_t p) { return c.v(p, h); }, c.D);
            want.insert(want.end(), b.skipped.begin(), b.skipped.end());
            for (uint8_t x : b.skipped) total_skipped += x;
            for (int64_t t = 0; t < tb; ++t)
              for (int d = 0; d < c.D; ++d)
                ASSERT_NEAR(out[size_t(((t0 + t) * Hq + h * c.G + g) * c.D + d)],
                            b.out[size_t(t)][size_t(d)], 1e-5);
          }
      ASSERT_EQ(skipped, want) << "lambda " << lam << " order " << int(order);
      int64_t sk = 0, tiles = 0;
      for (auto& x : counts) sk += x.skipped, tiles += x.tiles;
      EXPECT_EQ(tiles, int64_t(want.size()));
      EXPECT_EQ(sk, int64_t(std::count(want.begin(), want.end(), 1)));
    }
  EXPECT_GT(total_skipped, 100);
}

// ---------------------------------------------------------------- error bound

TEST(Blasst, OutputErrorIsBoundedByTheSkippedMass) {
  // Float data. Derivation (BLASST 3.1): a skipped token i has s_i <= m~ < m(j) + ln(lambda)
  // <= m_final + ln(lambda), so its true weight w_i = exp(s_i - m_final) / Z < lambda
  // (Z >= 1). The output is the softmax over the kept tokens, so with skipped mass
  // s = sum of skipped w_i:  O - O_b = sum_{i skipped} w_i (v_i - O_b), hence
  // |O - O_b|_d <= s * max_i |v_i,d - O_b,d| <= 2 s max|v|.
  IntCache c(1000, 7, false);
  const int Hq = c.Hkv * c.G;
  const float scale = 1.f / 4.f;
  cpu::BlasstScratch bs;
  std::vector<float> out(size_t(Hq * c.D));
  Selection sel;
  sel.set_dense(c.Hkv, c.L);
  double worst_ratio = 0;
  int64_t skipped_tiles = 0;
  for (double lam : {1e-4, 1e-3, 1e-2, 0.1, 0.5}) {
    const float ll[2] = {float(std::log(lam)), float(std::log(lam))};
    std::vector<uint8_t> skipped;
    cpu::BlasstTrace tr;
    tr.skipped = &skipped;
    cpu::attention_blasst_decode(c.kv, 0, c.pt, c.Q.data(), Hq, scale, sel, ll, 32,
                                 TileOrder::Sequential, out.data(), bs, nullptr, &tr);
    const int64_t nt = (c.L + 31) / 32;
    ASSERT_EQ(int64_t(skipped.size()), nt * c.Hkv);
    for (int h = 0; h < c.Hkv; ++h)
      for (int g = 0; g < c.G; ++g) {
        const float* q = &c.Q[size_t((h * c.G + g) * c.D)];
        std::vector<double> w(size_t(c.L));
        double mx = -1e300, z = 0;
        for (int64_t p = 0; p < c.L; ++p) mx = std::max(mx, w[size_t(p)] = c.score(q, p, h));
        for (auto& x : w) z += (x = std::exp(x - mx));
        for (auto& x : w) x /= z;
        std::vector<double> o(size_t(c.D), 0.0);
        double smass = 0;
        for (int64_t p = 0; p < c.L; ++p) {
          for (int d = 0; d < c.D; ++d) o[size_t(d)] += w[size_t(p)] * c.v(p, h)[d];
          if (skipped[size_t(h * nt + p / 32)]) {
            smass += w[size_t(p)];
            ASSERT_LT(w[size_t(p)], lam * (1 + 1e-5)) << "skipped token above lambda";
          }
        }
        const float* ob = &out[size_t((h * c.G + g) * c.D)];
        for (int d = 0; d < c.D; ++d) {
          double spread = 0;
          for (int64_t p = 0; p < c.L; ++p) spread = std::max(spread, double(std::fabs(c.v(p, h)[d] - ob[d])));
          const double err = std::fabs(o[size_t(d)] - ob[d]);
          ASSERT_LE(err, smass * spread + 2e-6) << "lambda " << lam;
          if (smass > 1e-9) worst_ratio = std::max(worst_ratio, err / (smass * spread));
        }
      }
    for (uint8_t x : skipped) skipped_tiles += x;
  }
  EXPECT_GT(skipped_tiles, 20);
  EXPECT_GT(worst_ratio, 0.0);
}

// ---------------------------------------------------------------- V reads

TEST(Blasst, ReadsValueRowsOnlyForKeptTiles) {
  std::mt19937 rng(8);
  const int64_t M = 3, n = 200, D = 8, tile = 16;
  std::vector<float> S(size_t(M * n)), V(size_t(n * D)), O(size_t(M * D));
  test::fill_random(S.data(), S.size(), rng, 3.f);
  test::fill_random(V.data(), V.size(), rng);
  for (int64_t r = 0; r < M; ++r) S[size_t(r * n + 20)] = 30.f;  // one dominant key
  std::vector<int64_t> reads;
  cpu::VRowsFn v_rows = [&](int64_t start, int64_t len) -> const float* {
    EXPECT_EQ(start % tile, 0);
    EXPECT_EQ(len, std::min(tile, n - start));
    reads.push_back(start / tile);
    return V.data() + start * D;
  };
  std::vector<uint8_t> skipped;
  cpu::BlasstTrace tr;
  tr.skipped = &skipped;
  cpu::BlasstScratch sc;
  cpu::BlasstParams p{float(std::log(1e-3)), tile, TileOrder::Sequential};
  const cpu::TileCounts tc = cpu::blasst_rows(S.data(), n, M, n, nullptr, D, p, v_rows, O.data(), D,
                                              sc, &tr);
  std::vector<int64_t> kept;
  for (size_t j = 0; j < skipped.size(); ++j)
    if (!skipped[j]) kept.push_back(int64_t(j));
  EXPECT_EQ(reads, kept);
  EXPECT_EQ(tc.tiles, (n + tile - 1) / tile);
  EXPECT_EQ(tc.skipped, tc.tiles - int64_t(kept.size()));
  EXPECT_GE(tc.skipped, 8);  // everything after tile 1 is ~27 below the max
}

TEST(Blasst, InitialMaxSeedsTheSkipTestOnly) {
  // A seeded running max lets the first tiles be skipped too; the kept tiles' softmax stays
  // exact: the output equals brute-force attention over exactly the kept tiles.
  std::mt19937 rng(12);
  const int64_t M = 2, n = 96, D = 8, tile = 16;
  std::vector<float> S(size_t(M * n)), V(size_t(n * D));
  test::fill_random(S.data(), S.size(), rng, 1.f);
  test::fill_random(V.data(), V.size(), rng);
  for (int64_t r = 0; r < M; ++r) S[size_t(r * n + 70)] = 12.f;  // the max sits in tile 4
  cpu::VRowsFn v_rows = [&](int64_t start, int64_t) { return V.data() + start * D; };
  cpu::BlasstScratch sc;
  for (bool seeded : {false, true}) {
    SCOPED_TRACE(seeded);
    const std::vector<float> seed(size_t(M), 12.f);
    cpu::BlasstParams p{float(std::log(1e-2)), tile, TileOrder::Sequential,
                        seeded ? seed.data() : nullptr};
    std::vector<float> s2 = S, O(size_t(M * D));
    std::vector<uint8_t> skipped;
    cpu::BlasstTrace tr;
    tr.skipped = &skipped;
    const cpu::TileCounts tc = cpu::blasst_rows(s2.data(), n, M, n, nullptr, D, p, v_rows, O.data(),
                                                D, sc, &tr);
    ASSERT_EQ(skipped.size(), size_t(6));
    // Unseeded, tiles 0..3 each hold their row's running max at some point (kept at least
    // tile 0); seeded, every tile but the max's is ~10 below it.
    if (seeded) {
      EXPECT_EQ(tc.skipped, 5);
      EXPECT_EQ(skipped[4], 0);
    } else {
      EXPECT_EQ(skipped[0], 0);
      EXPECT_LT(tc.skipped, 5);
    }
    for (int64_t r = 0; r < M; ++r) {
      double mx = -INFINITY, den = 0;
      for (size_t t = 0; t < skipped.size(); ++t)
        if (!skipped[t])
          for (int64_t j = int64_t(t) * tile; j < std::min(n, int64_t(t + 1) * tile); ++j)
            mx = std::max(mx, double(S[size_t(r * n + j)]));
      std::vector<double> o(size_t(D), 0.0);
      for (size_t t = 0; t < skipped.size(); ++t)
        if (!skipped[t])
          for (int64_t j = int64_t(t) * tile; j < std::min(n, int64_t(t + 1) * tile); ++j) {
            const double w = std::exp(double(S[size_t(r * n + j)]) - mx);
            den += w;
            for (int64_t d = 0; d < D; ++d) o[size_t(d)] += w * V[size_t(j * D + d)];
          }
      for (int64_t d = 0; d < D; ++d)
        EXPECT_NEAR(O[size_t(r * D + d)], o[size_t(d)] / den, 1e-5) << "row " << r << " dim " << d;
    }
  }
}

// ---------------------------------------------------------------- one-pass gaps

TEST(Blasst, GapTracePredictsTheSparsityOfEveryLambda) {
  IntCache c(400, 9, false);
  const int Hq = c.Hkv * c.G;
  std::mt19937 rng(10);
  std::vector<float> q(size_t(150 * Hq * c.D));
  test::fill_random(q.data(), q.size(), rng, 2.f);
  cpu::BlasstScratch bs;
  std::vector<float> out(q.size());
  std::vector<float> gaps;
  cpu::BlasstTrace tr;
  tr.gaps = &gaps;
  cpu::attention_blasst_prefill(c.kv, 0, c.pt, q.data(), 250, 150, Hq, 0.25f, -INFINITY, 32, 64,
                                TileOrder::Sequential, out.data(), bs, nullptr, &tr);
  std::sort(gaps.begin(), gaps.end());
  for (double lam : {1e-5, 1e-3, 0.01, 0.1, 0.5, 1.0}) {
    std::vector<cpu::TileCounts> counts(static_cast<size_t>(Hq));
    cpu::attention_blasst_prefill(c.kv, 0, c.pt, q.data(), 250, 150, Hq, 0.25f, float(std::log(lam)),
                                  32, 64, TileOrder::Sequential, out.data(), bs, counts.data());
    cpu::TileCounts t;
    for (auto& x : counts) t += x;
    ASSERT_EQ(t.tiles, int64_t(gaps.size()));
    EXPECT_DOUBLE_EQ(double(t.skipped) / double(t.tiles), sparsity_from_gaps(gaps, lam)) << lam;
  }
  EXPECT_GT(sparsity_from_gaps(gaps, 0.5), 0.0);
}

// ---------------------------------------------------------------- Algorithm 2

TEST(BlasstCalibration, RecoversAKnownAOnSyntheticData) {
  // Synthetic model of the skip ratio: a logistic in log(lambda * L / a_true), so the target
  // sparsity S is reached at lambda = a_true * (S / (1 - S))^(1/k) / L.
  const double a_true = 3.7, k = 1.6;
  int calls = 0;
  SparsityFn measure = [&](double lam, int64_t L) {
    ++calls;
    return 1.0 / (1.0 + std::exp(-k * std::log(lam * double(L) / a_true)));
  };
  const auto grid = log_grid(1e-6, 1.0, 4);
  ASSERT_EQ(grid.size(), 25u);
  EXPECT_NEAR(grid[4], 1e-5, 1e-17);
  for (double S : {0.5, 0.7}) {
    BlasstCalibration c = calibrate_blasst(measure, S, {512, 1024, 2048, 4096}, grid, 0.02, 12);
    const double want = a_true * std::pow(S / (1 - S), 1 / k);
    EXPECT_NEAR(c.a, want, 0.01 * want) << S;
    EXPECT_GT(c.r2, 0.999);
    EXPECT_EQ(c.used, 4);
    for (const auto& l : c.lengths) {
      EXPECT_TRUE(l.kept);
      EXPECT_LT(l.gap, 0.005);
      EXPECT_TRUE(std::is_sorted(l.sweep.begin(), l.sweep.end(),
                                 [](auto& a, auto& b) { return a.lambda < b.lambda; }));
    }
  }
  // Without refinement the grid point nearest in sparsity is taken (Algorithm 2 as written).
  BlasstCalibration c = calibrate_blasst(measure, 0.5, {1000}, {1e-3, 2e-3, 4e-3, 8e-3}, 0.2, 0);
  EXPECT_DOUBLE_EQ(c.lengths[0].lambda_best, 4e-3);
  EXPECT_NEAR(c.a, 4.0, 1e-12);
  EXPECT_TRUE(std::isnan(c.r2));
  // delta drops lengths that cannot reach the target; none left is an error.
  EXPECT_THROW(calibrate_blasst(measure, 0.5, {1000}, {1e-6}, 0.05, 0), Error);
  // The error says what each length measured (closest sparsity, its lambda, the swept range).
  try {
    calibrate_blasst(measure, 0.5, {1000}, {1e-6, 1e-5}, 0.05, 0);
    FAIL() << "no length reached the target, yet no error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("L=1000: closest " + std::to_string(measure(1e-5, 1000)) + " at lambda " +
                     std::to_string(1e-5) + ", swept " + std::to_string(measure(1e-6, 1000)) +
                     ".." + std::to_string(measure(1e-5, 1000))),
              std::string::npos)
        << m;
  }
}

TEST(BlasstCalibration, FitThroughOrigin) {
  double r2 = 0;
  EXPECT_DOUBLE_EQ(fit_through_origin({1, 2, 3}, {2, 4, 6}, &r2), 2.0);
  EXPECT_DOUBLE_EQ(r2, 1.0);
  EXPECT_NEAR(fit_through_origin({1, 2}, {1, 3}, &r2), 7.0 / 5.0, 1e-12);
  EXPECT_LT(r2, 1.0);
}

// ---------------------------------------------------------------- methods and sessions

namespace {
struct TinyModel {
  ModelConfig cfg = test::tiny_config();
  ModelWeights w = test::random_model(cfg, 31);
  std::vector<int32_t> tokens;
  TinyModel() {
    std::mt19937 rng(32);
    for (int i = 0; i < 120; ++i) tokens.push_back(int32_t(rng() % uint32_t(cfg.vocab)));
  }
  // Logits of prefill(80) and 6 teacher-forced decode steps through `attn`.
  std::vector<float> run(const AttentionFn* attn) {
    ModelRunner r(w, 128);
    std::vector<float> all;
    const float* lg = r.prefill(tokens.data(), 80, attn, 48);  // two chunks
    all.insert(all.end(), lg, lg + cfg.vocab);
    for (int i = 0; i < 6; ++i) {
      lg = r.step(tokens[size_t(80 + i)], attn);
      all.insert(all.end(), lg, lg + cfg.vocab);
    }
    return all;
  }
};
std::shared_ptr<const SparseMethod> make(const std::string& spec, const ModelConfig& cfg) {
  return make_method(SparseConfig::parse_spec(spec), cfg);
}
}  // namespace

TEST(BlasstSession, LambdaZeroMatchesDenseAndSkippingIsCounted) {
  TinyModel t;
  auto dense = t.run(nullptr);
  ModelRunner r(t.w, 128);
  ProbeSession s0(make("blasst:lambda=0,tile=8,prefill_tile=8,q_block=16", t.cfg), t.cfg, r.kv());
  std::vector<float> got;
  const float* lg = r.prefill(t.tokens.data(), 80, &s0.attention(), 48);
  got.insert(got.end(), lg, lg + t.cfg.vocab);
  for (int i = 0; i < 6; ++i) {
    lg = r.step(t.tokens[size_t(80 + i)], &s0.attention());
    got.insert(got.end(), lg, lg + t.cfg.vocab);
  }
  ASSERT_EQ(got.size(), dense.size());
  for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], dense[i], 1e-4f);
  EXPECT_EQ(s0.blasst()->prefill_sparsity(), 0.0);
  EXPECT_EQ(s0.blasst()->decode_sparsity(), 0.0);
  EXPECT_EQ(s0.steps(), 6);
  // A large lambda skips in both phases (prefill skipping is opt-in: prefill=1).
  ModelRunner r2(t.w, 128);
  ProbeSession s1(make("blasst:lambda=0.9,tile=8,prefill_tile=8,q_block=16,prefill=1", t.cfg), t.cfg,
                  r2.kv());
  r2.prefill(t.tokens.data(), 80, &s1.attention(), 48);
  for (int i = 0; i < 6; ++i) r2.step(t.tokens[size_t(80 + i)], &s1.attention());
  EXPECT_GT(s1.blasst()->prefill_sparsity(), 0.0);
  EXPECT_GT(s1.blasst()->decode_sparsity(), 0.0);
  EXPECT_LT(s1.blasst()->decode_sparsity(), 1.0);
}

TEST(BlasstSession, SkipsInsideTheBaseSelection) {
  TinyModel t;
  ModelRunner r(t.w, 128);
  auto m = make("blasst:base=quest+twilight,budget=32,dense_layers=0,keys=exact,p=0.999,"
                "lambda=0,tile=8",
                t.cfg);
  ProbeSession s(m, t.cfg, r.kv());
  r.prefill(t.tokens.data(), 80, &s.attention(), 80);
  r.step(t.tokens[80], &s.attention());
  const BlasstStats* st = s.blasst();
  const TwilightStats* tw = s.twilight();
  ASSERT_TRUE(st && tw);
  for (int l = 0; l < t.cfg.n_layers; ++l)
    for (int h = 0; h < t.cfg.n_kv_heads; ++h) {
      const size_t i = size_t(l * t.cfg.n_kv_heads + h);
      // quest at L = 81: its best full page + the current page (1 token).
      EXPECT_EQ(tw->base_count[i], 17);
      EXPECT_LE(tw->kept_count[i], tw->base_count[i]);
      EXPECT_GE(tw->kept_count[i], 1);
      EXPECT_EQ(st->step[i].tiles, (tw->kept_count[i] + 7) / 8);  // tiles of the kept rows
    }
  EXPECT_NEAR(s.mean_attended(), tw->mean_kept(), 1e-9);
}

TEST(BlasstSession, SparseSessionRunsTheHooksLikeTheProbeSession) {
  TinyModel t;
  auto m = make("blasst:lambda=0.9,tile=8,prefill_tile=8,q_block=16", t.cfg);
  ModelRunner r1(t.w, 128), r2(t.w, 128);
  SparseSession s1(m, t.cfg, r1.kv());
  ProbeSession s2(m, t.cfg, r2.kv());
  const float* a = r1.prefill(t.tokens.data(), 80, &s1.attention(), 48);
  const float* b = r2.prefill(t.tokens.data(), 80, &s2.attention(), 48);
  for (int v = 0; v < t.cfg.vocab; ++v) ASSERT_EQ(a[v], b[v]);
  for (int i = 0; i < 4; ++i) {
    a = r1.step(t.tokens[size_t(80 + i)], &s1.attention());
    b = r2.step(t.tokens[size_t(80 + i)], &s2.attention());
    for (int v = 0; v < t.cfg.vocab; ++v) ASSERT_EQ(a[v], b[v]);
  }
  EXPECT_GT(s2.blasst()->decode_sparsity(), 0.0);
  const auto dense = t.run(nullptr);
  double diff = 0;
  for (int v = 0; v < t.cfg.vocab; ++v) diff = std::max(diff, double(std::fabs(b[v] - dense[size_t(4 * t.cfg.vocab + v)])));
  EXPECT_GT(diff, 1e-4);  // the skipping changed the computation
}

// Density and recall count the rows BLASST's attention read: a skipped tile's rows get no
// weight, so they are not attended (issue 37, item 5: density read 1.0 while tiles skipped).
// Per (layer, KV head) of every step, L - attended is the rows of the skipped tiles: between
// 8 * skipped - 7 (the last tile may be partial) and 8 * skipped; recall is the full
// attention's mass on the kept rows (1 with lambda = 0). ProbeSession counts the same rows.
TEST(BlasstSession, DensityAndRecallCountOnlyTheKeptTiles) {
  TinyModel t;
  auto m = make("blasst:lambda=0.9,tile=8,prefill_tile=8,q_block=16", t.cfg);
  ModelRunner r(t.w, 128), r2(t.w, 128);
  SessionOptions so;
  so.measure_recall = true;
  SparseSession s(m, t.cfg, r.kv(), so);
  ProbeSession p(m, t.cfg, r2.kv(), true);
  r.prefill(t.tokens.data(), 80, &s.attention(), 48);
  r2.prefill(t.tokens.data(), 80, &p.attention(), 48);
  const int Hkv = t.cfg.n_kv_heads;
  int64_t skipped_tiles = 0;
  double attended_sum = 0;
  for (int i = 0; i < 6; ++i) {
    r.step(t.tokens[size_t(80 + i)], &s.attention());
    r2.step(t.tokens[size_t(80 + i)], &p.attention());
    const StepStats& st = s.last_step();
    auto* bs = dynamic_cast<const BlasstState*>(s.state());
    ASSERT_TRUE(bs);
    for (int l = 0; l < t.cfg.n_layers; ++l)
      for (int h = 0; h < Hkv; ++h) {
        const cpu::TileCounts& tc = bs->stats.step[size_t(l * Hkv + h)];
        const int64_t dropped = st.length - st.attended[size_t(l * Hkv + h)];
        EXPECT_LE(dropped, 8 * tc.skipped) << "layer " << l << " head " << h;
        EXPECT_GE(dropped, 8 * tc.skipped - 7) << "layer " << l << " head " << h;
        EXPECT_GE(st.attended[size_t(l * Hkv + h)], 1);
        skipped_tiles += tc.skipped;
        attended_sum += double(st.attended[size_t(l * Hkv + h)]);
      }
    EXPECT_LE(st.mean_recall(), 1.0 + 1e-6);
    EXPECT_GT(st.min_recall(), 0.0);
  }
  ASSERT_GT(skipped_tiles, 0);
  EXPECT_LT(s.totals().mean_density(), 1.0);
  EXPECT_LT(s.totals().mean_recall(), 1.0);
  EXPECT_NEAR(p.mean_attended(), attended_sum / double(6 * t.cfg.n_layers * Hkv), 1e-9);
  // lambda = 0 skips nothing: density and recall 1.
  ModelRunner r3(t.w, 128);
  SparseSession s0(make("blasst:lambda=0,tile=8,prefill_tile=8,q_block=16", t.cfg), t.cfg, r3.kv(), so);
  r3.prefill(t.tokens.data(), 80, &s0.attention(), 48);
  for (int i = 0; i < 3; ++i) r3.step(t.tokens[size_t(80 + i)], &s0.attention());
  EXPECT_EQ(s0.totals().mean_density(), 1.0);
  EXPECT_NEAR(s0.totals().mean_recall(), 1.0, 1e-5);
}

TEST(BlasstSession, AttendingWithoutTheHookThrows) {
  IntCache c(64, 12);
  ModelConfig cfg = test::tiny_config();
  cfg.n_layers = 1;
  cfg.n_heads = 6;
  cfg.n_kv_heads = 2;
  cfg.head_dim = 16;
  auto m = make("blasst:lambda=0.1,prefill=1", cfg);  // prefill skipping on: its hook is checked
  auto st = m->new_state();
  StepContext ctx;
  ctx.n_layers = 1;
  ctx.Hq = 6;
  ctx.Hkv = 2;
  ctx.D = 16;
  ctx.G = 3;
  ctx.kv = &c.kv;
  ctx.state = st.get();
  // A prefill chunk indexed without attend_prefill.
  ctx.begin_layer(0, c.pt, nullptr, 64);
  EXPECT_THROW(m->on_prefill(ctx, 0, 64), Error);
  // A decode layer attended without attend_decode: the next select notices.
  Selection sel;
  ctx.begin_layer(0, c.pt, c.Q.data(), 64);
  m->select(ctx, sel);
  m->prune(ctx, sel);
  EXPECT_THROW(m->select(ctx, sel), Error);
  // With the hook the sequence is fine.
  auto st2 = m->new_state();
  ctx.state = st2.get();
  std::vector<float> out(6 * 16);
  for (int step = 0; step < 2; ++step) {
    m->select(ctx, sel);
    m->prune(ctx, sel);
    EXPECT_TRUE(m->attend_decode(ctx, sel, out.data()));
  }
}

TEST(BlasstOptions, LambdaSourcesAndConfigFile) {
  ModelConfig cfg = test::tiny_config();
  const std::string path = testing::TempDir() + "blasst_cfg_test.json";
  {
    std::ofstream f(path);
    f << R"({"method": "blasst", "a": 1.5, "target_sparsity": 0.5, "fit_r2": 0.99})";
  }
  auto m = make("blasst:config=" + path, cfg);
  EXPECT_NE(m->describe().find("lambda=1.5/L"), std::string::npos) << m->describe();
  EXPECT_NEAR(as_blasst(*m)->log_lambda(3000), std::log(1.5 / 3000), 1e-6);
  EXPECT_EQ(as_blasst(*make("blasst:lambda=0", cfg))->log_lambda(10), -INFINITY);
  EXPECT_EQ(as_blasst(*make("blasst:a=50", cfg))->log_lambda(10), 0.f);  // lambda clamps at 1
  EXPECT_NE(make("blasst", cfg)->describe().find(cat("lambda=", kBlasstDefaultA, "/L")),
            std::string::npos);
  EXPECT_NEAR(as_blasst(*make("blasst", cfg))->log_lambda(4096, true),
              std::log(kBlasstDefaultPrefillA / 4096), 1e-6);
  // One file per phase; a alone serves both phases.
  const std::string pre = testing::TempDir() + "blasst_cfg_prefill.json";
  {
    std::ofstream f(pre);
    f << R"({"method": "blasst", "a": 700, "phase": "prefill"})";
  }
  const auto both_method = make("blasst:config=" + path + "," + pre, cfg);  // keeps it alive
  auto both = as_blasst(*both_method);
  EXPECT_NEAR(both->log_lambda(3000), std::log(1.5 / 3000), 1e-6);
  EXPECT_NEAR(both->log_lambda(3000, true), std::log(700.0 / 3000), 1e-6);
  const auto a2_method = make("blasst:a=2", cfg);
  auto a2 = as_blasst(*a2_method);
  EXPECT_NEAR(a2->log_lambda(4000, true), std::log(2.0 / 4000), 1e-6);
  EXPECT_NEAR(as_blasst(*make("blasst:a=2,prefill_a=300", cfg))->log_lambda(3000, true),
              std::log(0.1), 1e-6);
  std::remove(pre.c_str());
  EXPECT_THROW(make("blasst:lambda=0.1,a=2", cfg), Error);
  EXPECT_THROW(make("blasst:lambda=2", cfg), Error);
  EXPECT_THROW(make("blasst:order=random", cfg), Error);
  EXPECT_THROW(make("blasst:config=/nonexistent.json", cfg), Error);
  std::remove(path.c_str());
}
