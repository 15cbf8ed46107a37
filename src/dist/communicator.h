// The collectives that tensor parallelism needs between the ranks of one model (issue 39):
// one interface, two transports. TcpCommunicator (tcp_communicator.h) moves host memory over
// TCP: the rendezvous, the CPU model's all-reduces and the broadcast of the NCCL unique id.
// NcclCommunicator (nccl_communicator.h, CUDA builds with NCCL) moves device memory.
// Every rank calls the same collectives in the same order; any failure (a peer that exits, a
// timeout, a mismatched call) throws spade::Error on every rank instead of hanging.
#pragma once
#include <cstdint>

namespace spade::dist {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // In place: data[i] becomes the sum over ranks of data[i], bitwise identical on every rank.
  // The TCP transport sums in rank order ((x0 + x1) + x2 ...), so the result is also the same
  // from run to run.
  virtual void all_reduce_sum(float* data, int64_t n) = 0;
  // In place: every rank's `bytes` bytes at `data` become root's.
  virtual void broadcast(void* data, int64_t bytes, int root) = 0;
  // Returns once every rank has called it.
  virtual void barrier() = 0;
};

}  // namespace spade::dist
