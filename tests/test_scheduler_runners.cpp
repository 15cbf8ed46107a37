// The scheduler over runners other than the plain CPU one (test doubles over the CPU model):
// sampling on the device, methods the runner runs itself per request, delivery of large
// steps on the thread pool.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <thread>

#include "engine/generator.h"
#include "engine/scheduler.h"
#include "scheduler_test_util.h"
#include "sparse/registry.h"
#include "sparse/session.h"
#include "test_util.h"

using namespace spade;
using namespace spade::sched_test;
using namespace std::chrono_literals;

namespace {

TEST(Scheduler, DeviceSamplingUnlessAStepNeedsHostLogits) {
  Fixture f;
  DeviceSamplingRunner runner(f.model);
  SchedulerOptions so;
  so.max_batch = 4;
  Scheduler sched(runner, f.text, so);
  const auto p1 = make_prompt(7, 3, f.cfg.vocab), p2 = make_prompt(5, 4, f.cfg.vocab);
  EngineRequest a = greedy(p1, 6), b = greedy(p2, 6);
  a.sampling.seed = 11;
  b.sampling.seed = 22;
  auto ca = sched.submit(std::move(a));
  auto cb = sched.submit(std::move(b));
  const Result ra = collect(*ca), rb = collect(*cb);
  ASSERT_EQ(ra.tokens.size(), 6u);
  ASSERT_EQ(rb.tokens.size(), 6u);
  expect_greedy(f.w, p1, ra.tokens);
  expect_greedy(f.w, p2, rb.tokens);
  EXPECT_EQ(runner.host_steps, 0);
  EXPECT_GE(runner.device_steps, 6);
  // Each request's rows carry its own seed and the index of the token being drawn.
  std::vector<uint64_t> seen_a, seen_b;
  for (auto [seed, draw] : runner.draws) (seed == 11 ? seen_a : seen_b).push_back(draw);
  EXPECT_EQ(seen_a, (std::vector<uint64_t>{0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(seen_b, (std::vector<uint64_t>{0, 1, 2, 3, 4, 5}));
  // A request with logprobs needs the logits on the host: its steps take forward().
  EngineRequest c = greedy(p1, 3);
  c.logprobs = 2;
  const Result rc = collect(*sched.submit(std::move(c)));
  EXPECT_EQ(rc.tokens, std::vector<int32_t>(ra.tokens.begin(), ra.tokens.begin() + 3));
  EXPECT_EQ(rc.logprobs.size(), 3u);
  EXPECT_EQ(runner.host_steps, 3);
  ASSERT_TRUE(sched.wait_idle(5s));
  EXPECT_EQ(sched.metrics().device_sampled_steps, uint64_t(runner.device_steps));
  EXPECT_EQ(f.kv.used_pages(), 0);
}

// A runner that runs per-request methods itself (runs_methods), as the GPU runner does with
// its GpuMethods, here with the CPU methods: each request's state holds its SparseSession and
// forward() hands it to CpuModel. Records the methods it was asked for and how many distinct
// ones shared a step.
class MethodRunner final : public CpuStepModel {
 public:
  explicit MethodRunner(CpuModel& m) : CpuStepModel(m) {}
  struct State final : sparse::MethodState {
    std::string key;
    std::unique_ptr<sparse::SparseSession> session;
    int64_t rows_per_token = 0;
    // Rows read, as the GPU's states count them (-1: its own method, which counts none).
    int64_t attended_rows() const override {
      return session ? int64_t(session->totals().tokens_sum * double(rows_per_token) + 0.5) : -1;
    }
  };
  std::unique_ptr<sparse::MethodState> new_request_state(
      const sparse::SparseConfig* method) override {
    auto st = std::make_unique<State>();
    st->key = method ? method->to_string() : "own";
    if (method)
      st->session = std::make_unique<sparse::SparseSession>(
          sparse::make_method(*method, m_.config()), m_.config(), m_.kv());
    st->rows_per_token = int64_t(m_.config().n_layers) * m_.config().n_kv_heads;
    asked.push_back(st->key);
    return st;
  }
  bool runs_methods() const override { return true; }
  const std::vector<float>& forward(const std::vector<SeqInput>& batch,
                                    std::vector<int64_t>& row_of) override {
    std::vector<SeqInput> b = batch;
    std::vector<std::string> keys;
    for (SeqInput& s : b) {
      auto* st = dynamic_cast<State*>(s.device_state);
      EXPECT_NE(st, nullptr) << "a sequence without its request state";
      if (!st) continue;
      if (st->session) s.attention = &st->session->attention();
      if (std::find(keys.begin(), keys.end(), st->key) == keys.end()) keys.push_back(st->key);
    }
    most_methods_in_a_step = std::max(most_methods_in_a_step, int(keys.size()));
    return m_.forward(b, row_of);
  }
  bool supports_attention_callbacks() const override { return false; }
  std::string device() const override { return "method runner"; }

  std::vector<std::string> asked;
  int most_methods_in_a_step = 0;

 private:
};

TEST(Scheduler, RunnerMethodsPerRequestShareSteps) {
  Fixture f;
  MethodRunner runner(f.model);
  SchedulerOptions so;
  so.max_batch = 4;
  Scheduler sched(runner, f.text, so);
  const std::vector<std::string> specs = {"", "streaming:budget=12", "quest:budget=16",
                                          "tidal:budget=12"};
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::shared_ptr<RequestChannel>> chans;
  for (size_t i = 0; i < specs.size(); ++i) {
    prompts.push_back(make_prompt(int(20 + 3 * i), 5 + int(i), f.cfg.vocab));
    EngineRequest r = greedy(prompts.back(), 16);
    if (!specs[i].empty())
      r.device_method =
          std::make_shared<const sparse::SparseConfig>(sparse::SparseConfig::parse_spec(specs[i]));
    chans.push_back(sched.submit(std::move(r)));
  }
  std::vector<Result> got;
  for (auto& c : chans) got.push_back(collect(*c));
  ASSERT_TRUE(sched.wait_idle(5s));
  EXPECT_GE(runner.most_methods_in_a_step, 3);  // they really shared steps
  EXPECT_EQ(f.kv.used_pages(), 0);
  // Each request's tokens are those of the same request alone with its method (CPU session).
  for (size_t i = 0; i < specs.size(); ++i) {
    ASSERT_EQ(got[i].reason, FinishReason::Length) << got[i].error;
    KVPool kv(f.kv.layout(), 64);
    CpuModel m(f.w, kv);
    GenerateOptions go;
    go.max_new_tokens = 16;
    go.sampling.temperature = 0;
    std::unique_ptr<sparse::SparseSession> s;
    if (!specs[i].empty()) {
      const sparse::SparseConfig sc = sparse::SparseConfig::parse_spec(specs[i]);
      s = std::make_unique<sparse::SparseSession>(sparse::make_method(sc, f.cfg), f.cfg, kv);
      go.attention = &s->attention();
    }
    PageTable pt;
    std::vector<int32_t> alone;
    generate(m, pt, prompts[i], go, [&](int32_t t) {
      alone.push_back(t);
      return true;
    });
    EXPECT_EQ(got[i].tokens, alone) << (specs[i].empty() ? "own" : specs[i]);
    // The density the runner's state counted reaches the request's end: the own method's
    // state counts nothing (dense: 1), streaming's budget reads less than the context.
    if (specs[i].empty()) {
      EXPECT_DOUBLE_EQ(got[i].density, 1.0);
    } else {  // (quest and tidal keep this 2-layer model's layers dense: density 1)
      EXPECT_GT(got[i].density, 0.0) << specs[i];
      EXPECT_LE(got[i].density, 1.0) << specs[i];
      if (specs[i].rfind("streaming", 0) == 0) {
        EXPECT_LT(got[i].density, 0.8) << specs[i];
      }
    }
  }
  // The runner was asked for each request's method (null: its own).
  std::vector<std::string> want = {"own"};
  for (size_t i = 1; i < specs.size(); ++i)
    want.push_back(sparse::SparseConfig::parse_spec(specs[i]).to_string());
  std::vector<std::string> asked = runner.asked;
  std::sort(asked.begin(), asked.end());
  std::sort(want.begin(), want.end());
  EXPECT_EQ(asked, want);
}

TEST(Scheduler, RunnerMethodsNeedARunnerThatRunsThem) {
  Fixture f;
  Scheduler sched(f.model, f.text, SchedulerOptions{});
  EngineRequest r = greedy(make_prompt(5, 1, f.cfg.vocab), 2);
  r.device_method =
      std::make_shared<const sparse::SparseConfig>(sparse::SparseConfig::parse_spec("quest"));
  try {
    sched.submit(std::move(r));
    ADD_FAILURE() << "expected a 400";
  } catch (const SubmitError& e) {
    EXPECT_EQ(e.status, 400);
    EXPECT_NE(std::string(e.what()).find("runs no per-request methods"), std::string::npos);
  }
}

// Steps of >= Scheduler::kParallelDeliverRows requests deliver their tokens on the thread
// pool: every request still gets exactly its own tokens, text, logprobs and end.
TEST(Scheduler, LargeBatchDeliversEveryRequestInParallel) {
  Fixture f(1024);
  SchedulerOptions so;
  so.max_batch = 64;
  Scheduler sched(f.model, f.text, so);
  const int n = 48;
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::shared_ptr<RequestChannel>> chans;
  for (int i = 0; i < n; ++i) {
    prompts.push_back(make_prompt(4 + i % 7, 100 + i, f.cfg.vocab));
    EngineRequest r = greedy(prompts.back(), 40 + i % 5);  // long enough to share steps
    if (i % 3 == 1) r.logprobs = 2;
    if (i % 3 == 2) r.sampling.temperature = 0.8f, r.sampling.seed = uint64_t(i);
    chans.push_back(sched.submit(std::move(r)));
  }
  std::vector<Result> got;
  for (auto& c : chans) got.push_back(collect(*c));
  ASSERT_TRUE(sched.wait_idle(5s));
  {  // some step delivered more than 32 tokens (the batch-size histogram's buckets past 32)
    const Histogram& h = sched.metrics().batch_size;
    uint64_t big = 0;
    for (size_t b = 0; b < h.bounds.size(); ++b)
      if (h.bounds[b] > 32) big += h.counts[b];
    big += h.counts.back();
    EXPECT_GT(big, 0u);
  }
  EXPECT_EQ(f.kv.used_pages(), 0);
  for (int i = 0; i < n; ++i) {
    const Result& r = got[size_t(i)];
    ASSERT_EQ(r.reason, FinishReason::Length) << i << ": " << r.error;
    ASSERT_EQ(r.tokens.size(), size_t(40 + i % 5)) << i;
    if (i % 3 != 2) expect_greedy(f.w, prompts[size_t(i)], r.tokens);
    if (i % 3 == 1) {
      EXPECT_EQ(r.logprobs.size(), r.tokens.size()) << i;
    }
  }
  // A seeded sampled request alone gives the same tokens as inside the large batch.
  for (int i : {2, 5, 47}) {
    if (i % 3 != 2) continue;
    EngineRequest r = greedy(prompts[size_t(i)], 40 + i % 5);
    r.sampling.temperature = 0.8f, r.sampling.seed = uint64_t(i);
    EXPECT_EQ(collect(*sched.submit(std::move(r))).tokens, got[size_t(i)].tokens) << i;
  }
}

}  // namespace

// SchedulerOptions::isolate_prefill (--deterministic servers): a step holds decode tokens only,
// or one request's prefill chunk, and a prompt's chunks start at multiples of max_step_tokens,
// whatever else is running; outputs stay greedy and every request finishes.
class StepRecorder final : public CpuStepModel {
 public:
  explicit StepRecorder(CpuModel& m) : CpuStepModel(m) {}
  struct Row {
    const PageTable* pt;
    int64_t p0, n;
    std::vector<int32_t> tokens;
  };
  const std::vector<float>& forward(const std::vector<SeqInput>& batch,
                                    std::vector<int64_t>& row_of) override {
    std::vector<Row> step;
    for (const SeqInput& s : batch)
      step.push_back({s.pages, s.pages->length, s.n_tokens,
                      std::vector<int32_t>(s.tokens, s.tokens + s.n_tokens)});
    steps.push_back(step);
    return m_.forward(batch, row_of);
  }
  std::vector<std::vector<Row>> steps;
};

TEST(Scheduler, IsolatedPrefillNeverSharesAStep) {
  Fixture f;
  StepRecorder runner(f.model);
  SchedulerOptions so;
  so.max_batch = 8;
  so.max_step_tokens = 16;
  so.isolate_prefill = true;
  Scheduler sched(runner, f.text, so);
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::shared_ptr<RequestChannel>> chans;
  for (int i = 0; i < 6; ++i) {
    prompts.push_back(make_prompt(5 + 9 * i, i + 3, f.cfg.vocab));  // 5 .. 50 tokens
    chans.push_back(sched.submit(greedy(prompts.back(), 10)));
  }
  for (size_t i = 0; i < chans.size(); ++i) {
    const Result r = collect(*chans[i]);
    EXPECT_EQ(r.reason, FinishReason::Length);
    EXPECT_EQ(r.tokens.size(), 10u);
    expect_greedy(f.w, prompts[i], r.tokens);
  }
  ASSERT_TRUE(sched.wait_idle(5s));
  EXPECT_EQ(f.kv.used_pages(), 0);
  // Which prompt each page table holds: the one its first chunk starts with.
  std::map<const PageTable*, int64_t> prompt_len;
  int prefill_steps = 0, decode_steps = 0;
  for (const auto& st : runner.steps) {
    ASSERT_FALSE(st.empty());
    int prefill_rows = 0;
    for (const auto& r : st) {
      if (r.p0 == 0)
        for (const auto& p : prompts)
          if (p.size() >= r.tokens.size() && std::equal(r.tokens.begin(), r.tokens.end(), p.begin()))
            prompt_len[r.pt] = int64_t(p.size());
      ASSERT_TRUE(prompt_len.count(r.pt)) << "a row of an unknown request";
      if (r.p0 < prompt_len[r.pt]) {
        ++prefill_rows;
        EXPECT_EQ(r.p0 % so.max_step_tokens, 0) << "a chunk off the max_step_tokens grid";
      } else {
        EXPECT_EQ(r.n, 1);
      }
    }
    if (prefill_rows > 0) {
      EXPECT_EQ(st.size(), 1u) << "a prefill chunk shares a step";
      ++prefill_steps;
    } else {
      ++decode_steps;
    }
  }
  // 5, 14, 23, 32, 41, 50 tokens in chunks of 16: 1 + 1 + 2 + 2 + 3 + 4 chunks.
  EXPECT_EQ(prefill_steps, 13);
  EXPECT_GE(decode_steps, 10);
}
