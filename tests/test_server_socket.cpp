// Client-disconnect detection (src/server/socket_probe.h) on real loopback TCP sockets.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "server/socket_probe.h"

using namespace spade::server;

namespace {

int port_of(int fd, bool peer) {
  sockaddr_in a{};
  socklen_t n = sizeof a;
  if (peer) getpeername(fd, reinterpret_cast<sockaddr*>(&a), &n);
  else getsockname(fd, reinterpret_cast<sockaddr*>(&a), &n);
  return ntohs(a.sin_port);
}

// A connected pair over 127.0.0.1: {server side, client side}.
std::pair<int, int> tcp_pair() {
  int ls = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(bind(ls, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  EXPECT_EQ(listen(ls, 4), 0);
  socklen_t n = sizeof a;
  getsockname(ls, reinterpret_cast<sockaddr*>(&a), &n);
  int c = socket(AF_INET, SOCK_STREAM, 0);
  EXPECT_EQ(connect(c, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  int s = accept(ls, nullptr, nullptr);
  close(ls);
  return {s, c};
}

}  // namespace

TEST(ServerSocket, FindsTheServerSideAndSeesTheClientLeave) {
  auto [s, c] = tcp_pair();
  ASSERT_GE(s, 0);
  // The handler knows its local port and the client's port, as cpp-httplib reports them.
  const int local = port_of(s, false), remote = port_of(s, true);
  EXPECT_EQ(find_connection_socket(local, remote), s);
  EXPECT_EQ(find_connection_socket(local, remote), s);  // cached
  EXPECT_EQ(find_connection_socket(local, remote + 1 == 65536 ? 1 : remote + 1), -1);
  EXPECT_FALSE(peer_closed(s));
  // Unread data from a live client is not a disconnect.
  ASSERT_EQ(write(c, "x", 1), 1);
  usleep(10000);
  EXPECT_FALSE(peer_closed(s));
  close(c);
  usleep(10000);
  EXPECT_TRUE(peer_closed(s));
  close(s);
  EXPECT_FALSE(peer_closed(-1));
}
