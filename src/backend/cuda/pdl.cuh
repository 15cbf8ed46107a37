// Programmatic dependent launch (Hopper, sm_90): a kernel launched with launch_pdl may be
// scheduled while the kernel before it in the stream is still running, so the launch latency
// and the CTAs' start-up overlap that kernel's tail instead of following it. In a CUDA graph
// the same launch becomes a programmatic edge.
//
// Contract for every kernel launched with launch_pdl (and any kernel may call these; without
// a programmatic dependency both are no-ops):
//   - pdl_begin() comes, in every CTA, before any access to memory that another kernel of the
//     step writes or reads, and before any return (tests/lint/check_pdl_contract.py checks the
//     latter): griddepcontrol.wait blocks until the previous grid has COMPLETED and its writes
//     are visible, so reads of its outputs and writes to buffers it reads are both ordered
//     after it. In practice it is the first statement; the decode GEMV and RMSNorm first
//     request their constant weights;
//   - pdl_begin() then releases the next kernel (griddepcontrol.launch_dependents) only
//     after that wait, so at most one launch runs ahead: a kernel two launches back has
//     always completed when a kernel passes its wait (its predecessor waited for it).
// SPADE_PDL=0 in the environment launches without the attribute (A/B measurements).
#pragma once
#include <cuda_runtime.h>

#include <utility>

#include "backend/cuda/cuda_common.h"

namespace spade::cuda {

__device__ __forceinline__ void pdl_begin() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The same two steps apart, for a kernel whose dependents should not launch while it runs
// (pdl_begin's early release lets the next kernel's CTAs take SM slots and start their
// pre-wait work during this one): pdl_wait() where pdl_begin() would be, pdl_release() after
// the CTA's last store (a CTA that exits without it releases at its exit). The release still
// follows the wait, so "at most one launch runs ahead" holds.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

template <typename... KArgs, typename... Args>
void launch_pdl(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t s,
                Args&&... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cfg.attrs = attr;
  cfg.numAttrs = pdl_enabled() ? 1 : 0;
  SPADE_CUDA(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

}  // namespace spade::cuda
