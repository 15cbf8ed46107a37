// Long-generation helpers (eval/longgen.h): the top-K reference row and the bucketed KL against
// an exact KL on random distributions.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "eval/longgen.h"

using namespace spade::eval;

namespace {
std::vector<float> random_logp(int V, uint32_t seed, float spread) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.f, spread);
  std::vector<float> lg(static_cast<size_t>(V)), lp;
  for (auto& x : lg) x = n(rng);
  log_softmax_into(lg.data(), V, lp);
  return lp;
}
double exact_kl(const std::vector<float>& p, const std::vector<float>& q) {
  double kl = 0;
  for (size_t i = 0; i < p.size(); ++i) kl += std::exp(double(p[i])) * (double(p[i]) - double(q[i]));
  return kl;
}
}  // namespace

TEST(EvalLongGen, TopLogpKeepsTheMostLikelyTokensAndTheTailMass) {
  const auto lp = random_logp(500, 1, 2.f);
  const TopLogp t = top_logp(lp, 20);
  ASSERT_EQ(t.ids.size(), 20u);
  double kept = 0;
  for (size_t j = 0; j < t.ids.size(); ++j) {
    EXPECT_EQ(t.logp[j], lp[size_t(t.ids[j])]);
    if (j) {
      EXPECT_GE(t.logp[j - 1], t.logp[j]);
    }
    kept += std::exp(double(t.logp[j]));
  }
  for (size_t i = 0; i < lp.size(); ++i)  // nothing outside is more likely than the last kept
    if (std::find(t.ids.begin(), t.ids.end(), int32_t(i)) == t.ids.end()) {
      EXPECT_LE(lp[i], t.logp.back());
    }
  EXPECT_NEAR(t.tail + kept, 1.0, 1e-5);
  EXPECT_EQ(top_logp(lp, 4096).ids.size(), 500u);  // K past V: the whole row
  EXPECT_NEAR(top_logp(lp, 4096).tail, 0.0, 1e-5);
}

TEST(EvalLongGen, BucketKlIsExactOverTheWholeVocabularyAndALowerBoundOtherwise) {
  for (uint32_t seed = 0; seed < 20; ++seed) {
    const int V = 300;
    const auto p = random_logp(V, 100 + seed, 2.5f), q = random_logp(V, 200 + seed, 2.5f);
    const double exact = exact_kl(p, q);
    EXPECT_NEAR(bucket_kl(top_logp(p, V), q), exact, 1e-5 * (1 + exact));
    double prev = 0;
    for (int K : {1, 8, 64, 256}) {
      const double b = bucket_kl(top_logp(p, K), q);
      EXPECT_GE(b, -1e-12);
      EXPECT_LE(b, exact + 1e-6) << "K " << K;
      EXPECT_GE(b, prev - 1e-6) << "K " << K;  // a finer partition never lowers it
      prev = b;
    }
    EXPECT_NEAR(bucket_kl(top_logp(p, 64), p), 0.0, 1e-6);  // identical distributions
  }
}

TEST(EvalLongGen, WindowMeans) {
  EXPECT_EQ(window_means({1, 2, 3, 4, 5}, 2), (std::vector<double>{1.5, 3.5, 5}));
  EXPECT_EQ(window_means({}, 4), std::vector<double>{});
  EXPECT_ANY_THROW(window_means({1}, 0));
}
