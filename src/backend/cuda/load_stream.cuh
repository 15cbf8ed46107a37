// Load patterns for streams read once: a 16-byte load past L1 (weights, KV bytes), and a
// thread-strided loop that keeps U loads of each thread in flight.
#pragma once
#include <cuda_runtime.h>

namespace spade::cuda {

// A 16-byte global load for data read once (weights, KV bytes): non-coherent path, no L1
// allocation, so a stream does not evict what L1 holds for others.
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// f(src[i], i) for i = tid, tid + nt, ... < n, with U loads of a thread in flight before its
// first call (a plain strided loop waits for each load); calls in ascending i per thread.
template <int U, class T, class F>
__device__ __forceinline__ void for_each_strided(const T* src, int n, int tid, int nt, F&& f) {
  for (int c0 = tid; c0 < n; c0 += U * nt) {
    T v[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (c0 + u * nt < n) v[u] = src[c0 + u * nt];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (c0 + u * nt < n) f(v[u], c0 + u * nt);
  }
}

}  // namespace spade::cuda
