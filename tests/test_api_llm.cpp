// spade::api::LLM (src/api/llm.h), the library entry point the Python package binds, on the
// stories260k fixture: greedy completions equal in a batch and alone, per-prompt methods and
// sampling parameters, logprobs, stop handling, and clear errors that name the prompt.
#include <gtest/gtest.h>

#include <cmath>

#include "api/llm.h"
#include "core/error.h"
#include "test_util.h"

using namespace spade;
using namespace spade::api;

namespace {
const std::string kModel = test::source_dir() + "/tests/fixtures/models/stories260k-hf";

GenerateParams greedy(int64_t n, std::string sparse = "") {
  GenerateParams g;
  g.max_tokens = n;
  g.ignore_eos = true;
  g.sparse = std::move(sparse);
  return g;
}

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(ApiLLM, GreedyCompletionsAreTheSameInABatchAndAlone) {
  LLM llm(kModel, {});
  EXPECT_EQ(llm.device(), "cpu");
  const std::vector<std::string> prompts = {"Once upon a time", "The little dog", "Lily and Tom went"};
  const auto batch = llm.generate(prompts, {greedy(24)});
  ASSERT_EQ(batch.size(), 3u);
  for (size_t i = 0; i < prompts.size(); ++i) {
    const auto alone = llm.generate({prompts[i]}, {greedy(24)});
    EXPECT_EQ(batch[i].token_ids, alone[0].token_ids) << prompts[i];
    EXPECT_EQ(batch[i].token_ids.size(), 24u);
    EXPECT_EQ(batch[i].finish_reason, "length");
    EXPECT_EQ(batch[i].prompt_token_ids, llm.encode(prompts[i]));
    // The text continues the prompt's (a leading space is kept).
    std::vector<int32_t> all = batch[i].prompt_token_ids;
    all.insert(all.end(), batch[i].token_ids.begin(), batch[i].token_ids.end());
    EXPECT_EQ(llm.decode(batch[i].prompt_token_ids) + batch[i].text, llm.decode(all));
  }
  // generate_ids of the same ids gives the same tokens.
  EXPECT_EQ(llm.generate_ids({llm.encode(prompts[0])}, {greedy(24)})[0].token_ids, batch[0].token_ids);
}

TEST(ApiLLM, EachPromptItsOwnMethodAndParameters) {
  LLM llm(kModel, {});
  const std::string p = "Once upon a time there was a little girl. She liked to play in the park with her dog.";
  const auto out = llm.generate({p, p, p}, {greedy(40), greedy(40, "streaming:budget=16"), greedy(7)});
  EXPECT_EQ(out[0].token_ids.size(), 40u);
  EXPECT_EQ(out[2].token_ids.size(), 7u);
  EXPECT_EQ(std::vector<int32_t>(out[0].token_ids.begin(), out[0].token_ids.begin() + 7), out[2].token_ids);
  // A 16-token window over a ~60-token context reads less than full attention.
  EXPECT_GT(out[1].density, 0.0);
  EXPECT_LT(out[1].density, 0.6);
  EXPECT_NEAR(out[0].density, 1.0, 1e-9);
  EXPECT_EQ(llm.generate({p}, {greedy(40, "streaming:budget=16")})[0].token_ids, out[1].token_ids);
  // Sampling: a seed repeats, temperature 1 differs from greedy somewhere in 3 tries.
  GenerateParams s = greedy(30);
  s.temperature = 1.f;
  s.seed = 7;
  const auto a = llm.generate({p}, {s}), b = llm.generate({p}, {s});
  EXPECT_EQ(a[0].token_ids, b[0].token_ids);
  bool differs = false;
  for (uint64_t seed = 1; seed <= 3 && !differs; ++seed) {
    s.seed = seed;
    differs = llm.generate({p}, {s})[0].token_ids != out[0].token_ids;
  }
  EXPECT_TRUE(differs);
}

TEST(ApiLLM, LogprobsAndStops) {
  LLM llm(kModel, {});
  GenerateParams g = greedy(12);
  g.logprobs = 3;
  const auto out = llm.generate({"Once upon a time"}, {g});
  ASSERT_EQ(out[0].logprobs.size(), out[0].token_ids.size());
  for (size_t i = 0; i < out[0].token_ids.size(); ++i) {
    ASSERT_EQ(out[0].top_logprobs[i].size(), 3u);
    EXPECT_EQ(out[0].top_logprobs[i][0].first, out[0].token_ids[i]);  // greedy: the best
    EXPECT_NEAR(out[0].top_logprobs[i][0].second, out[0].logprobs[i], 1e-6);
    EXPECT_LE(out[0].logprobs[i], 0.f);
  }
  // A stop token id ends the completion with "stop" before max_tokens.
  GenerateParams st = greedy(12);
  st.stop_token_ids = {out[0].token_ids[5]};
  const auto stopped = llm.generate({"Once upon a time"}, {st});
  EXPECT_EQ(stopped[0].finish_reason, "stop");
  EXPECT_LE(stopped[0].token_ids.size(), 6u);
}

TEST(ApiLLM, BadInputIsAClearErrorNamingThePrompt) {
  EXPECT_NE(error_of([] { LLM x(kModel + "/missing", {}); }).find("missing"), std::string::npos);
  LLMOptions bad;
  bad.device = "tpu";
  EXPECT_NE(error_of([&] { LLM x(kModel, bad); }).find("device"), std::string::npos);
  LLM llm(kModel, {});
  EXPECT_NE(error_of([&] { llm.generate({"a", "b"}, {greedy(4), greedy(4, "quest:budget=-3")}); })
                .find("prompt 1"),
            std::string::npos);
  EXPECT_NE(error_of([&] { llm.generate({"a"}, {greedy(4, "nosuchmethod")}); }).find("nosuchmethod"),
            std::string::npos);
  EXPECT_NE(error_of([&] { llm.generate({"a", "b", "c"}, {greedy(4), greedy(4)}); }).find("one per prompt"),
            std::string::npos);
  EXPECT_NE(error_of([&] { llm.generate_ids({{}}, {greedy(4)}); }).find("empty"), std::string::npos);
  EXPECT_NE(error_of([&] { llm.generate_ids({{1, 99999}}, {greedy(4)}); }).find("outside the vocabulary"),
            std::string::npos);
  GenerateParams g = greedy(4);
  g.top_p = 0;
  EXPECT_NE(error_of([&] { llm.generate({"a"}, {g}); }).find("top_p"), std::string::npos);
  GenerateParams longer = greedy(100000);
  EXPECT_FALSE(error_of([&] { llm.generate({"a"}, {longer}); }).empty());  // past the context
  // The LLM still works after errors.
  EXPECT_EQ(llm.generate({"a"}, {greedy(3)})[0].token_ids.size(), 3u);
}
