// The per-request `sparse` field -> SparseSession adapter (src/server/sparse_adapter.h):
// validation at request time, and requests of different methods in one running batch,
// with the per-method density the scheduler reports.
#include <gtest/gtest.h>

#include <thread>

#include "engine/scheduler.h"
#include "server/sparse_adapter.h"
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
  SparseMethods methods(cfg, kv, spec("full"));
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
  EXPECT_THROW(SparseMethods(cfg, kv, spec("nope")), Error);
}

TEST(ServerSparse, MixedMethodsShareABatch) {
  ModelConfig cfg = test::tiny_config();
  ModelWeights w = test::random_model(cfg, 5);
  KVPool kv(KVLayout{cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 16}, 128);
  CpuModel model(w, kv);
  SparseMethods methods(cfg, kv, spec("full"));
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
    const auto end = std::chrono::steady_clock::now() + 60s;
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
