// Logit parity with Hugging Face transformers (float64 reference on CPU, fixtures made by
// python/make_reference_logits.py; see docs/fixtures.md). For each case: logits at the
// checked prompt positions (chunked prefill through the paged cache) and the last position
// within an absolute tolerance, and the 32-token greedy continuation identical.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "engine/sampler.h"
#include "model/cpu_model.h"
#include "model/loader.h"
#include "test_util.h"

using namespace spade;
using json = nlohmann::json;

namespace {

std::vector<float> read_f32(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  EXPECT_TRUE(f.good()) << path;
  f.seekg(0, std::ios::end);
  std::vector<float> v(size_t(f.tellg()) / 4);
  f.seekg(0);
  f.read(reinterpret_cast<char*>(v.data()), std::streamsize(v.size() * 4));
  return v;
}

struct Case {
  const char* name;
  double tol;  // max |logit - reference| allowed (fp32 engine vs float64 reference)
};

class HfParity : public ::testing::TestWithParam<Case> {};

TEST_P(HfParity, LogitsAndGreedyMatchTransformers) {
  const Case c = GetParam();
  const std::string dir = test::source_dir() + "/tests/fixtures/reference/";
  json ref = json::parse(std::ifstream(dir + c.name + ".json"));
  const std::string model_path = test::source_dir() + "/" + ref["model"].get<std::string>();
  if (!std::filesystem::exists(model_path))
    GTEST_SKIP() << model_path << " is missing: run `bash scripts/fetch_model.sh` (make test does)";
  auto w = load_model(model_path);
  const ModelConfig& cfg = w->config;
  const int V = cfg.vocab;
  ASSERT_EQ(V, ref["vocab_size"].get<int>());
  auto prompt = ref["prompt_ids"].get<std::vector<int32_t>>();
  auto positions = ref["positions_checked"].get<std::vector<int64_t>>();
  auto pos_logits = read_f32(dir + ref["logits_at_positions"].get<std::string>());
  auto last_logits = read_f32(dir + ref["last_logits"].get<std::string>());
  auto greedy = ref["greedy_ids"].get<std::vector<int32_t>>();
  ASSERT_EQ(pos_logits.size(), positions.size() * size_t(V));

  const int64_t total = int64_t(prompt.size() + greedy.size());
  KVPool kv({cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 16}, (total + 15) / 16);
  CpuModel model(*w, kv);
  PageTable pt;
  std::vector<int64_t> row_of;
  // Uneven prefill chunks exercise the paged, chunked path; every row's logits are kept.
  std::vector<float> all(prompt.size() * size_t(V));
  const int64_t chunk = 97;
  for (int64_t off = 0; off < int64_t(prompt.size()); off += chunk) {
    int64_t n = std::min<int64_t>(chunk, int64_t(prompt.size()) - off);
    std::vector<SeqInput> b = {{&pt, prompt.data() + off, n, true, nullptr}};
    const auto& lg = model.forward(b, row_of);
    std::copy(lg.begin(), lg.begin() + n * V, all.begin() + off * V);
  }
  double worst = 0;
  for (size_t i = 0; i < positions.size(); ++i)
    for (int v = 0; v < V; ++v)
      worst = std::max(worst, std::abs(double(all[size_t(positions[i] * V + v)]) -
                                       pos_logits[i * size_t(V) + size_t(v)]));
  const float* last = all.data() + (prompt.size() - 1) * size_t(V);
  for (int v = 0; v < V; ++v) worst = std::max(worst, std::abs(double(last[v]) - last_logits[size_t(v)]));
  EXPECT_LE(worst, c.tol) << "max |logit diff| over positions " << ref["positions_checked"].dump();
  RecordProperty("max_abs_logit_diff", std::to_string(worst));
  std::printf("[parity] %s: max |logit - transformers| = %.3g (tolerance %.3g)\n", c.name, worst, c.tol);

  // Greedy continuation through single-token decode steps.
  std::vector<int32_t> got;
  int32_t tok = argmax(last, V);
  for (size_t i = 0; i < greedy.size(); ++i) {
    got.push_back(tok);
    std::vector<SeqInput> b = {{&pt, &got.back(), 1, false, nullptr}};
    const auto& lg = model.forward(b, row_of);
    tok = argmax(lg.data(), V);
  }
  EXPECT_EQ(got, greedy);
}

INSTANTIATE_TEST_SUITE_P(
    Fixtures, HfParity,
    ::testing::Values(Case{"smollm2_p1", 5e-4}, Case{"smollm2_p2", 5e-4}, Case{"smollm2_p3", 5e-4},
                      Case{"stories260k_p1", 5e-5}, Case{"tiny_qwen3", 5e-5},
                      Case{"tiny_qwen2", 5e-5}, Case{"tiny_llama3_rope", 5e-5}),
    [](const auto& info) { return std::string(info.param.name); });

}  // namespace
