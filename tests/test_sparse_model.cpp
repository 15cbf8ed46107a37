// Sparse methods inside the CPU layer loop on a small random model: budget >= context is
// exactly full attention (same logits, bit for bit), small budgets change the outputs and
// report recall < 1, batches mix sequences of different lengths and methods, and a decode
// step allocates nothing once the session is warm.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <new>

#include "model/cpu_model.h"
#include "sparse/registry.h"
#include "sparse/session.h"
#include "test_util.h"

// Counts operator new calls made by the current thread while counting is on. The whole
// replaceable family (plain, array, nothrow, sized) goes through malloc / free, so that no
// allocation made by one form is released by another (AddressSanitizer's
// alloc-dealloc-mismatch); the aligned forms keep the library's own pair.
namespace {
thread_local bool g_count_allocs = false;
std::atomic<int64_t> g_allocs{0};
void* counted_alloc(std::size_t n) noexcept {
  if (g_count_allocs) g_allocs.fetch_add(1);
  return std::malloc(n ? n : 1);
}
}  // namespace
void* operator new(std::size_t n) {
  if (void* p = counted_alloc(n)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n) {
  if (void* p = counted_alloc(n)) return p;
  throw std::bad_alloc();
}
void* operator new(std::size_t n, const std::nothrow_t&) noexcept { return counted_alloc(n); }
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept { return counted_alloc(n); }
// g++ 12 takes the replaced operator new for the library's and warns on free() of its result
// (-Wmismatched-new-delete) where gtest's `new TestClass` is inlined; the pair matches here.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

using namespace spade;
using namespace spade::sparse;

namespace {

ModelConfig model_config() {
  ModelConfig c = test::tiny_config();
  c.n_layers = 4;
  return c;
}

std::vector<int32_t> ids(int n, int vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (auto& x : v) x = int32_t(rng() % uint32_t(vocab));
  return v;
}

// Prefill `prompt`, then decode `steps` tokens of `forced` (teacher forcing, so every
// method sees the same inputs); returns the logits of every decode step.
std::vector<std::vector<float>> decode_logits(const ModelWeights& w, const std::vector<int32_t>& seq,
                                              int prompt, int steps, const std::string& spec,
                                              std::vector<double>* recall = nullptr,
                                              std::vector<double>* density = nullptr) {
  const ModelConfig& c = w.config;
  KVPool kv({c.n_layers, c.n_kv_heads, c.head_dim, 8}, 64);
  CpuModel model(w, kv);
  std::unique_ptr<SparseSession> s;
  if (!spec.empty())
    s = std::make_unique<SparseSession>(make_method(SparseConfig::parse_spec(spec), c), c, kv,
                                        SessionOptions{true, true});
  PageTable pt;
  std::vector<int64_t> row_of;
  std::vector<SeqInput> b = {{&pt, seq.data(), prompt, false, s ? &s->attention() : nullptr}};
  model.forward(b, row_of);
  std::vector<std::vector<float>> out;
  for (int i = 0; i < steps; ++i) {
    b = {{&pt, seq.data() + prompt + i, 1, false, s ? &s->attention() : nullptr}};
    const auto& lg = model.forward(b, row_of);
    out.emplace_back(lg.begin(), lg.begin() + c.vocab);
    if (s && recall) recall->push_back(s->last_step().sparse_recall());
    if (s && density) density->push_back(s->last_step().density());
  }
  return out;
}

const char* kLayerOpts = "dense_layers=1,selection_layers=1,3";

}  // namespace

TEST(SparseModel, BudgetAtLeastTheContextReproducesFullAttentionBitForBit) {
  ModelWeights w = test::random_model(model_config(), 5);
  auto seq = ids(60, w.config.vocab, 6);
  auto ref = decode_logits(w, seq, 40, 12, "");  // no AttentionFn: the model's dense path
  for (std::string spec :
       {std::string("full"), std::string("streaming:budget=52"), std::string("quest:budget=64"),
        cat("tidal:budget=52,", kLayerOpts), cat("lessismore:budget=60,", kLayerOpts),
        std::string("oracle-topk:budget=52")}) {
    std::vector<double> rec, dens;
    auto got = decode_logits(w, seq, 40, 12, spec, &rec, &dens);
    for (size_t i = 0; i < ref.size(); ++i) {
      EXPECT_EQ(got[i], ref[i]) << spec << " step " << i;
      EXPECT_EQ(rec[i], 1.0) << spec;
      EXPECT_EQ(dens[i], 1.0) << spec;
    }
  }
}

TEST(SparseModel, SmallBudgetsChangeTheOutputAndReportRecallBelowOne) {
  ModelWeights w = test::random_model(model_config(), 5);
  auto seq = ids(110, w.config.vocab, 7);
  auto ref = decode_logits(w, seq, 100, 6, "");
  for (std::string spec :
       {std::string("streaming:budget=12"), std::string("quest:budget=16"),
        cat("tidal:budget=12,", kLayerOpts), cat("lessismore:budget=16,", kLayerOpts),
        std::string("oracle-topk:budget=12"), std::string("oracle-topp:p=0.5")}) {
    std::vector<double> rec, dens;
    auto got = decode_logits(w, seq, 100, 6, spec, &rec, &dens);
    double maxdiff = 0;
    for (size_t i = 0; i < ref.size(); ++i)
      for (size_t j = 0; j < ref[i].size(); ++j) maxdiff = std::max(maxdiff, double(std::abs(got[i][j] - ref[i][j])));
    EXPECT_GT(maxdiff, 1e-3) << spec;
    for (size_t i = 0; i < rec.size(); ++i) {
      EXPECT_LT(rec[i], 1.0) << spec;
      EXPECT_GT(rec[i], 0.0) << spec;
      EXPECT_LT(dens[i], 0.8) << spec;
    }
  }
}

TEST(SparseModel, BatchOfDifferentLengthsAndMethodsEqualsEachAlone) {
  ModelWeights w = test::random_model(model_config(), 9);
  const ModelConfig& c = w.config;
  const std::vector<std::string> specs = {"quest:budget=16", cat("lessismore:budget=24,", kLayerOpts),
                                          "full", cat("tidal:budget=20,", kLayerOpts)};
  const std::vector<int> lens = {70, 33, 90, 51};
  const int steps = 5;
  std::vector<std::vector<int32_t>> seqs;
  for (size_t i = 0; i < specs.size(); ++i) seqs.push_back(ids(lens[i] + steps, c.vocab, 20 + uint32_t(i)));
  // Alone.
  std::vector<std::vector<std::vector<float>>> alone;
  for (size_t i = 0; i < specs.size(); ++i) alone.push_back(decode_logits(w, seqs[i], lens[i], steps, specs[i]));
  // Together: one pool, one model, each sequence with its own session.
  KVPool kv({c.n_layers, c.n_kv_heads, c.head_dim, 8}, 128);
  CpuModel model(w, kv);
  std::vector<std::unique_ptr<SparseSession>> sess;
  std::vector<PageTable> pts(specs.size());
  std::vector<SeqInput> b;
  for (size_t i = 0; i < specs.size(); ++i) {
    sess.push_back(std::make_unique<SparseSession>(make_method(SparseConfig::parse_spec(specs[i]), c), c, kv,
                                                   SessionOptions{false, true}));
    b.push_back({&pts[i], seqs[i].data(), lens[i], false, &sess[i]->attention()});
  }
  std::vector<int64_t> row_of;
  model.forward(b, row_of);
  for (int t = 0; t < steps; ++t) {
    for (size_t i = 0; i < specs.size(); ++i) b[i] = {&pts[i], seqs[i].data() + lens[i] + t, 1, false, &sess[i]->attention()};
    const auto& lg = model.forward(b, row_of);
    for (size_t i = 0; i < specs.size(); ++i) {
      double md = 0;
      for (int j = 0; j < c.vocab; ++j)
        md = std::max(md, double(std::abs(lg[size_t(row_of[i] * c.vocab + j)] - alone[i][size_t(t)][size_t(j)])));
      EXPECT_LT(md, 1e-4) << specs[i] << " step " << t;
    }
    for (size_t i = 0; i < specs.size(); ++i)
      EXPECT_EQ(sess[i]->last_step().length, lens[i] + t + 1) << specs[i];
  }
  EXPECT_LT(sess[0]->totals().mean_density(), 1.0);
  EXPECT_EQ(sess[2]->totals().mean_density(), 1.0);
}

TEST(SparseModel, DecodeStepsAllocateNothingOnceWarm) {
  ModelConfig c = model_config();
  const int64_t L = 300;
  KVPool kv({c.n_layers, c.n_kv_heads, c.head_dim, 16}, 40);
  PageTable pt;
  kv.reserve(pt, L + 20);
  std::mt19937 rng(3);
  std::vector<float> k(size_t(c.n_kv_heads * c.head_dim)), q(size_t(c.n_heads * c.head_dim)),
      out(q.size());
  auto append = [&] {
    for (int l = 0; l < c.n_layers; ++l) {
      test::fill_random(k.data(), k.size(), rng);
      kv.write(l, pt, pt.length, k.data(), k.data());
    }
    ++pt.length;
  };
  for (int64_t i = 0; i < L; ++i) append();
  for (std::string spec : {std::string("full"), std::string("streaming:budget=64"), std::string("quest:budget=64"),
                           cat("tidal:budget=64,", kLayerOpts), cat("lessismore:budget=64,", kLayerOpts),
                           std::string("oracle-topk:budget=64"), std::string("oracle-topp")}) {
    SparseSession s(make_method(SparseConfig::parse_spec(spec), c), c, kv, SessionOptions{true, false});
    s.reserve(L + 20);
    auto step = [&] {
      append();
      test::fill_random(q.data(), q.size(), rng);
      for (int l = 0; l < c.n_layers; ++l) s.attend(l, pt, q.data(), pt.length - 1, 1, out.data());
    };
    step();  // warm-up: method state, first sets
    g_allocs = 0;
    g_count_allocs = true;
    for (int i = 0; i < 3; ++i) step();
    g_count_allocs = false;
    EXPECT_EQ(g_allocs.load(), 0) << spec;
    EXPECT_EQ(s.totals().steps, 4);
    pt.length -= 4;  // reuse the same slots for the next method
  }
}
