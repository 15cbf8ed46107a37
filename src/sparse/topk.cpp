#include "sparse/topk.h"

#include <algorithm>

namespace spade::sparse {

int64_t top_k_range(const float* score, int32_t lo, int32_t hi, int64_t k,
                    std::vector<int32_t>& idx) {
  const int64_t n = std::max<int64_t>(0, int64_t(hi) - lo);
  k = std::clamp<int64_t>(k, 0, n);
  if (idx.size() < size_t(n)) idx.resize(size_t(n));
  for (int64_t i = 0; i < n; ++i) idx[size_t(i)] = int32_t(lo + i);
  auto cmp = [score](int32_t a, int32_t b) { return ranks_before(score, a, b); };
  if (k < n) std::nth_element(idx.begin(), idx.begin() + k, idx.begin() + n, cmp);
  std::sort(idx.begin(), idx.begin() + k, cmp);
  return k;
}

}  // namespace spade::sparse
