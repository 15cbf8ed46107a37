// Long-generation comparison helpers (longgen.h).
#include "eval/longgen.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.h"

namespace spade::eval {

double log_softmax_into(const float* lg, int V, std::vector<float>& out) {
  out.resize(size_t(V));
  float mx = lg[0];
  for (int v = 1; v < V; ++v) mx = std::max(mx, lg[v]);
  double sum = 0;
  for (int v = 0; v < V; ++v) sum += std::exp(double(lg[v]) - mx);
  const double lse = double(mx) + std::log(sum);
  for (int v = 0; v < V; ++v) out[size_t(v)] = float(double(lg[v]) - lse);
  return lse;
}

TopLogp top_logp(const std::vector<float>& logp, int K) {
  SPADE_CHECK(K >= 1 && !logp.empty(), "top_logp: empty row or K < 1");
  const int V = int(logp.size());
  const int k = std::min(K, V);
  std::vector<int32_t> idx(static_cast<size_t>(V));
  std::iota(idx.begin(), idx.end(), 0);
  // Descending log-prob, ties by lower id (a fixed order).
  auto better = [&](int32_t a, int32_t b) {
    return logp[size_t(a)] > logp[size_t(b)] || (logp[size_t(a)] == logp[size_t(b)] && a < b);
  };
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), better);
  TopLogp t;
  t.ids.assign(idx.begin(), idx.begin() + k);
  double kept = 0;
  for (int32_t i : t.ids) {
    t.logp.push_back(logp[size_t(i)]);
    kept += std::exp(double(logp[size_t(i)]));
  }
  t.tail = std::max(0.0, 1.0 - kept);
  return t;
}

double bucket_kl(const TopLogp& ref, const std::vector<float>& m) {
  double kl = 0, m_kept = 0;
  for (size_t j = 0; j < ref.ids.size(); ++j) {
    const double lp = ref.logp[j], lq = m[size_t(ref.ids[j])];
    kl += std::exp(lp) * (lp - lq);
    m_kept += std::exp(lq);
  }
  if (ref.ids.size() < m.size() && ref.tail > 0) {
    const double q_tail = std::max(1e-300, 1.0 - m_kept);
    kl += ref.tail * (std::log(ref.tail) - std::log(q_tail));
  }
  return std::max(0.0, kl);
}

std::vector<double> window_means(const std::vector<double>& v, int64_t w) {
  SPADE_CHECK(w >= 1, "window_means: window must be >= 1");
  std::vector<double> out;
  for (size_t i = 0; i < v.size(); i += size_t(w)) {
    const size_t e = std::min(v.size(), i + size_t(w));
    double s = 0;
    for (size_t j = i; j < e; ++j) s += v[j];
    out.push_back(s / double(e - i));
  }
  return out;
}

}  // namespace spade::eval
