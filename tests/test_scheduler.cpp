// The continuous-batching scheduler on a small random model: outputs of concurrently
// batched requests (chunked prefill mixed with decode, preemption under a tight KV pool)
// against a reference forward pass, stop strings and stop tokens, cancellation, admission
// limits, logprobs, seeded sampling, shutdown, and KV pages all returned. Other runners:
// test_scheduler_runners.cpp; prompt logprobs: test_scheduler_prompt_logprobs.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <thread>

#include "engine/generator.h"
#include "engine/scheduler.h"
#include "sparse/registry.h"
#include "sparse/session.h"
#include "scheduler_test_util.h"
#include "test_util.h"

using namespace spade;
using namespace std::chrono_literals;
using namespace spade::sched_test;

TEST(Scheduler, BatchedGreedyMatchesReference) {
  Fixture f;
  SchedulerOptions so;
  so.max_batch = 4;
  so.max_step_tokens = 16;  // long prompts prefill in chunks between decode steps
  Scheduler sched(f.model, f.text, so);
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::shared_ptr<RequestChannel>> chans;
  const int lens[] = {1, 5, 40, 17, 3, 60, 9};
  for (int i = 0; i < 7; ++i) {
    prompts.push_back(make_prompt(lens[i], i, f.cfg.vocab));
    chans.push_back(sched.submit(greedy(prompts.back(), 6 + 3 * i)));
    if (i == 3) std::this_thread::sleep_for(5ms);  // some join while others run
  }
  for (int i = 0; i < 7; ++i) {
    Result r = collect(*chans[size_t(i)]);
    EXPECT_EQ(r.reason, FinishReason::Length);
    ASSERT_EQ(int64_t(r.tokens.size()), 6 + 3 * i);
    EXPECT_EQ(r.completion_tokens, 6 + 3 * i);
    EXPECT_EQ(r.prompt_tokens, lens[i]);
    expect_greedy(f.w, prompts[size_t(i)], r.tokens);
    std::string want;
    for (int32_t t : r.tokens) want += LetterStream().push(t);
    EXPECT_EQ(r.text, want);
  }
  ASSERT_TRUE(sched.wait_idle(5s));
  EngineMetrics m = sched.metrics();
  EXPECT_EQ(m.kv_pages_used, 0);
  EXPECT_EQ(m.finished_length, 7u);
  EXPECT_GT(m.batch_size.sum / double(m.batch_size.count), 1.0);  // requests really shared steps
  EXPECT_EQ(f.kv.used_pages(), 0);
}

TEST(Scheduler, GreedyEqualsGenerateForOneRequest) {
  Fixture f;
  Scheduler sched(f.model, f.text, SchedulerOptions{});
  auto prompt = make_prompt(12, 3, f.cfg.vocab);
  Result r = collect(*sched.submit(greedy(prompt, 20)));
  sched.shutdown();
  // The same single sequence through generate(): identical arithmetic, identical tokens.
  PageTable pt;
  GenerateOptions go;
  go.max_new_tokens = 20;
  std::vector<int32_t> ref;
  generate(f.model, pt, prompt, go, [&](int32_t t) {
    ref.push_back(t);
    return true;
  });
  EXPECT_EQ(r.tokens, ref);
}

TEST(Scheduler, StopStringsCutTheOutput) {
  Fixture f;
  Scheduler sched(f.model, f.text, SchedulerOptions{});
  auto prompt = make_prompt(7, 11, f.cfg.vocab);
  Result full = collect(*sched.submit(greedy(prompt, 40)));
  ASSERT_GE(full.text.size(), 12u);
  // A two-letter stop string spanning two tokens, first occurring after some output.
  const std::string stop = full.text.substr(8, 2);
  const size_t at = full.text.find(stop);
  EngineRequest req = greedy(prompt, 40);
  req.stop = {"zzzzzzzz", stop};
  Result r = collect(*sched.submit(std::move(req)));
  EXPECT_EQ(r.reason, FinishReason::Stop);
  EXPECT_EQ(r.text, full.text.substr(0, at));
  // A stop string that never occurs changes nothing.
  req = greedy(prompt, 40);
  req.stop = {"@"};
  Result same = collect(*sched.submit(std::move(req)));
  EXPECT_EQ(same.text, full.text);
  EXPECT_EQ(same.reason, FinishReason::Length);
}

TEST(Scheduler, HeldTextIsFlushedAtTheEnd) {
  Fixture f;
  Scheduler sched(f.model, f.text, SchedulerOptions{});
  auto prompt = make_prompt(7, 11, f.cfg.vocab);
  Result full = collect(*sched.submit(greedy(prompt, 10)));
  // Stop = the output's last letter + a letter that never follows: the last letter is held
  // back while it may start the stop string, then flushed when max_tokens ends it.
  EngineRequest req = greedy(prompt, 10);
  req.stop = {full.text.substr(full.text.size() - 1) + "@"};
  Result r = collect(*sched.submit(std::move(req)));
  EXPECT_EQ(r.text, full.text);
  EXPECT_EQ(r.reason, FinishReason::Length);
}

TEST(Scheduler, StopTokenEndsWithoutItsText) {
  Fixture f;
  Scheduler sched(f.model, f.text, SchedulerOptions{});
  auto prompt = make_prompt(5, 2, f.cfg.vocab);
  Result full = collect(*sched.submit(greedy(prompt, 12)));
  const int32_t stop = full.tokens[4];
  size_t first = 0;
  while (full.tokens[first] != stop) ++first;
  EngineRequest req = greedy(prompt, 12);
  req.stop_ids = {stop};
  Result r = collect(*sched.submit(std::move(req)));
  EXPECT_EQ(r.reason, FinishReason::Stop);
  ASSERT_EQ(r.tokens.size(), first + 1);
  std::string want;
  for (size_t i = 0; i < first; ++i) want += LetterStream().push(full.tokens[i]);
  EXPECT_EQ(r.text, want);
}

TEST(Scheduler, CancelFreesPages) {
  Fixture f;
  Scheduler sched(f.model, f.text, SchedulerOptions{});
  auto ch = sched.submit(greedy(make_prompt(30, 1, f.cfg.vocab), 400));
  auto other = sched.submit(greedy(make_prompt(20, 2, f.cfg.vocab), 5));
  RequestDelta d;
  while (!ch->wait_take(d, 10ms)) {
  }
  ch->cancel();
  Result r = collect(*ch);
  EXPECT_EQ(r.reason, FinishReason::Cancelled);
  EXPECT_LT(r.completion_tokens, 400);
  EXPECT_EQ(collect(*other).reason, FinishReason::Length);
  ASSERT_TRUE(sched.wait_idle(5s));
  EXPECT_EQ(sched.metrics().kv_pages_used, 0);
  EXPECT_EQ(sched.metrics().finished_cancelled, 1u);
}

TEST(Scheduler, CancelWhileQueued) {
  Fixture f;
  SchedulerOptions so;
  so.max_batch = 1;
  Scheduler sched(f.model, f.text, so);
  // a takes the only batch slot, b waits behind it. Both are cancelled before anything is
  // collected: cancelling a only after b's collection raced with a finishing its tokens on a
  // loaded machine (CI saw Length), since the tiny model decodes in microseconds per token.
  auto a = sched.submit(greedy(make_prompt(10, 1, f.cfg.vocab), 480));
  auto b = sched.submit(greedy(make_prompt(10, 2, f.cfg.vocab), 200));
  b->cancel();
  a->cancel();
  Result rb = collect(*b);
  EXPECT_EQ(rb.reason, FinishReason::Cancelled);
  EXPECT_EQ(rb.completion_tokens, 0);
  const Result ra = collect(*a);
  EXPECT_EQ(ra.reason, FinishReason::Cancelled);
  EXPECT_LT(ra.completion_tokens, 480);
  ASSERT_TRUE(sched.wait_idle(5s));
  EXPECT_EQ(f.kv.used_pages(), 0);
}

TEST(Scheduler, QueueFullAnswers429) {
  Fixture f;
  SchedulerOptions so;
  so.max_batch = 1;
  so.max_queue = 1;
  Scheduler sched(f.model, f.text, so);
  auto a = sched.submit(greedy(make_prompt(10, 1, f.cfg.vocab), 400));
  while (sched.metrics().running == 0) std::this_thread::sleep_for(1ms);
  auto b = sched.submit(greedy(make_prompt(10, 2, f.cfg.vocab), 400));  // queued
  try {
    sched.submit(greedy(make_prompt(10, 3, f.cfg.vocab), 4));
    FAIL() << "expected a 429";
  } catch (const SubmitError& e) {
    EXPECT_EQ(e.status, 429);
  }
  EXPECT_EQ(sched.metrics().rejected_queue_full, 1u);
  a->cancel();
  b->cancel();
  collect(*a);
  collect(*b);
}

TEST(Scheduler, ContextLimitIs400WithLengths) {
  Fixture f(8, 16);  // the pool holds 128 tokens: less than the model's 512
  Scheduler sched(f.model, f.text, SchedulerOptions{});
  EXPECT_EQ(sched.max_context(), 128);
  try {
    sched.submit(greedy(make_prompt(100, 1, f.cfg.vocab), 50));
    FAIL() << "expected a 400";
  } catch (const SubmitError& e) {
    EXPECT_EQ(e.status, 400);
    EXPECT_NE(std::string(e.what()).find("128"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("150"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("100 in the prompt"), std::string::npos) << e.what();
  }
  try {
    sched.submit(greedy(make_prompt(128, 1, f.cfg.vocab), 1));
    FAIL() << "expected a 400";
  } catch (const SubmitError& e) {
    EXPECT_EQ(e.status, 400);
  }
  for (auto bad : {std::vector<int32_t>{}, std::vector<int32_t>{-1}, std::vector<int32_t>{101}}) {
    try {
      sched.submit(greedy(bad, 1));
      FAIL() << "expected a 400";
    } catch (const SubmitError& e) {
      EXPECT_EQ(e.status, 400);
    }
  }
  // Exactly at the limit is fine.
  EXPECT_EQ(collect(*sched.submit(greedy(make_prompt(100, 1, f.cfg.vocab), 28))).completion_tokens, 28);
}

// SchedulerOptions::max_context (--ctx-size) caps requests below the model and the pool.
TEST(Scheduler, ContextOptionCapsRequests) {
  Fixture f;  // the pool and the model hold far more than 40 tokens
  SchedulerOptions so;
  so.max_context = 40;
  Scheduler sched(f.model, f.text, so);
  EXPECT_EQ(sched.max_context(), 40);
  try {
    sched.submit(greedy(make_prompt(30, 1, f.cfg.vocab), 11));
    FAIL() << "expected a 400";
  } catch (const SubmitError& e) {
    EXPECT_EQ(e.status, 400);
    EXPECT_NE(std::string(e.what()).find("40"), std::string::npos) << e.what();
  }
  EXPECT_EQ(collect(*sched.submit(greedy(make_prompt(30, 1, f.cfg.vocab), 10))).completion_tokens, 10);
}

TEST(Scheduler, PreemptionUnderATightPoolKeepsOutputs) {
  Fixture f(26, 4);  // 104 token slots; four requests of 12 + 40 tokens need 52 pages
  SchedulerOptions so;
  so.max_batch = 4;
  Scheduler sched(f.model, f.text, so);
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::shared_ptr<RequestChannel>> chans;
  for (int i = 0; i < 4; ++i) {
    prompts.push_back(make_prompt(12, 20 + i, f.cfg.vocab));
    chans.push_back(sched.submit(greedy(prompts.back(), 40)));
  }
  for (int i = 0; i < 4; ++i) {
    Result r = collect(*chans[size_t(i)]);
    EXPECT_EQ(r.reason, FinishReason::Length);
    ASSERT_EQ(r.tokens.size(), 40u);
    expect_greedy(f.w, prompts[size_t(i)], r.tokens);
    std::string want;
    for (int32_t t : r.tokens) want += LetterStream().push(t);
    EXPECT_EQ(r.text, want);  // no text lost or repeated across the recompute
  }
  ASSERT_TRUE(sched.wait_idle(5s));
  EngineMetrics m = sched.metrics();
  EXPECT_GT(m.preemptions, 0u);
  EXPECT_GT(m.recomputed_tokens, 0u);
  EXPECT_EQ(m.kv_pages_used, 0);
  EXPECT_EQ(f.kv.used_pages(), 0);
}

TEST(Scheduler, LogprobsAreNormalized) {
  Fixture f;
  Scheduler sched(f.model, f.text, SchedulerOptions{});
  EngineRequest req = greedy(make_prompt(6, 4, f.cfg.vocab), 5);
  req.logprobs = 3;
  Result r = collect(*sched.submit(std::move(req)));
  ASSERT_EQ(r.logprobs.size(), 5u);
  for (size_t i = 0; i < 5; ++i) {
    const TokenLogprob& lp = r.logprobs[i];
    EXPECT_EQ(lp.id, r.tokens[i]);
    EXPECT_LE(lp.logprob, 0.f);
    ASSERT_EQ(lp.top.size(), 3u);
    EXPECT_EQ(lp.top[0].first, lp.id);  // greedy: the chosen token is the best
    EXPECT_NEAR(lp.top[0].second, lp.logprob, 1e-6);
    EXPECT_GE(lp.top[0].second, lp.top[1].second);
    EXPECT_GE(lp.top[1].second, lp.top[2].second);
  }
}

TEST(Scheduler, SeededSamplingIsReproducible) {
  Fixture f;
  Scheduler sched(f.model, f.text, SchedulerOptions{});
  auto run = [&](uint64_t seed) {
    EngineRequest req = greedy(make_prompt(6, 4, f.cfg.vocab), 24);
    req.sampling.temperature = 2.0f;
    req.sampling.seed = seed;
    return collect(*sched.submit(std::move(req))).tokens;
  };
  auto a = run(123), b = run(123);
  EXPECT_EQ(a, b);
  bool differs = false;  // other seeds sample something else
  for (uint64_t s = 1; s <= 5 && !differs; ++s) differs = run(s) != a;
  EXPECT_TRUE(differs);
}

TEST(Scheduler, ShutdownFinishesEveryRequest) {
  Fixture f;
  SchedulerOptions so;
  so.max_batch = 2;
  auto sched = std::make_unique<Scheduler>(f.model, f.text, so);
  std::vector<std::shared_ptr<RequestChannel>> chans;
  for (int i = 0; i < 6; ++i) chans.push_back(sched->submit(greedy(make_prompt(10, i, f.cfg.vocab), 300)));
  std::this_thread::sleep_for(20ms);
  sched->stop_accepting();
  try {
    sched->submit(greedy(make_prompt(3, 1, f.cfg.vocab), 3));
    FAIL() << "expected a 503";
  } catch (const SubmitError& e) {
    EXPECT_EQ(e.status, 503);
  }
  sched->shutdown();
  for (auto& ch : chans) {
    Result r = collect(*ch, 5s);
    EXPECT_TRUE(r.reason == FinishReason::Cancelled || r.reason == FinishReason::Length);
  }
  EXPECT_EQ(f.kv.used_pages(), 0);
  sched.reset();
}

TEST(Scheduler, FailingAttentionMakerFailsOnlyThatRequest) {
  Fixture f;
  Scheduler sched(f.model, f.text, SchedulerOptions{});
  EngineRequest bad = greedy(make_prompt(4, 1, f.cfg.vocab), 4);
  bad.attention = []() -> std::unique_ptr<SeqAttention> { throw Error("no such method state"); };
  auto b = sched.submit(std::move(bad));
  auto g = sched.submit(greedy(make_prompt(4, 2, f.cfg.vocab), 4));
  EXPECT_EQ(collect(*b).reason, FinishReason::Error);
  EXPECT_EQ(collect(*g).reason, FinishReason::Length);
  ASSERT_TRUE(sched.wait_idle(5s));
  EXPECT_EQ(f.kv.used_pages(), 0);
}

// Dense attention through the callback path that throws at one layer of one decode step,
// as a sparse method's state can fail mid-step (issue: a tidal request with a bad layer
// schedule used to fail every request of its step).
class ThrowingAttention : public SeqAttention {
 public:
  ThrowingAttention(CpuModel& m, int64_t fail_at_call) {
    fn_ = [&m, fail_at_call, calls = int64_t(0)](int layer, const PageTable& pt, const float* q,
                                                 int64_t p0, int64_t T, float* out) mutable {
      if (++calls == fail_at_call) throw Error("layer 1 has no token set from this step");
      m.dense_attention(layer, pt, q, p0, T, out);
    };
  }
  const AttentionFn* fn() override { return &fn_; }

 private:
  AttentionFn fn_;
};

TEST(Scheduler, MethodFailingMidStepFailsOnlyThatRequest) {
  Fixture f;
  SchedulerOptions so;
  so.max_batch = 8;
  Scheduler sched(f.model, f.text, so);
  // Prefill is one call per layer; the throw lands in layer 1 of the third decode step.
  const int64_t fail_at = int64_t(f.cfg.n_layers) * 3 + 2;
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::shared_ptr<RequestChannel>> chans;
  for (int i = 0; i < 4; ++i) prompts.push_back(make_prompt(6 + i, 10 + i, f.cfg.vocab));
  EngineRequest bad = greedy(prompts[0], 12);
  bad.method = "planted";
  CpuModel& m = f.model;
  bad.attention = [&m, fail_at]() -> std::unique_ptr<SeqAttention> {
    return std::make_unique<ThrowingAttention>(m, fail_at);
  };
  chans.push_back(sched.submit(std::move(bad)));
  for (int i = 1; i < 4; ++i) chans.push_back(sched.submit(greedy(prompts[size_t(i)], 12)));
  const Result b = collect(*chans[0]);
  EXPECT_EQ(b.reason, FinishReason::Error);
  EXPECT_NE(b.error.find("sparse method 'planted': layer 1 has no token set"), std::string::npos) << b.error;
  EXPECT_EQ(b.completion_tokens, 3);  // the steps before the failing one were sampled
  for (int i = 1; i < 4; ++i) {
    const Result r = collect(*chans[size_t(i)]);
    EXPECT_EQ(r.reason, FinishReason::Length) << r.error;
    ASSERT_EQ(r.tokens.size(), 12u);
    expect_greedy(f.w, prompts[size_t(i)], r.tokens);
  }
  ASSERT_TRUE(sched.wait_idle(5s));
  const EngineMetrics em = sched.metrics();
  EXPECT_EQ(em.finished_error, 1u);
  EXPECT_EQ(em.finished_length, 3u);
  EXPECT_GT(em.batch_size.sum / double(em.batch_size.count), 1.0);  // it really shared steps
  EXPECT_EQ(f.kv.used_pages(), 0);
}
