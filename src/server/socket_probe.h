// Client-disconnect detection while a response is being produced, on the connected socket
// itself. A peer that reset the connection, or closed it fully, is gone; a peer that only
// shut down its sending side after a complete request (a legal HTTP half-close) is not.
// The two look alike on the wire until the server sends something: a fully closed peer
// answers any byte with a reset. So on end-of-stream PeerWatch sends one probe the client
// ignores (an HTTP/1.1 interim "100 Continue" before the response, or an SSE comment
// inside a stream) and reports the peer gone only when the reset arrives.
#pragma once
#include <string>

namespace spade::server {

class PeerWatch {
 public:
  explicit PeerWatch(int fd) : fd_(fd) {}
  // Never blocks. `probe`: bytes that may be sent to a half-closed peer (empty: none may,
  // and end-of-stream means gone, as for an HTTP/1.0 client).
  bool gone(const std::string& probe);
  bool saw_eof() const { return eof_; }

 private:
  int fd_;
  bool eof_ = false;
  bool probed_ = false;
  bool gone_ = false;
};

}  // namespace spade::server
