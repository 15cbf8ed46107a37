// `spade eval` on the real SmolLM2-135M-Instruct (skipped when models/ lacks it): task
// prompts through the chat template, one dense prefill shared by every method, and with a
// budget >= the prompt length every method decodes exactly full attention's tokens and so
// scores exactly what full attention scores. Kept small (short prompts, few tokens) for CI.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "eval/decode.h"
#include "eval/rng.h"
#include "eval/scoring.h"
#include "eval/tasks.h"
#include "model/loader.h"
#include "sparse/registry.h"
#include "test_util.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

using namespace spade;
using namespace spade::eval;

TEST(EvalModel, FullBudgetScoresExactlyWhatFullAttentionScores) {
  const std::string path = test::source_dir() + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
  if (!std::ifstream(path).good()) GTEST_SKIP() << "SmolLM2 not present; fetch it with `bash scripts/fetch_model.sh`";
  auto w = load_model(path);
  auto tok = Tokenizer::load(path);
  const ChatTemplate* tmpl = tok->chat_template();
  ASSERT_NE(tmpl, nullptr);
  std::ifstream tf(test::source_dir() + "/tests/fixtures/sparse/genesis_1_3.txt");
  std::stringstream ss;
  ss << tf.rdbuf();
  std::vector<std::string> hay;
  for (std::string l; std::getline(ss, l);)
    if (!l.empty()) hay.push_back(l);
  ASSERT_GT(hay.size(), 20u);
  auto count = [&](const std::string& user, const std::string& prefix) {
    return int64_t(tok->encode(render_prompt(*tmpl, user, prefix), false, true).size());
  };
  const int64_t L = 448;
  SharedPrefill sp(*w, L, 16, 16, 1024, tok.get());
  const ModelConfig& c = w->config;
  auto full = sparse::make_method(sparse::SparseConfig::parse_spec("full"), c);
  const std::vector<std::string> specs = {"streaming", "quest", "tidal", "lessismore",
                                          "oracle-topk", "lycheecluster"};
  for (const std::string task : {"niah_single_number", "variable_tracking", "json_lookup"}) {
    const TaskSample s = make_task(task, L, mix_seed(1, task, L, 0), hay, count);
    const auto prompt = tok->encode(render_prompt(*tmpl, s.user, s.answer_prefix), false, true);
    ASSERT_LE(int64_t(prompt.size()), L);
    ASSERT_GT(int64_t(prompt.size()), L - 64) << task;
    sp.prefill(prompt);
    DecodeOptions opt;
    opt.max_new = 8;
    opt.stop = tok->eos_ids();
    const DecodeResult ref = sp.decode(full, opt);
    const std::string ref_text = tok->decode(ref.tokens, true);
    const double ref_score = score_answer(s, ref_text);
    std::printf("  %s (%zu tokens): full answers '%s' (expected %s), score %.2f\n", task.c_str(),
                prompt.size(), ref_text.c_str(), s.answers[0].c_str(), ref_score);
    for (const auto& spec : specs) {
      auto m = sparse::make_method(sparse::SparseConfig::parse_spec(spec + ":budget=4096"), c);
      const DecodeResult r = sp.decode(m, opt);
      EXPECT_EQ(r.tokens, ref.tokens) << task << " " << spec;
      EXPECT_EQ(score_answer(s, tok->decode(r.tokens, true)), ref_score) << task << " " << spec;
      EXPECT_EQ(r.totals.mean_density(), 1.0) << task << " " << spec;
    }
  }
  EXPECT_EQ(sp.kv().free_pages() + (sp.length() + 15) / 16, sp.kv().n_pages());
}
