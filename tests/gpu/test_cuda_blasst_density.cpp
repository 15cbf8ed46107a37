// BLASST's skipped tiles count in a request's density on the GPU (issue 37, item 5): the rows a
// request's GpuRequestState reports as attended (what the scheduler turns into the server's
// usage.sparse.density, api::LLM's RequestOutput.density and /metrics) are its decode rows
// less kBlasstTileRows per decode tile the kernels skipped, consistent with the tile counters:
// over full attention (the dense decode kernel) and inside Quest's lists (the selection
// kernel). A lambda that never skips reports every row (density 1 over full attention); the
// eval's GPU records carry the same density.
// Random bf16-rounded weights, two requests batched.
#include <cstdio>

#include "../test_util.h"
#include "gpu_model_util.h"
#include "eval/cuda_decode.h"
#include "model/cuda_blasst_probe.h"
#include "model/cuda_model.h"
#include "sparse/gpu/method.h"
#include "sparse/registry.h"

namespace spade::test {
namespace {

struct Density {
  int64_t dense_rows = 0;     // NL * Hkv * L per decode step, both requests
  int64_t method_rows = 0;    // what the method's lists held, before skipping
  int64_t attended = 0;       // GpuRequestState::attended_rows(), both requests
  int64_t attended_each[2] = {0, 0};
  uint64_t skipped = 0, tiles = 0;  // decode tile counters
};

Density run(const ModelWeights& w, const std::string& spec, int steps) {
  const ModelConfig& c = w.config;
  CudaModelOptions o;
  o.max_tokens = 2048;
  o.max_batch = 4;
  o.max_step_tokens = 1024;
  o.max_logit_rows = 64;
  o.sparse = cuda_sparse_config(sparse::SparseConfig::parse_spec(spec), c, 16);
  CudaModel m(w, o);
  std::unique_ptr<sparse::MethodState> st[2] = {m.new_request_state(0), m.new_request_state(0)};
  auto* g0 = dynamic_cast<GpuRequestState*>(st[0].get());
  auto* g1 = dynamic_cast<GpuRequestState*>(st[1].get());
  EXPECT_TRUE(g0 && g1);
  std::mt19937 rng(11);
  const auto a = random_tokens(rng, 700, c.vocab), b = random_tokens(rng, 300, c.vocab);
  PageTable p[2];
  std::vector<int64_t> rows;
  m.forward({{&p[0], a.data(), 700, false, nullptr, st[0].get()},
             {&p[1], b.data(), 300, false, nullptr, st[1].get()}}, rows);
  EXPECT_EQ(g0->attended_rows(), 0) << "prefill rows are not decode rows";
  Density d;
  for (int s = 0; s < steps; ++s) {
    const int32_t ta = int32_t(rng() % uint32_t(c.vocab)), tb = int32_t(rng() % uint32_t(c.vocab));
    d.dense_rows += int64_t(c.n_layers) * c.n_kv_heads * (p[0].length + 1 + p[1].length + 1);
    m.forward({{&p[0], &ta, 1, false, nullptr, st[0].get()},
               {&p[1], &tb, 1, false, nullptr, st[1].get()}}, rows);
  }
  d.method_rows = g0->attended + g1->attended;
  d.attended_each[0] = g0->attended_rows();
  d.attended_each[1] = g1->attended_rows();
  d.attended = d.attended_each[0] + d.attended_each[1];
  const std::vector<uint64_t> cnt = m.blasst_counts(false);
  for (size_t i = 0; i + 1 < cnt.size(); i += 2) d.tiles += cnt[i], d.skipped += cnt[i + 1];
  m.release(p[0]);
  m.release(p[1]);
  return d;
}

TEST(CudaBlasstDensity, SkippedTilesAreNotAttended) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = tiny_config(Arch::Llama, 64, 2);
  ModelWeights w = random_model(c, 21);
  round_weights_bf16(w);
  const int steps = 6;
  // Over full attention: the method's rows are the dense rows; skipping lowers the attended.
  for (const char* spec : {"blasst:lambda=0", "blasst:lambda=1e-30", "blasst:lambda=0.9"}) {
    SCOPED_TRACE(spec);
    const Density d = run(w, spec, steps);
    EXPECT_EQ(d.method_rows, d.dense_rows);
    EXPECT_EQ(d.attended, d.dense_rows - GpuMethod::kBlasstTileRows * int64_t(d.skipped))
        << "attended rows = decode rows - 16 per skipped decode tile";
    const double density = double(d.attended) / double(d.dense_rows);
    std::printf("[ blasst density ] %s: density %.4f, decode tiles skipped %llu / %llu\n", spec,
                density, (unsigned long long)d.skipped, (unsigned long long)d.tiles);
    if (std::string(spec) == "blasst:lambda=0.9") {
      EXPECT_GT(d.skipped, 0u);
      EXPECT_LT(density, 1.0) << "BLASST density < 1 when tiles skip";
      // Each request gets a share, no more than its rows.
      for (int r = 0; r < 2; ++r) EXPECT_GE(d.attended_each[r], 0);
    } else {
      EXPECT_EQ(d.skipped, 0u);
      EXPECT_EQ(density, 1.0) << "a lambda that never skips attends every row";
    }
  }
  // Inside Quest's lists: the selection kernel's skipped chunks come off Quest's rows.
  const Density q = run(w, "quest:budget=256,dense_layers=1", steps);
  for (const char* spec : {"quest+blasst:budget=256,dense_layers=1,lambda=1e-30",
                           "quest+blasst:budget=256,dense_layers=1,lambda=0.9"}) {
    SCOPED_TRACE(spec);
    const Density d = run(w, spec, steps);
    EXPECT_EQ(d.method_rows, q.method_rows) << "the same host-sized lists as Quest alone";
    EXPECT_EQ(q.attended, q.method_rows);
    EXPECT_EQ(d.attended, d.method_rows - GpuMethod::kBlasstTileRows * int64_t(d.skipped));
    std::printf("[ blasst density ] %s: density %.4f (quest alone %.4f), chunks skipped %llu / %llu\n",
                spec, double(d.attended) / double(d.dense_rows),
                double(q.attended) / double(q.dense_rows), (unsigned long long)d.skipped,
                (unsigned long long)d.tiles);
    if (std::string(spec).find("0.9") != std::string::npos) {
      EXPECT_GT(d.skipped, 0u);
      EXPECT_LT(d.attended, q.attended);
    } else {
      EXPECT_EQ(d.attended, q.attended);
    }
  }
}

// `spade eval --device cuda` records the same density (DecodeResult::gpu_density, the JSON's
// "density"): 1 for a lambda that never skips, below 1 when tiles skip.
TEST(CudaBlasstDensity, EvalRecordsTheRequestDensity) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = tiny_config(Arch::Llama, 64, 2);
  ModelWeights w = random_model(c, 21);
  round_weights_bf16(w);
  std::mt19937 rng(3);
  const auto prompt = random_tokens(rng, 600, c.vocab);
  eval::CudaDecoder dec(w, 600, 8);
  eval::DecodeOptions o;
  o.max_new = 8;
  double density[2] = {0, 0};
  int i = 0;
  for (const char* spec : {"blasst:lambda=0", "blasst:lambda=0.9"}) {
    const eval::DecodeResult r =
        dec.decode(spec, cuda_sparse_config(sparse::SparseConfig::parse_spec(spec), c, 16), prompt, o);
    EXPECT_TRUE(r.gpu);
    density[i++] = r.gpu_density;
  }
  std::printf("[ blasst density ] eval: lambda 0 %.4f, lambda 0.9 %.4f\n", density[0], density[1]);
  EXPECT_EQ(density[0], 1.0);
  EXPECT_GT(density[1], 0.0);
  EXPECT_LT(density[1], 1.0) << "BLASST density < 1 when tiles skip";
}

// The probe behind `spade calibrate blasst --device cuda --sparse quest+blasst:...`: BLASST
// inside Quest's lists, lambda changed between runs on the selector (GpuMethod::set_blasst):
// lambda 0 and a lambda too small to skip give 0, a larger one skips, lambda = a / L with
// a = lambda * L (the calibration's sweep inside a selector) runs, the same answer twice; a
// placement that is not X+blasst, or the prefill phase, is refused.
TEST(CudaBlasstDensity, CalibrationProbeInsideQuest) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = tiny_config(Arch::Llama, 64, 2);
  ModelWeights w = random_model(c, 21);
  round_weights_bf16(w);
  std::mt19937 rng(9);
  const auto toks = random_tokens(rng, 900, c.vocab);
  const CudaSparse where = cuda_sparse_config(
      sparse::SparseConfig::parse_spec("quest+blasst:budget=256,dense_layers=1"), c, 16);
  ASSERT_TRUE(where.blasst_sel);
  CudaBlasstProbe probe(w, 2048, true, &where);
  const int64_t L = 800;
  EXPECT_EQ(probe.measure(0, toks, L, 2, 0.0, -1), 0.0);
  EXPECT_EQ(probe.measure(0, toks, L, 2, 1e-30, -1), 0.0);
  const double s = probe.measure(0, toks, L, 2, 0.9, -1);
  EXPECT_GT(s, 0.0);
  EXPECT_LT(s, 1.0);
  EXPECT_EQ(probe.measure(0, toks, L, 2, 0.9, -1), s);  // prefix reused, same decisions
  const double sa = probe.measure(0, toks, L, 2, -1, 0.9 * double(L));
  EXPECT_GT(sa, 0.0);
  std::printf("[ blasst probe in quest ] lambda 0.9: sparsity %.3f; a = 0.9 L: %.3f\n", s, sa);
  expect_error([&] { CudaBlasstProbe(w, 2048, false, &where); }, "--phase decode only");
  const CudaSparse quest =
      cuda_sparse_config(sparse::SparseConfig::parse_spec("quest:budget=256"), c, 16);
  expect_error([&] { CudaBlasstProbe(w, 2048, true, &quest); }, "is not BLASST inside a GPU selector");
}

}  // namespace
}  // namespace spade::test
