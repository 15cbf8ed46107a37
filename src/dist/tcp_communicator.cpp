// TCP transport of the tensor-parallel collectives (tcp_communicator.h): rendezvous, framing,
// timeouts, and the star-shaped collectives through rank 0.
#include "dist/tcp_communicator.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <thread>

#include "core/error.h"

namespace spade::dist {

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr uint32_t kMagic = 0x50545053;  // "SPTP"
constexpr uint32_t kVersion = 1;
enum Op : uint32_t { kAllReduce = 1, kBroadcast = 2, kBarrier = 3, kOk = 100, kAbort = 101 };

struct Hello {
  uint32_t magic = kMagic, version = kVersion;
  int32_t rank = 0, size = 0;
};

double seconds(milliseconds d) { return double(d.count()) / 1000.0; }

int remaining_ms(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now()).count();
  return int(std::clamp<int64_t>(left, 0, 1 << 30));
}

void close_fd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

void set_nodelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

struct AddrInfoFree {
  void operator()(addrinfo* a) const { freeaddrinfo(a); }
};
std::unique_ptr<addrinfo, AddrInfoFree> resolve(const HostPort& hp, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  addrinfo* res = nullptr;
  const std::string port = std::to_string(hp.port);
  const int rc = getaddrinfo(hp.host.c_str(), port.c_str(), &hints, &res);
  if (rc != 0) fail("tensor parallelism: cannot resolve host '", hp.host, "': ", gai_strerror(rc));
  return std::unique_ptr<addrinfo, AddrInfoFree>(res);
}

// A non-blocking connect bounded by the deadline; returns the socket or -1 (errno set).
int try_connect(const addrinfo* ai, Clock::time_point deadline) {
  int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
  if (fd < 0) return -1;
  if (::connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) return fd;
  if (errno != EINPROGRESS) {
    const int e = errno;
    close_fd(fd);
    errno = e;
    return -1;
  }
  pollfd p{fd, POLLOUT, 0};
  const int rc = ::poll(&p, 1, std::min(remaining_ms(deadline), 2000));
  int err = ETIMEDOUT;
  socklen_t len = sizeof err;
  if (rc > 0) ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
  if (err != 0) {
    close_fd(fd);
    errno = err;
    return -1;
  }
  return fd;
}

constexpr int kClosed = -1;

// Sends or receives exactly n bytes on a non-blocking socket, waiting at most `timeout` for
// each next byte. Returns 0, kClosed (the peer closed), ETIMEDOUT or the errno that failed.
int transfer(int fd, void* p, int64_t n, bool send, milliseconds timeout) {
  char* c = static_cast<char*>(p);
  const int wait_ms = int(std::clamp<int64_t>(timeout.count(), 0, 1 << 30));
  while (n > 0) {
    const ssize_t k = send ? ::send(fd, c, size_t(n), MSG_NOSIGNAL | MSG_DONTWAIT)
                           : ::recv(fd, c, size_t(n), MSG_DONTWAIT);
    if (k > 0) {
      c += k;
      n -= k;
      continue;
    }
    if (k == 0) return kClosed;
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return errno;
    pollfd pf{fd, short(send ? POLLOUT : POLLIN), 0};
    const int rc = ::poll(&pf, 1, wait_ms);
    if (rc == 0) return ETIMEDOUT;
    if (rc < 0 && errno != EINTR) return errno;
  }
  return 0;
}

}  // namespace

struct TcpCommunicator::Header {
  uint32_t magic = kMagic;
  uint32_t op = 0;
  uint64_t seq = 0;
  int64_t bytes = 0;
  int32_t root = 0;
  uint32_t pad = 0;
};

namespace {

std::string describe(uint32_t op, uint64_t seq, int64_t bytes, int root) {
  switch (op) {
    case kAllReduce: return cat("all_reduce_sum of ", bytes / 4, " floats (collective #", seq, ")");
    case kBroadcast:
      return cat("broadcast of ", bytes, " bytes from rank ", root, " (collective #", seq, ")");
    case kBarrier: return cat("barrier (collective #", seq, ")");
    case 0: return "the rendezvous";
    default: return cat("operation ", op, " (collective #", seq, ")");
  }
}

}  // namespace

HostPort parse_host_port(const std::string& address) {
  const size_t colon = address.rfind(':');
  HostPort hp;
  bool ok = colon != std::string::npos && colon > 0 && colon + 1 < address.size();
  if (ok) {
    hp.host = address.substr(0, colon);
    if (hp.host.size() >= 2 && hp.host.front() == '[' && hp.host.back() == ']')
      hp.host = hp.host.substr(1, hp.host.size() - 2);
    const std::string port = address.substr(colon + 1);
    ok = !hp.host.empty() && port.size() <= 5 &&
         std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; });
    if (ok) hp.port = std::stoi(port);
    ok = ok && hp.port <= 65535;
  }
  SPADE_CHECK(ok, "tensor parallelism: the rendezvous address must be host:port (port 0-65535), got '",
              address, "'");
  return hp;
}

TcpListener::TcpListener(const std::string& address) : address_(address) {
  const HostPort hp = parse_host_port(address);
  auto ai = resolve(hp, true);
  int last = 0;
  for (const addrinfo* a = ai.get(); a; a = a->ai_next) {
    int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      last = errno;
      continue;
    }
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 128) == 0) {
      sockaddr_storage ss{};
      socklen_t len = sizeof ss;
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len);
      port_ = ss.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port)
                                       : ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
      fd_ = fd;
      return;
    }
    last = errno;
    close_fd(fd);
  }
  fail("tensor parallelism: rank 0 cannot listen on ", address, ": ", std::strerror(last));
}

TcpListener::TcpListener(TcpListener&& o) noexcept
    : fd_(o.fd_), port_(o.port_), address_(std::move(o.address_)) {
  o.fd_ = -1;
}

TcpListener::~TcpListener() { close_fd(fd_); }

int TcpListener::release() {
  const int fd = fd_;
  fd_ = -1;
  return fd;
}

TcpCommunicator::TcpCommunicator(const std::string& address, int rank, int size, TcpOptions opt)
    : rank_(rank), size_(size), opt_(opt) {
  SPADE_CHECK(size >= 1, "tensor parallelism: the number of ranks must be at least 1, got ", size);
  SPADE_CHECK(rank >= 0 && rank < size, "tensor parallelism: rank ", rank, " is outside [0, ",
              size, ")");
  if (size == 1) return;
  try {
    if (rank == 0) {
      TcpListener l(address);
      accept_peers(l);
    } else {
      connect_to_root(address);
    }
  } catch (...) {
    for (int& fd : fds_) close_fd(fd);
    throw;
  }
}

TcpCommunicator::TcpCommunicator(TcpListener listener, int size, TcpOptions opt)
    : rank_(0), size_(size), opt_(opt) {
  SPADE_CHECK(size >= 1, "tensor parallelism: the number of ranks must be at least 1, got ", size);
  if (size == 1) return;
  try {
    accept_peers(listener);
  } catch (...) {
    for (int& fd : fds_) close_fd(fd);
    throw;
  }
}

TcpCommunicator::~TcpCommunicator() {
  for (int& fd : fds_) close_fd(fd);
}

std::string TcpCommunicator::who() const {
  return cat("tensor-parallel rank ", rank_, " of ", size_);
}

void TcpCommunicator::accept_peers(TcpListener& l) {
  fds_.assign(size_t(size_), -1);
  const auto deadline = Clock::now() + opt_.connect_timeout;
  int joined = 1;
  while (joined < size_) {
    pollfd p{l.fd_, POLLIN, 0};
    const int rc = ::poll(&p, 1, remaining_ms(deadline));
    if (rc == 0) {
      std::string missing;
      for (int r = 1; r < size_; ++r)
        if (fds_[size_t(r)] < 0) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      fail(who(), ": only ", joined, " of ", size_, " ranks joined the rendezvous at ", l.address_,
           " within ", seconds(opt_.connect_timeout), " s (missing: rank ", missing, ")");
    }
    if (rc < 0) {
      if (errno == EINTR) continue;
      fail(who(), ": waiting for ranks at ", l.address_, ": ", std::strerror(errno));
    }
    int fd = ::accept4(l.fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) continue;
    set_nodelay(fd);
    // The newcomer's hello; a connection that is not a spade rank is dropped.
    Hello h;
    if (transfer(fd, &h, sizeof h, false,
                 milliseconds(std::max(1, std::min(remaining_ms(deadline), 10000)))) != 0) {
      close_fd(fd);
      continue;
    }
    if (h.magic != kMagic || h.version != kVersion) {
      close_fd(fd);
      continue;
    }
    if (h.size != size_ || h.rank < 1 || h.rank >= size_ || fds_[size_t(h.rank)] >= 0) {
      close_fd(fd);
      fail(who(), ": a process joined the rendezvous at ", l.address_, " as rank ", h.rank, " of ",
           h.size, (h.size == size_ && h.rank >= 1 && h.rank < size_ ? " a second time" : ""),
           "; every rank must be started with the same number of ranks and its own rank");
    }
    fds_[size_t(h.rank)] = fd;
    ++joined;
  }
  // Everyone is here: release them.
  Hello ack;
  ack.size = size_;
  for (int r = 1; r < size_; ++r) send_bytes(fds_[size_t(r)], &ack, sizeof ack, r);
}

void TcpCommunicator::connect_to_root(const std::string& address) {
  const HostPort hp = parse_host_port(address);
  fds_.assign(1, -1);
  const auto deadline = Clock::now() + opt_.connect_timeout;
  std::string last = "no address";
  for (;;) {
    try {
      auto ai = resolve(hp, false);
      for (const addrinfo* a = ai.get(); a && fds_[0] < 0; a = a->ai_next) {
        fds_[0] = try_connect(a, deadline);
        if (fds_[0] < 0) last = std::strerror(errno);
      }
    } catch (const Error& e) {
      last = e.what();
    }
    if (fds_[0] >= 0) break;
    if (Clock::now() >= deadline)
      fail(who(), ": could not reach rank 0 at ", address, " within ",
           seconds(opt_.connect_timeout), " s (last error: ", last, ")");
    std::this_thread::sleep_for(milliseconds(std::min(50, remaining_ms(deadline) + 1)));
  }
  set_nodelay(fds_[0]);
  Hello h;
  h.rank = rank_;
  h.size = size_;
  send_bytes(fds_[0], &h, sizeof h, 0);
  // Rank 0 answers once every rank has joined.
  const int rc = transfer(fds_[0], &h, sizeof h, false, milliseconds(std::max(1, remaining_ms(deadline))));
  if (rc == kClosed)
    fail_all(cat("rank 0 at ", address, " closed the connection before every rank joined"), -1);
  if (rc == ETIMEDOUT)
    fail_all(cat("rank 0 at ", address, " did not see every rank join within ",
                 seconds(opt_.connect_timeout), " s"),
             -1);
  if (rc != 0) fail_all(cat("the rendezvous with rank 0 at ", address, " failed: ", std::strerror(rc)), -1);
  if (h.magic != kMagic || h.size != size_)
    fail_all(cat("the process at ", address, " is not rank 0 of ", size_, " spade ranks"), -1);
}

void TcpCommunicator::fail_all(const std::string& why, int bad_peer) {
  if (broken_.empty()) broken_ = cat(who(), ": ", why);
  if (rank_ == 0) {
    // Tell every peer why, best effort (never blocking), then close.
    Header h;
    h.op = kAbort;
    h.seq = seq_;
    h.bytes = int64_t(broken_.size());
    for (int r = 1; r < int(fds_.size()); ++r) {
      if (r == bad_peer || fds_[size_t(r)] < 0) continue;
      std::string frame(reinterpret_cast<const char*>(&h), sizeof h);
      frame += broken_;
      [[maybe_unused]] ssize_t n =
          ::send(fds_[size_t(r)], frame.data(), frame.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    }
  }
  for (int& fd : fds_) close_fd(fd);
  throw Error(broken_);
}

void TcpCommunicator::check_usable() const {
  if (!broken_.empty()) throw Error(broken_);
}

void TcpCommunicator::send_bytes(int fd, const void* p, int64_t n, int peer) {
  const int rc = transfer(fd, const_cast<void*>(p), n, true, opt_.io_timeout);
  if (rc == 0) return;
  const std::string during = describe(cur_op_, seq_, cur_bytes_, cur_root_);
  if (rc == ETIMEDOUT)
    fail_all(cat("sending to rank ", peer, " stalled for ", seconds(opt_.io_timeout), " s during ",
                 during),
             peer);
  fail_all(cat("sending to rank ", peer, " failed (", std::strerror(rc), "; did it exit?) during ",
               during),
           peer);
}

void TcpCommunicator::recv_bytes(int fd, void* p, int64_t n, int peer) {
  const int rc = transfer(fd, p, n, false, opt_.io_timeout);
  if (rc == 0) return;
  const std::string during = describe(cur_op_, seq_, cur_bytes_, cur_root_);
  if (rc == kClosed)
    fail_all(cat("rank ", peer, " closed its connection (did it exit?) during ", during), peer);
  if (rc == ETIMEDOUT)
    fail_all(cat("no data from rank ", peer, " for ", seconds(opt_.io_timeout), " s during ", during),
             peer);
  fail_all(cat("receiving from rank ", peer, " failed (", std::strerror(rc), "; did it exit?) during ",
               during),
           peer);
}

void TcpCommunicator::begin(uint32_t op, int64_t bytes, int root) {
  check_usable();
  cur_op_ = op;
  cur_bytes_ = bytes;
  cur_root_ = root;
  ++seq_;
}

void TcpCommunicator::gather_headers() {
  for (int r = 1; r < size_; ++r) {
    Header g;
    recv_bytes(fds_[size_t(r)], &g, sizeof g, r);
    if (g.magic != kMagic) fail_all(cat("rank ", r, " sent a malformed frame"), r);
    if (g.op != cur_op_ || g.seq != seq_ || g.bytes != cur_bytes_ || g.root != cur_root_)
      fail_all(cat("the ranks diverged: rank 0 called ", describe(cur_op_, seq_, cur_bytes_, cur_root_),
                   ", rank ", r, " called ", describe(g.op, g.seq, g.bytes, g.root)),
               -1);
  }
}

void TcpCommunicator::send_header() {
  Header h;
  h.op = cur_op_;
  h.seq = seq_;
  h.bytes = cur_bytes_;
  h.root = cur_root_;
  send_bytes(fds_[0], &h, sizeof h, 0);
}

void TcpCommunicator::send_ok(int peer, int64_t bytes) {
  Header h;
  h.op = kOk;
  h.seq = seq_;
  h.bytes = bytes;
  send_bytes(fds_[size_t(peer)], &h, sizeof h, peer);
}

int64_t TcpCommunicator::await_reply() {
  // Rank 0 may itself wait up to io_timeout on another rank before it answers (or says why it
  // cannot): the reply gets twice that.
  Header h;
  const auto saved = opt_.io_timeout;
  opt_.io_timeout = saved * 2;
  try {
    recv_bytes(fds_[0], &h, sizeof h, 0);
  } catch (...) {
    opt_.io_timeout = saved;
    throw;
  }
  opt_.io_timeout = saved;
  if (h.magic == kMagic && h.op == kAbort) {
    std::string msg(size_t(std::clamp<int64_t>(h.bytes, 0, 1 << 16)), '\0');
    try {
      recv_bytes(fds_[0], msg.data(), int64_t(msg.size()), 0);
    } catch (const Error&) {
      msg = "(its message was cut off)";
    }
    broken_.clear();
    fail_all(cat("rank 0 stopped: ", msg), -1);
  }
  if (h.magic != kMagic || h.op != kOk || h.seq != seq_)
    fail_all(cat("rank 0 sent an unexpected frame during ", describe(cur_op_, seq_, cur_bytes_, cur_root_)),
             -1);
  return h.bytes;
}

void TcpCommunicator::all_reduce_sum(float* data, int64_t n) {
  SPADE_CHECK(n >= 0 && (n == 0 || data), "all_reduce_sum: bad buffer");
  if (size_ == 1) return;
  const int64_t bytes = n * int64_t(sizeof(float));
  begin(kAllReduce, bytes, 0);
  if (rank_ != 0) {
    send_header();
    send_bytes(fds_[0], data, bytes, 0);
    if (await_reply() != bytes) fail_all("rank 0 answered with a wrong size", -1);
    recv_bytes(fds_[0], data, bytes, 0);
    return;
  }
  gather_headers();
  if (int64_t(scratch_.size()) < n) scratch_.resize(size_t(n));
  // Rank order: ((x0 + x1) + x2) + ..., the same on every run.
  for (int r = 1; r < size_; ++r) {
    recv_bytes(fds_[size_t(r)], scratch_.data(), bytes, r);
    for (int64_t i = 0; i < n; ++i) data[i] += scratch_[size_t(i)];
  }
  for (int r = 1; r < size_; ++r) {
    send_ok(r, bytes);
    send_bytes(fds_[size_t(r)], data, bytes, r);
  }
}

void TcpCommunicator::broadcast(void* data, int64_t bytes, int root) {
  SPADE_CHECK(bytes >= 0 && (bytes == 0 || data), "broadcast: bad buffer");
  SPADE_CHECK(root >= 0 && root < size_, "broadcast: root ", root, " is outside [0, ", size_, ")");
  if (size_ == 1) return;
  begin(kBroadcast, bytes, root);
  if (rank_ != 0) {
    send_header();
    if (rank_ == root) send_bytes(fds_[0], data, bytes, 0);
    const int64_t want = rank_ == root ? 0 : bytes;
    if (await_reply() != want) fail_all("rank 0 answered with a wrong size", -1);
    if (want) recv_bytes(fds_[0], data, bytes, 0);
    return;
  }
  gather_headers();
  if (root != 0) recv_bytes(fds_[size_t(root)], data, bytes, root);
  for (int r = 1; r < size_; ++r) {
    send_ok(r, r == root ? 0 : bytes);
    if (r != root) send_bytes(fds_[size_t(r)], data, bytes, r);
  }
}

void TcpCommunicator::barrier() {
  if (size_ == 1) return;
  begin(kBarrier, 0, 0);
  if (rank_ != 0) {
    send_header();
    if (await_reply() != 0) fail_all("rank 0 answered with a wrong size", -1);
    return;
  }
  gather_headers();
  for (int r = 1; r < size_; ++r) send_ok(r, 0);
}

}  // namespace spade::dist
