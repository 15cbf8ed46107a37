// Once per device: kernel attributes set with cudaFuncSetAttribute (the dynamic shared-memory
// limit) belong to the device that was current when they were set, so a process that drives
// several GPUs (tensor-parallel ranks as threads of one process, tests/gpu/test_cuda_tp.cpp)
// sets them on each. Replaces a `static bool done` beside such a call; costs a cudaGetDevice.
#pragma once
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

namespace spade::cuda {

class PerDeviceOnce {
 public:
  // Whether the current device has not been marked yet (devices 0..63).
  bool pending() const {
    return !(done_.load(std::memory_order_acquire) & bit());
  }
  void mark() { done_.fetch_or(bit(), std::memory_order_acq_rel); }

 private:
  static uint64_t bit() {
    int d = 0;
    if (cudaGetDevice(&d) != cudaSuccess) d = 0;
    return uint64_t(1) << (unsigned(d) & 63u);
  }
  std::atomic<uint64_t> done_{0};
};

}  // namespace spade::cuda
