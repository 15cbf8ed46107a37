#include "sparse/cache_correction.h"

#include "core/error.h"

namespace spade::sparse {

CacheCorrection::CacheCorrection(int64_t every) : every_(every) {
  SPADE_CHECK(every >= 1, "cache correction: interval must be at least 1");
  pending_.reserve(size_t(every));
}

bool CacheCorrection::after_decode(const Forward& forward, PageTable& pt, int32_t token,
                                   MethodState* device_state) {
  pending_.push_back(token);
  if (int64_t(pending_.size()) < every_) return false;
  const int64_t n = int64_t(pending_.size());
  SPADE_CHECK(pt.length >= n, "cache correction: the page table holds ", pt.length,
              " tokens, fewer than the ", n, " to correct");
  const int64_t end = pt.length;
  pt.length = end - n;  // the chunk rewrites positions [end - n, end)
  SeqInput in{&pt, pending_.data(), n, false, nullptr, device_state};
  in.dense = true;  // a one-token chunk (every = 1) must not be taken for a sparse decode row
  try {
    forward(in);
  } catch (...) {
    pt.length = end;
    throw;
  }
  SPADE_CHECK(pt.length == end, "cache correction: length mismatch");
  pending_.clear();
  ++corrections_;
  return true;
}

}  // namespace spade::sparse
