// Long generation against full attention (`spade eval longgen`, docs/eval.md): a short prompt,
// then thousands of decoded tokens. Full attention's greedy tokens are the reference; each
// method is run free (where its text first diverges) and teacher-forced along the reference
// (per-step KL(full || method), top-1 agreement, perplexity of the reference tokens, density
// and recall). A reference step's distribution over a 49K vocabulary for 8K steps would take
// 1.6 GB, so each step keeps its top-K log-probabilities and one bucket for the rest.
#pragma once
#include <cstdint>
#include <vector>

namespace spade::eval {

constexpr int kLongGenTopK = 1024;

// One reference step: its K most likely tokens (descending) with their log-probabilities, and
// the probability mass of all the other tokens (the tail bucket).
struct TopLogp {
  std::vector<int32_t> ids;
  std::vector<float> logp;
  double tail = 0;
};

// Log-softmax of logits [V] into logp (resized), returns log-sum-exp.
double log_softmax_into(const float* logits, int V, std::vector<float>& logp);
// The top min(K, V) tokens of a log-softmax row and the tail mass.
TopLogp top_logp(const std::vector<float>& logp, int K);
// KL(ref || method) over ref's top tokens plus one bucket holding every other token
// (method_logp: the method's log-softmax [V]). Exact when the top tokens are the whole
// vocabulary; otherwise the KL of the two distributions with the tail merged, which by the
// log-sum inequality never exceeds the full KL (a lower bound).
double bucket_kl(const TopLogp& ref, const std::vector<float>& method_logp);
// Means of v over consecutive windows of `w` entries (the last one may be shorter).
std::vector<double> window_means(const std::vector<double>& v, int64_t w);

}  // namespace spade::eval
