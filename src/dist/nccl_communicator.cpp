// NCCL transport of the tensor-parallel collectives (nccl_communicator.h). Compiled only in
// CUDA builds that find NCCL; untested until a multi-GPU run (issue 39:
// tests/gpu/test_cuda_tp.cpp).
#include "dist/nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>

#include "core/error.h"

namespace spade::dist {

namespace {

using Clock = std::chrono::steady_clock;

void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail("NCCL communicator: ", what, ": ", cudaGetErrorString(e));
}

// NVLink SHARP (NVLS, multicast memory) stays off unless the environment says otherwise: the
// device machines require it (their notes), and the all-reduces here are small. Set once per
// process, before the first communicator is created (setenv is not thread-safe).
void nvls_off_unless_set() {
  static std::once_flag once;
  std::call_once(once, [] { ::setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0); });
}

}  // namespace

void NcclCommunicator::settle(int result, const char* what) {
  check(result, what);
  if (static_cast<ncclResult_t>(result) != ncclInProgress) return;
  const auto deadline = Clock::now() + std::chrono::minutes(5);
  for (;;) {
    ncclResult_t state = ncclSuccess;
    check(ncclCommGetAsyncError(comm_, &state), "ncclCommGetAsyncError");
    if (state == ncclSuccess) return;
    if (state != ncclInProgress) check(state, what);
    if (Clock::now() > deadline) abort_with(cat(what, " did not return within 300 s"));
    std::this_thread::yield();
  }
}

void NcclCommunicator::abort_with(const std::string& why) {
  if (comm_) ncclCommAbort(comm_);
  comm_ = nullptr;
  fail("NCCL rank ", rank_, " of ", size_, ": ", why);
}

void NcclCommunicator::check(int result, const char* what) {
  const auto r = static_cast<ncclResult_t>(result);
  if (r == ncclSuccess || r == ncclInProgress) return;
  abort_with(cat(what, ": ", ncclGetErrorString(r),
                 comm_ ? cat(" (", ncclGetLastError(comm_), ")") : std::string()));
}

NcclCommunicator::NcclCommunicator(Communicator& bootstrap, int device, CUstream_st* stream,
                                   std::chrono::milliseconds timeout)
    : stream_(stream), rank_(bootstrap.rank()), size_(bootstrap.size()), device_(device) {
  nvls_off_unless_set();
  cuda_check(cudaSetDevice(device), "cudaSetDevice");
  if (!stream_) {
    cudaStream_t s = nullptr;
    cuda_check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    stream_ = s;
    own_stream_ = true;
  }
  cuda_check(cudaMalloc(&scratch_, sizeof(float)), "cudaMalloc");
  ncclUniqueId id{};
  if (rank_ == 0) check(ncclGetUniqueId(&id), "ncclGetUniqueId");
  bootstrap.broadcast(&id, sizeof id, 0);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // init and collectives return at once; errors are polled (wait())
  ncclComm_t comm = nullptr;
  const ncclResult_t r = ncclCommInitRankConfig(&comm, size_, id, rank_, &config);
  comm_ = comm;
  check(r, "ncclCommInitRankConfig");
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    ncclResult_t state = ncclSuccess;
    check(ncclCommGetAsyncError(comm_, &state), "ncclCommGetAsyncError");
    if (state == ncclSuccess) break;
    if (state != ncclInProgress) check(state, "joining the NCCL communicator");
    if (Clock::now() > deadline)
      abort_with(cat("not every rank joined the NCCL communicator within ",
                     std::chrono::duration<double>(timeout).count(), " s"));
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

NcclCommunicator::~NcclCommunicator() {
  if (comm_) {
    // Non-blocking: finalize returns at once; poll it (bounded), abort when it fails or hangs.
    cudaStreamSynchronize(stream_);
    ncclResult_t state = ncclCommFinalize(comm_);
    const auto deadline = Clock::now() + std::chrono::seconds(30);
    while (state == ncclInProgress && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) break;
    }
    if (state == ncclSuccess)
      ncclCommDestroy(comm_);
    else
      ncclCommAbort(comm_);
  }
  if (scratch_) cudaFree(scratch_);
  if (own_stream_) cudaStreamDestroy(stream_);
}

void NcclCommunicator::all_reduce_sum(float* device_data, int64_t n) {
  SPADE_CHECK(comm_, "NCCL rank ", rank_, ": the communicator was aborted");
  if (n == 0) return;
  settle(ncclAllReduce(device_data, device_data, size_t(n), ncclFloat32, ncclSum, comm_, stream_),
         "ncclAllReduce");
}

void NcclCommunicator::broadcast(void* device_data, int64_t bytes, int root) {
  SPADE_CHECK(comm_, "NCCL rank ", rank_, ": the communicator was aborted");
  SPADE_CHECK(root >= 0 && root < size_, "broadcast: root ", root, " is outside [0, ", size_, ")");
  if (bytes == 0) return;
  settle(ncclBroadcast(device_data, device_data, size_t(bytes), ncclUint8, root, comm_, stream_),
         "ncclBroadcast");
}

void NcclCommunicator::barrier() {
  all_reduce_sum(scratch_, 1);
  wait();
}

void NcclCommunicator::all_reduce_sum_on(float* device_data, int64_t n, void* stream) {
  SPADE_CHECK(comm_, "NCCL rank ", rank_, ": the communicator was aborted");
  if (n == 0) return;
  settle(ncclAllReduce(device_data, device_data, size_t(n), ncclFloat32, ncclSum, comm_,
                       static_cast<cudaStream_t>(stream)),
         "ncclAllReduce");
}

void NcclCommunicator::synchronize(void* stream) {
  wait_on(static_cast<cudaStream_t>(stream), std::chrono::minutes(5));
}

void NcclCommunicator::wait(std::chrono::milliseconds timeout) { wait_on(stream_, timeout); }

void NcclCommunicator::wait_on(CUstream_st* stream, std::chrono::milliseconds timeout) {
  SPADE_CHECK(comm_, "NCCL rank ", rank_, ": the communicator was aborted");
  const auto start = Clock::now();
  const auto deadline = start + timeout;
  for (;;) {
    const cudaError_t q = cudaStreamQuery(stream);
    if (q == cudaSuccess) return;
    if (q != cudaErrorNotReady) abort_with(cat("the stream failed: ", cudaGetErrorString(q)));
    ncclResult_t state = ncclSuccess;
    check(ncclCommGetAsyncError(comm_, &state), "ncclCommGetAsyncError");
    if (state != ncclSuccess && state != ncclInProgress) check(state, "a collective");
    const auto now = Clock::now();
    if (now > deadline)
      abort_with(cat("a collective did not finish within ",
                     std::chrono::duration<double>(timeout).count(), " s (did a rank exit?)"));
    // A decode step takes milliseconds: yield at first (no sleep granularity on the step
    // time), then sleep between polls.
    if (now - start < std::chrono::milliseconds(5))
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

}  // namespace spade::dist
