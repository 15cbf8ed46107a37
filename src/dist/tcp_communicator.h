// Communicator over TCP sockets (communicator.h): rank 0 listens on the rendezvous address
// `host:port`, the other ranks connect to it with retries; collectives are a star through
// rank 0 (it gathers, sums in rank order and sends the result back), which keeps the
// reduction deterministic. Meant for the rendezvous, small messages and the CPU model's
// tensor parallelism on one host, not for GPU bandwidth (NCCL's job).
//
// Failures never hang: connecting, every send and every receive are bounded by timeouts
// (TcpOptions); a peer that closes its connection or exits is seen at once. After the first
// failure the communicator is broken: rank 0 tells the peers why (or closes their
// connections), and every later call throws the same spade::Error.
//
// Wire format: fixed-size native-endian frames (every rank runs the same binary on one
// architecture), each collective checked on rank 0 against the others (operation, sequence
// number, byte count, root) so that ranks that diverge get an error naming both calls.
#pragma once
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "dist/communicator.h"

namespace spade::dist {

struct TcpOptions {
  // Rendezvous: how long rank 0 waits for every peer to join, and a peer to reach rank 0.
  std::chrono::milliseconds connect_timeout{60000};
  // A collective waiting on a peer: no byte moving for this long is a failure (a peer waits
  // twice as long for rank 0's reply, since rank 0 may be waiting on another rank).
  std::chrono::milliseconds io_timeout{600000};
};

struct HostPort {
  std::string host;
  int port = 0;
};
// "host:port" (the last ':' splits; "[::1]:29500" drops the brackets). Throws spade::Error.
HostPort parse_host_port(const std::string& address);

// Rank 0's listening socket, bound before any peer starts (port 0: an ephemeral port, port()
// says which). Move-only.
class TcpListener {
 public:
  explicit TcpListener(const std::string& address);
  TcpListener(TcpListener&& o) noexcept;
  TcpListener& operator=(TcpListener&&) = delete;
  TcpListener(const TcpListener&) = delete;
  ~TcpListener();
  int port() const { return port_; }
  int release();  // hands the socket over (the listener no longer closes it)

 private:
  int fd_ = -1;
  int port_ = 0;
  std::string address_;
  friend class TcpCommunicator;
};

class TcpCommunicator : public Communicator {
 public:
  // Rank 0 listens on `address`, the others connect to it; returns once all `size` ranks
  // have joined (throws spade::Error after opt.connect_timeout otherwise).
  TcpCommunicator(const std::string& address, int rank, int size, TcpOptions opt = {});
  // Rank 0 on a socket already bound (tests: an ephemeral port handed to the peers).
  TcpCommunicator(TcpListener listener, int size, TcpOptions opt = {});
  ~TcpCommunicator() override;
  TcpCommunicator(const TcpCommunicator&) = delete;
  TcpCommunicator& operator=(const TcpCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void all_reduce_sum(float* data, int64_t n) override;
  void broadcast(void* data, int64_t bytes, int root) override;
  void barrier() override;

 private:
  struct Header;
  void accept_peers(TcpListener& l);
  void connect_to_root(const std::string& address);
  void begin(uint32_t op, int64_t bytes, int root);  // a collective starts
  void gather_headers();             // rank 0: every peer's header, checked against ours
  void send_header();                // a peer: ours to rank 0
  void send_ok(int peer, int64_t bytes);  // rank 0: the reply header (bytes of data follow)
  int64_t await_reply();             // a peer: rank 0's reply (throws its abort message)
  // Marks the communicator broken, closes every connection (rank 0 first tells each peer but
  // `bad_peer` why) and throws.
  [[noreturn]] void fail_all(const std::string& why, int bad_peer);
  void check_usable() const;
  std::string who() const;
  void send_bytes(int fd, const void* p, int64_t n, int peer);
  void recv_bytes(int fd, void* p, int64_t n, int peer);

  int rank_ = 0, size_ = 1;
  TcpOptions opt_;
  std::vector<int> fds_;  // rank 0: fds_[r] for peer r (fds_[0] unused); others: fds_[0]
  uint64_t seq_ = 0;      // collectives so far
  uint32_t cur_op_ = 0;   // the current one (0: the rendezvous), for error messages
  int64_t cur_bytes_ = 0;
  int cur_root_ = 0;
  std::string broken_;    // the first failure; every call after it throws this
  std::vector<float> scratch_;
};

}  // namespace spade::dist
