// Client-disconnect detection (src/server/socket_probe.h) on real loopback TCP sockets.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "server/socket_probe.h"

using namespace spade::server;

namespace {

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

// Polls `w` for up to 1 s until it reports the peer gone; returns whether it did.
bool gone_within_1s(PeerWatch& w, const std::string& probe) {
  for (int i = 0; i < 100; ++i) {
    if (w.gone(probe)) return true;
    usleep(10000);
  }
  return false;
}

const std::string kProbe = "HTTP/1.1 100 Continue\r\n\r\n";

}  // namespace

TEST(ServerSocket, LiveClientWithUnreadDataIsNotGone) {
  auto [s, c] = tcp_pair();
  ASSERT_GE(s, 0);
  PeerWatch w(s);
  EXPECT_FALSE(w.gone(kProbe));
  ASSERT_EQ(write(c, "x", 1), 1);  // a pipelined byte: not a disconnect, and not consumed
  usleep(10000);
  EXPECT_FALSE(w.gone(kProbe));
  char b;
  EXPECT_EQ(recv(s, &b, 1, MSG_DONTWAIT), 1);
  EXPECT_FALSE(w.saw_eof());
  close(c);
  close(s);
  EXPECT_FALSE(PeerWatch(-1).gone(kProbe));
}

TEST(ServerSocket, HalfClosedClientStaysAndReadsTheProbe) {
  auto [s, c] = tcp_pair();
  ASSERT_GE(s, 0);
  ASSERT_EQ(shutdown(c, SHUT_WR), 0);  // the request is sent; the client still reads
  PeerWatch w(s);
  EXPECT_FALSE(gone_within_1s(w, kProbe));
  EXPECT_TRUE(w.saw_eof());
  char buf[64] = {};
  ASSERT_EQ(recv(c, buf, sizeof buf - 1, MSG_DONTWAIT), ssize_t(kProbe.size()));
  EXPECT_EQ(std::string(buf), kProbe);
  // The answer still reaches it.
  ASSERT_EQ(send(s, "ok", 2, MSG_NOSIGNAL), 2);
  usleep(10000);
  EXPECT_EQ(recv(c, buf, sizeof buf, MSG_DONTWAIT), 2);
  close(c);
  close(s);
}

TEST(ServerSocket, ClosedClientIsGoneAfterTheProbe) {
  auto [s, c] = tcp_pair();
  ASSERT_GE(s, 0);
  close(c);
  PeerWatch w(s);
  EXPECT_TRUE(gone_within_1s(w, kProbe));  // the probe draws the reset
  EXPECT_TRUE(w.gone(kProbe));             // and stays gone
  close(s);
}

TEST(ServerSocket, WithoutAProbeEndOfStreamIsGone) {
  auto [s, c] = tcp_pair();
  ASSERT_GE(s, 0);
  ASSERT_EQ(shutdown(c, SHUT_WR), 0);
  PeerWatch w(s);
  EXPECT_TRUE(gone_within_1s(w, ""));  // HTTP/1.0: nothing may be sent before the answer
  close(c);
  close(s);
}
