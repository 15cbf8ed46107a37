// The continuous-batching scheduler on a small random model: outputs of concurrently
// batched requests (chunked prefill mixed with decode, preemption under a tight KV pool)
// against a reference forward pass, stop strings and stop tokens, cancellation, admission
// limits, logprobs, seeded sampling, shutdown, and KV pages all returned.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <thread>

#include "engine/generator.h"
#include "engine/scheduler.h"
#include "sparse/registry.h"
#include "sparse/session.h"
#include "test_util.h"

using namespace spade;
using namespace std::chrono_literals;

namespace {

// Token id -> one letter; ids of a multiple of 26 never produce text (like special tokens).
class LetterStream : public TextStream {
 public:
  std::string push(int32_t id) override { return id % 26 == 0 ? "" : std::string(1, char('a' + id % 26)); }
  std::string flush() override { return {}; }
};
class LetterText : public TokenText {
 public:
  std::unique_ptr<TextStream> stream(int32_t) const override { return std::make_unique<LetterStream>(); }
  std::string piece(int32_t id) const override { return LetterStream().push(id); }
};

struct Result {
  std::string text;
  std::vector<int32_t> tokens;
  std::vector<TokenLogprob> logprobs;
  FinishReason reason = FinishReason::None;
  std::string error;
  int64_t prompt_tokens = 0, completion_tokens = 0;
  int deltas = 0;
  double density = -1;
};

Result collect(RequestChannel& ch, std::chrono::seconds limit = 60s) {
  Result r;
  RequestDelta d;
  const auto end = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < end) {
    if (!ch.wait_take(d, 20ms)) continue;
    ++r.deltas;
    r.text += d.text;
    r.tokens.insert(r.tokens.end(), d.tokens.begin(), d.tokens.end());
    r.logprobs.insert(r.logprobs.end(), d.logprobs.begin(), d.logprobs.end());
    if (d.finished) {
      r.reason = d.reason;
      r.error = d.error;
      r.prompt_tokens = d.prompt_tokens;
      r.completion_tokens = d.completion_tokens;
      r.density = d.density;
      return r;
    }
  }
  ADD_FAILURE() << "request did not finish in time";
  return r;
}

std::vector<int32_t> make_prompt(int n, int seed, int vocab) {
  std::vector<int32_t> p(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) p[size_t(i)] = 1 + (seed * 31 + i * 7) % (vocab - 1);
  return p;
}

struct Fixture {
  explicit Fixture(int64_t pages = 256, int page_size = 16)
      : cfg(test::tiny_config()), w(test::random_model(cfg, 7)),
        kv(KVLayout{cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, page_size}, pages),
        model(w, kv) {}
  ModelConfig cfg;
  ModelWeights w;
  KVPool kv;
  CpuModel model;
  LetterText text;
};

// Every generated token must be the argmax (within fp tolerance of batched vs unbatched
// arithmetic) of a fresh single-sequence forward pass over prompt + previous tokens.
void expect_greedy(const ModelWeights& w, const std::vector<int32_t>& prompt,
                   const std::vector<int32_t>& gen) {
  const ModelConfig& c = w.config;
  KVPool kv(KVLayout{c.n_layers, c.n_kv_heads, c.head_dim, 16}, 64);
  CpuModel m(w, kv);
  PageTable pt;
  std::vector<int32_t> seq(prompt);
  seq.insert(seq.end(), gen.begin(), gen.end());
  std::vector<SeqInput> b(1);
  b[0].pages = &pt;
  b[0].tokens = seq.data();
  b[0].n_tokens = int64_t(seq.size()) - 1;
  b[0].all_logits = true;
  std::vector<int64_t> row_of;
  const auto& logits = m.forward(b, row_of);
  for (size_t i = 0; i < gen.size(); ++i) {
    const float* row = logits.data() + (int64_t(prompt.size()) - 1 + int64_t(i)) * c.vocab;
    const float best = row[argmax(row, c.vocab)];
    EXPECT_GE(row[gen[i]], best - 1e-3f) << "token " << i << " is not the greedy choice";
  }
}

EngineRequest greedy(std::vector<int32_t> prompt, int64_t max_tokens) {
  EngineRequest r;
  r.prompt = std::move(prompt);
  r.max_tokens = max_tokens;
  r.sampling.temperature = 0;
  return r;
}

}  // namespace

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

// The StepModel plumbing of a test runner over a CpuModel and its pool; the runners below
// override what they observe or change.
class CpuBackedRunner : public StepModel {
 public:
  explicit CpuBackedRunner(CpuModel& m) : m_(m) {}
  const ModelConfig& config() const override { return m_.config(); }
  const std::vector<float>& forward(const std::vector<SeqInput>& batch,
                                    std::vector<int64_t>& row_of) override {
    return m_.forward(batch, row_of);
  }
  int page_size() const override { return m_.kv().layout().page_size; }
  int64_t total_pages() const override { return m_.kv().n_pages(); }
  int64_t free_pages() const override { return m_.kv().free_pages(); }
  void release(PageTable& pt) override { m_.kv().release(pt); }
  bool supports_attention_callbacks() const override { return true; }
  std::string device() const override { return "test runner"; }

 protected:
  CpuModel& m_;
};

// A runner that "samples on the device" (greedy over the CPU model's logits), recording what
// the scheduler asked of it: the path a CUDA server takes, checked without a GPU.
class DeviceSamplingRunner final : public CpuBackedRunner {
 public:
  explicit DeviceSamplingRunner(CpuModel& m) : CpuBackedRunner(m) {}
  const std::vector<float>& forward(const std::vector<SeqInput>& batch,
                                    std::vector<int64_t>& row_of) override {
    ++host_steps;
    return m_.forward(batch, row_of);
  }
  bool samples_on_device() const override { return true; }
  const std::vector<int32_t>& forward_sample(const std::vector<SeqInput>& batch,
                                             const std::vector<RowSampling>& rows) override {
    ++device_steps;
    EXPECT_EQ(rows.size(), batch.size());
    const auto& logits = m_.forward(batch, row_of_);
    out_.resize(batch.size());
    for (size_t i = 0; i < batch.size(); ++i) {
      EXPECT_EQ(rows[i].temperature, 0.f);
      draws.push_back({rows[i].seed, rows[i].draw});
      out_[i] = argmax(logits.data() + row_of_[i] * m_.config().vocab, m_.config().vocab);
    }
    return out_;
  }

  int host_steps = 0, device_steps = 0;
  std::vector<std::pair<uint64_t, uint64_t>> draws;  // (seed, draw) of every row

 private:
  std::vector<int64_t> row_of_;
  std::vector<int32_t> out_;
};

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
class MethodRunner final : public CpuBackedRunner {
 public:
  explicit MethodRunner(CpuModel& m) : CpuBackedRunner(m) {}
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
      if (specs[i].rfind("streaming", 0) == 0) EXPECT_LT(got[i].density, 0.8) << specs[i];
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
    if (i % 3 == 1) EXPECT_EQ(r.logprobs.size(), r.tokens.size()) << i;
  }
  // A seeded sampled request alone gives the same tokens as inside the large batch.
  for (int i : {2, 5, 47}) {
    if (i % 3 != 2) continue;
    EngineRequest r = greedy(prompts[size_t(i)], 40 + i % 5);
    r.sampling.temperature = 0.8f, r.sampling.seed = uint64_t(i);
    EXPECT_EQ(collect(*sched.submit(std::move(r))).tokens, got[size_t(i)].tokens) << i;
  }
}

// ---------------------------------------------------------------- prompt logprobs

namespace {

struct Scored {
  Result r;
  std::vector<TokenLogprob> prompt;
  int prompt_deltas = 0;  // deltas that carried prompt logprobs
  bool prompt_before_tokens = true;
};

Scored collect_scored(RequestChannel& ch, std::chrono::seconds limit = 60s) {
  Scored s;
  RequestDelta d;
  const auto end = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < end) {
    if (!ch.wait_take(d, 20ms)) continue;
    if (!d.prompt_logprobs.empty()) {
      ++s.prompt_deltas;
      if (!s.r.tokens.empty()) s.prompt_before_tokens = false;
      s.prompt.insert(s.prompt.end(), d.prompt_logprobs.begin(), d.prompt_logprobs.end());
    }
    s.r.text += d.text;
    s.r.tokens.insert(s.r.tokens.end(), d.tokens.begin(), d.tokens.end());
    s.r.logprobs.insert(s.r.logprobs.end(), d.logprobs.begin(), d.logprobs.end());
    if (d.finished) {
      s.r.reason = d.reason;
      s.r.error = d.error;
      s.r.prompt_tokens = d.prompt_tokens;
      s.r.completion_tokens = d.completion_tokens;
      return s;
    }
  }
  ADD_FAILURE() << "request did not finish in time";
  return s;
}

// log_softmax of every row of one unbatched forward pass over the whole prompt (a fresh KV
// pool, all logits), in double: row i scores the token at position i + 1.
std::vector<std::vector<double>> naive_prompt_logprobs(const ModelWeights& w,
                                                       const std::vector<int32_t>& prompt) {
  const ModelConfig& c = w.config;
  KVPool kv(KVLayout{c.n_layers, c.n_kv_heads, c.head_dim, 16}, 64);
  CpuModel m(w, kv);
  PageTable pt;
  std::vector<SeqInput> b(1);
  b[0].pages = &pt;
  b[0].tokens = prompt.data();
  b[0].n_tokens = int64_t(prompt.size());
  b[0].all_logits = true;
  std::vector<int64_t> row_of;
  const auto& logits = m.forward(b, row_of);
  std::vector<std::vector<double>> out;
  for (size_t i = 0; i + 1 < prompt.size(); ++i) {
    const float* row = logits.data() + (row_of[0] + int64_t(i)) * c.vocab;
    double sum = 0;
    for (int32_t v = 0; v < c.vocab; ++v) sum += std::exp(double(row[v]));
    std::vector<double> lp(size_t(c.vocab));
    for (int32_t v = 0; v < c.vocab; ++v) lp[size_t(v)] = double(row[v]) - std::log(sum);
    out.push_back(std::move(lp));
  }
  kv.release(pt);
  return out;
}

void expect_prompt_scores(const ModelWeights& w, const std::vector<int32_t>& prompt,
                          const std::vector<TokenLogprob>& got, int k) {
  const auto ref = naive_prompt_logprobs(w, prompt);
  ASSERT_EQ(got.size(), prompt.size() - 1);
  for (size_t i = 1; i < prompt.size(); ++i) {
    const TokenLogprob& t = got[i - 1];
    const std::vector<double>& row = ref[i - 1];
    const int32_t tok = prompt[i];
    EXPECT_EQ(t.id, tok) << "position " << i;
    EXPECT_NEAR(t.logprob, row[size_t(tok)], 1e-4) << "position " << i;
    // Rank: 1 + tokens scored higher (a near-tie may fall either way).
    int64_t lo = 1, hi = 1;
    for (double x : row) {
      lo += x > row[size_t(tok)] + 1e-4;
      hi += x > row[size_t(tok)] - 1e-4;
    }
    EXPECT_GE(t.rank, lo) << "position " << i;
    EXPECT_LE(t.rank, hi) << "position " << i;
    // Top k: the k best values, best first, each the logprob of its id.
    std::vector<double> sorted(row);
    std::sort(sorted.begin(), sorted.end(), [](double x, double y) { return x > y; });
    ASSERT_EQ(t.top.size(), size_t(k)) << "position " << i;
    for (size_t j = 0; j < t.top.size(); ++j) {
      EXPECT_NEAR(t.top[j].second, row[size_t(t.top[j].first)], 1e-4) << "position " << i;
      EXPECT_NEAR(t.top[j].second, sorted[j], 1e-4) << "position " << i << " top " << j;
    }
  }
}

}  // namespace

// Prompt logprobs of requests batched with others, their prompts prefilled in chunks over
// several steps, against a naive log_softmax of one unbatched forward pass; max_tokens 0
// scores the prompt and generates nothing.
TEST(Scheduler, PromptLogprobsMatchANaiveLogSoftmax) {
  Fixture f;
  SchedulerOptions so;
  so.max_batch = 4;
  so.max_step_tokens = 16;  // the 40-token prompt is scored over three steps
  Scheduler sched(f.model, f.text, so);
  const auto p40 = make_prompt(40, 1, f.cfg.vocab), p23 = make_prompt(23, 2, f.cfg.vocab),
             p1 = make_prompt(1, 3, f.cfg.vocab), p30 = make_prompt(30, 4, f.cfg.vocab);
  EngineRequest a = greedy(p40, 0), b = greedy(p23, 6), c = greedy(p1, 3), d = greedy(p30, 8);
  a.prompt_logprobs = 3;
  b.prompt_logprobs = 0;
  b.logprobs = 1;
  c.prompt_logprobs = 2;
  auto ca = sched.submit(std::move(a)), cb = sched.submit(std::move(b)), cc = sched.submit(std::move(c)),
       cd = sched.submit(std::move(d));
  const Scored ra = collect_scored(*ca), rb = collect_scored(*cb), rc = collect_scored(*cc),
               rd = collect_scored(*cd);

  EXPECT_EQ(ra.r.reason, FinishReason::Length);
  EXPECT_TRUE(ra.r.tokens.empty());
  EXPECT_EQ(ra.r.text, "");
  EXPECT_EQ(ra.r.completion_tokens, 0);
  EXPECT_EQ(ra.r.prompt_tokens, 40);
  EXPECT_EQ(ra.prompt_deltas, 1);  // all of them at once, when the prefill ends
  expect_prompt_scores(f.w, p40, ra.prompt, 3);

  // The first token is sampled from the last row of the all-logits chunk.
  EXPECT_EQ(rb.r.reason, FinishReason::Length);
  ASSERT_EQ(rb.r.tokens.size(), 6u);
  expect_greedy(f.w, p23, rb.r.tokens);
  EXPECT_EQ(rb.r.logprobs.size(), 6u);
  EXPECT_TRUE(rb.prompt_before_tokens);
  expect_prompt_scores(f.w, p23, rb.prompt, 0);

  EXPECT_TRUE(rc.prompt.empty());  // a one-token prompt has nothing to score
  ASSERT_EQ(rc.r.tokens.size(), 3u);
  expect_greedy(f.w, p1, rc.r.tokens);

  EXPECT_TRUE(rd.prompt.empty());  // not asked for
  ASSERT_EQ(rd.r.tokens.size(), 8u);
  expect_greedy(f.w, p30, rd.r.tokens);

  ASSERT_TRUE(sched.wait_idle(5s));
  EXPECT_EQ(sched.metrics().finished_length, 4u);
  EXPECT_EQ(f.kv.used_pages(), 0);
}

// A preempted request is prefilled again: its prompt is scored once, and its tokens are
// unchanged.
TEST(Scheduler, PromptLogprobsAreScoredOnceAcrossPreemption) {
  Fixture f(26, 4);  // as PreemptionUnderATightPoolKeepsOutputs: four requests do not fit
  SchedulerOptions so;
  so.max_batch = 4;
  Scheduler sched(f.model, f.text, so);
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::shared_ptr<RequestChannel>> chans;
  for (int i = 0; i < 4; ++i) {
    prompts.push_back(make_prompt(12, 20 + i, f.cfg.vocab));
    EngineRequest r = greedy(prompts.back(), 40);
    r.prompt_logprobs = 2;
    chans.push_back(sched.submit(std::move(r)));
  }
  for (int i = 0; i < 4; ++i) {
    const Scored s = collect_scored(*chans[size_t(i)]);
    EXPECT_EQ(s.r.reason, FinishReason::Length);
    ASSERT_EQ(s.r.tokens.size(), 40u);
    expect_greedy(f.w, prompts[size_t(i)], s.r.tokens);
    EXPECT_EQ(s.prompt_deltas, 1);
    expect_prompt_scores(f.w, prompts[size_t(i)], s.prompt, 2);
  }
  ASSERT_TRUE(sched.wait_idle(5s));
  EXPECT_GT(sched.metrics().preemptions, 0u);
  EXPECT_EQ(f.kv.used_pages(), 0);
}

// Only the steps that prefill a request scoring its prompt take host logits; its decode
// steps and prefill-only requests without scores stay on the device path.
TEST(Scheduler, PromptScoringStepsTakeHostLogits) {
  Fixture f;
  DeviceSamplingRunner runner(f.model);
  Scheduler sched(runner, f.text, SchedulerOptions{});
  const auto p = make_prompt(7, 3, f.cfg.vocab);
  EngineRequest a = greedy(p, 4);
  a.prompt_logprobs = 1;
  const Scored ra = collect_scored(*sched.submit(std::move(a)));
  ASSERT_EQ(ra.r.tokens.size(), 4u);
  expect_greedy(f.w, p, ra.r.tokens);
  expect_prompt_scores(f.w, p, ra.prompt, 1);
  EXPECT_EQ(runner.host_steps, 1);    // the prefill, all logits
  EXPECT_EQ(runner.device_steps, 3);  // the decode steps
  const Scored rb = collect_scored(*sched.submit(greedy(p, 0)));
  EXPECT_EQ(rb.r.reason, FinishReason::Length);
  EXPECT_TRUE(rb.r.tokens.empty());
  EXPECT_TRUE(rb.prompt.empty());
  EXPECT_EQ(runner.host_steps, 1);
  EXPECT_EQ(runner.device_steps, 4);
  try {
    sched.submit(greedy(p, -1));
    ADD_FAILURE() << "expected a 400";
  } catch (const SubmitError& e) {
    EXPECT_EQ(e.status, 400);
  }
  ASSERT_TRUE(sched.wait_idle(5s));
  EXPECT_EQ(f.kv.used_pages(), 0);
}

// A CPU runner that records the most logit rows one forward call returned.
class RowCountingRunner final : public CpuBackedRunner {
 public:
  explicit RowCountingRunner(CpuModel& m) : CpuBackedRunner(m) {}
  const std::vector<float>& forward(const std::vector<SeqInput>& batch,
                                    std::vector<int64_t>& row_of) override {
    const auto& logits = m_.forward(batch, row_of);
    max_rows = std::max(max_rows, int64_t(logits.size()) / m_.config().vocab);
    for (const SeqInput& s : batch) scoring_steps += s.all_logits;
    return logits;
  }

  int64_t max_rows = 0, scoring_steps = 0;
};

// A runner with a logit-row limit (CudaModel's max_logit_rows): prompt-scoring chunks are
// cut to fit beside the other sequences' rows, and the scores are unchanged.
TEST(Scheduler, PromptScoringChunksFitTheLogitRowLimit) {
  Fixture f;
  RowCountingRunner runner(f.model);
  SchedulerOptions so;
  so.max_batch = 4;
  so.max_logit_rows = 8;
  Scheduler sched(runner, f.text, so);
  const auto p5 = make_prompt(5, 7, f.cfg.vocab), p9 = make_prompt(9, 8, f.cfg.vocab),
             p40 = make_prompt(40, 9, f.cfg.vocab);
  auto c5 = sched.submit(greedy(p5, 30)), c9 = sched.submit(greedy(p9, 30));
  EngineRequest s = greedy(p40, 3);
  s.prompt_logprobs = 2;
  auto c40 = sched.submit(std::move(s));
  const Scored r40 = collect_scored(*c40);
  const Result r5 = collect(*c5), r9 = collect(*c9);
  EXPECT_LE(runner.max_rows, 8);
  EXPECT_GE(runner.scoring_steps, 6);  // 40 tokens in chunks of at most 8
  expect_prompt_scores(f.w, p40, r40.prompt, 2);
  ASSERT_EQ(r40.r.tokens.size(), 3u);
  expect_greedy(f.w, p40, r40.r.tokens);
  ASSERT_EQ(r5.tokens.size(), 30u);
  expect_greedy(f.w, p5, r5.tokens);
  ASSERT_EQ(r9.tokens.size(), 30u);
  expect_greedy(f.w, p9, r9.tokens);
  ASSERT_TRUE(sched.wait_idle(5s));
  EXPECT_EQ(f.kv.used_pages(), 0);
}
