// A 16-byte global load for data read once (weights, KV bytes): non-coherent path, no L1
// allocation, so a stream does not evict what L1 holds for others.
#pragma once
#include <cuda_runtime.h>

namespace spade::cuda {

__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

}  // namespace spade::cuda
