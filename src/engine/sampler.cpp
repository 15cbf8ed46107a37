#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.h"

namespace spade {

int32_t argmax(const float* logits, int32_t vocab) {
  int32_t best = 0;
  for (int32_t i = 1; i < vocab; ++i)
    if (logits[i] > logits[best]) best = i;
  return best;
}

int32_t Sampler::sample(const float* logits, int32_t vocab, const std::vector<int32_t>& history) {
  work_.assign(logits, logits + vocab);
  if (p_.repetition_penalty != 1.f) {
    seen_.assign(size_t(vocab), 0);
    for (int32_t t : history)
      if (t >= 0 && t < vocab && !seen_[size_t(t)]) {
        seen_[size_t(t)] = 1;
        float& l = work_[size_t(t)];
        l = l > 0 ? l / p_.repetition_penalty : l * p_.repetition_penalty;
      }
  }
  if (p_.temperature <= 0.f) return argmax(work_.data(), vocab);

  // Candidates sorted by logit (descending), cut by top-k.
  idx_.resize(size_t(vocab));
  std::iota(idx_.begin(), idx_.end(), 0);
  int32_t k = (p_.top_k > 0 && p_.top_k < vocab) ? p_.top_k : vocab;
  auto by_logit = [&](int32_t a, int32_t b) {
    return work_[size_t(a)] > work_[size_t(b)] || (work_[size_t(a)] == work_[size_t(b)] && a < b);
  };
  std::partial_sort(idx_.begin(), idx_.begin() + k, idx_.end(), by_logit);
  idx_.resize(size_t(k));

  // Softmax at temperature over the candidates.
  const float mx = work_[size_t(idx_[0])];
  double sum = 0;
  std::vector<double>& pr = probs_;
  pr.resize(idx_.size());
  for (size_t i = 0; i < idx_.size(); ++i) {
    pr[i] = std::exp(double(work_[size_t(idx_[i])] - mx) / double(p_.temperature));
    sum += pr[i];
  }
  for (double& x : pr) x /= sum;
  size_t keep = pr.size();
  if (p_.min_p > 0.f) {
    const double thr = double(p_.min_p) * pr[0];
    keep = 1;
    while (keep < pr.size() && pr[keep] >= thr) ++keep;
  }
  if (p_.top_p < 1.f) {
    double cum = 0;
    size_t n = 0;
    while (n < keep) {
      cum += pr[n++];
      if (cum >= double(p_.top_p)) break;
    }
    keep = std::max<size_t>(1, n);
  }
  double total = 0;
  for (size_t i = 0; i < keep; ++i) total += pr[i];
  std::uniform_real_distribution<double> u(0.0, total);
  double r = u(rng_), acc = 0;
  for (size_t i = 0; i < keep; ++i) {
    acc += pr[i];
    if (r < acc) return idx_[i];
  }
  return idx_[keep - 1];
}

}  // namespace spade
