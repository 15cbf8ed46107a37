// BLASST inside CudaModel (`--device cuda --sparse blasst`): the CPU method's options map to
// the GPU kernels' skipping; lambda = 0 is the dense path; a lambda too small to skip runs the
// skipping kernels and must give dense attention's logits; the tile counters count every
// 16-token chunk of every decode step exactly once per (layer, KV head); a / L skips tiles;
// with prefill=1 the prefill kernels (wgmma at head_dim 128, the generic one at 64) count tiles;
// and BLASST inside Quest's selections (InsideQuestSelections).
// Random bf16-rounded weights (as test_cuda_sparse_model.cpp), two requests batched.
#include <algorithm>
#include <cmath>
#include <cstdio>

#include "../test_util.h"
#include "gpu_model_util.h"
#include "model/cuda_blasst_probe.h"
#include "model/cuda_model.h"
#include "sparse/registry.h"

namespace spade::test {
namespace {

ModelConfig blasst_cfg(int D) { return tiny_config(Arch::Llama, D, 2); }

ModelWeights bf16_model(const ModelConfig& c, uint32_t seed) {
  ModelWeights w = random_model(c, seed);
  round_weights_bf16(w);
  return w;
}

CudaModelOptions opts(const ModelConfig& c, const std::string& spec) {
  CudaModelOptions o;
  o.max_tokens = 2048;
  o.max_batch = 4;
  o.max_step_tokens = 1024;
  o.max_logit_rows = 64;
  if (!spec.empty()) o.sparse = cuda_sparse_config(sparse::SparseConfig::parse_spec(spec), c, 16);
  return o;
}

struct Run {
  std::vector<std::vector<float>> logits;  // per decode step
  std::vector<int64_t> lens;               // context of each decode step (request 0, request 1)
};

// Prefill 700 + 300 tokens, then `steps` batched decode steps with fixed random tokens.
Run run_model(CudaModel& m, const ModelConfig& c, int steps) {
  std::mt19937 rng(5);
  auto toks = [&](int n) {
    std::vector<int32_t> t(static_cast<size_t>(n));
    for (auto& x : t) x = int32_t(rng() % uint32_t(c.vocab));
    return t;
  };
  auto a = toks(700), b = toks(300);
  PageTable p[2];
  std::vector<int64_t> rows;
  m.forward({{&p[0], a.data(), 700, false}, {&p[1], b.data(), 300, false}}, rows);
  Run r;
  for (int s = 0; s < steps; ++s) {
    int32_t ta = int32_t(rng() % uint32_t(c.vocab)), tb = int32_t(rng() % uint32_t(c.vocab));
    r.lens.push_back(p[0].length + 1);
    r.lens.push_back(p[1].length + 1);
    r.logits.push_back(m.forward({{&p[0], &ta, 1, false}, {&p[1], &tb, 1, false}}, rows));
  }
  m.release(p[0]);
  m.release(p[1]);
  return r;
}

void check(int D) {
  SCOPED_TRACE(testing::Message() << "head_dim " << D);
  const ModelConfig c = blasst_cfg(D);
  const ModelWeights w = bf16_model(c, 31);
  const int steps = 12;
  CudaModel dense(w, opts(c, ""));
  const Run ref = run_model(dense, c, steps);
  // Expected decode tiles per (layer, KV head): every 16-token chunk of every step.
  int64_t chunks = 0;
  for (int64_t L : ref.lens) chunks += (L + 15) / 16;
  for (const char* spec : {"blasst:lambda=0,prefill=1", "blasst:lambda=1e-30,prefill=1", "blasst:a=300,prefill=1"}) {
    SCOPED_TRACE(spec);
    CudaModel m(w, opts(c, spec));
    m.reset_blasst_counts();
    const auto got = run_model(m, c, steps);
    const bool exact = std::string(spec).rfind("blasst:lambda=0,", 0) == 0;
    const bool skips = std::string(spec).rfind("blasst:a=300", 0) == 0;
    double worst = 0;
    for (int s = 0; s < steps; ++s) {
      const double e = rel_err(got.logits[size_t(s)], ref.logits[size_t(s)]);
      worst = std::max(worst, e);
      if (exact) EXPECT_EQ(e, 0.0) << "step " << s;  // the dense kernels themselves
      else if (!skips) EXPECT_LT(e, 1e-2) << "step " << s;
      else EXPECT_TRUE(std::isfinite(e)) << "step " << s;
    }
    const std::vector<uint64_t> dc = m.blasst_counts(false), pc = m.blasst_counts(true);
    uint64_t tiles = 0, skipped = 0;
    for (int l = 0; l < c.n_layers; ++l)
      for (int h = 0; h < c.n_kv_heads; ++h) {
        const size_t i = (size_t(l) * c.n_kv_heads + h) * 2;
        EXPECT_EQ(int64_t(dc[i]), exact ? 0 : chunks) << "decode tiles, layer " << l << " head " << h;
        EXPECT_LE(dc[i + 1], dc[i]);
        tiles += dc[i], skipped += dc[i + 1];
      }
    if (!skips) EXPECT_EQ(skipped, 0u);
    else EXPECT_GT(skipped, 0u) << "lambda = 300 / L (0.42-1 here) skips some tiles";
    uint64_t ptiles = 0, pskipped = 0;
    for (size_t i = 0; i + 1 < pc.size(); i += 2) ptiles += pc[i], pskipped += pc[i + 1];
    if (!m.blasst_prefill_active() || exact) EXPECT_EQ(ptiles, 0u);
    else EXPECT_GT(ptiles, 0u) << "prefill=1: the prefill kernel counts its tiles";
    if (!skips) {
      EXPECT_EQ(pskipped, 0u);
    }
    std::printf("[ blasst model ] D=%d %s: worst logits rel err vs dense %.3g, decode tiles "
                "skipped %llu/%llu, prefill %llu/%llu (prefill skipping %s)\n",
                D, spec, worst, (unsigned long long)skipped, (unsigned long long)tiles,
                (unsigned long long)pskipped, (unsigned long long)ptiles,
                m.blasst_prefill_active() ? "on" : "off");
  }
}

TEST(CudaBlasstModel, HeadDim128) {
  SKIP_WITHOUT_GPU();
  check(128);
}

TEST(CudaBlasstModel, HeadDim64) {
  SKIP_WITHOUT_GPU();
  check(64);
}

// BLASST inside a selection (`--sparse quest+blasst`): a lambda too small to skip gives
// Quest's logits (within 1e-2: the dense layer runs the skipping dense kernel, whose tile
// schedule differs; the sparse layer's SKIP pipeline alone is bit-identical,
// test_cuda_sparse_blasst.cpp); every chunk of every list and of the dense layer is counted
// once; a larger lambda skips.
TEST(CudaBlasstModel, InsideQuestSelections) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = blasst_cfg(128);
  const ModelWeights w = bf16_model(c, 31);
  const int steps = 12;
  CudaModel quest(w, opts(c, "quest:budget=256,dense_layers=1"));
  const auto ref = run_model(quest, c, steps);
  int64_t dense_chunks = 0;
  for (int64_t L : ref.lens) dense_chunks += (L + 15) / 16;
  const int64_t list_chunks = int64_t(steps) * 2 * (256 / 16);  // 16 pages per list
  for (const char* spec : {"quest+blasst:budget=256,dense_layers=1,lambda=1e-30",
                           "quest+blasst:budget=256,dense_layers=1,lambda=0.05"}) {
    SCOPED_TRACE(spec);
    CudaModel m(w, opts(c, spec));
    ASSERT_TRUE(m.sparse().blasst_sel);
    m.reset_blasst_counts();
    const auto got = run_model(m, c, steps);
    const bool tiny = std::string(spec).find("1e-30") != std::string::npos;
    double worst = 0;
    for (int s = 0; s < steps; ++s) {
      const double e = rel_err(got.logits[size_t(s)], ref.logits[size_t(s)]);
      worst = std::max(worst, e);
      if (tiny) EXPECT_LT(e, 1e-2) << "step " << s;
      else EXPECT_TRUE(std::isfinite(e)) << "step " << s;
    }
    const std::vector<uint64_t> dc = m.blasst_counts(false);
    uint64_t skipped[2] = {0, 0};
    for (int l = 0; l < c.n_layers; ++l)
      for (int h = 0; h < c.n_kv_heads; ++h) {
        const size_t i = (size_t(l) * c.n_kv_heads + h) * 2;
        EXPECT_EQ(int64_t(dc[i]), l == 0 ? dense_chunks : list_chunks) << "layer " << l << " head " << h;
        skipped[l > 0] += dc[i + 1];
      }
    if (tiny) EXPECT_EQ(skipped[0] + skipped[1], 0u);
    else EXPECT_GT(skipped[1], 0u) << "lambda 0.05 skips chunks of the Quest lists";
    std::printf("[ blasst in quest ] %s: worst logits rel err vs quest %.3g, skipped chunks: dense "
                "layer %llu/%lld, quest layer %llu/%lld per head x %d heads\n", spec, worst,
                (unsigned long long)skipped[0], (long long)dense_chunks * c.n_kv_heads,
                (unsigned long long)skipped[1], (long long)list_chunks, c.n_kv_heads);
  }
}

TEST(CudaBlasstModel, CalibrationProbe) {
  // The probe behind `spade calibrate blasst --device cuda`: lambda 0 and a lambda too small
  // to skip give 0; lambda = a / L with a = lambda * L (one step: L fixed) gives the lambda's
  // own sparsity; prefixes are reused across lambdas (the same answer twice).
  SKIP_WITHOUT_GPU();
  const ModelConfig c = blasst_cfg(64);
  const ModelWeights w = bf16_model(c, 41);
  std::mt19937 rng(9);
  std::vector<int32_t> toks(900);
  for (auto& t : toks) t = int32_t(rng() % uint32_t(c.vocab));
  CudaBlasstProbe probe(w, 2048, true);
  const int64_t L = 800;
  EXPECT_EQ(probe.measure(0, toks, L, 1, 0.0, -1), 0.0);
  EXPECT_EQ(probe.measure(0, toks, L, 1, 1e-30, -1), 0.0);
  std::vector<double> layers;
  const double s1 = probe.measure(0, toks, L, 1, 0.5, -1, &layers);
  EXPECT_GT(s1, 0.0);
  ASSERT_EQ(layers.size(), size_t(c.n_layers));
  EXPECT_NEAR(probe.measure(0, toks, L, 1, -1, 0.5 * double(L + 1)), s1, 0.02);
  EXPECT_EQ(probe.measure(0, toks, L, 1, 0.5, -1), s1);  // prefix reused, same decisions
  const double s4 = probe.measure(1, toks, L, 4, 0.5, -1);
  EXPECT_GT(s4, 0.0);
  std::printf("[ blasst probe ] lambda 0.5: decode sparsity %.3f (1 step), %.3f (4 steps)\n", s1, s4);
  // The prefill phase at head_dim 64 (the generic prefill kernel's 32-row x 64-key tiles):
  // lambda 0 and a lambda too small to skip give 0, a larger one skips, the same answer twice.
  CudaBlasstProbe pf(w, 2048, false);
  EXPECT_EQ(pf.measure(0, toks, L, 1, 0.0, -1), 0.0);
  EXPECT_EQ(pf.measure(0, toks, L, 1, 1e-30, -1), 0.0);
  const double p1 = pf.measure(0, toks, L, 1, 0.5, -1);
  EXPECT_GT(p1, 0.0);
  EXPECT_LT(p1, 1.0);
  EXPECT_EQ(pf.measure(0, toks, L, 1, 0.5, -1), p1);
  std::printf("[ blasst probe ] lambda 0.5: prefill sparsity %.3f (head_dim 64)\n", p1);
}

TEST(CudaBlasstModel, OptionsMapOrFailClearly) {
  const ModelConfig c = blasst_cfg(64);
  auto expect_error = [&](const std::string& spec, const char* what) {
    expect_cuda_config_error(spec, what, c);
  };
  {  // oracle-topp has a GPU path (issue 37 item 6): BLASST over it skips in its list launches.
    const CudaSparse o = cuda_sparse_config(sparse::SparseConfig::parse_spec("blasst:base=oracle-topp"), c, 16);
    EXPECT_EQ(o.method, CudaSparse::Method::OracleTopP);
    EXPECT_TRUE(o.blasst_sel);
  }
  expect_error("blasst:tile=32", "fixed by the GPU kernels");
  for (const char* spec : {"blasst:base=quest,budget=512", "quest+blasst:budget=512"}) {
    const CudaSparse q = cuda_sparse_config(sparse::SparseConfig::parse_spec(spec), c, 16);
    EXPECT_EQ(q.method, CudaSparse::Method::Quest) << spec;
    EXPECT_TRUE(q.blasst_sel && q.blasst_any()) << spec;
    EXPECT_EQ(q.budget, 512) << spec;
    EXPECT_NE(q.describe().find("blasst over [quest budget=512"), std::string::npos) << q.describe();
  }
  const CudaSparse tw = cuda_sparse_config(
      sparse::SparseConfig::parse_spec("quest+twilight+blasst:budget=512,length=context"), c, 16);
  EXPECT_EQ(tw.method, CudaSparse::Method::Twilight);
  EXPECT_TRUE(tw.blasst_sel);
  EXPECT_FALSE(tw.blasst_len_selected);
  expect_error("blasst:order=reverse", "sequential");
  const CudaSparse d = cuda_sparse_config(sparse::SparseConfig::parse_spec("blasst"), c, 16);
  EXPECT_EQ(d.method, CudaSparse::Method::Blasst);
  EXPECT_LT(d.blasst_lambda, 0);
  EXPECT_NEAR(d.blasst_a, kBlasstDefaultGpuDecodeA, 1e-9);  // the GPU's own calibration
  EXPECT_NEAR(cuda_sparse_config(sparse::SparseConfig::parse_spec("blasst:a=7"), c, 16).blasst_a, 7.0, 1e-12);
  const CudaSparse f = cuda_sparse_config(sparse::SparseConfig::parse_spec("blasst:lambda=0.01"), c, 16);
  EXPECT_NEAR(f.blasst_lambda, 0.01, 1e-12);
  EXPECT_NE(f.describe().find("prefill dense (prefill=1"), std::string::npos) << f.describe();
  const CudaSparse fp =
      cuda_sparse_config(sparse::SparseConfig::parse_spec("blasst:lambda=0.01,prefill=1"), c, 16);
  EXPECT_TRUE(fp.blasst_prefill);
  EXPECT_NE(fp.describe().find("prefill lambda=0.01 (tiles: 32 rows x 64 keys)"), std::string::npos)
      << fp.describe();
}

}  // namespace
}  // namespace spade::test
