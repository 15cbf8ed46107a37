// The per-request `sparse` field -> SparseSession adapter (src/server/sparse_adapter.h):
// validation at request time, and requests of different methods in one running batch,
// with the per-method density the scheduler reports.
#include <gtest/gtest.h>

#include <thread>

#include "engine/scheduler.h"
#include "server/sparse_adapter.h"
#include "sparse/options.h"
#include "test_util.h"

using namespace spade;
using namespace spade::server;
using namespace std::chrono_literals;

namespace {

class NoText : public TokenText {
  struct S : TextStream {
    std::string push(int32_t) override { return "t"; }
    std::string flush() override { return {}; }
  };

 public:
  std::unique_ptr<TextStream> stream(int32_t) const override { return std::make_unique<S>(); }
  std::string piece(int32_t) const override { return "t"; }
};

SparseSpec spec(const std::string& method, std::vector<std::pair<std::string, std::string>> o = {}) {
  SparseSpec s;
  s.method = method;
  s.options = std::move(o);
  return s;
}

}  // namespace

TEST(ServerSparse, ResolveValidatesMethodsAndOptions) {
  ModelConfig cfg = test::tiny_config();
  ModelWeights w = test::random_model(cfg, 3);
  KVPool kv(KVLayout{cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 16}, 64);
  SparseMethods methods(cfg, &kv, spec("full"));
  ResolvedSparse full = methods.resolve(std::nullopt);
  EXPECT_EQ(full.method, "full");
  EXPECT_FALSE(full.maker);  // the dense path: no session at all
  ResolvedSparse st = methods.resolve(spec("streaming", {{"budget", "16"}}));
  EXPECT_EQ(st.method, "streaming");
  ASSERT_TRUE(st.maker);
  EXPECT_TRUE(st.maker()->fn() != nullptr);
  EXPECT_THROW(methods.resolve(spec("no-such-method")), Error);
  EXPECT_THROW(methods.resolve(spec("streaming", {{"no_such_option", "1"}})), Error);
  EXPECT_THROW(methods.resolve(spec("streaming", {{"budget", "abc"}})), Error);
  EXPECT_THROW(methods.resolve(spec("streaming", {{"recall", "maybe"}})), Error);
  // Requests may not name files on the server.
  EXPECT_THROW(methods.resolve(spec("lycheedecode", {{"roles", "/etc/passwd"}})), Error);
  EXPECT_THROW(methods.resolve(spec("lycheedecode", {{"roles", "roles.json"}})), Error);
  // A bad server default fails at start-up.
  EXPECT_THROW(SparseMethods(cfg, &kv, spec("nope")), Error);
}

TEST(ServerSparse, MixedMethodsShareABatch) {
  ModelConfig cfg = test::tiny_config();
  ModelWeights w = test::random_model(cfg, 5);
  KVPool kv(KVLayout{cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 16}, 128);
  CpuModel model(w, kv);
  SparseMethods methods(cfg, &kv, spec("full"));
  NoText text;
  SchedulerOptions so;
  so.max_batch = 8;
  Scheduler sched(model, text, so);
  const std::vector<SparseSpec> specs = {spec("full"), spec("streaming", {{"budget", "16"}}),
                                         spec("quest", {{"budget", "32"}, {"dense_layers", "0"}}),
                                         spec("streaming", {{"budget", "24"}, {"sinks", "2"}})};
  std::vector<std::shared_ptr<RequestChannel>> chans;
  for (size_t i = 0; i < 2 * specs.size(); ++i) {
    EngineRequest r;
    for (int t = 0; t < 120; ++t) r.prompt.push_back(1 + int32_t((t * 13 + i * 7) % (cfg.vocab - 1)));
    r.max_tokens = 24;
    r.sampling.temperature = 0;
    ResolvedSparse rs = methods.resolve(specs[i % specs.size()]);
    r.method = rs.method;
    r.attention = rs.maker;
    chans.push_back(sched.submit(std::move(r)));
  }
  for (auto& ch : chans) {
    RequestDelta d;
    int64_t n = 0;
    const auto end = std::chrono::steady_clock::now() + test::scaled(60s);
    while (std::chrono::steady_clock::now() < end) {
      if (!ch->wait_take(d, 20ms)) continue;
      n += int64_t(d.tokens.size());
      if (d.finished) break;
    }
    EXPECT_TRUE(d.finished);
    EXPECT_EQ(d.reason, FinishReason::Length) << d.error;
    EXPECT_EQ(n, 24);
  }
  ASSERT_TRUE(sched.wait_idle(5s));
  EngineMetrics m = sched.metrics();
  EXPECT_EQ(m.kv_pages_used, 0);
  EXPECT_GT(m.batch_size.sum / double(m.batch_size.count), 1.0);
  ASSERT_EQ(m.methods.size(), 3u);
  EXPECT_EQ(m.methods["full"].requests, 2u);
  EXPECT_DOUBLE_EQ(m.methods["full"].density(), 1.0);
  EXPECT_EQ(m.methods["streaming"].requests, 4u);
  // Windows of 16 / 24 (+ sinks) tokens out of 121..144: well under a quarter of the rows.
  EXPECT_GT(m.methods["streaming"].density(), 0.05);
  EXPECT_LT(m.methods["streaming"].density(), 0.25);
  EXPECT_LT(m.methods["quest"].density(), 1.0);
  EXPECT_GT(m.methods["quest"].dense_rows, 0);
}

// A server whose runner has no attention callbacks but runs methods itself (the GPU runner):
// requests resolve with no session; the server's own method (given or not) with no
// device_method, any other to a device_method the runner adds per request, after the device's
// own checks (DeviceCheck); recall is CPU-only. And the scheduler refuses a callback request
// even if one slipped through (400, not a crash in the runner).
TEST(ServerSparse, DenseOnlyRunnerRejectsSparseMethods) {
  ModelConfig cfg = test::tiny_config();
  ModelWeights w = test::random_model(cfg, 7);
  SparseMethods gpu(cfg, nullptr, spec("full"), "NVIDIA H200",
                    [](const sparse::SparseConfig& c) {
                      SPADE_CHECK(c.method != "oracle-topk", "oracle-topk: not on this device");
                    });
  EXPECT_FALSE(gpu.resolve(std::nullopt).maker);
  EXPECT_FALSE(gpu.resolve(std::nullopt).device_method);
  {
    const ResolvedSparse r = gpu.resolve(spec("quest", {{"budget", "16"}}));
    EXPECT_FALSE(r.maker);
    ASSERT_TRUE(r.device_method);
    EXPECT_EQ(r.device_method->method, "quest");
    EXPECT_EQ(r.device_method->to_string(),
              sparse::SparseConfig::parse_spec("quest:budget=16").to_string());
    EXPECT_EQ(r.method, "quest");
  }
  try {
    gpu.resolve(spec("oracle-topk"));
    ADD_FAILURE() << "the device check was not applied";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not on this device"), std::string::npos) << e.what();
  }
  EXPECT_THROW(SparseMethods(cfg, nullptr, spec("full")), Error);  // no pool, no device
  SparseMethods tidal(cfg, nullptr, spec("tidal", {{"budget", "32"}}), "NVIDIA H200");
  EXPECT_FALSE(tidal.resolve(std::nullopt).maker);
  EXPECT_FALSE(tidal.resolve(std::nullopt).device_method);
  EXPECT_EQ(tidal.resolve(std::nullopt).method, "tidal");
  EXPECT_FALSE(tidal.resolve(spec("tidal", {{"budget", "32"}})).device_method);  // its own
  for (const SparseSpec& other : {spec("full"), spec("tidal", {{"budget", "64"}}), spec("quest")}) {
    const ResolvedSparse r = tidal.resolve(other);
    EXPECT_FALSE(r.maker);
    ASSERT_TRUE(r.device_method) << other.method;
    EXPECT_EQ(r.device_method->method, other.method);
  }
  try {
    tidal.resolve(spec("tidal", {{"budget", "32"}, {"recall", "1"}}));
    ADD_FAILURE() << "recall resolved on a GPU server";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("CPU-only"), std::string::npos) << e.what();
  }
  EXPECT_THROW(tidal.resolve(spec("quest", {{"budget", "-3"}})), Error);  // the option checks

  // The scheduler side, with a CPU runner that claims no callback support.
  KVPool kv(KVLayout{cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 16}, 64);
  CpuModel model(w, kv);
  class DenseOnly final : public StepModel {
   public:
    explicit DenseOnly(CpuModel& m) : inner_(m) {}
    const ModelConfig& config() const override { return inner_.config(); }
    const std::vector<float>& forward(const std::vector<SeqInput>& b, std::vector<int64_t>& r) override {
      return inner_.forward(b, r);
    }
    int page_size() const override { return inner_.page_size(); }
    int64_t total_pages() const override { return inner_.total_pages(); }
    int64_t free_pages() const override { return inner_.free_pages(); }
    void release(PageTable& pt) override { inner_.release(pt); }
    bool supports_attention_callbacks() const override { return false; }
    std::string device() const override { return "a test GPU"; }

   private:
    CpuStepModel inner_;
  } dense(model);
  SparseMethods cpu(cfg, &kv, spec("full"));
  NoText text;
  Scheduler sched(dense, text, SchedulerOptions{});
  EngineRequest r;
  r.prompt = {1, 2, 3};
  r.max_tokens = 2;
  r.attention = cpu.resolve(spec("streaming", {{"budget", "16"}})).maker;
  try {
    sched.submit(std::move(r));
    ADD_FAILURE() << "a sparse request was accepted by a dense-only runner";
  } catch (const SubmitError& e) {
    EXPECT_EQ(e.status, 400);
    EXPECT_NE(std::string(e.what()).find("a test GPU"), std::string::npos) << e.what();
  }
}
