#include <gtest/gtest.h>

#include <map>
#include <set>

#include "engine/sampler.h"

using namespace spade;

TEST(Sampler, GreedyIsArgmaxLowestIdOnTies) {
  std::vector<float> l = {0.1f, 2.f, -1.f, 2.f};
  Sampler s({});
  EXPECT_EQ(s.sample(l.data(), 4, {}), 1);
}

TEST(Sampler, TopKOneIsGreedyAtAnyTemperature) {
  std::vector<float> l = {0.1f, 0.3f, 0.2f, 0.25f};
  SamplingParams p;
  p.temperature = 5.f;
  p.top_k = 1;
  Sampler s(p);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(s.sample(l.data(), 4, {}), 1);
}

TEST(Sampler, SeededIsDeterministicAndFollowsDistribution) {
  std::vector<float> l = {std::log(0.5f), std::log(0.3f), std::log(0.2f)};
  SamplingParams p;
  p.temperature = 1.f;
  p.seed = 7;
  Sampler a(p), b(p);
  std::map<int, int> count;
  const int n = 20000;
  for (int i = 0; i < n; ++i) {
    int x = a.sample(l.data(), 3, {});
    EXPECT_EQ(x, b.sample(l.data(), 3, {}));
    count[x]++;
  }
  EXPECT_NEAR(count[0] / double(n), 0.5, 0.02);
  EXPECT_NEAR(count[1] / double(n), 0.3, 0.02);
  EXPECT_NEAR(count[2] / double(n), 0.2, 0.02);
}

TEST(Sampler, TopPKeepsSmallestNucleus) {
  // probs 0.5, 0.3, 0.15, 0.05: top_p 0.75 keeps {0, 1}.
  std::vector<float> l = {std::log(0.5f), std::log(0.3f), std::log(0.15f), std::log(0.05f)};
  SamplingParams p;
  p.temperature = 1.f;
  p.top_p = 0.75f;
  Sampler s(p);
  std::set<int> seen;
  for (int i = 0; i < 2000; ++i) seen.insert(s.sample(l.data(), 4, {}));
  EXPECT_EQ(seen, (std::set<int>{0, 1}));
}

TEST(Sampler, MinPDropsTokensBelowFractionOfTop) {
  std::vector<float> l = {std::log(0.5f), std::log(0.3f), std::log(0.15f), std::log(0.05f)};
  SamplingParams p;
  p.temperature = 1.f;
  p.min_p = 0.35f;  // threshold 0.175: keeps 0.5 and 0.3
  Sampler s(p);
  std::set<int> seen;
  for (int i = 0; i < 2000; ++i) seen.insert(s.sample(l.data(), 4, {}));
  EXPECT_EQ(seen, (std::set<int>{0, 1}));
}

TEST(Sampler, RepetitionPenaltyFollowsHfSemantics) {
  std::vector<float> l = {2.f, 1.5f, -1.f};
  SamplingParams p;
  p.repetition_penalty = 2.f;  // 2 -> 1 (seen), so 1.5 wins
  Sampler s(p);
  EXPECT_EQ(s.sample(l.data(), 3, {0, 0}), 1);
  EXPECT_EQ(l[0], 2.f);  // caller's logits untouched
}
