// End to end on the real SmolLM2-135M-Instruct (skipped when models/ lacks it): one dense
// prefill of a ~300-token real prompt, then greedy decoding with every method from forks of
// that cache. With budget >= length every method's tokens and logits equal full
// attention's; at a small budget the logits differ and recall < 1 is reported.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <sstream>

#include "engine/sampler.h"
#include "model/cpu_model.h"
#include "model/loader.h"
#include "sparse/registry.h"
#include "sparse/session.h"
#include "test_util.h"
#include "tokenizer/tokenizer.h"

using namespace spade;
using namespace spade::sparse;

namespace {

const char* kSmol = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

struct Decoded {
  std::vector<int32_t> tokens;
  std::vector<std::vector<float>> logits;  // per decode step
  SessionTotals totals;
};

Decoded decode(CpuModel& model, KVPool& kv, const PageTable& base, const std::vector<float>& first,
               const std::string& spec, int n) {
  const ModelConfig& c = model.config();
  PageTable pt = kv.fork(base);
  SparseConfig sc = SparseConfig::parse_spec(spec);
  SparseSession s(make_method(sc, c), c, kv, {true, true});
  Decoded d;
  int32_t t = argmax(first.data(), c.vocab);
  std::vector<int64_t> row_of;
  for (int i = 0; i < n; ++i) {
    d.tokens.push_back(t);
    std::vector<SeqInput> b = {{&pt, &d.tokens.back(), 1, false, &s.attention()}};
    const auto& lg = model.forward(b, row_of);
    d.logits.emplace_back(lg.begin(), lg.begin() + c.vocab);
    t = argmax(d.logits.back().data(), c.vocab);
  }
  d.totals = s.totals();
  kv.release(pt);
  return d;
}

}  // namespace

TEST(SparseSmolLM2, EveryMethodDecodesAndFullBudgetEqualsFullAttention) {
  const std::string path = test::source_dir() + "/" + kSmol;
  if (!std::ifstream(path).good()) GTEST_SKIP() << kSmol << " not present; fetch it with `bash scripts/fetch_model.sh`";
  auto w = load_model(path);
  auto tok = Tokenizer::load(path);
  const ModelConfig& c = w->config;
  std::ifstream tf(test::source_dir() + "/tests/fixtures/sparse/genesis_1_3.txt");
  std::stringstream ss;
  ss << tf.rdbuf();
  std::string text = ss.str().substr(0, 1100);
  text = text.substr(0, text.rfind('\n'));
  std::string prompt_text = tok->chat_template()->render(
      {{"user", text + "\n\nQuestion: What did God call the light?"}}, true);
  std::vector<int32_t> prompt = tok->encode(prompt_text, false, true);
  ASSERT_GT(prompt.size(), 200u);
  ASSERT_LT(prompt.size(), 400u);
  const int n = 10;
  KVPool kv({c.n_layers, c.n_kv_heads, c.head_dim, 16}, int64_t(prompt.size()) / 16 + 8);
  CpuModel model(*w, kv);
  PageTable base;
  std::vector<int64_t> row_of;
  std::vector<SeqInput> b = {{&base, prompt.data(), int64_t(prompt.size()), false, nullptr}};
  const auto& lg = model.forward(b, row_of);
  std::vector<float> first(lg.begin(), lg.begin() + c.vocab);

  Decoded full = decode(model, kv, base, first, "full", n);
  const std::string full_text = tok->decode(full.tokens, true);
  std::printf("  L=%zu  full: %s\n", prompt.size(), full_text.c_str());
  EXPECT_GT(full.tokens.size(), 0u);

  const std::vector<std::string> methods = {"streaming", "quest", "tidal", "lessismore", "oracle-topk"};
  for (const auto& m : methods) {
    Decoded d = decode(model, kv, base, first, m + ":budget=4096", n);
    EXPECT_EQ(d.tokens, full.tokens) << m;
    for (int i = 0; i < n; ++i) EXPECT_EQ(d.logits[size_t(i)], full.logits[size_t(i)]) << m << " step " << i;
    EXPECT_EQ(d.totals.mean_density(), 1.0) << m;
    EXPECT_EQ(d.totals.mean_recall(), 1.0) << m;
  }
  for (const auto& spec : {std::string("streaming:budget=32"), std::string("quest:budget=32"),
                           std::string("tidal:budget=32"), std::string("lessismore:budget=32"),
                           std::string("oracle-topk:budget=32"), std::string("oracle-topp:p=0.8")}) {
    Decoded d = decode(model, kv, base, first, spec, n);
    double md = 0;
    for (int j = 0; j < c.vocab; ++j) md = std::max(md, double(std::abs(d.logits[0][size_t(j)] - full.logits[0][size_t(j)])));
    EXPECT_GT(md, 1e-3) << spec;  // the first sparse step already changes the logits
    EXPECT_LT(d.totals.mean_recall(), 1.0) << spec;
    EXPECT_GT(d.totals.mean_recall(), 0.3) << spec;
    EXPECT_LT(d.totals.mean_sparse_density(), 0.5) << spec;
    std::printf("  %-22s density %.3f (sparse layers %.3f) recall %.3f (sparse layers %.3f) max|dlogit| %.3f tokens %s: %s\n",
                spec.c_str(), d.totals.mean_density(), d.totals.mean_sparse_density(),
                d.totals.mean_recall(), d.totals.mean_sparse_recall(), md,
                d.tokens == full.tokens ? "same" : "differ", tok->decode(d.tokens, true).c_str());
  }
  kv.release(base);
  EXPECT_EQ(kv.free_pages(), kv.n_pages());
}
