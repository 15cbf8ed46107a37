// The tensor-parallel rank protocol (src/dist/tp_runner.h): rank 0's TpStepModel (through
// make_runner) against followers running dist::run_follower_rank, each rank a thread of this
// process on 127.0.0.1. Steps mix prefill and decode of several sequences, releases and new
// sequences; logits must equal one rank's within fp32 summation-order tolerance, and the
// followers' page tables must track rank 0's (run_follower checks the page ids every step).
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "dist/tcp_communicator.h"
#include "dist/tp_runner.h"
#include "engine/runner.h"
#include "model/cpu_model.h"
#include "test_util.h"

using namespace spade;
using namespace spade::dist;
using namespace std::chrono_literals;

namespace {

ModelConfig tp_config() {  // 6 KV heads, 12 query heads: splits over 2 and 3 ranks
  ModelConfig c = test::tiny_config(Arch::Llama);
  c.hidden = 64;
  c.n_heads = 12;
  c.n_kv_heads = 6;
  c.head_dim = 16;
  c.ffn = 96;
  return c;
}

std::string what(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";  // no error
}
bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Ranks 1..n-1 as threads running the follower loop on `w`; join() returns their errors.
struct Followers {
  std::shared_ptr<TcpListener> listener = std::make_shared<TcpListener>("127.0.0.1:0");
  std::string addr = "127.0.0.1:" + std::to_string(listener->port());
  std::vector<std::string> err;
  std::vector<std::thread> th;
  Followers(const ModelWeights& w, int n) : err(size_t(n)) {
    for (int r = 1; r < n; ++r)
      th.emplace_back([this, &w, r, n] { err[size_t(r)] = what([&] { run_follower_rank(w, addr, r, n); }); });
  }
  std::vector<std::string> join() {
    for (auto& t : th) t.join();
    th.clear();
    return err;
  }
  ~Followers() {
    for (auto& t : th) t.join();
  }
};

RunnerOptions tp_options(Followers& f, int n, int64_t pages = 64) {
  RunnerOptions ro;
  ro.kv_pages = pages;
  ro.page_size = 4;
  ro.tp = n;
  ro.dist_listener = f.listener;
  return ro;
}

// One step of the schedule: which sequences (by index) get which tokens.
struct Step {
  std::vector<std::pair<int, std::vector<int32_t>>> seqs;
  std::vector<int> release_before;
  bool all_logits = false;
};

std::vector<Step> schedule() {
  return {{{{0, {1, 5, 9, 13, 17, 21, 25}}, {1, {2, 4, 6, 8, 10}}}, {}, true},
          {{{0, {30}}, {1, {31}}}, {}, false},
          {{{1, {32}}, {2, {3, 7, 11, 15, 19, 23}}}, {0}, false},  // 0 released, 2 starts
          {{{2, {40}}, {1, {41}}}, {}, true},
          {{{3, {5, 6}}}, {1, 2}, false}};
}

// Every step's logits from `model`, the pool's free pages after each step.
std::vector<std::vector<float>> run(StepModel& model, std::vector<int64_t>* free_after = nullptr) {
  std::vector<PageTable> pts(4);
  std::vector<std::vector<float>> out;
  for (const Step& s : schedule()) {
    for (int i : s.release_before) model.release(pts[size_t(i)]);
    std::vector<SeqInput> batch;
    for (const auto& [i, toks] : s.seqs) {
      SeqInput in;
      in.pages = &pts[size_t(i)];
      in.tokens = toks.data();
      in.n_tokens = int64_t(toks.size());
      in.all_logits = s.all_logits;
      batch.push_back(in);
    }
    std::vector<int64_t> row_of;
    out.push_back(model.forward(batch, row_of));
    if (free_after) free_after->push_back(model.free_pages());
  }
  return out;
}

}  // namespace

TEST(TpRunner, StepPlanRoundTrips) {
  StepPlan p;
  p.released = {3, 9};
  StepPlan::Seq s;
  s.id = 7;
  s.cached = 12;
  s.all_logits = true;
  s.tokens = {1, 2, 3};
  s.pages = {4, 0, 2, 5};
  s.has_method = true;
  s.method = sparse::SparseConfig::parse_spec("lessismore:budget=64,selection_layers=1,3");
  s.text = {"int ", "", "x\n"};
  p.seqs = {s, StepPlan::Seq{}};
  p.seqs[1].dense = true;
  const std::vector<uint8_t> b = p.encode();
  const StepPlan q = StepPlan::decode(b.data(), b.size());
  EXPECT_EQ(q.released, p.released);
  ASSERT_EQ(q.seqs.size(), 2u);
  EXPECT_EQ(q.seqs[0].id, 7u);
  EXPECT_EQ(q.seqs[0].cached, 12);
  EXPECT_TRUE(q.seqs[0].all_logits);
  EXPECT_FALSE(q.seqs[0].dense);
  EXPECT_EQ(q.seqs[0].tokens, s.tokens);
  EXPECT_EQ(q.seqs[0].pages, s.pages);
  EXPECT_TRUE(q.seqs[0].has_method);
  EXPECT_EQ(q.seqs[0].method.to_string(), s.method.to_string());
  EXPECT_EQ(q.seqs[0].method.options, s.method.options);
  EXPECT_EQ(q.seqs[0].text, s.text);
  EXPECT_TRUE(q.seqs[1].dense);
  EXPECT_FALSE(q.seqs[1].has_method);
  EXPECT_TRUE(q.seqs[1].text.empty());
  EXPECT_TRUE(has(what([&] { StepPlan::decode(b.data(), b.size() - 1); }), "bad step message"));
}

class TpRunnerRanks : public ::testing::TestWithParam<int> {};

TEST_P(TpRunnerRanks, StepsEqualOneRankAndFollowersShutDown) {
  const int n = GetParam();
  ModelWeights w = test::random_model(tp_config(), 11);
  KVPool kv({w.config.n_layers, w.config.n_kv_heads, w.config.head_dim, 4}, 64);
  CpuModel one(w, kv);
  CpuStepModel one_step(one);
  std::vector<int64_t> free_ref, free_tp;
  const auto ref = run(one_step, &free_ref);
  Followers f(w, n);
  {
    Runner r = make_runner(w, tp_options(f, n));
    EXPECT_EQ(r.host_pool, nullptr);  // the runner runs each request's method on every rank
    EXPECT_FALSE(r.model->supports_attention_callbacks());
    EXPECT_EQ(r.model->config().n_kv_heads, 6);  // the model's, not the shard's
    const auto got = run(*r.model, &free_tp);
    ASSERT_EQ(got.size(), ref.size());
    for (size_t s = 0; s < ref.size(); ++s) {
      ASSERT_EQ(got[s].size(), ref[s].size()) << "step " << s;
      double max_abs = 0, max_ref = 1;
      for (size_t i = 0; i < ref[s].size(); ++i) {
        max_abs = std::max(max_abs, double(std::abs(got[s][i] - ref[s][i])));
        max_ref = std::max(max_ref, double(std::abs(ref[s][i])));
      }
      EXPECT_LT(max_abs, 1e-5 * max_ref) << "step " << s;
    }
    EXPECT_EQ(free_tp, free_ref);
  }  // the runner's destructor shuts the followers down
  for (const std::string& e : f.join()) EXPECT_EQ(e, "") << e;
}

INSTANTIATE_TEST_SUITE_P(Tp, TpRunnerRanks, ::testing::Values(2, 3));

TEST(TpRunner, ShortPoolFailsTheStepBeforeAnyRankRunsIt) {
  ModelWeights w = test::random_model(tp_config(), 12);
  Followers f(w, 2);
  {
    Runner r = make_runner(w, tp_options(f, 2, 3));  // 3 pages of 4 tokens
    PageTable a, b;
    std::vector<int32_t> toks(10, 3), more(5, 4);
    std::vector<int64_t> row_of;
    (void)r.model->forward({SeqInput{&a, toks.data(), 10}}, row_of);  // 3 pages
    EXPECT_TRUE(has(what([&] { (void)r.model->forward({SeqInput{&b, more.data(), 5}}, row_of); }),
                    "KV cache full"));
    EXPECT_TRUE(b.pages.empty());
    r.model->release(a);
    // The ranks are still in step: the sequence fits now.
    EXPECT_EQ(r.model->forward({SeqInput{&b, more.data(), 5}}, row_of).size(), size_t(w.config.vocab));
    EXPECT_EQ(r.model->free_pages(), 1);
    // A token outside the vocabulary is refused on rank 0 too, before the followers hear of it.
    std::vector<int32_t> bad = {int32_t(w.config.vocab)};
    EXPECT_TRUE(has(what([&] { (void)r.model->forward({SeqInput{&b, bad.data(), 1}}, row_of); }),
                    "outside the vocabulary"));
    EXPECT_EQ(r.model->forward({SeqInput{&b, more.data(), 1}}, row_of).size(), size_t(w.config.vocab));
  }
  for (const std::string& e : f.join()) EXPECT_EQ(e, "") << e;
}

TEST(TpRunner, FollowerThatExitsFailsRank0AtOnceAndForGood) {
  ModelWeights w = test::random_model(tp_config(), 13);
  auto l = std::make_shared<TcpListener>("127.0.0.1:0");
  const std::string addr = "127.0.0.1:" + std::to_string(l->port());
  std::thread quitter([&] {  // joins, agrees on the model, then exits: its connection closes
    TcpCommunicator c(addr, 1, 2);
    TpInit init;
    c.broadcast(&init, sizeof init, 0);
    float bad = 0;
    c.all_reduce_sum(&bad, 1);
  });
  RunnerOptions ro;
  ro.kv_pages = 16;
  ro.page_size = 4;
  ro.tp = 2;
  ro.dist_listener = l;
  Runner r = make_runner(w, ro);
  quitter.join();
  PageTable a;
  std::vector<int32_t> toks = {1, 2, 3};
  std::vector<int64_t> row_of;
  const auto t0 = std::chrono::steady_clock::now();
  const std::string e1 = what([&] { (void)r.model->forward({SeqInput{&a, toks.data(), 3}}, row_of); });
  EXPECT_LT(std::chrono::steady_clock::now() - t0, test::scaled(5s));
  EXPECT_TRUE(has(e1, "tensor parallelism stopped")) << e1;
  EXPECT_TRUE(has(e1, "rank 1")) << e1;
  PageTable b;
  EXPECT_EQ(what([&] { (void)r.model->forward({SeqInput{&b, toks.data(), 3}}, row_of); }), e1);
}

TEST(TpRunner, RanksWithAnotherModelAreRefused) {
  ModelWeights w = test::random_model(tp_config(), 14);
  ModelConfig c2 = tp_config();
  c2.vocab += 8;
  ModelWeights other = test::random_model(c2, 14);
  Followers f(other, 2);
  const std::string e = what([&] { (void)make_runner(w, tp_options(f, 2)); });
  EXPECT_TRUE(has(e, "loaded a model of another shape")) << e;
  const auto err = f.join();
  EXPECT_TRUE(has(err[1], "loaded a model of another shape")) << err[1];
}

TEST(TpRunner, RecallAndTheGpuAreRefusedByName) {
  ModelWeights w = test::random_model(tp_config(), 15);
  RunnerOptions ro;
  ro.kv_pages = 16;
  ro.tp = 2;
  ro.dist_init = "127.0.0.1:1";  // never reached: refused first
  // Sparse methods run under TP (tests/test_tp_sparse.cpp); recall needs every head's weights.
  ro.sparse.method = "quest";
  ro.sparse.measure_recall = true;
  EXPECT_TRUE(has(what([&] { (void)make_runner(w, ro); }), "--tp 2: sparse option 'recall'"));
  ro.sparse.measure_recall = false;
  ro.sparse.method = "full";
  // --device cuda runs where the build has CUDA and NCCL (tests/gpu/test_cuda_tp.cpp); else
  // a clear error naming what the build lacks.
#if !defined(SPADE_HAVE_CUDA)
  ro.device = "cuda";
  EXPECT_TRUE(has(what([&] { (void)make_runner(w, ro); }), "this build has no CUDA backend"));
#elif !defined(SPADE_HAVE_NCCL)
  ro.device = "cuda";
  EXPECT_TRUE(has(what([&] { (void)make_runner(w, ro); }), "this build has no NCCL"));
#endif
  ro.device = "cpu";
  ro.tp = 4;  // 6 KV heads
  EXPECT_TRUE(has(what([&] { (void)make_runner(w, ro); }), "6 KV heads are not divisible by 4"));
  // Per request (spade serve): the runner's check takes a method and refuses recall.
  Followers f(w, 2);
  {
    Runner r = make_runner(w, tp_options(f, 2));
    ASSERT_TRUE(r.check_method);
    EXPECT_TRUE(r.model->runs_methods());
    sparse::SparseConfig m;
    m.method = "tidal";
    EXPECT_EQ(what([&] { r.check_method(m); }), "");
    m.measure_recall = true;
    EXPECT_TRUE(has(what([&] { r.check_method(m); }), "sparse option 'recall'"));
    EXPECT_TRUE(has(what([&] { (void)r.model->new_request_state(&m); }), "sparse option 'recall'"));
  }
  for (const std::string& e : f.join()) EXPECT_EQ(e, "") << e;
}
