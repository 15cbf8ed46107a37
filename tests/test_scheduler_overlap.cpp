// Overlapped output (Scheduler: tokens of a device-sampled step are delivered while the next
// step runs): a runner whose steps really run on another thread, so the scheduler's text,
// stop strings, finishing and page accounting happen while a step is in flight, checked
// against the plain host path (CpuModel, logits on the host, everything in order).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <set>
#include <thread>

#include "engine/scheduler.h"
#include "scheduler_test_util.h"
#include "server/metrics_text.h"
#include "test_util.h"

using namespace spade;
using namespace spade::sched_test;
using namespace std::chrono_literals;

namespace {

// Samples greedily "on the device": forward_sample_launch starts the step on a thread of its
// own (with a delay, so that the scheduler's overlapped delivery runs inside the step) and
// forward_sample_wait joins it. Checks that nothing else touches the runner meanwhile and that
// no page of a sequence in flight goes back to the pool before the step returns.
class AsyncRunner final : public CpuStepModel {
 public:
  explicit AsyncRunner(CpuModel& m, std::chrono::microseconds delay = 300us)
      : CpuStepModel(m), delay_(delay) {}
  ~AsyncRunner() override {
    if (worker_.joinable()) worker_.join();
  }
  bool samples_on_device() const override { return true; }
  const std::vector<float>& forward(const std::vector<SeqInput>& batch,
                                    std::vector<int64_t>& row_of) override {
    EXPECT_FALSE(in_flight_) << "forward() while a step is in flight";
    ++host_steps;
    return m_.forward(batch, row_of);
  }
  const std::vector<int32_t>& forward_sample(const std::vector<SeqInput>& batch,
                                             const std::vector<RowSampling>& rows) override {
    forward_sample_launch(batch, rows);
    return forward_sample_wait();
  }
  void forward_sample_launch(const std::vector<SeqInput>& batch,
                             const std::vector<RowSampling>& rows) override {
    EXPECT_FALSE(in_flight_) << "a second launch before the first step's wait";
    EXPECT_EQ(rows.size(), batch.size());
    ++device_steps;
    in_flight_ = true;
    flight_pages_.clear();
    // The batch may change once launch returns: the forward pass (page reservation, page
    // tables advanced) happens here, as CudaModel's prepare() does before launch returns;
    // the "device" then takes its time to produce the tokens.
    const auto& logits = m_.forward(batch, row_of_);
    for (const SeqInput& s : batch)
      for (int32_t p : s.pages->pages) flight_pages_.insert(p);
    logits_.assign(logits.begin(), logits.end());
    out_.assign(batch.size(), -1);
    worker_ = std::thread([this] {
      std::this_thread::sleep_for(delay_);
      const int V = m_.config().vocab;
      for (size_t i = 0; i < out_.size(); ++i) out_[i] = argmax(logits_.data() + row_of_[i] * V, V);
    });
  }
  const std::vector<int32_t>& forward_sample_wait() override {
    EXPECT_TRUE(in_flight_) << "wait without a launch";
    worker_.join();
    in_flight_ = false;
    flight_pages_.clear();
    return out_;
  }
  StepCounters step_counters() const override {
    StepCounters c;
    c.replays = uint64_t(device_steps.load());
    c.eager = uint64_t(host_steps.load());
    c.replay_host_s = 1e-6 * double(c.replays);  // 1 us and 0.1 ms per step: distinct values
    c.graph_device_s = 1e-4 * double(c.replays);
    return c;
  }
  void release(PageTable& pt) override {
    for (int32_t p : pt.pages)
      EXPECT_EQ(flight_pages_.count(p), 0u) << "page " << p << " released while its step runs";
    CpuStepModel::release(pt);
  }

  std::atomic<int> host_steps{0}, device_steps{0};

 private:
  std::chrono::microseconds delay_;
  bool in_flight_ = false;
  std::thread worker_;
  std::set<int32_t> flight_pages_;
  std::vector<int64_t> row_of_;
  std::vector<float> logits_;
  std::vector<int32_t> out_;
};

// One request alone on the host path and alone on the overlapped path: the same arithmetic,
// so the same tokens, text, finish reason and counts.
void expect_same_alone(Fixture& f, const EngineRequest& req) {
  Result host, overlapped;
  uint64_t overlapped_steps = 0;
  {
    Scheduler s(f.model, f.text, SchedulerOptions{});
    host = collect(*s.submit(EngineRequest(req)));
  }
  {
    AsyncRunner runner(f.model);
    Scheduler s(runner, f.text, SchedulerOptions{});
    overlapped = collect(*s.submit(EngineRequest(req)));
    ASSERT_TRUE(s.wait_idle(5s));
    EXPECT_EQ(runner.host_steps.load(), 0);
    overlapped_steps = s.metrics().overlapped_steps;
    EXPECT_EQ(s.metrics().kv_pages_used, 0);
  }
  // Every decode step after the first delivers its predecessor's token meanwhile.
  if (host.completion_tokens >= 3) {
    EXPECT_GE(overlapped_steps, uint64_t(host.completion_tokens - 2));
  }
  EXPECT_EQ(overlapped.tokens, host.tokens);
  EXPECT_EQ(overlapped.text, host.text);
  EXPECT_EQ(overlapped.reason, host.reason);
  EXPECT_EQ(overlapped.completion_tokens, host.completion_tokens);
  EXPECT_EQ(overlapped.prompt_tokens, host.prompt_tokens);
  EXPECT_EQ(int64_t(overlapped.tokens.size()), overlapped.completion_tokens);
}

TEST(SchedulerOverlap, SameOutputAsTheHostPath) {
  Fixture f;
  const auto prompt = make_prompt(7, 11, f.cfg.vocab);
  Result full;
  {
    Scheduler s(f.model, f.text, SchedulerOptions{});
    full = collect(*s.submit(greedy(prompt, 40)));
  }
  ASSERT_GE(full.text.size(), 12u);
  expect_same_alone(f, greedy(prompt, 40));  // max_tokens
  EngineRequest stop_string = greedy(prompt, 40);
  stop_string.stop = {"zzzzzzzz", full.text.substr(8, 2)};  // ends inside a step in flight
  expect_same_alone(f, stop_string);
  EngineRequest held = greedy(prompt, 10);  // the last letter held back, then flushed
  held.stop = {full.text.substr(9, 1) + "@"};
  expect_same_alone(f, held);
  EngineRequest stop_id = greedy(prompt, 40);
  stop_id.stop_ids = {full.tokens[5]};
  expect_same_alone(f, stop_id);
  expect_same_alone(f, greedy(prompt, 1));
}

// A stop string found while the request's next token is in flight: that token is dropped,
// the request ends with Stop, and its text is exactly the text before the stop string.
TEST(SchedulerOverlap, ManyRequestsWithStopsAndLengths) {
  Fixture f;
  AsyncRunner runner(f.model, 100us);
  SchedulerOptions so;
  so.max_batch = 40;  // >= kParallelDeliverRows: the pool delivers
  Scheduler sched(runner, f.text, so);
  std::vector<std::shared_ptr<RequestChannel>> chans;
  std::vector<std::vector<std::string>> stops;
  for (int i = 0; i < 48; ++i) {
    EngineRequest r = greedy(make_prompt(4 + i % 9, i, f.cfg.vocab), 8 + i % 17);
    if (i % 3 == 1) r.stop = {std::string(1, char('a' + i % 26))};
    if (i % 3 == 2) r.stop = {std::string(1, char('a' + i % 26)) + char('a' + (i * 7) % 26)};
    stops.push_back(r.stop);
    chans.push_back(sched.submit(std::move(r)));
  }
  for (size_t i = 0; i < chans.size(); ++i) {
    const Result r = collect(*chans[i]);
    ASSERT_NE(r.reason, FinishReason::Error) << r.error;
    EXPECT_EQ(int64_t(r.tokens.size()), r.completion_tokens);
    std::string letters;
    for (int32_t t : r.tokens) letters += LetterStream().push(t);
    if (r.reason == FinishReason::Stop) {
      // The text stops right before the first stop string, which the tokens complete.
      size_t at = std::string::npos;
      for (const auto& s : stops[i]) at = std::min(at, letters.find(s));
      ASSERT_NE(at, std::string::npos) << "request " << i;
      EXPECT_EQ(r.text, letters.substr(0, at)) << "request " << i;
      std::string before;
      for (size_t k = 0; k + 1 < r.tokens.size(); ++k) before += LetterStream().push(r.tokens[k]);
      for (const auto& s : stops[i]) EXPECT_EQ(before.find(s), std::string::npos) << "request " << i;
    } else {
      EXPECT_EQ(r.reason, FinishReason::Length);
      EXPECT_EQ(r.completion_tokens, int64_t(8 + i % 17));
      EXPECT_EQ(r.text, letters);
    }
  }
  ASSERT_TRUE(sched.wait_idle(5s));
  const EngineMetrics m = sched.metrics();
  EXPECT_EQ(m.kv_pages_used, 0);
  EXPECT_GT(m.overlapped_steps, 0u);
  EXPECT_EQ(m.finished_stop + m.finished_length, 48u);
  // The runner's own counters come through the scheduler's metrics.
  EXPECT_EQ(m.graph_replays, uint64_t(runner.device_steps.load()));
  EXPECT_EQ(m.eager_steps, 0u);
  EXPECT_EQ(m.steps, m.graph_replays);
  EXPECT_DOUBLE_EQ(m.replay_host_seconds, 1e-6 * double(m.graph_replays));
  EXPECT_DOUBLE_EQ(m.graph_device_seconds, 1e-4 * double(m.graph_replays));
  EXPECT_EQ(m.eager_host_seconds, 0.0);
  // ... and into the Prometheus text.
  const std::string text = server::prometheus_text(m, server::HttpCounts{}, "x");
  char want[128];
  std::snprintf(want, sizeof want, "spade_engine_runner_device_seconds_total{how=\"graph\"} %.10g\n",
                1e-4 * double(m.graph_replays));
  EXPECT_NE(text.find(want), std::string::npos) << text;
  EXPECT_LE(m.forward_seconds + m.sample_seconds, m.busy_seconds * 1.0001 + 1e-6);
}

// Cancelling a request whose token is pending delivers that token first, then ends it;
// a request needing host logits (logprobs) joining the batch makes the scheduler deliver
// what is pending before its step, so every stream stays in order.
TEST(SchedulerOverlap, CancelAndHostLogitStepsKeepOrder) {
  Fixture f;
  AsyncRunner runner(f.model);
  Scheduler sched(runner, f.text, SchedulerOptions{});
  const auto p = make_prompt(9, 5, f.cfg.vocab);
  auto a = sched.submit(greedy(p, 300));
  RequestDelta d;
  while (!a->wait_take(d, 10ms)) {
  }
  EngineRequest lp = greedy(p, 12);
  lp.logprobs = 1;
  const Result rl = collect(*sched.submit(std::move(lp)));
  EXPECT_EQ(rl.reason, FinishReason::Length);
  EXPECT_EQ(rl.logprobs.size(), 12u);
  EXPECT_GE(runner.host_steps.load(), 12);
  a->cancel();
  const Result ra = collect(*a);
  EXPECT_EQ(ra.reason, FinishReason::Cancelled);
  EXPECT_EQ(int64_t(ra.tokens.size()) + int64_t(d.tokens.size()), ra.completion_tokens);
  // Both streams hold, in order, the greedy tokens of their prompt.
  std::vector<int32_t> all(d.tokens);
  all.insert(all.end(), ra.tokens.begin(), ra.tokens.end());
  ASSERT_GE(all.size(), 12u);
  expect_greedy(f.w, p, all);
  expect_greedy(f.w, p, rl.tokens);
  ASSERT_TRUE(sched.wait_idle(5s));
  EXPECT_EQ(sched.metrics().kv_pages_used, 0);
}

// Shutdown with tokens pending: they are delivered, and every request ends.
TEST(SchedulerOverlap, ShutdownDeliversPendingTokens) {
  Fixture f;
  AsyncRunner runner(f.model);
  std::vector<std::shared_ptr<RequestChannel>> chans;
  {
    Scheduler sched(runner, f.text, SchedulerOptions{});
    for (int i = 0; i < 6; ++i) chans.push_back(sched.submit(greedy(make_prompt(6, i, f.cfg.vocab), 500)));
    RequestDelta d;
    while (!chans[0]->wait_take(d, 10ms)) {
    }
    sched.shutdown();
  }
  for (auto& c : chans) {
    const Result r = collect(*c);
    EXPECT_EQ(r.reason, FinishReason::Cancelled);
    EXPECT_LE(int64_t(r.tokens.size()), r.completion_tokens);
  }
  EXPECT_EQ(f.kv.used_pages(), 0);
}

}  // namespace
