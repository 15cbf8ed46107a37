#include "backend/cuda/cuda_common.h"
#include "core/tuning.h"

#include <algorithm>
#include <cstdlib>

namespace spade::cuda {

void throw_cuda(cudaError_t e, const char* what, const char* file, int line) {
  fail("CUDA error ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ") in ", what, " at ",
       file, ":", line);
}

void throw_cublas(cublasStatus_t s, const char* what, const char* file, int line) {
  fail("cuBLAS error ", int(s), " in ", what, " at ", file, ":", line);
}

bool device_available() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

int sm_count() {
  static int n = [] {
    int dev = 0, v = 0;
    SPADE_CUDA(cudaGetDevice(&dev));
    SPADE_CUDA(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev));
    return v;
  }();
  return n;
}

std::string device_summary() {
  int dev = 0;
  SPADE_CUDA(cudaGetDevice(&dev));
  cudaDeviceProp p{};
  SPADE_CUDA(cudaGetDeviceProperties(&p, dev));
  return cat(p.name, ", ", p.multiProcessorCount, " SMs, ",
             double(p.totalGlobalMem) / double(1ull << 30), " GiB, L2 ",
             p.l2CacheSize >> 20, " MiB, sm_", p.major, p.minor);
}

DeviceArena::DeviceArena(size_t bytes) : cap_(align_up(bytes, 256)) {
  cudaError_t e = cudaMalloc(&base_, cap_);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    base_ = nullptr;
    fail("GPU memory: cannot allocate the ", double(cap_) / double(1ull << 30),
         " GiB device pool (weights + KV cache + workspaces); the device has ",
         double(free_b) / double(1ull << 30), " GiB free of ",
         double(total_b) / double(1ull << 30), " GiB (",
         cudaGetErrorString(e), "). Lower --kv-pages / context, or use a smaller model.");
  }
}

DeviceArena::~DeviceArena() {
  if (base_) cudaFree(base_);
}

void* DeviceArena::alloc(size_t bytes, const char* what) {
  size_t n = align_up(bytes, 256);
  SPADE_CHECK(n <= cap_ - used_, "GPU memory pool: ", what, " needs ", double(n) / 1048576.0,
              " MiB but only ", double(cap_ - used_) / 1048576.0, " MiB of the ",
              double(cap_) / 1048576.0, " MiB pool are left");
  void* p = base_ + used_;
  used_ += n;
  return p;
}

namespace {
int device_attr(cudaDeviceAttr a) {
  int dev = 0, v = 0;
  SPADE_CUDA(cudaGetDevice(&dev));
  SPADE_CUDA(cudaDeviceGetAttribute(&v, a, dev));
  return v;
}
}  // namespace

int cc_major() {
  static const int v = tuning().emulate_cc ? tuning().emulate_cc / 10
                                           : device_attr(cudaDevAttrComputeCapabilityMajor);
  return v;
}

int cc_minor() {
  static const int v = tuning().emulate_cc ? tuning().emulate_cc % 10
                                           : device_attr(cudaDevAttrComputeCapabilityMinor);
  return v;
}

size_t smem_optin_bytes() {
  static const size_t v = [] {
    size_t b = size_t(device_attr(cudaDevAttrMaxSharedMemoryPerBlockOptin));
    const int e = tuning().emulate_cc;
    if (e) b = std::min(b, size_t(e == 80 ? 163 : 99) << 10);  // A100; RTX 30xx / 40xx, L40S
    return b;
  }();
  return v;
}

bool pdl_enabled() {
  static const bool on = [] {
    if (!tuning().pdl) return false;
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return false;
    return cc_major() >= 9;
  }();
  return on;
}

}  // namespace spade::cuda
