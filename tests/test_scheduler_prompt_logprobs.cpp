// The scheduler's prompt logprobs (EngineRequest::prompt_logprobs): against a naive
// log_softmax, across preemption, on host-logit steps, within a runner's logit-row limit.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
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

struct Scored {
  Result r;
  std::vector<TokenLogprob> prompt;
  int prompt_deltas = 0;  // deltas that carried prompt logprobs
  bool prompt_before_tokens = true;
};

Scored collect_scored(RequestChannel& ch, std::chrono::seconds limit = 60s) {
  Scored s;
  RequestDelta d;
  const auto end = std::chrono::steady_clock::now() + test::scaled(limit);
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
class RowCountingRunner final : public CpuStepModel {
 public:
  explicit RowCountingRunner(CpuModel& m) : CpuStepModel(m) {}
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
  // 40 tokens in chunks of at most 8 rows: at least 5 steps (6-7 when the others run beside
  // it; alone, when the submitting thread was descheduled until they had finished, exactly 5).
  EXPECT_GE(runner.scoring_steps, 5);
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
