#include "server/socket_probe.h"

#include <poll.h>
#include <sys/socket.h>

#include <cerrno>

namespace spade::server {

bool PeerWatch::gone(const std::string& probe) {
  if (gone_) return true;
  if (fd_ < 0) return false;
  pollfd p{fd_, short(POLLIN | POLLRDHUP), 0};
  if (poll(&p, 1, 0) < 0) return false;
  if (p.revents & (POLLHUP | POLLERR | POLLNVAL)) return gone_ = true;
  if (!eof_ && (p.revents & (POLLIN | POLLRDHUP))) {
    char c;
    const ssize_t n = recv(fd_, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n == 0) eof_ = true;
    else if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return gone_ = true;
    // n > 0: a pipelined next request; it stays in the buffer for the next read.
  }
  if (!eof_) return false;
  if (probe.empty()) return gone_ = true;
  if (!probed_) {
    probed_ = true;
    const ssize_t n = send(fd_, probe.data(), probe.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n != ssize_t(probe.size())) return gone_ = true;
  }
  return false;
}

}  // namespace spade::server
