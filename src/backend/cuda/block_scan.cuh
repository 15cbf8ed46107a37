// Exclusive prefix sum of one int per thread over a whole CTA (any multiple of 32 threads up
// to 1024): warp scans with __shfl_up_sync, then a scan of the warp totals by warp 0.
// s_warp: 64 ints of shared memory. Returns the sum of v over the threads before this one;
// *total gets the sum over the block. Every thread must call it (it has barriers).
#pragma once
#include <cuda_runtime.h>

namespace spade::cuda {

__device__ __forceinline__ int block_exclusive_scan(int v, int* s_warp, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  int x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) s_warp[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int w = lane < n_warps ? s_warp[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += y;
    }
    s_warp[32 + lane] = w;  // inclusive prefix of warp sums
  }
  __syncthreads();
  const int before = (warp > 0 ? s_warp[32 + warp - 1] : 0) + x - v;
  *total = s_warp[32 + n_warps - 1];
  __syncthreads();
  return before;
}

}  // namespace spade::cuda
