#include <algorithm>

#include "backend/cpu/attention.h"
#include "sparse/method.h"

namespace spade::sparse {

const float* StepContext::full_weights() {
  if (has_full_weights()) return weights_.data();
  if (weights_.size() < size_t(Hq) * size_t(L)) weights_.resize(size_t(Hq) * size_t(L));
  cpu::attention_weights_full(*kv, layer, *pt, q, Hq, scale, L, weights_.data(),
                              *attention_scratch);
  weights_layer_ = layer;
  weights_step_ = step;
  return weights_.data();
}

void StepContext::reserve(int64_t n) {
  const size_t N = size_t(std::max<int64_t>(1, n));
  weights_.reserve(size_t(Hq) * N);
  scratch.f0.reserve(N);
  scratch.f1.reserve(std::max(N, size_t(2 * D)));
  scratch.i0.reserve(N);
  scratch.i1.reserve(size_t(Hq) * N);
  scratch.i2.reserve(N);
  scratch.mark.reserve(N);
}

}  // namespace spade::sparse
