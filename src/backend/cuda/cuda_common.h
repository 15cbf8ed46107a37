// CUDA plumbing shared by every file of the CUDA backend: checked calls, the one device
// memory arena taken at start-up, and small bf16 helpers. Host-compilable (g++ with the
// CUDA include path) so the model runner and the tests can use it.
//
// Memory: DeviceArena makes ONE cudaMalloc of a caller-chosen size; weights, KV pages and
// workspaces are bump-allocated from it (256-byte aligned) before the first step, so the
// decode loop never calls cudaMalloc. A request that does not fit throws spade::Error naming
// what was being allocated, the bytes asked for, and what is left.
#pragma once
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/error.h"

namespace spade::cuda {

using bf16 = __nv_bfloat16;

[[noreturn]] void throw_cuda(cudaError_t e, const char* what, const char* file, int line);
[[noreturn]] void throw_cublas(cublasStatus_t s, const char* what, const char* file, int line);

#define SPADE_CUDA(call)                                                              \
  do {                                                                                \
    cudaError_t e_ = (call);                                                          \
    if (e_ != cudaSuccess) ::spade::cuda::throw_cuda(e_, #call, __FILE__, __LINE__); \
  } while (0)
#define SPADE_CUBLAS(call)                                                                   \
  do {                                                                                       \
    cublasStatus_t s_ = (call);                                                              \
    if (s_ != CUBLAS_STATUS_SUCCESS) ::spade::cuda::throw_cublas(s_, #call, __FILE__, __LINE__); \
  } while (0)
// After a kernel launch: launch-configuration errors surface here.
#define SPADE_CUDA_LAUNCH() SPADE_CUDA(cudaGetLastError())

// Whether a CUDA device is usable (tests skip without one).
bool device_available();
// "NVIDIA H100 80GB HBM3, 132 SMs, 79.2 GiB"
std::string device_summary();
int sm_count();
// The current device's compute capability, read once (SPADE_EMULATE_CC: the emulated one).
int cc_major();
int cc_minor();
// Dynamic shared memory one block may opt in to (cudaFuncAttributeMaxDynamicSharedMemorySize):
// 227 KB on Hopper, 163 KB on A100, 99 KB on sm_86 / 89 (SPADE_EMULATE_CC: the emulated one's).
size_t smem_optin_bytes();
// Raises `kernel`'s dynamic shared-memory limit to `bytes` (every kernel that needs more than
// 48 KB goes through here): a request that, with the kernel's static shared memory, passes what
// the device gives a block (smem_optin_bytes, the emulated GPU's under SPADE_EMULATE_CC; a real
// GPU refuses dynamic bytes above the limit less the static ones) is a clear error naming the
// sizes.
template <typename K>
void set_max_dynamic_smem(K kernel, size_t bytes) {
  cudaFuncAttributes fa{};
  SPADE_CUDA(cudaFuncGetAttributes(&fa, kernel));
  const size_t stat = fa.sharedSizeBytes;
  SPADE_CHECK(bytes + stat <= smem_optin_bytes(), "CUDA: a kernel needs ", (bytes + stat + 1023) >> 10,
              " KB of shared memory per block (", (stat + 1023) >> 10, " KB static); this GPU gives ",
              smem_optin_bytes() >> 10, " KB");
  SPADE_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
}
// Throws spade::Error, naming the GPU and what this build targets, when the current device
// cannot run this build's kernels: compute capability below 8.0 (no bf16 tensor cores), or
// no kernel image for it in the binary (SPADE_CUDA_ARCHS at build time). Checked once.
void check_device_supported();
// Whether launch_pdl (pdl.cuh) launches with programmatic stream serialization: SPADE_PDL
// unset or not "0", and a device of compute capability 9.0 or newer.
bool pdl_enabled();

class DeviceArena {
 public:
  DeviceArena() = default;
  // One cudaMalloc of `bytes`; throws with free/total memory when the device cannot give it.
  explicit DeviceArena(size_t bytes);
  ~DeviceArena();
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;

  void* alloc(size_t bytes, const char* what);
  template <typename T>
  T* alloc_n(size_t n, const char* what) {
    return static_cast<T*>(alloc(n * sizeof(T), what));
  }
  size_t capacity() const { return cap_; }
  size_t used() const { return used_; }
  size_t left() const { return cap_ - used_; }
  // Rolls back to an earlier `used()` mark (scratch regions of tests and benches).
  void reset(size_t mark) { used_ = mark; }

 private:
  char* base_ = nullptr;
  size_t cap_ = 0, used_ = 0;
};

inline size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

}  // namespace spade::cuda
