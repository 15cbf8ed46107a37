#include "server/socket_probe.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <cstdlib>

namespace spade::server {

namespace {

int port_of(const sockaddr_storage& a) {
  if (a.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in&>(a).sin_port);
  if (a.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6&>(a).sin6_port);
  return -1;
}

bool matches(int fd, int local_port, int remote_port) {
  sockaddr_storage a{};
  socklen_t n = sizeof a;
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&a), &n) != 0 || port_of(a) != remote_port)
    return false;
  n = sizeof a;
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&a), &n) != 0 || port_of(a) != local_port)
    return false;
  return true;
}

}  // namespace

int find_connection_socket(int local_port, int remote_port) {
  if (local_port <= 0 || remote_port <= 0) return -1;
  thread_local int cached = -1;
  if (cached >= 0 && matches(cached, local_port, remote_port)) return cached;
  cached = -1;
  DIR* d = opendir("/proc/self/fd");
  if (!d) return -1;
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
    const int fd = std::atoi(e->d_name);
    if (fd == dirfd(d)) continue;
    if (matches(fd, local_port, remote_port)) {
      cached = fd;
      break;
    }
  }
  closedir(d);
  return cached;
}

bool peer_closed(int fd) {
  if (fd < 0) return false;
  pollfd p{fd, short(POLLIN | POLLRDHUP), 0};
  if (poll(&p, 1, 0) <= 0) return false;
  if (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) return true;
  if (p.revents & POLLIN) {
    char c;
    return recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
  }
  return false;
}

}  // namespace spade::server
