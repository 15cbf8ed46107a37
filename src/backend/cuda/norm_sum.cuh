// The RMSNorm's sum of squares in one fixed order, shared by the norm kernel (ops.cu) and the
// decode GEMVs that take the norm in (gemv.cu): the GEMV that writes the residual row (o, down)
// leaves the group sums, the GEMV that reads the normalized row (qkv, gate|up) finishes them and
// normalizes on the fly, and the norm kernel runs the same two stages itself, so the fused and
// the separate paths produce the same bits.
// Order: group g = elements 8g .. min(8g + 8, H) - 1, its sum an fmaf chain from 0 in element
// order (norm_group_ss); thread t < 256 of the block adds groups t, t + 256, ... in that order
// (from 0), warps 0-7 reduce by butterfly (xor 16, 8, 4, 2, 1), and thread 0 adds the 8 warp sums
// in warp order (norm_finish). The normalized element is bf16((x * scale) * w) with
// scale = rsqrtf(sum / H + eps).
#pragma once
#include <cuda_runtime.h>

namespace spade::cuda {

constexpr int kNormGroup = 8, kNormTreeThreads = 256;

__device__ __forceinline__ float norm_group_ss(const float (&v)[kNormGroup], int n) {
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < kNormGroup; ++i)
    if (i < n) s = fmaf(v[i], v[i], s);
  return s;
}

// Called by every thread of a block of >= 256 threads (it has two __syncthreads); gs(g) is group
// g's sum for g < G; red: >= 9 floats of shared memory. Returns the total to every thread.
template <typename GroupSum>
__device__ __forceinline__ float norm_finish(GroupSum gs, int G, float* red) {
  const int t = threadIdx.x;
  if (t < kNormTreeThreads) {
    float s = 0.f;
    for (int g = t; g < G; g += kNormTreeThreads) s += gs(g);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if ((t & 31) == 0) red[t >> 5] = s;
  }
  __syncthreads();
  if (t == 0) {
    float tot = red[0];
#pragma unroll
    for (int w = 1; w < kNormTreeThreads / 32; ++w) tot += red[w];
    red[8] = tot;
  }
  __syncthreads();
  return red[8];
}

}  // namespace spade::cuda
