// Twilight: the INT4 key copy (round-trip error bounds, incremental sync), Algorithm 1's
// binary search against sort-and-accumulate, the pruner's mass guarantee with exact keys,
// composition over quest / full, and the option routing of stacks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>

#include <sys/stat.h>

#include "core/half.h"
#include "kv/int4_keys.h"
#include "model/loader.h"
#include "sparse/blasst_calibration.h"
#include "sparse/methods/blasst.h"
#include "sparse/methods/twilight.h"
#include "sparse/registry.h"
#include "test_util.h"
#include "tokenizer/tokenizer.h"

using namespace spade;
using namespace spade::sparse;

namespace {

// A KV cache with random keys, some of them planted along the queries (focused heads).
struct Fixture {
  ModelConfig cfg;
  int page = 16;
  int64_t L;
  std::vector<float> K, V, Q;  // K/V [layer][pos][kv_head][D], Q [layer][Hq][D]
  KVPool kv;
  PageTable pt;
  Fixture(int64_t L_, uint32_t seed, int layers = 4)
      : cfg(make_cfg(layers)), L(L_),
        kv(KVLayout{cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, page}, (L_ + page - 1) / page + 1) {
    std::mt19937 rng(seed);
    const int D = cfg.head_dim, Hkv = cfg.n_kv_heads, Hq = cfg.n_heads;
    K.resize(size_t(cfg.n_layers) * size_t(L) * Hkv * D);
    V.resize(K.size());
    Q.resize(size_t(cfg.n_layers) * Hq * D);
    test::fill_random(K.data(), K.size(), rng);
    test::fill_random(V.data(), V.size(), rng);
    test::fill_random(Q.data(), Q.size(), rng, 1.5f);
    // Plant a few keys aligned with the group's first query: peaked attention.
    for (int l = 0; l < cfg.n_layers; ++l)
      for (int h = 0; h < Hkv; ++h)
        for (int j = 0; j < 6; ++j) {
          const int64_t p = int64_t(rng() % uint32_t(L));
          float* k = &K[size_t(((l * L + p) * Hkv + h) * D)];
          const float* q = &Q[size_t((l * Hq + h * cfg.group_size()) * D)];
          for (int d = 0; d < D; ++d) k[d] = 0.8f * q[d] + 0.2f * k[d];
        }
    kv.reserve(pt, L);
    for (int l = 0; l < cfg.n_layers; ++l)
      for (int64_t p = 0; p < L; ++p)
        kv.write(l, pt, p, &K[size_t((l * L + p) * Hkv * D)], &V[size_t((l * L + p) * Hkv * D)]);
    pt.length = L;
  }
  static ModelConfig make_cfg(int layers) {
    ModelConfig c = test::tiny_config();
    c.n_layers = layers;
    c.n_heads = 6;
    c.n_kv_heads = 2;
    c.head_dim = 32;
    return c;
  }
  const float* q(int l) const { return &Q[size_t(l * cfg.n_heads * cfg.head_dim)]; }
  // True softmax weights of query head hq at layer l over [0, L), double precision.
  std::vector<double> weights(int l, int hq) const {
    const int D = cfg.head_dim, h = hq / cfg.group_size();
    std::vector<double> w(static_cast<size_t>(L));
    double mx = -1e300, sum = 0;
    for (int64_t p = 0; p < L; ++p) {
      double s = 0;
      for (int d = 0; d < D; ++d)
        s += double(q(l)[hq * D + d]) * K[size_t(((l * L + p) * cfg.n_kv_heads + h) * D + d)];
      w[size_t(p)] = s / std::sqrt(double(D));
      mx = std::max(mx, w[size_t(p)]);
    }
    for (auto& x : w) sum += (x = std::exp(x - mx));
    for (auto& x : w) x /= sum;
    return w;
  }
  StepContext context(MethodState* st) {
    StepContext c;
    c.n_layers = cfg.n_layers;
    c.Hq = cfg.n_heads;
    c.Hkv = cfg.n_kv_heads;
    c.D = cfg.head_dim;
    c.G = cfg.group_size();
    c.scale = 1.f / std::sqrt(float(cfg.head_dim));
    c.kv = &kv;
    c.state = st;
    return c;
  }
  // One decode-like step at every layer: on_prefill of [0, L) first, then select + prune.
  std::vector<Selection> run(const SparseMethod& m, std::unique_ptr<MethodState>& st,
                             cpu::AttentionScratch& sc) {
    st = m.new_state();
    StepContext c = context(st.get());
    c.attention_scratch = &sc;
    for (int l = 0; l < cfg.n_layers; ++l) {
      c.begin_layer(l, pt, nullptr, L);
      m.on_prefill(c, 0, L);
    }
    std::vector<Selection> out(size_t(cfg.n_layers));
    for (int l = 0; l < cfg.n_layers; ++l) {
      c.begin_layer(l, pt, q(l), L);
      m.on_append(c);
      m.select(c, out[size_t(l)]);
      m.prune(c, out[size_t(l)]);
      validate(out[size_t(l)], cfg.n_kv_heads, L);
    }
    return out;
  }
};

std::vector<int32_t> positions(const Selection& s, int h) {
  if (s.dense()) {
    std::vector<int32_t> all(size_t(s.length));
    std::iota(all.begin(), all.end(), 0);
    return all;
  }
  return std::vector<int32_t>(s.head(h), s.head(h) + s.count(h));
}

std::shared_ptr<const SparseMethod> make(const std::string& spec, const ModelConfig& cfg) {
  return make_method(SparseConfig::parse_spec(spec), cfg);
}

}  // namespace

// ---------------------------------------------------------------- INT4 keys

TEST(TwilightInt4, RoundTripErrorIsAtMostHalfAScaleAndScaleIsTight) {
  std::mt19937 rng(7);
  const int D = 64;
  std::vector<float> x(D), y(D);
  std::vector<uint8_t> codes(D / 2);
  for (int trial = 0; trial < 400; ++trial) {
    const float spread = std::pow(10.f, float(int(trial % 9) - 4));  // 1e-4 .. 1e4
    const float offset = (trial % 3 == 0) ? 37.5f : (trial % 3 == 1 ? -0.01f : 0.f);
    test::fill_random(x.data(), D, rng, spread);
    for (auto& v : x) v += offset;
    if (trial % 50 == 0) std::fill(x.begin(), x.end(), 1.234567f);  // constant row
    uint16_t sh, zh;
    int4_quantize_row(x.data(), D, codes.data(), &sh, &zh);
    const float s = f16_to_f32(sh), z = f16_to_f32(zh);
    int4_dequantize_row(codes.data(), s, z, D, y.data());
    const float mn = *std::min_element(x.begin(), x.end());
    const float mx = *std::max_element(x.begin(), x.end());
    // zero = the largest fp16 <= min; scale = the smallest fp16 covering max.
    EXPECT_LE(z, mn);
    EXPECT_LE(mn - z, std::fabs(mn) * 0x1p-10f + 6e-8f) << trial;
    EXPECT_GE(z + 15.f * s, mx * (1 - 1e-7f) - 1e-30f);
    EXPECT_LE(s, ((mx - mn) + std::fabs(mn) * 0x1p-10f + 6e-8f) / 15.f * (1 + 0x1p-10f) + 6e-8f)
        << trial;
    for (int d = 0; d < D; ++d)
      ASSERT_LE(std::fabs(x[d] - y[d]), 0.5f * s * (1 + 1e-5f) + 1e-6f * std::fabs(x[d]))
          << "trial " << trial << " d " << d;
  }
}

TEST(TwilightInt4, ExactlyRepresentableRowsRoundTripExactly) {
  const int D = 16;
  std::vector<float> x(D), y(D);
  for (int d = 0; d < D; ++d) x[d] = -2.f + 0.5f * float((d * 7) % 16);  // codes 0..15, scale 0.5
  std::vector<uint8_t> codes(D / 2);
  uint16_t sh, zh;
  int4_quantize_row(x.data(), D, codes.data(), &sh, &zh);
  EXPECT_EQ(f16_to_f32(sh), 0.5f);
  EXPECT_EQ(f16_to_f32(zh), -2.f);
  int4_dequantize_row(codes.data(), 0.5f, -2.f, D, y.data());
  for (int d = 0; d < D; ++d) EXPECT_EQ(x[d], y[d]);
}

TEST(TwilightInt4, DotEqualsDequantizedDotAndIsBoundedByTheScale) {
  std::mt19937 rng(3);
  const int D = 64;
  std::vector<float> x(D), y(D), q(D);
  std::vector<uint8_t> codes(D / 2);
  for (int trial = 0; trial < 100; ++trial) {
    test::fill_random(x.data(), D, rng, 2.f);
    test::fill_random(q.data(), D, rng, 1.f);
    uint16_t sh, zh;
    int4_quantize_row(x.data(), D, codes.data(), &sh, &zh);
    const float s = f16_to_f32(sh), z = f16_to_f32(zh);
    int4_dequantize_row(codes.data(), s, z, D, y.data());
    double exact = 0, deq = 0, qabs = 0, qsum = 0;
    for (int d = 0; d < D; ++d) {
      exact += double(q[d]) * x[d];
      deq += double(q[d]) * y[d];
      qabs += std::fabs(q[d]);
      qsum += q[d];
    }
    const double est = int4_dot(q.data(), float(qsum), codes.data(), s, z, D);
    EXPECT_NEAR(est, deq, 1e-4 * (1 + std::fabs(deq)));
    EXPECT_LE(std::fabs(est - exact), 0.5 * s * qabs * (1 + 1e-5) + 1e-4);
  }
}

TEST(TwilightInt4, StoreSyncsIncrementallyFromTheCache) {
  Fixture f(150, 5, 2);
  Int4KeyStore st(f.cfg.n_layers, f.cfg.n_kv_heads, f.cfg.head_dim);
  const int D = f.cfg.head_dim;
  st.sync(f.kv, 1, f.pt, 100);  // "prefill"
  EXPECT_EQ(st.length(1), 100);
  EXPECT_EQ(st.length(0), 0);
  for (int64_t L = 101; L <= 150; ++L) st.sync(f.kv, 1, f.pt, L);  // "appends"
  std::vector<uint8_t> codes(D / 2);
  for (int64_t p = 0; p < 150; ++p)
    for (int h = 0; h < f.cfg.n_kv_heads; ++h) {
      uint16_t sh, zh;
      int4_quantize_row(f.kv.k_row(1, f.pt, p, h), D, codes.data(), &sh, &zh);
      ASSERT_EQ(0, std::memcmp(codes.data(), st.codes(1, p, h), size_t(D / 2))) << p;
      ASSERT_EQ(st.scale(1, p, h), f16_to_f32(sh));
      ASSERT_EQ(st.zero(1, p, h), f16_to_f32(zh));
    }
  EXPECT_EQ(st.bytes(), size_t(150 * f.cfg.n_kv_heads * (D / 2 + 4)));
}

// ---------------------------------------------------------------- Algorithm 1

TEST(TwilightTopP, BinarySearchKeepsTheMinimalSetUpToEpsilon) {
  std::mt19937 rng(11);
  const double eps = 1e-6;
  int exact_matches = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const int n = 1 + int(rng() % 3000);
    const double temp = std::pow(10.0, -1.0 + 2.0 * double(rng() % 1000) / 1000.0);
    std::vector<float> w(static_cast<size_t>(n));
    test::fill_random(w.data(), size_t(n), rng, float(1.0 / temp));
    float mx = *std::max_element(w.begin(), w.end());
    double sum = 0;
    for (auto& x : w) sum += (x = std::exp(x - mx));
    for (auto& x : w) x = float(x / sum);
    const double p = std::vector<double>{0.5, 0.8, 0.9, 0.95, 0.99}[size_t(trial % 5)];
    // Reference: sort descending and accumulate until p.
    std::vector<float> s(w);
    std::sort(s.begin(), s.end(), std::greater<float>());
    double acc = 0;
    size_t k = 0;
    while (k < s.size() && acc < p) acc += s[k++];
    const float wk = s[k - 1];  // the minimal set's smallest weight
    const TopPResult r = topp_binary_search(w.data(), n, p, eps);
    double kept_mass = 0;
    size_t kept = 0;
    for (float x : w)
      if (x >= r.threshold) kept_mass += x, ++kept;
    if (acc >= p) {
      EXPECT_GE(kept_mass, p) << "trial " << trial;  // mass reached
    }
    EXPECT_GE(kept, k) << "trial " << trial;                      // contains the minimal set
    EXPECT_LE(r.threshold, wk) << "trial " << trial;
    for (float x : w)  // every extra element lies within eps of the minimal set's smallest
      if (x >= r.threshold && x < wk) {
        EXPECT_GT(double(x), double(wk) - eps) << "trial " << trial;
      }
    EXPECT_LE(r.iterations, 64);
    // With a resolution far below the weights' spacing the set is exactly the minimal one.
    const float t2 = topp_binary_search(w.data(), n, p, 1e-12).threshold;
    size_t kept2 = 0;
    for (float x : w) kept2 += x >= t2;
    exact_matches += kept2 == k;
  }
  EXPECT_GE(exact_matches, 295);  // float ties at w_(k) are the only exceptions
}

TEST(TwilightTopP, OnePeakAndUniformAndEmpty) {
  std::vector<float> w = {0.97f, 0.01f, 0.01f, 0.01f};
  TopPResult r = topp_binary_search(w.data(), 4, 0.95, 1e-6);
  EXPECT_EQ(r.threshold, 0.97f);
  EXPECT_EQ(r.iterations, 0);
  std::vector<float> u(1000, 1e-3f);
  r = topp_binary_search(u.data(), 1000, 0.95, 1e-6);
  EXPECT_LE(r.threshold, 1e-3f);  // ties: every element is needed
  EXPECT_EQ(topp_binary_search(nullptr, 0, 0.9, 1e-6).threshold, 0.f);
}

// ---------------------------------------------------------------- the pruner

TEST(TwilightPrune, ExactKeysOverFullKeepMassAtLeastPPerQueryHead) {
  Fixture f(700, 21);
  cpu::AttentionScratch sc;
  for (double p : {0.8, 0.95, 0.99}) {
    auto m = make(cat("twilight:base=full,keys=exact,p=", p), f.cfg);
    std::unique_ptr<MethodState> st;
    auto sel = f.run(*m, st, sc);
    const TwilightStats* ts = twilight_stats(st.get());
    ASSERT_TRUE(ts);
    for (int l = 0; l < f.cfg.n_layers; ++l) {
      if (l < 2) {
        EXPECT_TRUE(sel[size_t(l)].dense());
        EXPECT_EQ(ts->pruned[size_t(l)], 0);
        continue;
      }
      EXPECT_EQ(ts->pruned[size_t(l)], 1);
      for (int hq = 0; hq < f.cfg.n_heads; ++hq) {
        const int h = hq / f.cfg.group_size();
        auto w = f.weights(l, hq);
        double mass = 0;
        for (int32_t pos : positions(sel[size_t(l)], h)) mass += w[size_t(pos)];
        EXPECT_GE(mass, p - 1e-5) << "layer " << l << " head " << hq << " p " << p;
      }
      for (int h = 0; h < f.cfg.n_kv_heads; ++h) {
        EXPECT_EQ(ts->base_count[size_t(l * 2 + h)], f.L);
        EXPECT_EQ(ts->kept_count[size_t(l * 2 + h)], sel[size_t(l)].count(h));
        EXPECT_LT(sel[size_t(l)].count(h), f.L);  // peaked heads: something was pruned
      }
    }
    EXPECT_NEAR(ts->mean_base(), double(f.L), 1e-9);
    EXPECT_LT(ts->mean_kept(), ts->mean_base());
  }
}

TEST(TwilightPrune, MeanCombineReachesPForTheGroupMean) {
  Fixture f(500, 22);
  cpu::AttentionScratch sc;
  auto m = make("twilight:base=full,keys=exact,p=0.9,head_combine=mean", f.cfg);
  auto mu = make("twilight:base=full,keys=exact,p=0.9", f.cfg);
  std::unique_ptr<MethodState> st, st2;
  auto sel = f.run(*m, st, sc);
  auto sel_u = f.run(*mu, st2, sc);
  const int G = f.cfg.group_size();
  for (int l = 2; l < f.cfg.n_layers; ++l)
    for (int h = 0; h < f.cfg.n_kv_heads; ++h) {
      double mass = 0;
      auto pos = positions(sel[size_t(l)], h);
      for (int g = 0; g < G; ++g) {
        auto w = f.weights(l, h * G + g);
        for (int32_t p : pos) mass += w[size_t(p)] / G;
      }
      EXPECT_GE(mass, 0.9 - 1e-5);
      EXPECT_LE(pos.size(), positions(sel_u[size_t(l)], h).size());  // union keeps more
    }
}

TEST(TwilightPrune, Int4EstimateKeepsTrueMassNearP) {
  Fixture f(900, 23);
  cpu::AttentionScratch sc;
  auto m = make("twilight:base=full,p=0.95", f.cfg);  // INT4 keys (default)
  std::unique_ptr<MethodState> st;
  auto sel = f.run(*m, st, sc);
  for (int l = 2; l < f.cfg.n_layers; ++l)
    for (int hq = 0; hq < f.cfg.n_heads; ++hq) {
      auto w = f.weights(l, hq);
      double mass = 0;
      for (int32_t pos : positions(sel[size_t(l)], hq / f.cfg.group_size())) mass += w[size_t(pos)];
      EXPECT_GE(mass, 0.93) << "layer " << l << " head " << hq;
    }
  // The INT4 copy covers the pruned layers only, every position once.
  const TwilightState* ts = twilight_state(st.get());
  EXPECT_EQ(ts->keys.length(0), 0);
  EXPECT_EQ(ts->keys.length(2), f.L);
}

TEST(TwilightPrune, OverQuestAndLycheeClusterKeepsASubsetOfTheBaseSelection) {
  Fixture f(640, 24);
  cpu::AttentionScratch sc;
  for (const std::string base : {"quest", "lycheecluster"}) {
    const std::string opts = base == "quest" ? "budget=160" : "budget=128,sink=4";
    auto plain = make(base + ":" + opts, f.cfg);
    auto tw = make("twilight:base=" + base + ",p=0.9," + opts, f.cfg);
    std::unique_ptr<MethodState> s1, s2;
    auto a = f.run(*plain, s1, sc);
    auto b = f.run(*tw, s2, sc);
    const TwilightStats* ts = twilight_stats(s2.get());
    for (int l = 0; l < f.cfg.n_layers; ++l)
      for (int h = 0; h < f.cfg.n_kv_heads; ++h) {
        auto pa = positions(a[size_t(l)], h), pb = positions(b[size_t(l)], h);
        EXPECT_TRUE(std::includes(pa.begin(), pa.end(), pb.begin(), pb.end())) << base << l;
        if (l >= 2) {
          EXPECT_EQ(ts->base_count[size_t(l * 2 + h)], int64_t(pa.size())) << base;
          EXPECT_LT(int64_t(pa.size()), f.L) << base;  // the base really was sparse
          if (base == "quest") {
            EXPECT_EQ(int64_t(pa.size()), 160);
          }
          EXPECT_LT(pb.size(), pa.size()) << base;     // and Twilight pruned it
        }
      }
  }
}

// ---------------------------------------------------------------- composition and options

TEST(TwilightOptions, StacksRouteOptionsAndRejectBadOnes) {
  ModelConfig cfg = Fixture::make_cfg(4);
  auto m = make("twilight:base=quest,budget=512,p=0.9,group=sum", cfg);
  EXPECT_NE(m->describe().find("budget=512"), std::string::npos) << m->describe();
  EXPECT_NE(m->describe().find("group=sum"), std::string::npos) << m->describe();
  EXPECT_NE(m->describe().find("p=0.9"), std::string::npos);
  // budget=auto: max(8192, L/4) for the base.
  auto a = make("twilight", cfg);
  EXPECT_NE(a->describe().find("budget=auto"), std::string::npos) << a->describe();
  EXPECT_NE(a->describe().find("quest budget=8192"), std::string::npos) << a->describe();
  // The stack syntax and the base option build the same thing.
  auto s = make_stack("quest+twilight", {{"budget", "256"}}, cfg);
  EXPECT_EQ(s->describe(), make("twilight:base=quest,budget=256", cfg)->describe());
  auto b = make("blasst:base=quest+twilight,budget=256,lambda=0.01", cfg);
  EXPECT_NE(b->describe().find("twilight"), std::string::npos);
  EXPECT_NE(b->describe().find("quest budget=256"), std::string::npos) << b->describe();
  EXPECT_THROW(make("twilight:base=full,page_size=16", cfg), Error);  // full has no page_size
  EXPECT_THROW(make("twilight:base=blasst", cfg), Error);             // blasst must be last
  EXPECT_THROW(make("twilight:head_combine=max", cfg), Error);
  EXPECT_THROW(make("twilight:p=1.5", cfg), Error);
  EXPECT_THROW(make_stack("twilight+quest", {}, cfg), Error);  // quest is not a modifier
  // make_method (the CLI's --sparse, the server's "method") takes the stack as a name.
  EXPECT_EQ(make("quest+twilight:budget=256", cfg)->describe(), s->describe());
  EXPECT_EQ(make("quest+twilight+blasst:budget=256,lambda=0.01", cfg)->describe(), b->describe());
  EXPECT_THROW(make("twilight+quest", cfg), Error);
  EXPECT_EQ(find_method("quest+twilight+blasst").name, "blasst");  // checks every stage
  EXPECT_THROW(find_method("quest++twilight"), Error);
  EXPECT_THROW(find_method("quest+nope"), Error);
}

// ---------------------------------------------------------------- real model (optional)

TEST(TwilightSmolLM2, ExactKeysKeepMassPOnRealAttentionAndInt4StaysClose) {
  const std::string path = test::source_dir() + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
  struct stat sb;
  if (stat(path.c_str(), &sb) != 0) GTEST_SKIP() << "fetch the model with scripts/fetch_model.sh";
  auto w = load_model(path);
  auto tok = Tokenizer::load(path);
  std::string text;
  for (int i = 0; i < 6; ++i)
    text += "In the beginning God created the heaven and the earth. And the earth was without "
            "form, and void; and darkness was upon the face of the deep. And the Spirit of God "
            "moved upon the face of the waters. And God said, Let there be light: and there was "
            "light. And God saw the light, that it was good. ";
  const auto ids = tok->encode(text, false, false);
  ASSERT_GT(ids.size(), 260u);
  const ModelConfig& cfg = w->config;
  for (const char* keys : {"exact", "int4"}) {
    ModelRunner r(*w, 300);
    ProbeSession s(make_method(SparseConfig::parse_spec(cat("twilight:base=full,p=0.95,keys=", keys)),
                               cfg),
                   cfg, r.kv(), true);
    r.prefill(ids.data(), 256, &s.attention());
    for (int i = 0; i < 3; ++i) r.step(ids[size_t(256 + i)], &s.attention());
    const TwilightStats* ts = s.twilight();
    ASSERT_TRUE(ts);
    EXPECT_LT(ts->mean_kept(), 0.8 * ts->mean_base()) << keys;  // real heads are focused
    if (std::string(keys) == "exact")
      EXPECT_GE(s.min_recall(2), 0.95 - 1e-3);  // every (layer >= 2, query head, step)
    else
      EXPECT_GE(s.mean_recall(2), 0.94);
  }
}
