// Once per device: kernel attributes set with cudaFuncSetAttribute (the dynamic shared-memory
// limit) belong to the device that was current when they were set, so a process that drives
// several GPUs (tensor-parallel ranks as threads of one process, tests/gpu/test_cuda_tp.cpp)
// sets them on each. Replaces a `static bool done` beside such a call; costs a cudaGetDevice.
#pragma once
#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
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

// The largest value granted so far on the current device (devices 0..63), for attributes
// raised as launches need more: replaces a `static size_t granted` beside such a call.
class PerDeviceMax {
 public:
  // Whether `v` exceeds the current device's value (it is then recorded: set the attribute).
  bool raise(size_t v) {
    int d = 0;
    if (cudaGetDevice(&d) != cudaSuccess) d = 0;
    std::atomic<size_t>& g = v_[unsigned(d) & 63u];
    size_t cur = g.load(std::memory_order_acquire);
    while (v > cur)
      if (g.compare_exchange_weak(cur, v, std::memory_order_acq_rel)) return true;
    return false;
  }

 private:
  std::atomic<size_t> v_[64]{};
};

}  // namespace spade::cuda
