// LycheeCluster (docs/lycheecluster.md): spherical k-means, the index's node bound
// q.c + |q| r >= q.k of every member token (random and structured keys, fp16 and fp32
// centers, after lazy updates), the chunk-space variant's bound over chunk keys, the
// hierarchical search against a brute-force re-implementation, the method's selection
// (sinks + whole chunks + recent buffer, budgets, budget >= L = full attention), lazy
// updates through decode steps, token text reaching the chunker, the appendix D counters,
// and the index memory. The real-model checks live in test_lycheecluster_real.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <set>

#include "backend/cpu/attention.h"
#include "sparse/chunker.h"
#include "sparse/cluster_index.h"
#include "sparse/kmeans.h"
#include "sparse/methods/lycheecluster.h"
#include "sparse/methods/twilight.h"
#include "sparse/registry.h"
#include "sparse/session.h"
#include "sparse/topk.h"
#include "test_util.h"

using namespace spade;
using namespace spade::sparse;

namespace {

double ddot(const float* a, const float* b, int D) {
  double s = 0;
  for (int d = 0; d < D; ++d) s += double(a[d]) * b[d];
  return s;
}
double dnorm(const float* a, int D) { return std::sqrt(ddot(a, a, D)); }

// Keys shaped like real ones: a large shared offset, a few strong directions that drift
// with position (RoPE-like rotation of pairs), per-token norms that vary 4x, and noise.
std::vector<float> structured_keys(int64_t L, int D, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n01(0.f, 1.f);
  std::vector<float> off(static_cast<size_t>(D)), k(static_cast<size_t>(L * D));
  for (auto& x : off) x = 3.f * n01(rng);
  std::vector<float> topic(static_cast<size_t>(8 * D));
  for (auto& x : topic) x = 2.f * n01(rng);
  for (int64_t p = 0; p < L; ++p) {
    const int t = int((p / 40) % 8);
    const float scale = 0.5f + 1.5f * float((p * 7919) % 101) / 100.f;
    for (int d = 0; d < D; ++d) {
      float v = off[size_t(d)] + topic[size_t(t * D + d)] + 0.7f * n01(rng);
      k[size_t(p * D + d)] = scale * v;
    }
    for (int d = 0; d + 1 < D; d += 2) {  // rotate pairs by a position-dependent angle
      const double th = double(p) * std::pow(10000.0, -double(d) / D);
      const float a = k[size_t(p * D + d)], b = k[size_t(p * D + d + 1)];
      k[size_t(p * D + d)] = float(a * std::cos(th) - b * std::sin(th));
      k[size_t(p * D + d + 1)] = float(a * std::sin(th) + b * std::cos(th));
    }
  }
  return k;
}

std::vector<int32_t> random_starts(int64_t begin, int64_t end, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> s;
  int64_t p = begin;
  while (p < end) {
    s.push_back(int32_t(p));
    p = std::min<int64_t>(end, p + 8 + int64_t(rng() % 9));
  }
  s.push_back(int32_t(end));
  return s;
}

// Every member's score against its fine and coarse nodes' bounds, for many queries.
// Returns the number of (query, token, node) checks.
int64_t check_bounds(const ClusterIndex& ix, const std::vector<float>& K, const std::vector<int32_t>& starts,
                     const std::vector<std::vector<float>>& queries) {
  const int D = ix.D();
  int64_t checks = 0;
  std::vector<float> cf(static_cast<size_t>(D)), cg(static_cast<size_t>(D));
  for (const auto& q : queries) {
    const float qn = float(dnorm(q.data(), D));
    for (int g = 0; g < ix.n_coarse(); ++g) {
      ix.center(ClusterIndex::kCoarse, g, cg.data());
      const double bg = ix.bound(ClusterIndex::kCoarse, g, q.data(), qn);
      const double tol_g = 1e-5 * qn * (dnorm(cg.data(), D) + ix.radius(ClusterIndex::kCoarse, g)) + 1e-6;
      for (int f = ix.fine_begin(g); f < ix.fine_begin(g + 1); ++f) {
        ix.center(ClusterIndex::kFine, f, cf.data());
        const double bf = ix.bound(ClusterIndex::kFine, f, q.data(), qn);
        const double tol_f = 1e-5 * qn * (dnorm(cf.data(), D) + ix.radius(ClusterIndex::kFine, f)) + 1e-6;
        for (int32_t c = ix.first_chunk(f); c >= 0; c = ix.next_chunk(c)) {
          if (ix.options().space == BoundSpace::Token) {
            for (int32_t p = starts[size_t(c)]; p < starts[size_t(c) + 1]; ++p) {
              const double s = ddot(q.data(), &K[size_t(p) * D], D);
              EXPECT_LE(s, bf + tol_f) << "fine " << f << " pos " << p;
              EXPECT_LE(s, bg + tol_g) << "coarse " << g << " pos " << p;
              checks += 2;
            }
          } else {  // chunk space: the unit chunk key
            std::vector<double> m(static_cast<size_t>(D), 0.0);
            for (int32_t p = starts[size_t(c)]; p < starts[size_t(c) + 1]; ++p)
              for (int d = 0; d < D; ++d) m[size_t(d)] += K[size_t(p) * D + d];
            double nn = 0;
            for (double x : m) nn += x * x;
            double s = 0;
            for (int d = 0; d < D; ++d) s += q[size_t(d)] * m[size_t(d)] / std::sqrt(nn);
            EXPECT_LE(s, bf + tol_f) << "fine " << f << " chunk " << c;
            EXPECT_LE(s, bg + tol_g) << "coarse " << g << " chunk " << c;
            checks += 2;
          }
        }
      }
    }
  }
  return checks;
}

std::vector<std::vector<float>> make_queries(const std::vector<float>& K, int64_t L, int D, int n,
                                             uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<float>> qs;
  for (int i = 0; i < n; ++i) {
    std::vector<float> q = test::random_vec(size_t(D), seed * 1000 + i, 0.5f + float(i % 5));
    if (i % 3 == 1) {  // aligned with (a scaled copy of) a key: large true scores
      const int64_t p = int64_t(rng() % uint64_t(L));
      for (int d = 0; d < D; ++d) q[size_t(d)] = 2.f * K[size_t(p * D + d)] + 0.1f * q[size_t(d)];
    } else if (i % 3 == 2) {  // against a key
      const int64_t p = int64_t(rng() % uint64_t(L));
      for (int d = 0; d < D; ++d) q[size_t(d)] = -K[size_t(p * D + d)];
    }
    qs.push_back(q);
  }
  return qs;
}

}  // namespace

// ---------------------------------------------------------------- k-means

TEST(LycheeClusterKMeans, RecoversPlantedDirectionsDeterministically) {
  const int D = 16, per = 30, C = 5;
  std::mt19937 rng(2);
  std::vector<std::vector<float>> dirs;
  for (int c = 0; c < C; ++c) {
    auto v = test::random_vec(D, 100 + c);
    l2_normalize(v.data(), D);
    dirs.push_back(v);
  }
  std::vector<int> label;
  std::vector<float> X;
  for (int i = 0; i < C * per; ++i) label.push_back(i % C);
  std::shuffle(label.begin(), label.end(), rng);
  for (int i = 0; i < C * per; ++i) {
    auto n = test::random_vec(D, 1000 + i, 0.05f);
    for (int d = 0; d < D; ++d) n[size_t(d)] += dirs[size_t(label[size_t(i)])][size_t(d)];
    l2_normalize(n.data(), D);
    X.insert(X.end(), n.begin(), n.end());
  }
  KMeansOptions o;
  o.seeding = KMeansSeeding::PlusPlus;
  auto r = spherical_kmeans(X.data(), C * per, D, C, o);
  ASSERT_EQ(r.K, C);
  // Purity 1: every found cluster holds exactly one planted label, 30 points each.
  std::map<int, std::set<int>> labels_of;
  for (int i = 0; i < C * per; ++i) labels_of[r.assign[size_t(i)]].insert(label[size_t(i)]);
  for (auto& [k, ls] : labels_of) EXPECT_EQ(ls.size(), 1u) << "cluster " << k;
  for (int k = 0; k < C; ++k) {
    EXPECT_EQ(r.size[size_t(k)], per);
    EXPECT_NEAR(dnorm(r.centroids.data() + k * D, D), 1.0, 1e-5);
  }
  EXPECT_LT(r.iterations_run, 10);  // converged
  // Same input, same options: same result, bit for bit (also for stride seeding).
  for (auto seeding : {KMeansSeeding::PlusPlus, KMeansSeeding::Stride}) {
    o.seeding = seeding;
    auto a = spherical_kmeans(X.data(), C * per, D, 12, o);
    auto b = spherical_kmeans(X.data(), C * per, D, 12, o);
    EXPECT_EQ(a.assign, b.assign);
    EXPECT_EQ(a.centroids, b.centroids);
    int total = 0;
    for (int s : a.size) total += s;
    EXPECT_EQ(total, C * per);
  }
  // K is clamped to N; N == 0 is empty.
  EXPECT_EQ(spherical_kmeans(X.data(), 3, D, 10, o).K, 3);
  EXPECT_EQ(spherical_kmeans(X.data(), 0, D, 10, o).K, 0);
}

TEST(LycheeClusterKMeans, StrideSeedingSpreadsOverTheSequence) {
  // Eight blocks of 20 identical points in sequence order: stride seeds land one per block,
  // so k-means with K = 8 returns the blocks.
  const int D = 8;
  std::vector<float> X;
  for (int b = 0; b < 8; ++b)
    for (int i = 0; i < 20; ++i) {
      std::vector<float> v(static_cast<size_t>(D), 0.f);
      v[size_t(b)] = 1.f;
      X.insert(X.end(), v.begin(), v.end());
    }
  auto r = spherical_kmeans(X.data(), 160, D, 8, {});
  ASSERT_EQ(r.K, 8);
  for (int i = 0; i < 160; ++i) EXPECT_EQ(r.assign[size_t(i)], i / 20);
}

// ---------------------------------------------------------------- index bounds

TEST(LycheeClusterIndex, BoundCoversEveryMemberTokenAtBuild) {
  const int D = 32;
  const int64_t L = 1500;
  int64_t checks = 0;
  for (int keys = 0; keys < 2; ++keys) {
    std::vector<float> K = keys == 0 ? test::random_vec(size_t(L * D), 7, 1.5f) : structured_keys(L, D, 8);
    auto starts = random_starts(16, L, 3 + keys);
    KeyFn key = [&](int64_t p) { return &K[size_t(p) * D]; };
    auto queries = make_queries(K, L, D, 60, 11 + keys);
    for (bool f16 : {true, false}) {
      ClusterIndexOptions o;
      o.f16_centers = f16;
      ClusterIndex ix;
      ix.build(D, key, starts.data(), int32_t(starts.size() - 1), o);
      const int M = int(starts.size() - 1);
      EXPECT_EQ(ix.n_fine(), (M + 1) / 2) << "about 2 chunks per fine cluster";
      EXPECT_EQ(ix.n_coarse(), int(std::ceil(std::sqrt(double(ix.n_fine())))));
      EXPECT_EQ(ix.fine_begin(ix.n_coarse()), ix.n_fine());
      // Radii are the exact covering radii around the stored centers (not inflated).
      std::vector<float> c(static_cast<size_t>(D));
      for (int f = 0; f < ix.n_fine(); ++f) {
        ix.center(ClusterIndex::kFine, f, c.data());
        double rmax = 0;
        int64_t tok = 0;
        for (int32_t ch = ix.first_chunk(f); ch >= 0; ch = ix.next_chunk(ch))
          for (int32_t p = starts[size_t(ch)]; p < starts[size_t(ch) + 1]; ++p, ++tok) {
            double s = 0;
            for (int d = 0; d < D; ++d) s += std::pow(double(K[size_t(p) * D + d]) - c[size_t(d)], 2);
            rmax = std::max(rmax, std::sqrt(s));
          }
        EXPECT_EQ(tok, ix.tokens(ClusterIndex::kFine, f));
        EXPECT_GE(double(ix.radius(ClusterIndex::kFine, f)), rmax);
        EXPECT_LE(double(ix.radius(ClusterIndex::kFine, f)), rmax * (1 + 1e-6) + 1e-6);
      }
      checks += check_bounds(ix, K, starts, queries);
    }
  }
  EXPECT_GT(checks, 4 * 60 * 2 * 1400);
}

TEST(LycheeClusterIndex, ChunkSpaceBoundCoversChunkKeysAndMaxPooling) {
  const int D = 24;
  const int64_t L = 900;
  std::vector<float> K = structured_keys(L, D, 21);
  auto starts = random_starts(0, L, 4);
  KeyFn key = [&](int64_t p) { return &K[size_t(p) * D]; };
  auto queries = make_queries(K, L, D, 40, 5);
  ClusterIndexOptions o;
  o.space = BoundSpace::Chunk;
  ClusterIndex ix;
  ix.build(D, key, starts.data(), int32_t(starts.size() - 1), o);
  EXPECT_GT(check_bounds(ix, K, starts, queries), 0);
  // Max pooling changes the clustering only; the token bound still holds.
  o.space = BoundSpace::Token;
  o.pooling = Pooling::Max;
  ClusterIndex mx;
  mx.build(D, key, starts.data(), int32_t(starts.size() - 1), o);
  EXPECT_GT(check_bounds(mx, K, starts, queries), 0);
  // And the chunk-space bound is not a bound on raw token scores: with the structured
  // keys' large norms some token's q.k exceeds its chunk-space node bound.
  int64_t violations = 0;
  for (const auto& q : queries) {
    const float qn = float(dnorm(q.data(), D));
    for (int f = 0; f < ix.n_fine(); ++f)
      for (int32_t c = ix.first_chunk(f); c >= 0; c = ix.next_chunk(c))
        for (int32_t p = starts[size_t(c)]; p < starts[size_t(c) + 1]; ++p)
          violations += ddot(q.data(), &K[size_t(p) * D], D) > ix.bound(ClusterIndex::kFine, f, q.data(), qn);
  }
  EXPECT_GT(violations, 0);
}

TEST(LycheeClusterIndex, LazyUpdatesKeepTheBoundAndOnlyGrowRadii) {
  const int D = 32;
  const int64_t L0 = 800, L = 1600;
  std::vector<float> K = structured_keys(L, D, 31);
  // Tokens 1300..1400 are outliers far from everything seen at build time.
  for (int64_t p = 1300; p < 1400; ++p)
    for (int d = 0; d < D; ++d) K[size_t(p) * D + d] = 25.f * float((d * 7 + p) % 5) - 40.f;
  auto starts = random_starts(16, L, 6);
  int32_t m0 = 0;
  while (starts[size_t(m0) + 1] <= L0) ++m0;
  KeyFn key = [&](int64_t p) { return &K[size_t(p) * D]; };
  for (auto space : {BoundSpace::Token, BoundSpace::Chunk}) {
    for (bool f16 : {true, false}) {
      ClusterIndexOptions o;
      o.space = space;
      o.f16_centers = f16;
      ClusterIndex ix;
      ix.build(D, key, starts.data(), m0, o);
      const int nf = ix.n_fine(), ng = ix.n_coarse();
      for (int32_t c = m0; c + 1 < int32_t(starts.size()); ++c) {
        std::vector<float> rf(static_cast<size_t>(nf)), rg(static_cast<size_t>(ng));
        for (int f = 0; f < nf; ++f) rf[size_t(f)] = ix.radius(ClusterIndex::kFine, f);
        for (int g = 0; g < ng; ++g) rg[size_t(g)] = ix.radius(ClusterIndex::kCoarse, g);
        ix.insert(key, starts.data(), c);
        for (int f = 0; f < nf; ++f) ASSERT_GE(ix.radius(ClusterIndex::kFine, f), rf[size_t(f)]);
        for (int g = 0; g < ng; ++g) ASSERT_GE(ix.radius(ClusterIndex::kCoarse, g), rg[size_t(g)]);
      }
      EXPECT_EQ(ix.n_chunks(), int32_t(starts.size()) - 1);
      EXPECT_EQ(ix.n_fine(), nf);  // lazy updates graft, never create nodes
      // Every chunk is in exactly one fine list, in position order.
      std::vector<int> seen(starts.size() - 1, 0);
      int64_t tokens = 0;
      for (int f = 0; f < nf; ++f) {
        int32_t prev = -1;
        for (int32_t c = ix.first_chunk(f); c >= 0; c = ix.next_chunk(c)) {
          EXPECT_GT(c, prev);
          prev = c;
          seen[size_t(c)]++;
        }
        tokens += ix.tokens(ClusterIndex::kFine, f);
      }
      for (int s : seen) EXPECT_EQ(s, 1);
      EXPECT_EQ(tokens, L - 16);
      EXPECT_GT(check_bounds(ix, K, starts, make_queries(K, L, D, 40, 77)), 0);
    }
  }
}

// ---------------------------------------------------------------- search

TEST(LycheeClusterIndex, SearchMatchesBruteForceAndRespectsTheBudget) {
  const int D = 16, G = 3;
  const int64_t L = 2000;
  std::vector<float> K = structured_keys(L, D, 41);
  auto starts = random_starts(16, L, 8);
  KeyFn key = [&](int64_t p) { return &K[size_t(p) * D]; };
  ClusterIndex ix;
  ix.build(D, key, starts.data(), int32_t(starts.size() - 1), {});
  SearchScratch scratch;
  std::mt19937 rng(5);
  for (int trial = 0; trial < 40; ++trial) {
    std::vector<float> q = test::random_vec(size_t(G * D), 300 + trial, 1.f + float(trial % 4));
    SearchParams p;
    p.budget = 64 + int64_t(rng() % 900);
    p.coarse_topk = trial % 3 == 0 ? 1 + int(rng() % 5) : 0;
    p.coarse_cover = 1.0 + double(trial % 4);
    p.group = trial % 2 ? GroupAgg::Sum : GroupAgg::Max;
    p.rank = trial % 5 == 4 ? RankBy::Center : RankBy::Bound;
    std::vector<int32_t> chunks, fines;
    const int64_t got = ix.search(q.data(), G, p, starts.data(), chunks, &fines, scratch);

    // Brute force.
    auto agg = [&](ClusterIndex::Level l, int n) {  // float, in head order, like the index
      float a = p.group == GroupAgg::Max ? -INFINITY : 0.f;
      for (int g = 0; g < G; ++g) {
        const float* qg = q.data() + g * D;
        const float b = ix.bound(l, n, qg, p.rank == RankBy::Bound ? float(dnorm(qg, D)) : 0.f);
        a = p.group == GroupAgg::Max ? std::max(a, b) : a + b;
      }
      return a;
    };
    std::vector<int> units(static_cast<size_t>(ix.n_coarse()));
    std::vector<float> us(static_cast<size_t>(ix.n_coarse()));
    for (int g = 0; g < ix.n_coarse(); ++g) {
      units[size_t(g)] = g;
      us[size_t(g)] = float(agg(ClusterIndex::kCoarse, g));
    }
    std::stable_sort(units.begin(), units.end(), [&](int a, int b) { return ranks_before(us.data(), a, b); });
    size_t kg = 0;
    if (p.coarse_topk > 0) {
      kg = std::min<size_t>(units.size(), size_t(p.coarse_topk));
    } else {
      double have = 0;
      while (kg < units.size() && have < p.coarse_cover * double(p.budget))
        have += double(ix.tokens(ClusterIndex::kCoarse, units[kg++]));
    }
    std::vector<int> cand;
    for (size_t j = 0; j < kg; ++j)
      for (int f = ix.fine_begin(units[j]); f < ix.fine_begin(units[j] + 1); ++f) cand.push_back(f);
    std::sort(cand.begin(), cand.end());
    std::vector<float> fs(cand.size());
    for (size_t j = 0; j < cand.size(); ++j) fs[j] = float(agg(ClusterIndex::kFine, cand[j]));
    std::vector<int> ord(cand.size());
    for (size_t j = 0; j < cand.size(); ++j) ord[j] = int(j);
    std::stable_sort(ord.begin(), ord.end(), [&](int a, int b) { return ranks_before(fs.data(), a, b); });
    std::vector<int32_t> want;
    std::vector<int32_t> want_f;
    int64_t left = p.budget;
    for (int j : ord) {
      bool used = false;
      for (int32_t c = ix.first_chunk(cand[size_t(j)]); c >= 0; c = ix.next_chunk(c)) {
        const int64_t len = starts[size_t(c) + 1] - starts[size_t(c)];
        if (len <= left) {
          want.push_back(c);
          left -= len;
          used = true;
        }
      }
      if (used) want_f.push_back(cand[size_t(j)]);
      if (left == 0) break;
    }
    EXPECT_EQ(chunks, want) << "trial " << trial;
    EXPECT_EQ(fines, want_f) << "trial " << trial;
    EXPECT_EQ(got, p.budget - left);
    EXPECT_LE(got, p.budget);
    if (p.coarse_topk == 0) {
      EXPECT_GE(got, p.budget - 16) << "filled to less than one chunk";
    }
  }
}

// ---------------------------------------------------------------- the method

namespace {

ModelConfig small_config(int layers = 4) {
  ModelConfig c;
  c.n_layers = layers;
  c.n_heads = 6;
  c.n_kv_heads = 2;
  c.head_dim = 16;
  c.hidden = 96;
  c.max_context = 4096;
  return c;
}

// A paged cache with structured keys and random values, and a direct driver of a method
// (the session hides the per-request state; tests need it for the token text).
struct Bench {
  ModelConfig cfg;
  int64_t cap;
  KVPool kv;
  PageTable pt;
  std::vector<std::vector<float>> K;  // [layer] -> [pos][head][D]
  std::vector<float> V;
  Bench(ModelConfig c, int64_t L, int64_t capacity, uint32_t seed)
      : cfg(c), cap(capacity), kv({c.n_layers, c.n_kv_heads, c.head_dim, 16}, capacity / 16 + 2) {
    const int D = c.head_dim, H = c.n_kv_heads;
    for (int l = 0; l < c.n_layers; ++l) {
      std::vector<float> all(static_cast<size_t>(capacity * H * D));
      for (int h = 0; h < H; ++h) {
        auto kh = structured_keys(capacity, D, seed + 17 * l + h);
        for (int64_t p = 0; p < capacity; ++p)
          std::copy_n(&kh[size_t(p * D)], D, &all[size_t((p * H + h) * D)]);
      }
      K.push_back(std::move(all));
    }
    V = test::random_vec(size_t(capacity * H * D), seed + 999);
    kv.reserve(pt, capacity);
    pt.length = 0;
    append(L);
  }
  void append(int64_t n) {
    const int D = cfg.head_dim, H = cfg.n_kv_heads;
    for (int64_t i = 0; i < n; ++i, ++pt.length)
      for (int l = 0; l < cfg.n_layers; ++l)
        kv.write(l, pt, pt.length, &K[size_t(l)][size_t(pt.length * H * D)], &V[size_t(pt.length * H * D)]);
  }
  const float* key(int l, int64_t p, int h) const {
    return &K[size_t(l)][size_t((p * cfg.n_kv_heads + h) * cfg.head_dim)];
  }
};

struct Driver {
  std::shared_ptr<const SparseMethod> m;
  std::unique_ptr<MethodState> state;
  StepContext ctx;
  cpu::AttentionScratch scratch;
  Selection sel;
  Driver(const std::string& spec, Bench& b) {
    m = make_method(SparseConfig::parse_spec(spec), b.cfg);
    state = m->new_state();
    ctx.n_layers = b.cfg.n_layers;
    ctx.Hq = b.cfg.n_heads;
    ctx.Hkv = b.cfg.n_kv_heads;
    ctx.D = b.cfg.head_dim;
    ctx.G = ctx.Hq / ctx.Hkv;
    ctx.scale = 1.f / std::sqrt(float(ctx.D));
    ctx.kv = &b.kv;
    ctx.state = state.get();
    ctx.attention_scratch = &scratch;
  }
  LycheeClusterState& st() { return *lycheecluster_state(state.get()); }
  void prefill(Bench& b) {
    for (int l = 0; l < b.cfg.n_layers; ++l) {
      ctx.begin_layer(l, b.pt, nullptr, b.pt.length);
      m->on_prefill(ctx, 0, b.pt.length);
    }
  }
  const Selection& select(Bench& b, int layer, const float* q) {
    ctx.begin_layer(layer, b.pt, q, b.pt.length);
    m->on_append(ctx);
    m->select(ctx, sel);
    validate(sel, b.cfg.n_kv_heads, b.pt.length);
    return sel;
  }
};

std::vector<int32_t> head_positions(const Selection& s, int h) {
  if (s.dense()) {
    std::vector<int32_t> all(static_cast<size_t>(s.length));
    for (int64_t i = 0; i < s.length; ++i) all[size_t(i)] = int32_t(i);
    return all;
  }
  return std::vector<int32_t>(s.head(h), s.head(h) + s.count(h));
}

}  // namespace

TEST(LycheeClusterMethod, SelectionIsSinksWholeChunksAndRecentTokens) {
  Bench b(small_config(), 1200, 1400, 51);
  for (const char* mode : {"clusters", "total"}) {
    Driver dr(std::string("lycheecluster:budget=256,budget_mode=") + mode, b);
    dr.prefill(b);
    auto q = test::random_vec(size_t(b.cfg.n_heads * b.cfg.head_dim), 9, 2.f);
    for (int l = 0; l < b.cfg.n_layers; ++l) {
      const Selection& s = dr.select(b, l, q.data());
      if (l < 2) {
        EXPECT_TRUE(s.dense()) << "first 2 layers dense";
        continue;
      }
      ASSERT_FALSE(s.dense());
      auto& st = dr.st();
      const auto& starts = st.chunk_starts();
      const int32_t n = st.indexed_chunks(l);
      ASSERT_GT(n, 0);
      EXPECT_EQ(starts[0], 16);
      const int64_t recent_begin = starts[size_t(n)];
      EXPECT_LE(b.pt.length - recent_begin, 16) << "after the build only the open tail waits";
      for (int h = 0; h < b.cfg.n_kv_heads; ++h) {
        auto pos = head_positions(s, h);
        std::set<int32_t> ps(pos.begin(), pos.end());
        for (int32_t p = 0; p < 16; ++p) EXPECT_TRUE(ps.count(p)) << "sink " << p;
        for (int64_t p = recent_begin; p < b.pt.length; ++p) EXPECT_TRUE(ps.count(int32_t(p)));
        // The rest is whole chunks.
        int64_t chunk_tokens = 0;
        for (int32_t c = 0; c < n; ++c) {
          int in = 0;
          for (int32_t p = starts[size_t(c)]; p < starts[size_t(c) + 1]; ++p) in += int(ps.count(p));
          const int len = starts[size_t(c) + 1] - starts[size_t(c)];
          EXPECT_TRUE(in == 0 || in == len) << "chunk " << c << " partly selected";
          chunk_tokens += in;
        }
        EXPECT_EQ(int64_t(pos.size()), 16 + chunk_tokens + (b.pt.length - recent_begin));
        if (std::string(mode) == "clusters") {
          EXPECT_LE(chunk_tokens, 256);
          EXPECT_GT(chunk_tokens, 256 - 16);
        } else {
          EXPECT_LE(int64_t(pos.size()), 256);
          EXPECT_GT(int64_t(pos.size()), 256 - 16);
        }
      }
    }
  }
}

TEST(LycheeClusterMethod, BudgetAtLeastContextIsFullAttention) {
  // Through the real session: budget >= L makes every layer dense, and the output equals
  // the full-attention output exactly. A budget just below L (sparse path, but every chunk
  // fits) selects every position and matches full attention to float rounding.
  ModelConfig cfg = small_config(3);
  Bench b(cfg, 700, 720, 61);
  auto q = test::random_vec(size_t(cfg.n_heads * cfg.head_dim), 4, 2.f);
  auto run = [&](const std::string& spec, std::vector<Selection>* sels) {
    SparseSession s(make_method(SparseConfig::parse_spec(spec), cfg), cfg, b.kv, {false, true});
    if (sels) s.on_select = [&](int, const Selection& x) { sels->push_back(x); };
    std::vector<float> out(size_t(cfg.n_layers * cfg.n_heads * cfg.head_dim));
    for (int l = 0; l < cfg.n_layers; ++l)
      s.attend(l, b.pt, q.data(), b.pt.length - 1, 1, out.data() + size_t(l * cfg.n_heads * cfg.head_dim));
    return out;
  };
  auto full = run("full", nullptr);
  std::vector<Selection> sels;
  auto big = run("lycheecluster:budget=700", &sels);
  for (const auto& s : sels) EXPECT_TRUE(s.dense());
  EXPECT_EQ(big, full);
  sels.clear();
  auto edge = run("lycheecluster:budget=683", &sels);  // L = 700 > 16 + 683
  ASSERT_EQ(sels.size(), 3u);
  EXPECT_FALSE(sels[2].dense());
  for (int h = 0; h < cfg.n_kv_heads; ++h) EXPECT_EQ(sels[2].count(h), 700);
  for (size_t i = 0; i < full.size(); ++i) EXPECT_NEAR(edge[i], full[i], 1e-5f) << i;
}

TEST(LycheeClusterMethod, LazyUpdatesThroughDecodeKeepBoundsOnTheCache) {
  ModelConfig cfg = small_config(3);
  Bench b(cfg, 600, 1000, 71);
  Driver dr("lycheecluster:budget=128,buffer=32", b);
  dr.prefill(b);
  auto& st = dr.st();
  int32_t built_chunks = -1;
  for (int step = 0; step < 300; ++step) {
    if (step) b.append(1);
    auto q = test::random_vec(size_t(cfg.n_heads * cfg.head_dim), 1000 + step, 2.f);
    for (int l = 0; l < cfg.n_layers; ++l) dr.select(b, l, q.data());
    if (step == 0) built_chunks = st.indexed_chunks(2);
    const int64_t waiting = b.pt.length - st.chunk_starts()[size_t(st.indexed_chunks(2))];
    EXPECT_LT(waiting, 32 + 16) << "the buffer is flushed once it holds 32 tokens";
  }
  EXPECT_GT(st.indexed_chunks(2), built_chunks + 15);
  EXPECT_GT(st.stats().inserted_chunks, 0);
  EXPECT_EQ(st.stats().builds, 2);  // one layer (2) x 2 KV heads
  // The bound holds on the cache's real rows, old and grafted, for fresh queries.
  for (int h = 0; h < cfg.n_kv_heads; ++h) {
    const ClusterIndex* ix = st.index(2, h);
    ASSERT_NE(ix, nullptr);
    std::vector<float> Kh;
    for (int64_t p = 0; p < b.pt.length; ++p) Kh.insert(Kh.end(), b.key(2, p, h), b.key(2, p, h) + cfg.head_dim);
    std::vector<int32_t> starts(st.chunk_starts().begin(), st.chunk_starts().begin() + ix->n_chunks() + 1);
    EXPECT_GT(check_bounds(*ix, Kh, starts, make_queries(Kh, b.pt.length, cfg.head_dim, 30, 3 + h)), 0);
  }
}

TEST(LycheeClusterMethod, TokenTextDrivesTheChunkBoundaries) {
  ModelConfig cfg = small_config(3);
  // 401 tokens: the step at L = 401 chunks the 400 before the current one (the method's rule).
  Bench b(cfg, 401, 401, 81);
  // Sentences of 10 tokens: "w w w w w w w w w." -> with text, chunks end after the "."
  std::vector<std::string> text;
  for (int64_t p = 0; p < 401; ++p) text.push_back(p % 10 == 9 ? "." : " w");
  auto q = test::random_vec(size_t(cfg.n_heads * cfg.head_dim), 5, 1.f);
  Driver with("lycheecluster:budget=64", b);
  with.st().set_token_text(text);
  with.prefill(b);
  with.select(b, 2, q.data());
  const auto& s1 = with.st().chunk_starts();
  ASSERT_GT(s1.size(), 10u);
  // From position 16: the first cut at >= 8 tokens after a "." is 30, then every 10.
  EXPECT_EQ(s1[0], 16);
  for (size_t i = 1; i < s1.size(); ++i) EXPECT_EQ(s1[i], 20 + 10 * int32_t(i)) << i;
  // No text: fixed 16-token chunks.
  Driver without("lycheecluster:budget=64", b);
  without.prefill(b);
  without.select(b, 2, q.data());
  const auto& s2 = without.st().chunk_starts();
  for (size_t i = 0; i < s2.size(); ++i) EXPECT_EQ(s2[i], 16 + 16 * int32_t(i));
  // The fixed ablation ignores the text.
  Driver fixed("lycheecluster:budget=64,chunking=fixed", b);
  fixed.st().set_token_text(text);
  fixed.prefill(b);
  fixed.select(b, 2, q.data());
  const auto& s3 = fixed.st().chunk_starts();
  ASSERT_EQ(s3.size(), s2.size() + 1);  // a fixed chunk closes without lookahead
  EXPECT_TRUE(std::equal(s2.begin(), s2.end(), s3.begin()));
  // The current token (position 399 of L = 400) is not indexed in its own step, though its
  // fixed chunk [384, 400) is full: every layer's index covers tokens whose K is cached before
  // the step (the GPU builds all layers at the first sparse one).
  Bench b2(cfg, 400, 400, 81);
  Driver cur("lycheecluster:budget=64,chunking=fixed", b2);
  cur.prefill(b2);
  cur.select(b2, 2, q.data());
  EXPECT_EQ(cur.st().chunk_starts().back(), 384);
  EXPECT_EQ(cur.st().indexed_chunks(2), 23);  // [16, 384) in chunks of 16
}

// The CLI, needle job and server hand token text to the method through the session (and
// through modifier stages such as Twilight over LycheeCluster).
TEST(LycheeClusterMethod, TokenTextReachesTheMethodThroughTheSessionAndModifiers) {
  ModelConfig cfg = small_config(3);
  Bench b(cfg, 400, 400, 81);
  std::vector<std::string> text;
  for (int64_t p = 0; p < 400; ++p) text.push_back(p % 10 == 9 ? "." : " w");
  auto q = test::random_vec(size_t(cfg.n_heads * cfg.head_dim), 5, 1.f);
  std::vector<float> out(size_t(cfg.n_heads * cfg.head_dim));
  for (const std::string spec : {"lycheecluster:budget=64", "twilight:base=lycheecluster,budget=64",
                                 "blasst:base=lycheecluster,budget=64"}) {
    SparseSession s(make_method(SparseConfig::parse_spec(spec), cfg), cfg, b.kv);
    EXPECT_TRUE(s.wants_token_text()) << spec;
    for (const auto& t : text) s.append_token_text(t);
    for (int l = 0; l < cfg.n_layers; ++l) s.attend(l, b.pt, q.data(), b.pt.length - 1, 1, out.data());
    MethodState* st = s.state();
    if (auto* c = dynamic_cast<ComposedState*>(st)) st = c->base.get();
    LycheeClusterState* lc = lycheecluster_state(st);
    ASSERT_NE(lc, nullptr) << spec;
    EXPECT_EQ(lc->token_text().size(), text.size()) << spec;
    const auto& starts = lc->chunk_starts();
    ASSERT_GT(starts.size(), 10u) << spec;
    EXPECT_EQ(starts[0], 16) << spec;
    for (size_t i = 1; i < starts.size(); ++i) EXPECT_EQ(starts[i], 20 + 10 * int32_t(i)) << spec << " " << i;
  }
  // Methods that do not read text say so (callers then skip decoding it).
  for (const std::string spec : {"quest:budget=64", "full", "quest+twilight:budget=64"})
    EXPECT_FALSE(SparseSession(make_method(SparseConfig::parse_spec(spec), cfg), cfg, b.kv).wants_token_text()) << spec;
}

TEST(LycheeClusterMethod, StabilityCounters) {
  ModelConfig cfg = small_config(3);
  Bench b(cfg, 800, 900, 91);
  Driver same("lycheecluster:budget=128,stability=1", b);
  same.prefill(b);
  auto q = test::random_vec(size_t(cfg.n_heads * cfg.head_dim), 6, 2.f);
  for (int step = 0; step < 5; ++step)
    for (int l = 0; l < cfg.n_layers; ++l) same.select(b, l, q.data());
  // The same query on an unchanged cache retrieves the same clusters every step.
  EXPECT_EQ(same.st().stats().jaccard_n, 4 * 2);
  EXPECT_DOUBLE_EQ(same.st().stats().mean_jaccard(), 1.0);
  EXPECT_DOUBLE_EQ(same.st().stats().mean_window_hit(), 1.0);
  // Alternating between two queries: Jaccard < 1, but every set was seen 2 steps ago.
  Driver alt("lycheecluster:budget=128,stability=1,stability_window=2", b);
  alt.prefill(b);
  auto q2 = test::random_vec(size_t(cfg.n_heads * cfg.head_dim), 7, 2.f);
  for (int step = 0; step < 6; ++step)
    for (int l = 0; l < cfg.n_layers; ++l) alt.select(b, l, (step % 2 ? q2 : q).data());
  EXPECT_LT(alt.st().stats().mean_jaccard(), 1.0);
  EXPECT_GT(alt.st().stats().mean_window_hit(), 0.5);
  // Window hit: step 1 can only hit clusters of step 0; from step 2 on every set repeats.
  const auto& a = alt.st().stats();
  EXPECT_EQ(a.window_hit_n, 5 * 2);
  // Off by default.
  Driver off("lycheecluster:budget=128", b);
  off.prefill(b);
  off.select(b, 2, q.data());
  EXPECT_EQ(off.st().stats().jaccard_n, 0);
}

TEST(LycheeClusterMethod, IndexMemoryIsAboutOnePercentOfTheKVCache) {
  // SmolLM2-like head geometry (D = 64, 3 KV heads), 6 layers (2 dense), 4096 tokens.
  ModelConfig cfg;
  cfg.n_layers = 6;
  cfg.n_heads = 9;
  cfg.n_kv_heads = 3;
  cfg.head_dim = 64;
  cfg.hidden = 576;
  cfg.max_context = 8192;
  Bench b(cfg, 4096, 4096, 101);
  std::vector<std::string> text;
  for (int64_t p = 0; p < 4096; ++p) text.push_back(p % 12 == 11 ? "." : " w");  // 12-token sentences
  Driver dr("lycheecluster:budget=1024", b);
  dr.st().set_token_text(text);
  dr.prefill(b);
  auto q = test::random_vec(size_t(cfg.n_heads * cfg.head_dim), 8, 1.f);
  for (int l = 0; l < cfg.n_layers; ++l) dr.select(b, l, q.data());
  const double kv_bytes = 2.0 * cfg.n_layers * cfg.n_kv_heads * 4096.0 * cfg.head_dim * sizeof(float);
  const double frac = double(dr.st().index_bytes()) / kv_bytes;
  // Per fine cluster (~2 chunks of 12 tokens): fp16 center 128 B + radius, counters and
  // links ~20 B, + 4 B per chunk, against 24 tokens x 512 B of K/V per (layer, head):
  // ~1.2% on an indexed layer, 4/6 of that over the whole cache.
  EXPECT_GT(frac, 0.005);
  EXPECT_LT(frac, 0.012);
  RecordProperty("index_fraction", std::to_string(frac));
}

TEST(LycheeClusterMethod, RegistryOptionsAndDescribe) {
  ModelConfig cfg = small_config(4);
  auto m = make_method(SparseConfig::parse_spec("lycheecluster"), cfg);
  EXPECT_EQ(m->name(), "lycheecluster");
  const std::string d = m->describe();
  for (const char* s : {"budget=1024", "sink=16", "buffer=128", "dense_layers=2", "min_chunk=8",
                        "max_chunk=16", "chunking=structure", "pooling=mean", "bound=token",
                        "chunks_per_fine=2", "max_coarse=64", "kmeans_iters=10", "group=max"})
    EXPECT_NE(d.find(s), std::string::npos) << s << " in " << d;
  EXPECT_THROW(make_method(SparseConfig::parse_spec("lycheecluster:pooling=min"), cfg), Error);
  EXPECT_THROW(make_method(SparseConfig::parse_spec("lycheecluster:nope=1"), cfg), Error);
  EXPECT_THROW(make_method(SparseConfig::parse_spec("lycheecluster:min_chunk=20"), cfg), Error);
  auto v = make_method(SparseConfig::parse_spec(
                           "lycheecluster:chunking=fixed,pooling=max,bound=chunk,center_dtype=f32,"
                           "seeding=kmeans++,group=sum,budget_mode=total"),
                       cfg);
  EXPECT_NE(v->describe().find("chunking=fixed"), std::string::npos);
  EXPECT_NE(v->describe().find("bound=chunk"), std::string::npos);
}
