// engine/runner.h: one factory for the scheduler's model runner.
#include <gtest/gtest.h>

#include "engine/runner.h"
#include "engine/scheduler.h"
#include "test_util.h"

namespace spade {
namespace {

TEST(Runner, CpuRunnerOwnsItsPoolAndRuns) {
  const ModelConfig cfg = test::tiny_config();
  const ModelWeights w = test::random_model(cfg, 3);
  RunnerOptions o;
  o.kv_pages = 32;
  o.page_size = 16;
  Runner r = make_runner(w, o);
  ASSERT_TRUE(r.model);
  ASSERT_NE(r.host_pool, nullptr);
  EXPECT_EQ(r.model->device(), "cpu");
  EXPECT_EQ(r.model->total_pages(), 32);
  EXPECT_EQ(r.host_pool->n_pages(), 32);
  EXPECT_GT(r.kv_mib, 0.0);
  EXPECT_FALSE(r.check_method);  // the CPU checks methods through its sparse sessions
  EXPECT_FALSE(r.model->runs_methods());
  // It runs: one forward over a short prompt, every page back after release.
  PageTable pt;
  const std::vector<int32_t> ids = {1, 2, 3, 4, 5};
  std::vector<int64_t> rows;
  const std::vector<float>& logits = r.model->forward({{&pt, ids.data(), 5, false}}, rows);
  EXPECT_EQ(logits.size(), size_t(cfg.vocab));
  r.model->release(pt);
  EXPECT_EQ(r.model->free_pages(), 32);
}

TEST(Runner, BadDeviceOrPoolIsAClearError) {
  const ModelConfig cfg = test::tiny_config();
  const ModelWeights w = test::random_model(cfg, 3);
  RunnerOptions o;
  o.kv_pages = 8;
  o.device = "tpu";
  try {
    make_runner(w, o);
    ADD_FAILURE() << "tpu accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--device must be cpu or cuda"), std::string::npos) << e.what();
  }
  o.device = "cpu";
  o.kv_pages = 0;
  EXPECT_THROW(make_runner(w, o), Error);
#if !defined(SPADE_HAVE_CUDA)
  // cuda in a build without the backend says so instead of running on the CPU.
  o.kv_pages = 8;
  o.device = "cuda";
  try {
    make_runner(w, o);
    ADD_FAILURE() << "cuda accepted by a CPU-only build";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no CUDA backend"), std::string::npos) << e.what();
  }
#endif
}

}  // namespace
}  // namespace spade
