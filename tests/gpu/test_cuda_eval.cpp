// `spade eval --device cuda` (src/eval/cuda_decode.h, src/eval/runner.h) vs the CPU path
// (SharedPrefill). As in test_cuda_model.cpp, the CPU runs fp32 on the SAME bf16-rounded
// weights the GPU holds, so the differences are the GPU's bf16 activations and KV cache:
//  - teacher-forced logits: every step's ||gpu - cpu|| / ||cpu|| < 3e-2 (the CudaModel tests'
//    model-level tolerance);
//  - greedy tokens: identical, or a divergence only where the CPU's own top-2 logits are
//    within 0.15 (a near-tie that bf16 rounding may flip), as in SmolLM2GreedyMatchesCpu.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>

#include "../test_util.h"
#include "engine/sampler.h"
#include "eval/cuda_decode.h"
#include "eval/decode.h"
#include "eval/methods.h"
#include "eval/rng.h"
#include "eval/runner.h"
#include "eval/tasks.h"
#include "gpu_model_util.h"
#include "gpu_util.h"
#include "model/loader.h"
#include "sparse/registry.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace spade::test {
namespace {

using namespace spade::eval;

// Per teacher-forced decode step, rel err of the logits. One decode row of a random bf16
// model measured 0.020-0.030 (H100; CudaEval.RandomModel), at the edge of the dense prefill
// bound 3e-2 that averages over many rows; the per-step bound of the other decode comparisons
// (test_cuda_twilight_model.cpp, the sparse model tests) is 5e-2. What this test guards, the
// eval plumbing (positions, pages, forced tokens), fails by O(1) when wrong.
constexpr double kTolLogits = 5e-2;
constexpr float kNearTie = 0.15f;    // CPU top-2 margin under which a greedy flip is accepted

float top2_margin(const float* lg, int V) {
  std::vector<float> t(lg, lg + V);
  std::nth_element(t.begin(), t.begin() + 1, t.end(), std::greater<float>());
  return t[0] - t[1];
}

// Greedy `full` on the GPU (CudaDecoder) and on the CPU (SharedPrefill) from `prompt`, then
// both teacher-forced along the CPU's tokens. `strict`: a greedy divergence must sit at a
// CPU near-tie (real weights; random weights only report it). Returns the equal prefix.
int compare_full(const ModelWeights& w, CudaDecoder& gpu, SharedPrefill& cpu,
                 const std::vector<int32_t>& prompt, int64_t max_new,
                 const std::vector<int32_t>& stop, const char* what, bool strict) {
  const int V = w.config.vocab;
  auto full = sparse::make_method(sparse::SparseConfig::parse_spec("full"), w.config);
  DecodeOptions opt;
  opt.max_new = max_new;
  opt.stop = stop;
  std::vector<float> margin;
  opt.on_logits = [&](int64_t, const float* lg) { margin.push_back(top2_margin(lg, V)); };
  cpu.prefill(prompt);
  const DecodeResult c = cpu.decode(full, opt);
  opt.on_logits = nullptr;
  const DecodeResult g = gpu.decode("full", CudaSparse{}, prompt, opt);
  EXPECT_TRUE(g.gpu);
  EXPECT_GT(g.prefill_seconds, 0.0);
  EXPECT_EQ(gpu.pages_in_use(), 0) << what << ": pages released after the decode";
  size_t div = 0;
  while (div < c.tokens.size() && div < g.tokens.size() && c.tokens[div] == g.tokens[div]) ++div;
  if (div < c.tokens.size() || div < g.tokens.size()) {
    const size_t i = std::min(div, margin.size() - 1);
    std::printf("[ eval ] %s: greedy diverges at %zu, CPU top-2 margin %.4f\n", what, div,
                margin[i]);
    if (strict) {
      EXPECT_LT(margin[i], kNearTie) << what << ": divergence at a clear CPU argmax";
    }
  }
  // Teacher forced along the CPU's tokens: per-step logits.
  std::vector<std::vector<float>> lc;
  DecodeOptions tf;
  tf.max_new = int64_t(c.tokens.size());
  tf.forced = &c.tokens;
  tf.on_logits = [&](int64_t, const float* lg) { lc.emplace_back(lg, lg + V); };
  cpu.decode(full, tf);
  double worst = 0;
  int argmax_agree = 0;
  tf.on_logits = [&](int64_t i, const float* lg) {
    const auto& ref = lc[size_t(i)];
    const double e = rel_err(lg, ref.data(), size_t(V));
    worst = std::max(worst, e);
    EXPECT_LT(e, kTolLogits) << what << " step " << i;
    argmax_agree += argmax(lg, V) == argmax(ref.data(), V);
  };
  const DecodeResult gt = gpu.decode("full", CudaSparse{}, prompt, tf);
  EXPECT_EQ(gt.tokens, c.tokens);
  std::printf("[ eval ] %s (%zu prompt tokens): greedy equal %zu/%zu; teacher forced %zu steps: "
              "worst logits rel err %.3g, argmax agree %d\n",
              what, prompt.size(), div, c.tokens.size(), lc.size(), worst, argmax_agree);
  return int(div);
}

// Random bf16-rounded weights (no tokenizer, no model file): always runs on a GPU.
TEST(CudaEval, RandomModelFullMatchesCpuPath) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = tiny_config(Arch::Llama, 64, 3, 2048);
  ModelWeights w = random_model(c, 21);
  round_weights_bf16(w);
  CudaDecoder gpu(w, 1200, 16, 16, 256);
  SharedPrefill cpu(w, 1200, 16, 16, 256);
  std::mt19937 rng(9);
  for (int n : {40, 300, 1100}) {
    const auto prompt = random_tokens(rng, n, c.vocab);
    compare_full(w, gpu, cpu, prompt, 16, {}, ("random n=" + std::to_string(n)).c_str(), false);
  }
  EXPECT_EQ(gpu.models(), 1u);
}

std::string model_path() {
  if (const char* p = std::getenv("SPADE_MODEL")) return p;
  return source_dir() + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
}

// SmolLM2-135M on eval task prompts: GPU `full` vs the CPU path, then a mixed sweep through
// EvalRunner (--device cuda): GPU runs for methods with a GPU path, the CPU for the others,
// and GPU methods whose budget covers the prompt decode exactly GPU full attention's tokens.
TEST(CudaEval, SmolLM2TaskPromptsMatchCpuPath) {
  SKIP_WITHOUT_GPU();
  const std::string path = model_path();
  if (!std::ifstream(path).good()) GTEST_SKIP() << "model not found: " << path;
  auto w = load_model(path);
  round_weights_bf16(*w);
  auto tok = Tokenizer::load(path);
  const ChatTemplate* tmpl = tok->chat_template();
  ASSERT_NE(tmpl, nullptr);
  std::ifstream tf(source_dir() + "/tests/fixtures/sparse/genesis_1_3.txt");
  std::stringstream ss;
  ss << tf.rdbuf();
  std::vector<std::string> hay;
  for (std::string l; std::getline(ss, l);)
    if (!l.empty()) hay.push_back(l);
  ASSERT_GT(hay.size(), 20u);
  auto count = [&](const std::string& user, const std::string& prefix) {
    return int64_t(tok->encode(render_prompt(*tmpl, user, prefix), false, true).size());
  };
  const int64_t L = 448, N = 16;
  CudaDecoder gpu(*w, L, N, 16, 1024);
  SharedPrefill cpu(*w, L, N, 16, 1024, tok.get());
  const auto runs = expand_methods("full;quest;streaming;lycheecluster;quest:page_size=32", {4096});
  const auto place = place_runs(runs, Device::CUDA, [&](const MethodRun& r) {
    return gpu_config_error(r, w->config, 16);
  });
  std::vector<std::shared_ptr<const sparse::SparseMethod>> methods;
  for (size_t i = 0; i < runs.size(); ++i)
    methods.push_back(place[i].gpu ? nullptr : sparse::make_method(runs[i].config, w->config));
  std::printf("[ eval ] placement: %s\n", placement_line(runs, place).c_str());
  EXPECT_TRUE(place[0].gpu && place[1].gpu && place[2].gpu && place[3].gpu);
  EXPECT_FALSE(place[4].gpu);  // quest with pages of 32: the GPU refuses it, the CPU runs it
  RunnerOptions ro;
  ro.max_prompt = L;
  ro.max_new = N;
  EvalRunner runner(*w, runs, place, methods, ro, tok.get());
  for (const std::string task : {"niah_single_number", "variable_tracking", "json_lookup"}) {
    const TaskSample s = make_task(task, L, mix_seed(1, task, L, 0), hay, count);
    const auto prompt = tok->encode(render_prompt(*tmpl, s.user, s.answer_prefix), false, true);
    ASSERT_LE(int64_t(prompt.size()), L);
    compare_full(*w, gpu, cpu, prompt, N, tok->eos_ids(), task.c_str(), true);
    runner.set_prompt(prompt);
    DecodeOptions opt;
    opt.max_new = N;
    opt.stop = tok->eos_ids();
    const DecodeResult ref = runner.decode(0, opt);
    EXPECT_TRUE(ref.gpu);
    for (size_t m = 1; m < runs.size(); ++m) {
      const DecodeResult r = runner.decode(m, opt);
      EXPECT_EQ(r.gpu, place[m].gpu) << runs[m].label;
      EXPECT_STREQ(runner.backend(m), place[m].gpu ? "cuda" : "cpu");
      // Budget >= prompt: every GPU method decodes GPU full attention's tokens; the CPU run
      // is compared with the CPU's full attention.
      const DecodeResult own_full = runner.decode_full(m, opt);
      EXPECT_EQ(own_full.gpu, r.gpu);
      EXPECT_EQ(r.tokens, own_full.tokens) << task << " " << runs[m].label;
      if (r.gpu) {
        EXPECT_EQ(r.tokens, ref.tokens) << task << " " << runs[m].label;
      }
    }
  }
}

}  // namespace
}  // namespace spade::test
