// LycheeDecode (src/sparse/methods/lycheedecode.*, src/sparse/head_roles.*):
//  - every selection mode (topk, topp, threshold, ratio; tokens and blocks) against a
//    brute-force definition written here;
//  - the propagation rule on a planted cache: a retrieval head reads everything and hands
//    its set to the same head index of the next layer, a sparse head reads exactly the set
//    of the latest retrieval head of its column and never adds a token;
//  - budget >= L (and ratio = 1, p = 1) is full attention bit for bit in the layer loop;
//  - reordering heads so retrieval heads are contiguous leaves the outputs unchanged;
//  - cache correction rewrites the decoded tokens' K/V with the dense values;
//  - head-role files: parsing, checks against the model, the inline form.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>

#include "engine/generator.h"
#include "model/cpu_model.h"
#include "sparse/head_roles.h"
#include "sparse/cache_correction.h"
#include "sparse/methods/lycheedecode.h"
#include "sparse/registry.h"
#include "sparse/session.h"
#include "test_util.h"

using namespace spade;
using namespace spade::sparse;

namespace {

// ---------------------------------------------------------------- brute-force rule
// The definition of docs/lycheedecode.md in double precision: units of `block` tokens,
// unit weight = sum of its weights, ranked by weight (desc) then position (asc).
std::vector<int32_t> brute_select(const std::vector<double>& w, const LdRule& r) {
  const int64_t L = int64_t(w.size()), B = r.block, U = (L + B - 1) / B;
  std::vector<double> u(static_cast<size_t>(U), 0.0);
  for (int64_t j = 0; j < L; ++j) u[size_t(j / B)] += w[size_t(j)];
  std::vector<int64_t> order(static_cast<size_t>(U));
  for (int64_t i = 0; i < U; ++i) order[size_t(i)] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return u[size_t(a)] > u[size_t(b)]; });
  std::vector<int64_t> keep;
  if (r.mode == LdMode::TopK || r.mode == LdMode::Ratio) {
    const int64_t tokens =
        r.mode == LdMode::TopK ? r.budget : int64_t(std::ceil(r.ratio * double(L)));
    const int64_t k = std::min<int64_t>(U, (tokens + B - 1) / B);
    keep.assign(order.begin(), order.begin() + k);
  } else if (r.mode == LdMode::TopP) {
    double cum = 0;
    for (int64_t i : order) {
      keep.push_back(i);
      cum += u[size_t(i)];
      if (cum >= r.p) break;
    }
  } else {
    for (int64_t i = 0; i < U; ++i)
      if (u[size_t(i)] > r.tau) keep.push_back(i);
    if (keep.empty()) keep.push_back(order[0]);
  }
  std::sort(keep.begin(), keep.end());
  std::vector<int32_t> pos;
  for (int64_t i : keep)
    for (int64_t j = i * B; j < std::min(L, (i + 1) * B); ++j) pos.push_back(int32_t(j));
  return pos;
}

std::vector<double> softmax(const std::vector<double>& s) {
  std::vector<double> w(s.size());
  const double mx = *std::max_element(s.begin(), s.end());
  double sum = 0;
  for (size_t i = 0; i < s.size(); ++i) sum += (w[i] = std::exp(s[i] - mx));
  for (auto& x : w) x /= sum;
  return w;
}

LdRule rule(LdMode m, int block = 1) {
  LdRule r;
  r.mode = m;
  r.block = block;
  return r;
}

// ---------------------------------------------------------------- planted cache harness
ModelConfig harness_config(int layers) {
  ModelConfig c;
  c.n_layers = layers;
  c.n_heads = 6;
  c.n_kv_heads = 2;
  c.head_dim = 16;
  c.hidden = 96;
  c.max_context = 4096;
  return c;
}

// A cache of L tokens with random keys and one decode query per layer.
struct Harness {
  ModelConfig cfg;
  int64_t L;
  std::vector<float> K, V, Q;  // K/V [layer][pos][h][d], Q [layer][hq][d]
  Harness(ModelConfig c, int64_t L_, uint32_t seed) : cfg(c), L(L_) {
    std::mt19937 rng(seed);
    K.resize(size_t(cfg.n_layers * L * cfg.n_kv_heads * cfg.head_dim));
    V.resize(K.size());
    Q.resize(size_t(cfg.n_layers * cfg.n_heads * cfg.head_dim));
    test::fill_random(K.data(), K.size(), rng);
    test::fill_random(V.data(), V.size(), rng);
    test::fill_random(Q.data(), Q.size(), rng, 2.f);
  }
  int D() const { return cfg.head_dim; }
  int G() const { return cfg.n_heads / cfg.n_kv_heads; }
  const float* k(int l, int64_t p, int h) const {
    return &K[size_t(((l * L + p) * cfg.n_kv_heads + h) * D())];
  }
  const float* q(int l, int hq) const { return &Q[size_t((l * cfg.n_heads + hq) * D())]; }
  // Selection weights of KV head h at layer l: softmax of the group-averaged query's scores.
  std::vector<double> group_weights(int l, int h) const {
    std::vector<double> s(static_cast<size_t>(L));
    for (int64_t p = 0; p < L; ++p) {
      double acc = 0;
      for (int d = 0; d < D(); ++d) {
        double qb = 0;
        for (int g = 0; g < G(); ++g) qb += q(l, h * G() + g)[d];
        acc += qb / G() * k(l, p, h)[d];
      }
      s[size_t(p)] = acc / std::sqrt(double(D()));
    }
    return softmax(s);
  }
  // One decode step (the token at L-1) through a session; the selection of every layer.
  std::vector<Selection> run(const std::string& spec, StepStats* stats = nullptr) const {
    const int page = 16;
    KVPool kv({cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, page}, (L + page - 1) / page + 1);
    PageTable pt;
    kv.reserve(pt, L);
    for (int l = 0; l < cfg.n_layers; ++l)
      for (int64_t p = 0; p < L; ++p)
        kv.write(l, pt, p, k(l, p, 0), &V[size_t((l * L + p) * cfg.n_kv_heads * D())]);
    pt.length = L;
    SparseSession s(make_method(SparseConfig::parse_spec(spec), cfg), cfg, kv, {true, true});
    std::vector<Selection> sel(static_cast<size_t>(cfg.n_layers));
    s.on_select = [&](int layer, const Selection& x) { sel[size_t(layer)] = x; };
    std::vector<float> out(size_t(cfg.n_heads * D()));
    for (int l = 0; l < cfg.n_layers; ++l) s.attend(l, pt, q(l, 0), L - 1, 1, out.data());
    if (stats) *stats = s.last_step();
    return sel;
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

std::vector<int32_t> iota(int64_t n) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[size_t(i)] = int32_t(i);
  return v;
}

// ---------------------------------------------------------------- tiny model helpers
ModelConfig model_config() {
  ModelConfig c = test::tiny_config();
  c.n_layers = 4;
  c.n_heads = 6;
  c.n_kv_heads = 3;  // G = 2
  return c;
}

std::vector<int32_t> ids(int n, int vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (auto& x : v) x = int32_t(rng() % uint32_t(vocab));
  return v;
}

struct Decoded {
  std::vector<std::vector<float>> logits;
  std::vector<double> density, recall;
  std::vector<std::vector<Selection>> sel;  // [step][layer]
};

// Prefill `prompt` tokens of seq, then teacher-force `steps` decode tokens.
Decoded decode(const ModelWeights& w, const std::vector<int32_t>& seq, int prompt, int steps,
               std::shared_ptr<const SparseMethod> m) {
  const ModelConfig& c = w.config;
  KVPool kv({c.n_layers, c.n_kv_heads, c.head_dim, 8}, 64);
  CpuModel model(w, kv);
  std::unique_ptr<SparseSession> s;
  if (m) s = std::make_unique<SparseSession>(m, c, kv, SessionOptions{true, true});
  Decoded d;
  if (s)
    s->on_select = [&](int layer, const Selection& x) {
      if (layer == 0) d.sel.emplace_back();
      d.sel.back().push_back(x);
    };
  PageTable pt;
  std::vector<int64_t> row_of;
  const AttentionFn* fn = s ? &s->attention() : nullptr;
  std::vector<SeqInput> b = {{&pt, seq.data(), prompt, false, fn}};
  model.forward(b, row_of);
  for (int i = 0; i < steps; ++i) {
    b = {{&pt, seq.data() + prompt + i, 1, false, fn}};
    const auto& lg = model.forward(b, row_of);
    d.logits.emplace_back(lg.begin(), lg.begin() + c.vocab);
    if (s) {
      d.density.push_back(s->last_step().density());
      d.recall.push_back(s->last_step().mean_recall());
    }
  }
  return d;
}

std::shared_ptr<const SparseMethod> method(const std::string& spec, const ModelConfig& c) {
  return make_method(SparseConfig::parse_spec(spec), c);
}

}  // namespace

// ================================================================ selection rule

TEST(LycheeDecodeRule, EveryModeEqualsTheBruteForceDefinition) {
  std::mt19937 rng(3);
  SelectScratch sc;
  std::vector<int32_t> got;
  int checked = 0;
  for (int trial = 0; trial < 60; ++trial) {
    const int64_t L = 1 + int64_t(rng() % 700);
    std::vector<double> s(static_cast<size_t>(L));
    std::normal_distribution<double> nd(0.0, trial % 2 ? 1.0 : 3.0);  // flat and peaked
    for (auto& x : s) x = nd(rng);
    auto wd = softmax(s);
    std::vector<float> wf(wd.begin(), wd.end());
    std::vector<double> w(wf.begin(), wf.end());  // the rule sees float weights
    for (int block : {1, 7, 64}) {
      for (LdMode m : {LdMode::TopK, LdMode::Ratio, LdMode::TopP, LdMode::Threshold}) {
        LdRule r = rule(m, block);
        r.budget = 1 + int64_t(rng() % 300);
        r.ratio = 0.05 + 0.9 * double(rng() % 100) / 100.0;
        r.p = std::vector<double>{0.5, 0.9, 0.99, 0.999}[rng() % 4];
        r.tau = std::vector<double>{1e-2, 1e-3, 1e-4, 0.5}[rng() % 4];
        const int64_t n = ld_select(wf.data(), L, r, sc, got);
        ASSERT_EQ(n, int64_t(got.size()));
        ASSERT_EQ(got, brute_select(w, r)) << r.describe() << " L=" << L << " trial " << trial;
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, 60 * 3 * 4);
}

TEST(LycheeDecodeRule, TiesRankByLowerPositionAndCountsAreExact) {
  SelectScratch sc;
  std::vector<int32_t> got;
  std::vector<float> w(10, 0.1f);  // all equal
  LdRule r = rule(LdMode::TopK);
  r.budget = 3;
  ld_select(w.data(), 10, r, sc, got);
  EXPECT_EQ(got, (std::vector<int32_t>{0, 1, 2}));
  // Blocks of 4 over L = 10: units {0-3}, {4-7}, {8,9}; budget 5 tokens -> 2 blocks.
  w = {0.f, 0.f, 0.f, 0.f, .2f, .2f, .2f, .2f, .1f, .1f};
  r = rule(LdMode::TopK, 4);
  r.budget = 5;
  ld_select(w.data(), 10, r, sc, got);
  EXPECT_EQ(got, (std::vector<int32_t>{4, 5, 6, 7, 8, 9}));
  // topp 0.75: block {4-7} has 0.8 >= 0.75.
  r = rule(LdMode::TopP, 4);
  r.p = 0.75;
  ld_select(w.data(), 10, r, sc, got);
  EXPECT_EQ(got, (std::vector<int32_t>{4, 5, 6, 7}));
  // threshold below every weight but the zeros; above all -> the heaviest unit only.
  r = rule(LdMode::Threshold);
  r.tau = 0.05;
  ld_select(w.data(), 10, r, sc, got);
  EXPECT_EQ(got, (std::vector<int32_t>{4, 5, 6, 7, 8, 9}));
  r.tau = 0.5;
  ld_select(w.data(), 10, r, sc, got);
  EXPECT_EQ(got, (std::vector<int32_t>{4}));
  // ratio 0.25 of L = 10 -> ceil(2.5) = 3 tokens, growing with L.
  r = rule(LdMode::Ratio);
  r.ratio = 0.25;
  EXPECT_EQ(ld_select(w.data(), 10, r, sc, got), 3);
  std::vector<float> w2(40, 0.025f);
  EXPECT_EQ(ld_select(w2.data(), 40, r, sc, got), 10);
}

// ================================================================ propagation rule

TEST(LycheeDecodePropagation, SetsFlowToTheSameHeadOfTheNextLayerAndSparseHeadsAddNothing) {
  // Column 0: retrieval at layers 0, 2; column 1: retrieval at layers 0, 3, 4.
  const std::string pattern = "RR/SS/RS/SR/SR/SS";
  Harness hz(harness_config(6), 300, 11);
  for (std::string extra : {"mode=topk,budget=40", "mode=topp,p=0.9", "mode=threshold,tau=0.004",
                            "mode=ratio,ratio=0.2", "mode=topk,budget=64,block=16"}) {
    const std::string spec = "lycheedecode:roles=" + pattern + "," + extra;
    auto opts = SparseConfig::parse_spec(spec);
    auto m = make_method(opts, hz.cfg);
    const LdRule r = static_cast<const LycheeDecodeMethod&>(*m).rule();
    StepStats st;
    auto sel = hz.run(spec, &st);
    HeadRoles roles = HeadRoles::parse_pattern(pattern);
    EXPECT_TRUE(sel[0].dense()) << "layer 0 is all retrieval";
    for (int l = 1; l < hz.cfg.n_layers; ++l) {
      for (int h = 0; h < hz.cfg.n_kv_heads; ++h) {
        const auto got = positions(sel[size_t(l)], h);
        if (roles.is_retrieval(l, h)) {
          EXPECT_EQ(got, iota(hz.L)) << spec << " layer " << l << " head " << h;
          continue;
        }
        int src = l - 1;  // the latest retrieval head of this column
        while (!roles.is_retrieval(src, h)) --src;
        const auto want = brute_select(hz.group_weights(src, h), r);
        EXPECT_EQ(got, want) << spec << " layer " << l << " head " << h << " from " << src;
        EXPECT_LT(got.size(), size_t(hz.L)) << spec;
        if (!roles.is_retrieval(l - 1, h)) {  // passed on unchanged: nothing added or dropped
          EXPECT_EQ(got, positions(sel[size_t(l - 1)], h)) << spec << " layer " << l;
        }
        EXPECT_EQ(st.attended[size_t(l * hz.cfg.n_kv_heads + h)], int64_t(got.size()));
      }
    }
    // Recall counters: 1 for retrieval heads, the true mass of the set for sparse ones.
    for (int l = 1; l < hz.cfg.n_layers; ++l)
      for (int hq = 0; hq < hz.cfg.n_heads; ++hq) {
        const float rec = st.recall[size_t(l * hz.cfg.n_heads + hq)];
        if (roles.is_retrieval(l, hq / hz.G()))
          EXPECT_NEAR(rec, 1.0, 1e-5);
        else
          EXPECT_LT(rec, 1.0);
      }
  }
}

TEST(LycheeDecodePropagation, AllRetrievalAndBudgetAtLeastLAreDense) {
  Harness hz(harness_config(4), 120, 5);
  for (std::string spec : {"lycheedecode:roles=RR/RR/RR/RR,budget=8",
                           "lycheedecode:roles=RR/SS/RS/SS,budget=120",
                           "lycheedecode:roles=RR/SS/RS/SS,mode=ratio,ratio=1",
                           "lycheedecode:roles=RR/SS/RS/SS,mode=topp,p=1",
                           "lycheedecode:roles=RR/SS/RS/SS,mode=threshold,tau=0",
                           "lycheedecode:roles=RR/SS/RS/SS,budget=100,block=64"}) {
    auto sel = hz.run(spec);
    for (int l = 0; l < 4; ++l) EXPECT_TRUE(sel[size_t(l)].dense()) << spec << " layer " << l;
  }
  // Mixed layer with budget < L: CSR where retrieval heads list every position.
  auto sel = hz.run("lycheedecode:roles=RR/SR/RS/SS,budget=30");
  EXPECT_EQ(sel[1].kind, SelKind::PerHead);
  EXPECT_EQ(sel[1].count(0), 30);
  EXPECT_EQ(sel[1].count(1), 120);
  EXPECT_EQ(sel[2].count(0), 120);
  EXPECT_EQ(sel[2].count(1), 30);
  EXPECT_EQ(sel[3].count(0), 30);  // column 0: chosen again by layer 2's retrieval head
  EXPECT_EQ(positions(sel[3], 1), positions(sel[2], 1)) << "column 1 passed on unchanged";
}

// ================================================================ in the layer loop

TEST(LycheeDecodeModel, BudgetAtLeastTheContextIsFullAttentionBitForBit) {
  ModelWeights w = test::random_model(model_config(), 21);
  auto seq = ids(70, w.config.vocab, 22);
  auto ref = decode(w, seq, 50, 12, nullptr);  // the model's own dense path
  for (std::string spec : {"lycheedecode:roles=RRR/SRS/SSR/RSS,budget=62",
                           "lycheedecode:roles=RRR/SSS/SSS/SSS,mode=ratio,ratio=1",
                           "lycheedecode:roles=RRR/SRS/SSR/RSS,budget=64,block=64"}) {
    auto got = decode(w, seq, 50, 12, method(spec, w.config));
    for (size_t i = 0; i < ref.logits.size(); ++i) {
      EXPECT_EQ(got.logits[i], ref.logits[i]) << spec << " step " << i;
      EXPECT_EQ(got.density[i], 1.0) << spec;
      EXPECT_EQ(got.recall[i], 1.0) << spec;
    }
  }
}

TEST(LycheeDecodeModel, SmallBudgetsReadFewerTokensAndChangeTheOutput) {
  ModelWeights w = test::random_model(model_config(), 21);
  auto seq = ids(130, w.config.vocab, 23);
  auto ref = decode(w, seq, 120, 6, nullptr);
  auto got = decode(w, seq, 120, 6, method("lycheedecode:roles=RRR/SRS/SSR/RSS,budget=16", w.config));
  double maxdiff = 0;
  for (size_t i = 0; i < ref.logits.size(); ++i)
    for (size_t j = 0; j < ref.logits[i].size(); ++j)
      maxdiff = std::max(maxdiff, double(std::abs(got.logits[i][j] - ref.logits[i][j])));
  EXPECT_GT(maxdiff, 1e-3);
  for (size_t i = 0; i < got.density.size(); ++i) {
    const double L = 121.0 + double(i);
    // 12 heads: 3 (layer 0) + 1 + 1 + 1 retrieval read L; the other 6 read 16.
    EXPECT_NEAR(got.density[i], (6 * L + 6 * 16) / (12 * L), 1e-12);
    EXPECT_LT(got.recall[i], 1.0);
    EXPECT_GT(got.recall[i], 0.3);
  }
}

TEST(LycheeDecodeModel, ReorderingHeadsLeavesTheOutputsUnchanged) {
  ModelWeights w = test::random_model(model_config(), 31);
  auto seq = ids(100, w.config.vocab, 32);
  const std::string pattern = "RRR/SSR/RSS/SRS";
  HeadRoles roles = HeadRoles::parse_pattern(pattern);
  LdRule r;
  r.budget = 20;
  auto plain = std::make_shared<LycheeDecodeMethod>(roles, r, false, 32);
  ModelWeights w2 = test::random_model(model_config(), 31);
  HeadRoles re = reorder_heads(w2, roles);
  // Retrieval heads first in every layer, original order kept inside each group.
  EXPECT_EQ(re.pattern(), "RRR/RSS/RSS/RSS");
  EXPECT_EQ(re.origin[1], (std::vector<int>{2, 0, 1}));
  EXPECT_EQ(re.origin[2], (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(re.origin[3], (std::vector<int>{1, 0, 2}));
  EXPECT_NE(w2.layers[1].wk.storage, w.layers[1].wk.storage);
  auto reordered = std::make_shared<LycheeDecodeMethod>(re, r, false, 32);
  auto a = decode(w, seq, 80, 10, plain);
  auto b = decode(w2, seq, 80, 10, reordered);
  double maxdiff = 0, maxabs = 0;
  for (size_t i = 0; i < a.logits.size(); ++i)
    for (size_t j = 0; j < a.logits[i].size(); ++j) {
      maxdiff = std::max(maxdiff, double(std::abs(a.logits[i][j] - b.logits[i][j])));
      maxabs = std::max(maxabs, double(std::abs(a.logits[i][j])));
    }
  EXPECT_LT(maxdiff, 1e-5 * std::max(1.0, maxabs)) << "logit scale " << maxabs;
  // The same token sets, found at the permuted head indices.
  for (size_t s = 0; s < a.sel.size(); ++s)
    for (int l = 0; l < 4; ++l)
      for (int i = 0; i < 3; ++i)
        EXPECT_EQ(positions(b.sel[s][size_t(l)], i),
                  positions(a.sel[s][size_t(l)], re.origin[size_t(l)][size_t(i)]))
            << "step " << s << " layer " << l << " head " << i;
  EXPECT_EQ(a.density, b.density);
  // A sparse selection really happened (the proof is not about dense layers only).
  EXPECT_LT(a.density[0], 0.9);
}

TEST(LycheeDecodeModel, CacheCorrectionRewritesDecodedKVWithDenseValues) {
  ModelWeights w = test::random_model(model_config(), 41);
  const ModelConfig& c = w.config;
  auto seq = ids(160, c.vocab, 42);
  const int P = 120, steps = 20, every = 8;
  auto m = method("lycheedecode:roles=RRR/SSS/SSS/SSS,budget=12,correction=1,correction_every=8", c);
  ASSERT_EQ(m->correction_every(), every);
  EXPECT_EQ(method("full", c)->correction_every(), 0);
  EXPECT_EQ(method("lycheedecode:roles=RRR/SSS/SSS/SSS,budget=12,correction_every=8", c)->correction_every(), 0);
  EXPECT_EQ(method("tidal:budget=12,correction=1,correction_every=5", c)->correction_every(), 5);
  // Three caches over the same tokens: dense, sparse, sparse + correction.
  auto run = [&](KVPool& kv, PageTable& pt, bool sparse, bool correct) {
    CpuModel model(w, kv);
    SparseSession s(m, c, kv);
    CacheCorrection cc(m->correction_every());
    const AttentionFn* fn = sparse ? &s.attention() : nullptr;
    std::vector<int64_t> row_of;
    auto dense = [&](const SeqInput& in) { model.forward({in}, row_of); };
    std::vector<SeqInput> b = {{&pt, seq.data(), P, false, fn}};
    model.forward(b, row_of);
    int corrections = 0;
    for (int i = 0; i < steps; ++i) {
      b = {{&pt, seq.data() + P + i, 1, false, fn}};
      model.forward(b, row_of);
      if (correct) corrections += cc.after_decode(dense, pt, seq[size_t(P + i)]);
    }
    EXPECT_EQ(pt.length, P + steps);
    return corrections;
  };
  KVLayout lay{c.n_layers, c.n_kv_heads, c.head_dim, 8};
  KVPool kd(lay, 64), ks(lay, 64), kc(lay, 64);
  PageTable pd, ps, pc;
  run(kd, pd, false, false);
  run(ks, ps, true, false);
  EXPECT_EQ(run(kc, pc, true, true), steps / every);
  auto diff = [&](const KVPool& a, const PageTable& pa, const KVPool& b, const PageTable& pb,
                  int64_t p0, int64_t p1, int l0) {
    double d = 0;
    for (int l = l0; l < c.n_layers; ++l)
      for (int64_t p = p0; p < p1; ++p)
        for (int h = 0; h < c.n_kv_heads; ++h)
          for (int x = 0; x < c.head_dim; ++x) {
            d = std::max(d, double(std::abs(a.k_row(l, pa, p, h)[x] - b.k_row(l, pb, p, h)[x])));
            d = std::max(d, double(std::abs(a.v_row(l, pa, p, h)[x] - b.v_row(l, pb, p, h)[x])));
          }
    return d;
  };
  const int64_t corrected_end = P + (steps / every) * every;
  // Sparse decoding pollutes the K/V of layers >= 1 of the decoded tokens.
  EXPECT_GT(diff(kd, pd, ks, ps, P, P + steps, 1), 1e-3);
  // Corrected tokens carry the dense K/V (up to the chunked-vs-single-token rounding).
  EXPECT_LT(diff(kd, pd, kc, pc, P, corrected_end, 0), 2e-5);
  // The tokens after the last correction are still the sparse ones.
  EXPECT_GT(diff(kd, pd, kc, pc, corrected_end, P + steps, 1), 1e-3);
  // The prompt is never touched.
  EXPECT_EQ(diff(kd, pd, kc, pc, 0, P, 0), 0.0);
}

// The decode loop of `spade generate` / `chat` (generate()) runs the method's correction: with
// correction on, every `every` generated tokens are rewritten with dense K/V (those generated
// by the step before the last correction included), and the count is reported; without it the
// decoded tokens keep their sparse K/V. Tidal's option goes through the same loop.
TEST(LycheeDecodeModel, GenerateRunsTheMethodsCacheCorrection) {
  ModelWeights w = test::random_model(model_config(), 41);
  const ModelConfig& c = w.config;
  const auto prompt = ids(120, c.vocab, 42);
  for (const std::string spec : {"lycheedecode:roles=RRR/SSS/SSS/SSS,budget=12",
                                  "tidal:budget=12,dense_layers=1,selection_layers=1"}) {
    SCOPED_TRACE(spec);
    const int every = 6, n = 20;
    // Generated tokens, and the K/V of a sparse run with and without correction.
    auto run = [&](KVPool& kv, PageTable& pt, const std::string& s, std::vector<int32_t>& out) {
      CpuModel model(w, kv);
      auto m = method(s, c);
      SparseSession session(m, c, kv);
      GenerateOptions go;
      go.max_new_tokens = n;
      go.attention = &session.attention();
      go.correction_every = m->correction_every();
      return generate(model, pt, prompt, go, [&](int32_t t) {
        out.push_back(t);
        return true;
      });
    };
    KVLayout lay{c.n_layers, c.n_kv_heads, c.head_dim, 8};
    KVPool ks(lay, 64), kc(lay, 64), kd(lay, 64);
    PageTable ps, pc, pd;
    std::vector<int32_t> ts, tc;
    const GenerateStats s0 = run(ks, ps, spec, ts);
    const GenerateStats s1 = run(kc, pc, spec + ",correction=1,correction_every=" + std::to_string(every), tc);
    EXPECT_EQ(s0.corrections, 0);
    // n tokens generated: n - 1 decode steps fed them (the last is never fed).
    EXPECT_EQ(s1.corrections, (n - 1) / every);
    ASSERT_EQ(pc.length, int64_t(prompt.size()) + n - 1);
    // Dense reference K/V over the corrected run's own tokens.
    {
      CpuModel model(w, kd);
      std::vector<int32_t> all(prompt);
      all.insert(all.end(), tc.begin(), tc.end() - 1);
      std::vector<int64_t> rows;
      model.forward({{&pd, all.data(), int64_t(all.size()), false, nullptr}}, rows);
    }
    auto diff = [&](const KVPool& a, const PageTable& pa, int64_t p0, int64_t p1) {
      double d = 0;
      for (int l = 1; l < c.n_layers; ++l)
        for (int64_t p = p0; p < p1; ++p)
          for (int h = 0; h < c.n_kv_heads; ++h)
            for (int x = 0; x < c.head_dim; ++x)
              d = std::max(d, double(std::abs(a.k_row(l, pa, p, h)[x] - kd.k_row(l, pd, p, h)[x])));
      return d;
    };
    const int64_t P = int64_t(prompt.size()), corrected_end = P + ((n - 1) / every) * every;
    EXPECT_LT(diff(kc, pc, P, corrected_end), 2e-5) << "corrected tokens keep sparse K/V";
    EXPECT_GT(diff(kc, pc, corrected_end, P + n - 1), 1e-3) << "tokens after the last correction";
  }
}

// ================================================================ head-role files

TEST(LycheeDecodeRoles, JsonFileParsesAndIsCheckedAgainstTheModel) {
  ModelConfig c = model_config();
  c.hidden = 48;
  const std::string json = R"({"model": "tiny", "arch": "llama", "n_layers": 4, "n_heads": 6,
    "n_kv_heads": 3, "hidden": 48, "training": {"steps": 3},
    "roles": [["retrieval","retrieval","retrieval"], ["sparse","retrieval","sparse"],
              ["S","S","R"], ["sparse","sparse","sparse"]]})";
  HeadRoles r = HeadRoles::parse_json(json, "test");
  r.check_model(c);
  EXPECT_EQ(r.model, "tiny");
  EXPECT_EQ(r.pattern(), "RRR/SRS/SSR/SSS");
  EXPECT_EQ(r.count_retrieval(), 5);
  EXPECT_EQ(r.count_retrieval(1), 1);
  // Round trip through the file form.
  EXPECT_EQ(HeadRoles::parse_json(r.to_json(), "rt").pattern(), r.pattern());
  auto throws = [&](const std::string& j, const std::string& needle) {
    try {
      HeadRoles::parse_json(j, "bad").check_model(c);
      ADD_FAILURE() << "accepted: " << j;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  throws(R"({"n_layers": 1, "n_kv_heads": 1, "roles": [["retrieval"]]})", "model");
  throws(R"({"model": "m", "n_layers": 4, "n_kv_heads": 3, "roles": [["sparse","retrieval","retrieval"],
           ["R","R","R"],["R","R","R"],["R","R","R"]]})", "layer 0");
  throws(R"({"model": "m", "n_layers": 2, "n_kv_heads": 3, "roles": [["R","R","R"],["R","R","R"]]})",
         "2 layers");
  throws(R"({"model": "m", "n_layers": 4, "n_kv_heads": 3, "n_heads": 12, "roles": [["R","R","R"],
           ["R","R","R"],["R","R","R"],["R","R","R"]]})", "query heads");
  throws(R"({"model": "m", "n_layers": 4, "n_kv_heads": 3, "roles": [["R","R","R"],
           ["R","X","R"],["R","R","R"],["R","R","R"]]})", "unknown role");
  EXPECT_THROW(HeadRoles::parse_pattern("RR/R"), Error);
  EXPECT_THROW(HeadRoles::parse_pattern("SR/RR"), Error);
  EXPECT_THROW(make_method(SparseConfig::parse_spec("lycheedecode:roles=RR/RR"), c), Error);
  EXPECT_THROW(make_method(SparseConfig::parse_spec("lycheedecode:roles=RRR/RRR/RRR/RRR,mode=topq"), c),
               Error);
  // A file on disk through the option.
  const std::string path = (std::filesystem::temp_directory_path() / "spade_roles_test.json").string();
  std::ofstream(path) << json;
  auto m = make_method(SparseConfig::parse_spec("lycheedecode:roles=" + path), c);
  EXPECT_NE(m->describe().find("retrieval heads 5/12"), std::string::npos) << m->describe();
  std::filesystem::remove(path);
}

TEST(LycheeDecodeRoles, TheShippedSmolLM2FileIsFoundByAuto) {
  ModelConfig c;
  c.arch = Arch::Llama;
  c.n_layers = 30;
  c.hidden = 576;
  c.n_heads = 9;
  c.n_kv_heads = 3;
  c.head_dim = 64;
  c.max_context = 8192;
  ASSERT_EQ(default_head_roles_file(c), "smollm2-135m-instruct.json");
  HeadRoles r = resolve_head_roles("auto", c);  // cwd = repository root (ctest)
  EXPECT_EQ(r.model, "SmolLM2-135M-Instruct");
  EXPECT_EQ(r.n_layers, 30);
  EXPECT_EQ(r.count_retrieval(0), 3);
  EXPECT_GT(r.count_retrieval(), 3);
  EXPECT_LT(r.count_retrieval(), 90);
  c.n_layers = 31;
  EXPECT_THROW(resolve_head_roles("auto", c), Error);
}
