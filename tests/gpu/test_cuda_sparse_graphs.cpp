// CUDA graphs for sparse decode steps (issue 9): for every GPU method, decode steps replayed
// from captured graphs give bit-identical logits to the same steps run eagerly, while the
// launch shapes change under them (a request crossing 1024 tokens re-plans the Quest stride and
// the dense heads' work items; a batch-size change picks another graph).
#include <cstring>
#include <random>

#include "../test_util.h"
#include "gpu_model_util.h"
#include "model/cuda_model.h"
#include "sparse/method.h"
#include "sparse/registry.h"

namespace spade::test {
namespace {

void compare_graphs(const std::string& spec, int na, int nb, int steps) {
  SCOPED_TRACE(spec);
  const ModelConfig c = tiny_config(Arch::Llama, 64, 4, 4096);
  ModelWeights w = random_model(c, 77);
  round_weights_bf16(w);
  CudaModelOptions opt;
  opt.max_tokens = 4096;
  opt.max_batch = 4;
  opt.max_step_tokens = 1024;
  opt.max_logit_rows = 64;
  opt.sparse = cuda_sparse_config(sparse::SparseConfig::parse_spec(spec), c, 16);
  opt.graph_min_uses = 1;  // every decode step replays a graph, the first of its shape too
  CudaModelOptions eager_opt = opt;
  eager_opt.cuda_graphs = false;
  CudaModel graphed(w, opt), eager(w, eager_opt);
  std::mt19937 rng(11);
  const auto a = random_tokens(rng, na, c.vocab), b = random_tokens(rng, nb, c.vocab);
  PageTable pg[2], pe[2];
  // Request states (LycheeCluster; null for the others). Token text: none (fixed chunks).
  std::unique_ptr<sparse::MethodState> sg[2] = {graphed.new_request_state(), graphed.new_request_state()};
  std::unique_ptr<sparse::MethodState> se[2] = {eager.new_request_state(), eager.new_request_state()};
  std::vector<int64_t> rows;
  for (int off = 0; off < na; off += 1024) {  // chunked prefill of a, then b
    const int n = std::min(1024, na - off);
    graphed.forward({{&pg[0], a.data() + off, n, false, nullptr, sg[0].get()}}, rows);
    eager.forward({{&pe[0], a.data() + off, n, false, nullptr, se[0].get()}}, rows);
  }
  graphed.forward({{&pg[1], b.data(), nb, false, nullptr, sg[1].get()}}, rows);
  eager.forward({{&pe[1], b.data(), nb, false, nullptr, se[1].get()}}, rows);
  int diffs = 0;
  for (int s = 0; s < steps; ++s) {
    int32_t ta = int32_t(rng() % uint32_t(c.vocab)), tb = int32_t(rng() % uint32_t(c.vocab));
    // Every 7th step only request a decodes (another batch size, another graph).
    std::vector<SeqInput> bg = {{&pg[0], &ta, 1, false, nullptr, sg[0].get()}},
                          be = {{&pe[0], &ta, 1, false, nullptr, se[0].get()}};
    if (s % 7 != 6)
      bg.push_back({&pg[1], &tb, 1, false, nullptr, sg[1].get()}),
          be.push_back({&pe[1], &tb, 1, false, nullptr, se[1].get()});
    const std::vector<float> lg = graphed.forward(bg, rows);
    const std::vector<float>& le = eager.forward(be, rows);
    ASSERT_EQ(lg.size(), le.size());
    if (std::memcmp(lg.data(), le.data(), lg.size() * sizeof(float)) != 0) {
      ++diffs;
      ADD_FAILURE() << "step " << s << ": graph replay differs from the eager step (rel err "
                    << rel_err(lg, le) << ")";
    }
  }
  EXPECT_EQ(diffs, 0);
  EXPECT_GE(graphed.graphs_captured(), 2) << "sparse decode steps were not captured";
  // Every decode step replays a graph, LycheeCluster's index builds and inserts included
  // (they run ahead of the step's graph): only the prefill forwards ran eagerly.
  const uint64_t prefills = uint64_t((na + 1023) / 1024 + 1);
  EXPECT_EQ(graphed.graph_counters().eager.load(), prefills) << "decode steps ran eagerly";
  EXPECT_EQ(eager.graphs_captured(), 0);
  std::printf("[ sparse-graphs ] %s: %d steps, %d graphs captured, identical logits\n",
              spec.c_str(), steps, graphed.graphs_captured());
}

// The graph cache keeps max_graphs graphs and evicts the least recently replayed one: with
// room for two, batch sizes 1, 2, 1, 2, 3 capture three graphs (3 evicts batch 1's, the older
// replay), then batch 2 replays its graph without a capture and batch 1 captures again.
TEST(CudaSparseGraphs, CacheEvictsTheLeastRecentlyReplayedGraph) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = tiny_config(Arch::Llama, 64, 4, 4096);
  ModelWeights w = random_model(c, 78);
  round_weights_bf16(w);
  CudaModelOptions opt;
  opt.max_tokens = 2048;
  opt.max_batch = 4;
  opt.max_graphs = 2;
  opt.graph_min_uses = 1;
  CudaModel m(w, opt);
  std::mt19937 rng(12);
  PageTable pt[3];
  std::vector<int64_t> rows;
  for (PageTable& p : pt) {
    const auto prompt = random_tokens(rng, 40, c.vocab);
    m.forward({{&p, prompt.data(), 40, false, nullptr, nullptr}}, rows);
  }
  int32_t tok[3] = {1, 2, 3};
  auto step = [&](int b) {
    std::vector<SeqInput> batch;
    for (int i = 0; i < b; ++i) batch.push_back({&pt[i], &tok[i], 1, false, nullptr, nullptr});
    m.forward(batch, rows);
  };
  const auto& g = m.graph_counters();
  for (int b : {1, 2, 1, 2}) step(b);
  EXPECT_EQ(g.captures.load(), 2u);
  EXPECT_EQ(m.graphs_captured(), 2);
  step(3);  // evicts batch 1's graph (replayed before batch 2's last replay)
  EXPECT_EQ(g.captures.load(), 3u);
  EXPECT_EQ(m.graphs_captured(), 2);
  step(2);  // kept: a replay
  EXPECT_EQ(g.captures.load(), 3u);
  step(1);  // evicted: captured again
  EXPECT_EQ(g.captures.load(), 4u);
  EXPECT_EQ(m.graphs_captured(), 2);
  EXPECT_EQ(g.replays.load(), 7u);
  for (PageTable& p : pt) m.release(p);
}

// graph_min_uses = 2 (the default): a launch shape's first step runs eagerly, its second is
// captured, later ones replay; the logits equal a model that never captures.
TEST(CudaSparseGraphs, ShapeCapturedTheSecondTimeItOccurs) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = tiny_config(Arch::Llama, 64, 4, 4096);
  ModelWeights w = random_model(c, 79);
  round_weights_bf16(w);
  CudaModelOptions opt;
  opt.max_tokens = 2048;
  opt.max_batch = 4;
  std::vector<std::vector<int>> log;
  opt.graph_log = &log;
  ASSERT_EQ(opt.graph_min_uses, 2);
  CudaModelOptions eager_opt = opt;
  eager_opt.cuda_graphs = false;
  eager_opt.graph_log = nullptr;
  CudaModel m(w, opt), e(w, eager_opt);
  std::mt19937 rng(13);
  PageTable pm[2], pe[2];
  std::vector<int64_t> rows;
  for (int i = 0; i < 2; ++i) {
    const auto prompt = random_tokens(rng, 40, c.vocab);
    m.forward({{&pm[i], prompt.data(), 40, false, nullptr, nullptr}}, rows);
    e.forward({{&pe[i], prompt.data(), 40, false, nullptr, nullptr}}, rows);
  }
  const auto& g = m.graph_counters();
  const uint64_t eager0 = g.eager.load();
  int32_t tok[2] = {5, 6};
  auto step = [&](int b) {
    std::vector<SeqInput> bm, be;
    for (int i = 0; i < b; ++i) {
      bm.push_back({&pm[i], &tok[i], 1, false, nullptr, nullptr});
      be.push_back({&pe[i], &tok[i], 1, false, nullptr, nullptr});
    }
    const std::vector<float> lm = m.forward(bm, rows);
    const std::vector<float>& le = e.forward(be, rows);
    ASSERT_EQ(lm.size(), le.size());
    EXPECT_EQ(std::memcmp(lm.data(), le.data(), lm.size() * sizeof(float)), 0)
        << "batch " << b << ": rel err " << rel_err(lm, le);
  };
  step(1);  // first sight of batch 1: eager
  EXPECT_EQ(g.eager.load() - eager0, 1u);
  EXPECT_EQ(g.captures.load(), 0u);
  step(1);  // second: captured (and replayed)
  EXPECT_EQ(g.captures.load(), 1u);
  EXPECT_EQ(g.replays.load(), 1u);
  step(2);  // batch 2, first sight: eager
  EXPECT_EQ(g.eager.load() - eager0, 2u);
  step(1);  // replay
  EXPECT_EQ(g.replays.load(), 2u);
  EXPECT_EQ(g.captures.load(), 1u);
  step(2);  // captured
  step(2);  // replay
  EXPECT_EQ(g.captures.load(), 2u);
  EXPECT_EQ(g.replays.load(), 4u);
  EXPECT_EQ(g.eager.load() - eager0, 2u);
  ASSERT_EQ(log.size(), 2u);  // the two captures' launch shapes, batch first
  EXPECT_NE(log[0], log[1]);
  EXPECT_EQ(log[0][0] / 4, 1);
  EXPECT_EQ(log[1][0] / 4, 2);
  for (int i = 0; i < 2; ++i) m.release(pm[i]), e.release(pe[i]);
}

TEST(CudaSparseGraphs, ReplayEqualsEagerForEveryMethod) {
  SKIP_WITHOUT_GPU();
  // Request a starts at 1000 tokens and crosses 1024 while decoding.
  const int na = 1000, nb = 300, steps = 40;
  compare_graphs("streaming:budget=128,dense_layers=1", na, nb, steps);
  compare_graphs("quest:budget=256,dense_layers=1", na, nb, steps);
  compare_graphs("quest:budget=256,dense_layers=1,gpu_scores=fast", na, nb, steps);
  compare_graphs("tidal:budget=128,dense_layers=1,selection_layers=1", na, nb, steps);
  compare_graphs("lessismore:budget=128,dense_layers=1,selection_layers=1", na, nb, steps);
  compare_graphs("lycheedecode:roles=RR/SR/RS/SS,budget=128", na, nb, steps);
  compare_graphs("oracle-topk:budget=128,dense_layers=1", na, nb, steps);
  compare_graphs("twilight:base=quest,budget=512,dense_layers=1", na, nb, steps);
  compare_graphs("blasst:a=4", na, nb, steps);
  // Index builds (the first decode step) and lazy updates (every 32 tokens here): ahead of
  // the step's graph in one model, inside the eager step in the other.
  compare_graphs("lycheecluster:budget=128,buffer=32,dense_layers=1", na, nb, steps);
}

}  // namespace
}  // namespace spade::test
