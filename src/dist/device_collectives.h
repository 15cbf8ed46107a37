// The device side of tensor parallelism that CudaModel needs (issue 39): an in-place sum
// all-reduce of fp32 device memory enqueued on the caller's stream (so a captured decode graph
// holds it), and a host wait on that stream that notices a failed or stalled rank instead of
// hanging. NcclCommunicator (nccl_communicator.h) implements it; CudaModelOptions::tp takes it.
// This header needs neither CUDA nor NCCL (streams are passed as void*).
#pragma once
#include <cstdint>

namespace spade::dist {

class DeviceCollectives {
 public:
  virtual ~DeviceCollectives() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // In place over the ranks: device_data[i] becomes the sum of every rank's device_data[i]
  // (the same bits on every rank), enqueued on `stream` (a cudaStream_t); returns at once.
  virtual void all_reduce_sum_on(float* device_data, int64_t n, void* stream) = 0;
  // Blocks until `stream`'s work is done; throws spade::Error (and gives the collectives up)
  // when a collective failed, a rank died or the stream does not finish in time.
  virtual void synchronize(void* stream) = 0;
};

}  // namespace spade::dist
