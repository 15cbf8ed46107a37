// The HTTP/1.1 transport of `spade serve`, on Boost.Beast's parser and Asio (docs/design.md
// says why not cpp-httplib). One reactor thread owns every connection while it is idle or
// reading a request, so idle, slow and half-sent connections cost a socket and a buffer,
// never a thread. A request is handed on only once it is whole and within the limits:
//   - the request line and header fields within max_header_bytes and max_header_fields
//     (else 431), read within header_timeout_s of the first wait (else 408 and close);
//   - the body, after chunked transfer coding AND Content-Encoding (gzip / deflate) are
//     decoded, within max_body_bytes (else 413, as soon as the limit is crossed: a
//     Content-Length over it is refused before any body byte is read), read within
//     request_timeout_s; other content codings get 415;
//   - at most max_connections open connections; the next one gets 503 and is closed.
// Complete requests go to `quick` on the reactor (cheap routes: health, metrics, errors),
// or, if it declines, to `handle` on one of `workers` threads, which writes its response
// itself (whole, or chunked for Server-Sent Events) with write_timeout_s per write.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace spade::server {

struct TransportLimits {
  size_t max_body_bytes = 16 << 20;
  size_t max_header_bytes = 32 << 10;
  int max_header_fields = 100;
  double header_timeout_s = 10;   // connection open or keep-alive wait -> whole header
  double request_timeout_s = 30;  // header received -> whole body
  double keep_alive_s = 5;        // idle between requests on one connection
  double write_timeout_s = 30;    // one write that makes no progress this long ends the connection
  int max_connections = 1024;
  int workers = 16;
};

using HeaderList = std::vector<std::pair<std::string, std::string>>;

struct HttpRequest {
  std::string method;
  std::string path;    // target without the query
  std::string target;  // as sent
  HeaderList headers;  // names lower-case
  std::string body;    // decoded
  int version = 11;    // 10 or 11
  std::string header(std::string_view lower_name) const;  // "" when absent
};

struct HttpResponse {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  HeaderList headers;
};

// One request on a worker thread. Exactly one of respond() or begin_stream() .. end_stream().
class HttpExchange {
 public:
  virtual ~HttpExchange() = default;
  virtual const HttpRequest& request() const = 0;
  virtual void respond(const HttpResponse& r) = 0;
  // Sends the status line and headers of a chunked response; false if the client is gone.
  virtual bool begin_stream(int status, const std::string& content_type, const HeaderList& h) = 0;
  virtual bool write_chunk(std::string_view data) = 0;
  virtual void end_stream() = 0;
  // True once the client has gone (reset the connection, or closed it and did not take a
  // probe); never blocks. A client that only shut down its sending side (half-close after a
  // complete request) is not gone: it gets its answer.
  virtual bool peer_gone() = 0;
};

struct TransportHooks {
  // Reactor thread: answer cheap requests here (return true with `out` filled).
  std::function<bool(const HttpRequest&, HttpResponse& out)> quick;
  // Worker thread: every other request.
  std::function<void(HttpExchange&)> handle;
  // An error the transport answers itself (408, 413, 415, 431, 503, 400): the body.
  std::function<std::string(int status, const std::string& message)> error_body;
  // Every response's path and status, once its head is written (any thread).
  std::function<void(const std::string& path, int status)> on_response;
};

class HttpTransport {
 public:
  HttpTransport(TransportLimits limits, TransportHooks hooks);
  ~HttpTransport();
  HttpTransport(const HttpTransport&) = delete;
  HttpTransport& operator=(const HttpTransport&) = delete;

  // Binds and listens (port 0: any free port); returns the port. Throws spade::Error.
  int bind(const std::string& host, int port);
  // Runs the reactor on the calling thread until stop(); joins the workers before returning.
  void serve();
  // Closes the listener and every connection (in-flight responses are cut); serve() returns.
  void stop();
  int open_connections() const;

  struct Impl;  // opaque (http_transport.cpp)

 private:
  std::shared_ptr<Impl> impl_;
};

}  // namespace spade::server
