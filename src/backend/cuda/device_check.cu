// check_device_supported (cuda_common.h): whether this build's kernels run on the current GPU.
//
// probe_kernel: reads and writes nothing; only its presence in the binary for the device's
// compute capability is asked (cudaFuncGetAttributes), never launched.
#include <string>

#include "backend/cuda/cuda_common.h"

#ifndef SPADE_CUDA_TARGETS
#define SPADE_CUDA_TARGETS "unknown"
#endif

namespace spade::cuda {
namespace {
__global__ void probe_kernel() {}
}  // namespace

void check_device_supported() {
  static const bool checked = [] {
    int dev = 0, major = 0, minor = 0;
    SPADE_CUDA(cudaGetDevice(&dev));
    SPADE_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    SPADE_CUDA(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
    cudaDeviceProp p{};
    SPADE_CUDA(cudaGetDeviceProperties(&p, dev));
    const std::string gpu = cat(p.name, " (compute capability ", major, ".", minor, ")");
    SPADE_CHECK(major >= 8, "--device cuda: ", gpu, " is not supported: spade's kernels need "
                "compute capability 8.0 or newer (bf16 tensor cores: A100, RTX 30xx and newer)");
    cudaFuncAttributes a{};
    const cudaError_t e = cudaFuncGetAttributes(&a, probe_kernel);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      fail("--device cuda: this spade build has no kernels for ", gpu, " (built for CUDA "
           "architectures ", SPADE_CUDA_TARGETS, "; ", cudaGetErrorString(e), "). Rebuild with "
           "`make build CUDA_ARCHS=all`, or CUDA_ARCHS=", major, minor, " for this GPU alone.");
    }
    return true;
  }();
  (void)checked;
}

}  // namespace spade::cuda
