// Top-k over a contiguous range of positions, ranked by score (descending) with ties broken
// by the lower position; NaN ranks last. The order every method and test uses.
#pragma once
#include <cstdint>
#include <vector>

namespace spade::sparse {

// Writes the k best positions of [lo, hi) by score[pos] into idx[0..k) in rank order
// (best first); returns k' = min(k, hi - lo). `idx` grows to hi - lo and is reused.
int64_t top_k_range(const float* score, int32_t lo, int32_t hi, int64_t k,
                    std::vector<int32_t>& idx);

// True when position a ranks before position b.
inline bool ranks_before(const float* score, int32_t a, int32_t b) {
  const float x = score[a], y = score[b];
  const bool nx = x != x, ny = y != y;
  if (nx != ny) return ny;  // a number ranks before NaN
  if (nx) return a < b;
  return x > y || (x == y && a < b);
}

}  // namespace spade::sparse
