// Cache correction in the scheduler (EngineRequest::correction_every, from the method's
// correction option through the server's SparseMethods): after every N decode tokens a request
// feeds those N tokens again as one chunk with dense attention at their own positions, then
// decodes on. Checked against generate() with the same method and correction (one sequence:
// the same arithmetic, so the same tokens), with the chunks the runner saw.
#include <gtest/gtest.h>

#include <vector>

#include "engine/generator.h"
#include "engine/scheduler.h"
#include "scheduler_test_util.h"
#include "server/sparse_adapter.h"
#include "sparse/registry.h"
#include "sparse/session.h"

using namespace spade;
using namespace spade::sched_test;

namespace {

// Records each step's rows: start position, tokens, whether a sparse method attended.
class ChunkRecorder final : public CpuStepModel {
 public:
  explicit ChunkRecorder(CpuModel& m) : CpuStepModel(m) {}
  struct Row {
    int64_t p0;
    std::vector<int32_t> tokens;
    bool sparse;
  };
  const std::vector<float>& forward(const std::vector<SeqInput>& batch,
                                    std::vector<int64_t>& row_of) override {
    for (const SeqInput& s : batch)
      rows.push_back({s.pages->length, std::vector<int32_t>(s.tokens, s.tokens + s.n_tokens),
                      s.attention != nullptr});
    return m_.forward(batch, row_of);
  }
  std::vector<Row> rows;
};

TEST(SchedulerCorrection, FeedsDecodedTokensAgainDenselyLikeGenerate) {
  ModelConfig cfg = test::tiny_config();
  cfg.n_layers = 4;  // sparse layers after the first: their K/V are what correction rewrites
  const ModelWeights w = test::random_model(cfg, 13);
  KVPool kv(KVLayout{cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 8}, 128);
  CpuModel model(w, kv);
  LetterText text;
  const std::vector<int32_t> prompt = make_prompt(40, 5, cfg.vocab);
  const int every = 5, n = 23;
  for (const std::string method : {"lycheedecode", "tidal"}) {
    SCOPED_TRACE(method);
    server::SparseSpec spec;
    spec.method = method;
    spec.options = {{"budget", "6"}, {"correction", "1"}, {"correction_every", std::to_string(every)}};
    if (method == "lycheedecode") spec.options.push_back({"roles", "RR/SS/SS/SS"});
    else spec.options.push_back({"dense_layers", "1"}), spec.options.push_back({"selection_layers", "1"});
    server::SparseMethods methods(cfg, &kv, server::SparseSpec{"full", {}});
    server::ResolvedSparse rs = methods.resolve(spec);
    ASSERT_EQ(rs.correction_every, every);

    // generate(): the decode loop's correction.
    std::vector<int32_t> want;
    int64_t want_corrections = 0;
    {
      sparse::SparseConfig sc;
      sc.method = method;
      for (const auto& [k, v] : spec.options) sc.set(k, v);
      auto m = sparse::make_method(sc, cfg);
      sparse::SparseSession session(m, cfg, kv);
      PageTable pt;
      GenerateOptions go;
      go.max_new_tokens = n;
      go.prefill_chunk = 512;
      go.attention = &session.attention();
      go.correction_every = m->correction_every();
      want_corrections = generate(model, pt, prompt, go, [&](int32_t t) {
                           want.push_back(t);
                           return true;
                         }).corrections;
      kv.release(pt);
    }
    ASSERT_EQ(want_corrections, (n - 1) / every);  // n - 1 decode steps; (n - 1) % every != 0

    ChunkRecorder runner(model);
    SchedulerOptions so;
    so.max_step_tokens = 512;
    Scheduler sched(runner, text, so);
    EngineRequest r = greedy(prompt, n);
    r.attention = rs.maker;
    r.correction_every = rs.correction_every;
    const Result got = collect(*sched.submit(std::move(r)));
    ASSERT_TRUE(sched.wait_idle(5s));
    EXPECT_EQ(got.tokens, want);
    EXPECT_EQ(sched.metrics().cache_corrections, uint64_t(want_corrections));
    EXPECT_EQ(kv.used_pages(), 0);
    // The chunks: N tokens already decoded, fed again at their positions, densely; the
    // decode rows around them attend sparsely.
    int chunks = 0;
    for (const auto& row : runner.rows) {
      if (row.p0 == 0) continue;  // the prompt
      if (row.tokens.size() == 1) {
        EXPECT_TRUE(row.sparse);
        continue;
      }
      ++chunks;
      ASSERT_EQ(row.tokens.size(), size_t(every));
      EXPECT_FALSE(row.sparse) << "a correction chunk attends densely";
      const int64_t first = row.p0 - int64_t(prompt.size());  // index among the generated
      ASSERT_GE(first, 0);
      for (int j = 0; j < every; ++j) EXPECT_EQ(row.tokens[size_t(j)], got.tokens[size_t(first + j)]);
    }
    EXPECT_EQ(chunks, want_corrections);
  }
}

}  // namespace
