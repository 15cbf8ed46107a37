// BLASST's skipped tiles count in the density a user sees (issue 37, item 5): api::LLM's
// RequestOutput.density, which is the scheduler's per-request density (the server's
// usage.sparse.density and /metrics come from the same Scheduler::finish), on the CPU.
// A lambda that skips reports density < 1 over full attention; lambda 0 (never skips) and full
// attention report 1. The session-level twin: BlasstSession.DensityAndRecallCountOnlyTheKeptTiles.
#include <gtest/gtest.h>

#include "api/llm.h"
#include "test_util.h"

using namespace spade;
using namespace spade::api;

namespace {

const std::string kModel = test::source_dir() + "/tests/fixtures/models/stories260k-hf";

GenerateParams greedy(int64_t n, std::string sparse) {
  GenerateParams g;
  g.max_tokens = n;
  g.ignore_eos = true;
  g.sparse = std::move(sparse);
  return g;
}

}  // namespace

TEST(BlasstDensity, SkippedTilesLowerTheRequestDensity) {
  LLM llm(kModel, {});
  std::string p;
  for (int i = 0; i < 8; ++i)
    p += "Once upon a time there was a little girl named Lily. She liked to play in the park "
         "with her dog and her red ball. ";
  const auto n_prompt = llm.encode(p).size();
  ASSERT_GT(n_prompt, 160u) << "several 16-key tiles per head";
  ASSERT_LT(n_prompt + 24, 512u);
  const auto out = llm.generate(
      {p, p, p, p},
      {greedy(24, "full"), greedy(24, "blasst:tile=16,lambda=0"),
       greedy(24, "blasst:tile=16,lambda=0.5,prefill=0"), greedy(24, "blasst:tile=16,lambda=1e-30")});
  ASSERT_EQ(out.size(), 4u);
  EXPECT_NEAR(out[0].density, 1.0, 1e-9) << "full attention";
  EXPECT_NEAR(out[1].density, 1.0, 1e-9) << "lambda 0 never skips";
  EXPECT_NEAR(out[3].density, 1.0, 1e-9) << "a lambda too small to skip";
  // lambda 0.5 skips tiles: their rows are not attended (was 1.0 whatever BLASST skipped).
  EXPECT_GT(out[2].density, 0.0);
  EXPECT_LT(out[2].density, 0.99) << "BLASST density < 1 when tiles skip";
}
