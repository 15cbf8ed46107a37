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
    bool dense;  // SeqInput::dense (a correction chunk, whatever its length)
  };
  const std::vector<float>& forward(const std::vector<SeqInput>& batch,
                                    std::vector<int64_t>& row_of) override {
    for (const SeqInput& s : batch)
      rows.push_back({s.pages->length, std::vector<int32_t>(s.tokens, s.tokens + s.n_tokens),
                      s.attention != nullptr, s.dense});
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
        EXPECT_FALSE(row.dense);
        continue;
      }
      ++chunks;
      ASSERT_EQ(row.tokens.size(), size_t(every));
      EXPECT_FALSE(row.sparse) << "a correction chunk attends densely";
      EXPECT_TRUE(row.dense) << "and is marked dense";
      const int64_t first = row.p0 - int64_t(prompt.size());  // index among the generated
      ASSERT_GE(first, 0);
      for (int j = 0; j < every; ++j) EXPECT_EQ(row.tokens[size_t(j)], got.tokens[size_t(first + j)]);
    }
    EXPECT_EQ(chunks, want_corrections);
  }
}

// Correction chunks of one token (correction_every=1), and pieces of a chunk split by the
// step's token budget, are marked dense (SeqInput::dense): CudaModel plans a one-token row
// as a sparse decode row unless it is. Every row after the prompt is either a sparse decode
// row or a dense correction piece, the pieces cover every corrected token once, and the
// tokens are generate()'s.
TEST(SchedulerCorrection, MarksOneTokenCorrectionPiecesDense) {
  ModelConfig cfg = test::tiny_config();
  cfg.n_layers = 4;
  const ModelWeights w = test::random_model(cfg, 17);
  KVPool kv(KVLayout{cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 8}, 128);
  CpuModel model(w, kv);
  LetterText text;
  const std::vector<int32_t> prompt = make_prompt(40, 7, cfg.vocab);
  const int n = 13;
  for (const auto& [every, step_tokens] : {std::pair{1, 512}, std::pair{5, 2}}) {
    SCOPED_TRACE(every);
    server::SparseSpec spec;
    spec.method = "tidal";
    spec.options = {{"budget", "6"}, {"correction", "1"}, {"correction_every", std::to_string(every)},
                    {"dense_layers", "1"}, {"selection_layers", "1"}};
    server::SparseMethods methods(cfg, &kv, server::SparseSpec{"full", {}});
    server::ResolvedSparse rs = methods.resolve(spec);
    ASSERT_EQ(rs.correction_every, every);
    std::vector<int32_t> want;
    {
      sparse::SparseConfig sc;
      sc.method = spec.method;
      for (const auto& [k, v] : spec.options) sc.set(k, v);
      auto m = sparse::make_method(sc, cfg);
      sparse::SparseSession session(m, cfg, kv);
      PageTable pt;
      GenerateOptions go;
      go.max_new_tokens = n;
      go.prefill_chunk = 512;
      go.attention = &session.attention();
      go.correction_every = m->correction_every();
      generate(model, pt, prompt, go, [&](int32_t t) {
        want.push_back(t);
        return true;
      });
      kv.release(pt);
    }
    ChunkRecorder runner(model);
    SchedulerOptions so;
    so.max_step_tokens = step_tokens;
    so.max_batch = 2;  // max_step_tokens is at least max_batch
    Scheduler sched(runner, text, so);
    EngineRequest r = greedy(prompt, n);
    r.attention = rs.maker;
    r.correction_every = rs.correction_every;
    const Result got = collect(*sched.submit(std::move(r)));
    ASSERT_TRUE(sched.wait_idle(5s));
    EXPECT_EQ(got.tokens, want);
    // The scheduler corrects a group before the next decode step, so not the group that the
    // last decode step completes (generate() corrects right after the step).
    const int64_t corrections = (n - 2) / every;
    EXPECT_EQ(sched.metrics().cache_corrections, uint64_t(corrections));
    EXPECT_EQ(kv.used_pages(), 0);
    const int64_t P = int64_t(prompt.size());
    std::vector<int> fed_densely(size_t(n), 0);  // per generated token
    int one_token_pieces = 0;
    for (const auto& row : runner.rows) {
      if (row.p0 < P) continue;  // the prompt
      if (row.sparse) {
        EXPECT_EQ(row.tokens.size(), 1u);
        EXPECT_FALSE(row.dense) << "a decode row at " << row.p0;
        continue;
      }
      EXPECT_TRUE(row.dense) << "a correction piece of " << row.tokens.size() << " tokens at " << row.p0;
      one_token_pieces += row.tokens.size() == 1;
      for (size_t j = 0; j < row.tokens.size(); ++j) {
        const int64_t g = row.p0 - P + int64_t(j);
        ASSERT_LT(g, n);
        EXPECT_EQ(row.tokens[j], got.tokens[size_t(g)]);
        ++fed_densely[size_t(g)];
      }
    }
    for (int64_t g = 0; g < n; ++g)
      EXPECT_EQ(fed_densely[size_t(g)], g < corrections * every ? 1 : 0) << "generated token " << g;
    EXPECT_GT(one_token_pieces, 0) << "the case under test occurred";
  }
}

}  // namespace
