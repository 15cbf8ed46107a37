// Argument checks of the kernel API (ops.h) that the CPU paths (ops.cpp) and the CUDA entry
// points (ops_cuda.cpp) share; each throws spade::Error naming the offending entry.
#pragma once
#include <cstdint>

#include "api/ops.h"

namespace spade::api::ops::detail {

// Pages of a request of `len` tokens.
int64_t pages_of(int64_t len, int P);
// kv_indptr starts at 0 and never decreases, every request has >= 1 token and enough pages,
// every page id lies in the cache.
void check_paged(const Paged& kv);
// n_starts >= 2 strictly increasing chunk starts from >= 0, the last <= L.
void check_starts(const int32_t* starts, int32_t n_starts, int64_t L);

}  // namespace spade::api::ops::detail
