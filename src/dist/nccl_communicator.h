// Communicator over NCCL (communicator.h) for tensor parallelism across GPUs, one process (or
// thread) per GPU. The NCCL unique id is made by rank 0 and travels over a bootstrap
// communicator (the TCP rendezvous, tcp_communicator.h), so the same binary runs ranks on one
// host or several. Buffers are device memory; collectives are enqueued on the communicator's
// stream (so a decode step that is one CUDA graph can capture them) and return at once.
//
// The communicator is non-blocking (ncclConfig_t::blocking = 0): initialization and wait()
// poll NCCL's asynchronous error and abort the communicator on an error or a timeout, so a
// rank that dies makes the others throw spade::Error instead of hanging.
//
// It also implements DeviceCollectives (device_collectives.h): CudaModel's all-reduces go on
// the model's own stream (all_reduce_sum_on), and the model's host syncs poll NCCL's errors
// (synchronize). NVLink SHARP / multicast (NVLS) stays off: the constructor sets
// NCCL_NVLS_ENABLE=0 unless the environment already sets it (the device machines need it off).
//
// UNTESTED until a multi-GPU run: compiled in CUDA builds that find NCCL (CMakeLists.txt:
// SPADE_HAVE_NCCL); tests/gpu/test_cuda_tp.cpp exercises it on 2+ GPUs (issue 39).
#pragma once
#include <chrono>
#include <cstdint>
#include <string>

#include "dist/communicator.h"
#include "dist/device_collectives.h"

struct ncclComm;     // nccl.h: typedef struct ncclComm* ncclComm_t
struct CUstream_st;  // cuda_runtime.h: typedef struct CUstream_st* cudaStream_t

namespace spade::dist {

class NcclCommunicator : public Communicator, public DeviceCollectives {
 public:
  // Collective over `bootstrap`'s ranks: binds this thread to `device`, rank 0 creates the
  // unique id and broadcasts it, every rank joins (at most `timeout`). `stream` (null: a new
  // one, owned) carries every collective.
  NcclCommunicator(Communicator& bootstrap, int device, CUstream_st* stream = nullptr,
                   std::chrono::milliseconds timeout = std::chrono::minutes(5));
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  // Device pointers; enqueued on stream(), in place. The sum is NCCL's (identical on every
  // rank; its order depends on NCCL's algorithm, not on the rank order).
  void all_reduce_sum(float* device_data, int64_t n) override;
  void broadcast(void* device_data, int64_t bytes, int root) override;
  // A one-float all-reduce, then wait().
  void barrier() override;
  // Waits for the stream's work; throws spade::Error (and aborts the communicator) on an NCCL
  // error or after `timeout`.
  void wait(std::chrono::milliseconds timeout = std::chrono::minutes(5));
  CUstream_st* stream() const { return stream_; }
  // DeviceCollectives: the all-reduce on any stream of this device; synchronize = wait on it.
  void all_reduce_sum_on(float* device_data, int64_t n, void* stream) override;
  void synchronize(void* stream) override;
  void wait_on(CUstream_st* stream, std::chrono::milliseconds timeout);

 private:
  void check(int result, const char* what);  // an ncclResult_t
  // After an enqueue that returned ncclInProgress (non-blocking communicator): polls until
  // the call is done, as NCCL requires before more work goes to the stream.
  void settle(int result, const char* what);
  [[noreturn]] void abort_with(const std::string& why);

  ncclComm* comm_ = nullptr;
  CUstream_st* stream_ = nullptr;
  bool own_stream_ = false;
  float* scratch_ = nullptr;  // one device float (barrier)
  int rank_ = 0, size_ = 1, device_ = 0;
};

}  // namespace spade::dist
