// Median per-call time (us) of f(r) with r cycling through R rotations (cache regions of which
// consecutive calls share none, so no call finds its bytes in L2): 2R + 2 warm-up calls, then
// 30 batches of calls between CUDA events (a multiple of R, at least 8). us_min (optional)
// gets the fastest batch. Used by bench_sparse and bench_gather_pattern.
#pragma once
#include <algorithm>
#include <functional>
#include <vector>

#include "backend/cuda/cuda_common.h"

inline double time_calls(int R, const std::function<void(int)>& f, float* us_min = nullptr) {
  for (int i = 0; i < 2 * R + 2; ++i) f(i % R);
  SPADE_CUDA(cudaDeviceSynchronize());
  const int calls = std::max(R, 8) / R * R;
  cudaEvent_t a, b;
  SPADE_CUDA(cudaEventCreate(&a));
  SPADE_CUDA(cudaEventCreate(&b));
  std::vector<float> per;
  for (int rep = 0; rep < 30; ++rep) {
    SPADE_CUDA(cudaEventRecord(a));
    for (int i = 0; i < calls; ++i) f(i % R);
    SPADE_CUDA(cudaEventRecord(b));
    SPADE_CUDA(cudaEventSynchronize(b));
    float ms = 0;
    SPADE_CUDA(cudaEventElapsedTime(&ms, a, b));
    per.push_back(ms * 1000.f / calls);
  }
  SPADE_CUDA(cudaGetLastError());
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(per.begin(), per.end());
  if (us_min) *us_min = per.front();
  return per[per.size() / 2];
}
