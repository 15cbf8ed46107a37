// Device-to-device copy bandwidth (read + write bytes per second) of 2 GiB, median of 7: the
// bandwidth the benchmarks' byte floors divide by (bench_tpot, bench_tpot_batch).
#pragma once
#include <algorithm>
#include <vector>

#include "backend/cuda/cuda_common.h"

inline double copy_bandwidth() {
  const size_t n = size_t(2) << 30;
  void *a, *b;
  SPADE_CUDA(cudaMalloc(&a, n));
  SPADE_CUDA(cudaMalloc(&b, n));
  SPADE_CUDA(cudaMemset(a, 1, n));
  cudaEvent_t e0, e1;
  SPADE_CUDA(cudaEventCreate(&e0));
  SPADE_CUDA(cudaEventCreate(&e1));
  std::vector<float> ms;
  for (int i = 0; i < 7; ++i) {
    SPADE_CUDA(cudaEventRecord(e0));
    SPADE_CUDA(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice));
    SPADE_CUDA(cudaEventRecord(e1));
    SPADE_CUDA(cudaEventSynchronize(e1));
    float t;
    SPADE_CUDA(cudaEventElapsedTime(&t, e0, e1));
    ms.push_back(t);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaFree(a);
  cudaFree(b);
  std::sort(ms.begin(), ms.end());
  return 2.0 * n / (ms[3] * 1e-3);
}
