// Cache correction (src/sparse/cache_correction.*, the eval decode loop of src/eval/decode.*;
// issue 37): every N decoded tokens their K/V are recomputed with one dense pass.
//  - the chunk a correction feeds: the last N tokens at their own positions, marked dense
//    (SeqInput::dense), the page table's length restored;
//  - the CPU model attends a dense input densely whatever attention function it carries;
//  - on the stories260k fixture with correction_every=1, after every step the whole cache
//    (every layer, every position) equals full attention's cache, and each step's logits are
//    those of one sparse step over a cache built by a dense prefill of the same tokens, in
//    the eval loop (SharedPrefill) too;
//  - on the fixture, correction lowers the teacher-forced KL against full attention.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <random>
#include <vector>

#include "eval/decode.h"
#include "model/cpu_model.h"
#include "model/loader.h"
#include "sparse/cache_correction.h"
#include "sparse/registry.h"
#include "sparse/session.h"
#include "test_util.h"
#include "tokenizer/tokenizer.h"

using namespace spade;

namespace {

const std::string kModel = test::source_dir() + "/tests/fixtures/models/stories260k-hf";

std::shared_ptr<const sparse::SparseMethod> method(const std::string& spec, const ModelConfig& c) {
  return sparse::make_method(sparse::SparseConfig::parse_spec(spec), c);
}

TEST(CacheCorrection, FeedsTheLastTokensAgainAtTheirPositionsMarkedDense) {
  for (int every : {1, 3}) {
    SCOPED_TRACE(every);
    sparse::CacheCorrection cc(every);
    PageTable pt;
    struct Call {
      int64_t length;
      std::vector<int32_t> tokens;
      bool dense, attention;
    };
    std::vector<Call> calls;
    auto forward = [&](const SeqInput& in) {
      ASSERT_EQ(in.pages, &pt);
      calls.push_back({in.pages->length, std::vector<int32_t>(in.tokens, in.tokens + in.n_tokens),
                       in.dense, in.attention != nullptr});
      in.pages->length += in.n_tokens;  // what a model's forward does
    };
    pt.length = 20;  // prompt
    for (int32_t t = 100; t < 106; ++t) {
      ++pt.length;  // the decode step that fed `t`
      const bool ran = cc.after_decode(forward, pt, t);
      EXPECT_EQ(ran, (t - 100 + 1) % every == 0) << "token " << t;
      EXPECT_EQ(pt.length, 20 + (t - 100) + 1) << "the length is restored";
    }
    ASSERT_EQ(calls.size(), size_t(6 / every));
    for (size_t i = 0; i < calls.size(); ++i) {
      const int64_t first = int64_t(i) * every;  // index among the decoded tokens
      EXPECT_EQ(calls[i].length, 20 + first) << "the chunk starts at its first token's position";
      ASSERT_EQ(calls[i].tokens.size(), size_t(every));
      for (int j = 0; j < every; ++j) EXPECT_EQ(calls[i].tokens[size_t(j)], 100 + first + j);
      EXPECT_TRUE(calls[i].dense) << "a correction chunk is marked dense (one token included)";
      EXPECT_FALSE(calls[i].attention);
    }
    EXPECT_EQ(cc.corrections(), int64_t(calls.size()));
  }
}

// A dense input ignores its attention function: the same logits as without one, and the
// function is never called (the CPU model's side of SeqInput::dense).
TEST(CacheCorrection, CpuModelAttendsADenseInputDensely) {
  const ModelConfig c = test::tiny_config();
  const ModelWeights w = test::random_model(c, 5);
  std::mt19937 rng(6);
  std::vector<int32_t> seq(40);
  for (auto& t : seq) t = int32_t(rng() % uint32_t(c.vocab));
  int calls = 0;
  const AttentionFn zero = [&](int, const PageTable&, const float*, int64_t, int64_t T, float* out) {
    ++calls;
    std::fill_n(out, T * c.n_heads * c.head_dim, 0.f);
  };
  auto run = [&](bool dense, const AttentionFn* fn) {
    KVPool kv(KVLayout{c.n_layers, c.n_kv_heads, c.head_dim, 8}, 16);
    CpuModel m(w, kv);
    PageTable pt;
    std::vector<int64_t> rows;
    m.forward({{&pt, seq.data(), 32, false, nullptr}}, rows);
    std::vector<float> out;
    for (int i = 32; i < 40; ++i) {
      SeqInput in{&pt, seq.data() + i, 1, false, fn};
      in.dense = dense;
      const auto& lg = m.forward({in}, rows);
      out.insert(out.end(), lg.begin(), lg.begin() + c.vocab);
    }
    return out;
  };
  const std::vector<float> want = run(false, nullptr);
  EXPECT_EQ(run(true, &zero), want);
  EXPECT_EQ(calls, 0);
  EXPECT_NE(run(false, &zero), want);  // the function does change the output when used
  EXPECT_GT(calls, 0);
}

// ---------------------------------------------------------------- stories260k fixture

struct Fixture {
  std::unique_ptr<ModelWeights> w;
  std::unique_ptr<Tokenizer> tok;
  std::vector<int32_t> prompt, forced;
  std::vector<std::vector<float>> full_logits;  // [step] full attention's logits (step 0: prefill)
};

// Full attention's greedy continuation of a story opening (teacher-forcing tokens) and its
// logits at every step.
const Fixture& fixture(int64_t G) {
  static std::map<int64_t, std::unique_ptr<Fixture>> cache;
  auto& f = cache[G];
  if (f) return *f;
  f = std::make_unique<Fixture>();
  f->w = load_model(kModel);
  f->tok = Tokenizer::load(kModel);
  f->prompt = f->tok->encode("Once upon a time", true, false);
  eval::SharedPrefill sp(*f->w, int64_t(f->prompt.size()), G, 16);
  sp.prefill(f->prompt);
  eval::DecodeOptions o;
  o.max_new = G;
  o.on_logits = [&](int64_t, const float* lg) {
    f->full_logits.emplace_back(lg, lg + f->w->config.vocab);
  };
  f->forced = sp.decode(method("full", f->w->config), o).tokens;
  return *f;
}

double kl(const std::vector<float>& p_logits, const float* q_logits, int V) {
  auto lse = [&](const float* l) {
    const float mx = *std::max_element(l, l + V);
    double s = 0;
    for (int v = 0; v < V; ++v) s += std::exp(double(l[v]) - mx);
    return double(mx) + std::log(s);
  };
  const double a = lse(p_logits.data()), b = lse(q_logits);
  double d = 0;
  for (int v = 0; v < V; ++v) {
    const double lp = double(p_logits[size_t(v)]) - a, lq = double(q_logits[v]) - b;
    d += std::exp(lp) * (lp - lq);
  }
  return d;
}

double max_kv_diff(const KVPool& a, const PageTable& pa, const KVPool& b, const PageTable& pb,
                   int64_t p0, int64_t p1, const ModelConfig& c) {
  double d = 0;
  for (int l = 0; l < c.n_layers; ++l)
    for (int64_t p = p0; p < p1; ++p)
      for (int h = 0; h < c.n_kv_heads; ++h)
        for (int x = 0; x < c.head_dim; ++x) {
          d = std::max(d, double(std::abs(a.k_row(l, pa, p, h)[x] - b.k_row(l, pb, p, h)[x])));
          d = std::max(d, double(std::abs(a.v_row(l, pa, p, h)[x] - b.v_row(l, pb, p, h)[x])));
        }
  return d;
}

const char* const kSpecs[] = {"tidal:budget=16,dense_layers=1,selection_layers=1",
                              "lycheedecode:roles=RRRR/SSSS/SSSS/SSSS/SSSS,budget=16"};

// With correction_every=1 every decoded token's K/V are recomputed densely right after its
// step, so the cache is full attention's at every step, and a step's logits are exactly those
// of one sparse step over a dense prefill of the same tokens (the method's own error of that
// step, nothing accumulated). The eval loop (SharedPrefill, Corrector) gives the same logits.
TEST(CacheCorrectionFixture, EveryTokenKeepsFullAttentionsCache) {
  const int64_t G = 120;
  const Fixture& f = fixture(G);
  const ModelConfig& c = f.w->config;
  const int V = c.vocab;
  const int64_t P = int64_t(f.prompt.size());
  ASSERT_EQ(int64_t(f.forced.size()), G);
  const KVLayout lay{c.n_layers, c.n_kv_heads, c.head_dim, 16};
  for (const char* spec : kSpecs) {
    SCOPED_TRACE(spec);
    auto m = method(std::string(spec) + ",correction=1,correction_every=1", c);
    ASSERT_EQ(m->correction_every(), 1);
    // Three caches over the same tokens: full attention, sparse, sparse + correction.
    KVPool kd(lay, 32), ks(lay, 32), kc(lay, 32);
    CpuModel md(*f.w, kd), ms(*f.w, ks), mc(*f.w, kc);
    PageTable pd, ps, pc;
    sparse::SparseSession ss(m, c, ks), sc(m, c, kc);
    sparse::CacheCorrection cc(1);
    std::vector<int64_t> rows, corr_rows;
    for (auto [model, pt] : {std::pair{&md, &pd}, {&ms, &ps}, {&mc, &pc}})
      model->forward({{pt, f.prompt.data(), P, false, nullptr}}, rows);
    double worst_cache = 0, worst_logit = 0, polluted = 0;
    std::vector<std::vector<float>> corrected;  // [step - 1] logits of the corrected run
    for (int64_t i = 0; i + 1 < G; ++i) {
      const int32_t* t = &f.forced[size_t(i)];
      md.forward({{&pd, t, 1, false, nullptr}}, rows);
      ms.forward({{&ps, t, 1, false, &ss.attention()}}, rows);
      const auto& lg = mc.forward({{&pc, t, 1, false, &sc.attention()}}, rows);
      corrected.emplace_back(lg.begin() + rows[0] * V, lg.begin() + (rows[0] + 1) * V);
      ASSERT_TRUE(cc.after_decode([&](const SeqInput& in) { mc.forward({in}, corr_rows); }, pc, *t));
      ASSERT_EQ(pc.length, pd.length);
      worst_cache = std::max(worst_cache, max_kv_diff(kd, pd, kc, pc, 0, pd.length, c));
      polluted = std::max(polluted, max_kv_diff(kd, pd, ks, ps, P, ps.length, c));
      // Independently: a dense prefill of the prompt and the tokens before t, then one sparse
      // step feeding t.
      if (i % 7 == 0 || i + 2 == G) {
        KVPool ki(lay, 32);
        CpuModel mi(*f.w, ki);
        PageTable pi;
        std::vector<int32_t> prefix(f.prompt);
        prefix.insert(prefix.end(), f.forced.begin(), f.forced.begin() + i);
        mi.forward({{&pi, prefix.data(), int64_t(prefix.size()), false, nullptr}}, rows);
        sparse::SparseSession si(m, c, ki);
        const auto& li = mi.forward({{&pi, t, 1, false, &si.attention()}}, rows);
        for (int v = 0; v < V; ++v)
          worst_logit = std::max(worst_logit, double(std::abs(li[size_t(v)] - corrected.back()[size_t(v)])));
      }
    }
    EXPECT_LT(worst_cache, 1e-5) << "the corrected cache is full attention's";
    EXPECT_LT(worst_logit, 1e-4) << "a corrected step is one sparse step over the dense cache";
    // Not vacuous: the method is sparse and pollutes the K/V of the tokens it decodes.
    EXPECT_GT(polluted, 1e-3);
    EXPECT_LT(sc.totals().mean_density(), 0.7);
    EXPECT_EQ(cc.corrections(), G - 1);

    // The eval loop: the same logits at every step, teacher forced on the same tokens.
    eval::SharedPrefill sp(*f.w, P, G, 16);
    sp.prefill(f.prompt);
    eval::DecodeOptions o;
    o.max_new = G;
    o.forced = &f.forced;
    o.correction_every = m->correction_every();
    double worst_eval = 0;
    int64_t seen = 0;
    o.on_logits = [&](int64_t i, const float* lg) {
      if (i == 0) return;  // the prefill's
      ++seen;
      for (int v = 0; v < V; ++v)
        worst_eval = std::max(worst_eval, double(std::abs(lg[v] - corrected[size_t(i - 1)][size_t(v)])));
    };
    const eval::DecodeResult r = sp.decode(m, o);
    EXPECT_EQ(r.corrections, G - 1);
    EXPECT_EQ(r.tokens, f.forced);
    EXPECT_EQ(seen, G - 1);
    EXPECT_LT(worst_eval, 1e-5);
  }
}

// On the fixture's story, teacher forced along full attention's tokens, correction lowers the
// mean KL of the method's next-token distribution against full attention's; every token more
// than every 4.
TEST(CacheCorrectionFixture, LowersTheKLAgainstFullAttention) {
  const int64_t G = 400;
  const Fixture& f = fixture(G);
  const ModelConfig& c = f.w->config;
  const int64_t P = int64_t(f.prompt.size());
  eval::SharedPrefill sp(*f.w, P, G, 16);
  sp.prefill(f.prompt);
  for (const char* spec : kSpecs) {
    SCOPED_TRACE(spec);
    auto mean_kl = [&](int64_t every) {
      auto m = method(every ? std::string(spec) + ",correction=1,correction_every=" +
                                  std::to_string(every)
                            : std::string(spec),
                      c);
      EXPECT_EQ(m->correction_every(), every);
      eval::DecodeOptions o;
      o.max_new = G;
      o.forced = &f.forced;
      o.correction_every = m->correction_every();
      double sum = 0;
      o.on_logits = [&](int64_t i, const float* lg) {
        if (i > 0) sum += kl(f.full_logits[size_t(i)], lg, c.vocab);
      };
      const eval::DecodeResult r = sp.decode(m, o);
      EXPECT_EQ(r.corrections, every ? (G - 1) / every : 0);
      return sum / double(G - 1);
    };
    const double none = mean_kl(0), every4 = mean_kl(4), every1 = mean_kl(1);
    EXPECT_GT(none, 1e-2) << "the method is lossy here";
    EXPECT_LT(every1, 0.92 * none);
    EXPECT_LT(every4, none);
    EXPECT_LT(every1, every4);
  }
}

}  // namespace
