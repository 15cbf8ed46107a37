// `spade eval --device`: which method runs go to the GPU and which stay on the CPU
// (src/eval/runner.h), and EvalRunner on the CPU backend decoding exactly what
// SharedPrefill decodes. Host-only: the GPU side is tests/gpu/test_cuda_eval.cpp.
#include <gtest/gtest.h>

#include <random>

#include "eval/decode.h"
#include "eval/methods.h"
#include "eval/report.h"
#include "eval/runner.h"
#include "engine/sampler.h"
#include "model/cuda_methods.h"
#include "sparse/registry.h"
#include "test_util.h"

using namespace spade;
using namespace spade::eval;

TEST(EvalRunner, CpuDevicePlacesEveryRunOnTheCpu) {
  const auto runs = expand_methods("full;quest;lycheecluster;oracle-topk", {64});
  for (const Placement& p : place_runs(runs, Device::CPU)) {
    EXPECT_FALSE(p.gpu);
    EXPECT_TRUE(p.why.empty());
  }
  EXPECT_EQ(device_name(parse_device("cpu")), std::string("cpu"));
  EXPECT_THROW(parse_device("gpu"), Error);
#if !defined(SPADE_HAVE_CUDA)
  EXPECT_THROW(parse_device("cuda"), Error);
#endif
}

TEST(EvalRunner, CudaDeviceFollowsHasCudaPathAndTheGpuConfig) {
  EXPECT_TRUE(has_cuda_path("quest+blasst"));  // a stack: every stage has one
  EXPECT_TRUE(has_cuda_path("quest+twilight+blasst"));
  // Every CPU method has a GPU path (oracle-topp since issue 37 item 6); unknown names none.
  EXPECT_TRUE(has_cuda_path("oracle-topp"));
  EXPECT_TRUE(has_cuda_path("oracle-topp+blasst"));
  EXPECT_FALSE(has_cuda_path("no-such-method"));
  EXPECT_FALSE(has_cuda_path("quest+no-such-method"));
  const auto runs = expand_methods("full;quest;oracle-topp;oracle-topk;streaming", {64, 128});
  // No GPU config check: has_cuda_path alone decides.
  const auto p = place_runs(runs, Device::CUDA);
  ASSERT_EQ(p.size(), runs.size());
  for (size_t i = 0; i < runs.size(); ++i) {
    EXPECT_EQ(p[i].gpu, has_cuda_path(runs[i].name)) << runs[i].label;
    EXPECT_EQ(p[i].why.empty(), p[i].gpu) << runs[i].label;
  }
  // The GPU refuses a run (as cuda_sparse_config does for unsupported options): CPU, with why.
  const auto q = place_runs(runs, Device::CUDA, [](const MethodRun& r) {
    return r.label == "quest:budget=128" ? std::string("quest: not on the GPU") : std::string();
  });
  for (size_t i = 0; i < runs.size(); ++i) {
    if (runs[i].label == "quest:budget=128") {
      EXPECT_FALSE(q[i].gpu);
      EXPECT_EQ(q[i].why, "quest: not on the GPU");
    } else {
      EXPECT_EQ(q[i].gpu, p[i].gpu) << runs[i].label;
    }
  }
  const std::string line = placement_line(runs, q);
  EXPECT_EQ(line.rfind("GPU: full, quest:budget=64, ", 0), 0u) << line;
  EXPECT_NE(line.find("; CPU: quest:budget=128 (quest: not on the GPU)"), std::string::npos) << line;
  // oracle-topp runs on the GPU: named before the CPU part.
  EXPECT_LT(line.find("oracle-topp"), line.find("; CPU:")) << line;
  EXPECT_EQ(line.find("no GPU path"), std::string::npos) << line;
  EXPECT_EQ(placement_line(runs, place_runs(runs, Device::CPU)).rfind("CPU: full, ", 0), 0u);
}

TEST(EvalRunner, CpuRunnerDecodesWhatSharedPrefillDecodes) {
  const ModelConfig c = test::tiny_config();
  const ModelWeights w = test::random_model(c, 11);
  const auto runs = expand_methods("full;streaming;quest", {32});
  std::vector<std::shared_ptr<const sparse::SparseMethod>> methods;
  for (const auto& r : runs) methods.push_back(sparse::make_method(r.config, c));
  RunnerOptions ro;
  ro.max_prompt = 200;
  ro.max_new = 12;
  ro.chunk = 64;
  EvalRunner runner(w, runs, place_runs(runs, Device::CPU), methods, ro, nullptr);
  SharedPrefill sp(w, 200, 12, 16, 64);
  std::mt19937 rng(5);
  for (int prompt_len : {150, 37}) {
    std::vector<int32_t> prompt(static_cast<size_t>(prompt_len));
    for (auto& t : prompt) t = int32_t(rng() % uint32_t(c.vocab));
    runner.set_prompt(prompt);
    sp.prefill(prompt);
    DecodeOptions opt;
    opt.max_new = 12;
    for (size_t m = 0; m < runs.size(); ++m) {
      const DecodeResult a = runner.decode(m, opt), b = sp.decode(methods[m], opt);
      EXPECT_EQ(a.tokens, b.tokens) << runs[m].label;
      EXPECT_FALSE(a.gpu);
      EXPECT_STREQ(runner.backend(m), "cpu");
      EXPECT_GT(a.prefill_seconds, 0.0);
      EXPECT_EQ(a.totals.steps, b.totals.steps);
      EXPECT_EQ(runner.describe(m), methods[m]->describe());
    }
    // Teacher forcing along full attention's tokens reproduces its own logits' argmax.
    const DecodeResult full = runner.decode_full(1, opt);
    EXPECT_EQ(full.tokens, runner.decode(0, opt).tokens);
    DecodeOptions tf;
    tf.max_new = int64_t(full.tokens.size());
    tf.forced = &full.tokens;
    int64_t seen = 0;
    tf.on_logits = [&](int64_t i, const float* lg) {
      EXPECT_EQ(argmax(lg, c.vocab), full.tokens[size_t(i)]) << i;
      ++seen;
    };
    runner.decode(0, tf);
    EXPECT_EQ(seen, tf.max_new);
  }
}

// The eval decode loops run the method's cache correction (issue 37): a run whose method asks
// for it reports its corrections, and its tokens equal SharedPrefill's with the same option;
// forced tokens (teacher forcing) are corrected like sampled ones.
TEST(EvalRunner, RunsTheMethodsCacheCorrection) {
  ModelConfig c = test::tiny_config();
  c.n_layers = 4;
  const ModelWeights w = test::random_model(c, 17);
  const auto runs = expand_methods(
      "tidal:dense_layers=1,selection_layers=1,correction=1,correction_every=4;"
      "tidal:dense_layers=1,selection_layers=1",
      {8});
  std::vector<std::shared_ptr<const sparse::SparseMethod>> methods;
  for (const auto& r : runs) methods.push_back(sparse::make_method(r.config, c));
  ASSERT_EQ(methods[0]->correction_every(), 4);
  ASSERT_EQ(methods[1]->correction_every(), 0);
  RunnerOptions ro;
  ro.max_prompt = 100;
  ro.max_new = 15;
  EvalRunner runner(w, runs, place_runs(runs, Device::CPU), methods, ro, nullptr);
  std::mt19937 rng(3);
  std::vector<int32_t> prompt(90);
  for (auto& t : prompt) t = int32_t(rng() % uint32_t(c.vocab));
  runner.set_prompt(prompt);
  DecodeOptions opt;
  opt.max_new = 15;
  const DecodeResult a = runner.decode(0, opt), b = runner.decode(1, opt);
  EXPECT_EQ(a.corrections, (15 - 1) / 4);  // 14 decode steps
  EXPECT_EQ(b.corrections, 0);
  SharedPrefill sp(w, 100, 15, 16, 1024);
  sp.prefill(prompt);
  DecodeOptions with = opt;
  with.correction_every = 4;
  const DecodeResult c0 = sp.decode(methods[1], with);
  EXPECT_EQ(c0.corrections, a.corrections);
  EXPECT_EQ(c0.tokens, a.tokens);
}

TEST(EvalRunner, ReportNamesTheBackendOfEachMethod) {
  nlohmann::json doc = {{"kind", "ppl"}, {"meta", {{"backend", "cuda"}}}, {"commands", {"x"}}};
  doc["results"] = {{{"key", "a"}, {"method", "full"}, {"length", 64}, {"nll_mean", 1.0},
                     {"density", nullptr}, {"backend", "cuda"}},
                    {{"key", "b"}, {"method", "lycheecluster:budget=64"}, {"length", 64},
                     {"nll_mean", 1.5}, {"density", 0.5}, {"backend", "cpu"}}};
  const std::string md = markdown_report(doc);
  EXPECT_NE(md.find("| full | cuda |"), std::string::npos) << md;
  EXPECT_NE(md.find("| lycheecluster:budget=64 | cpu |"), std::string::npos) << md;
  // A CPU-only report has no backend section.
  doc["results"][0]["backend"] = "cpu";
  EXPECT_EQ(markdown_report(doc).find("Backend per method"), std::string::npos);
}
