#include "server/http_transport.h"

#include <poll.h>
#include <sys/socket.h>
#include <zlib.h>

#include <algorithm>
#include <atomic>
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_set>

#include "core/error.h"
#include "server/socket_probe.h"

namespace spade::server {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;
using error_code = boost::system::error_code;

std::string HttpRequest::header(std::string_view name) const {
  for (const auto& [k, v] : headers)
    if (k == name) return v;
  return {};
}

namespace {

std::string lower(std::string_view s) {
  std::string o(s);
  for (char& c : o) c = char(std::tolower(static_cast<unsigned char>(c)));
  return o;
}

std::string trim(std::string_view s) {
  const size_t a = s.find_first_not_of(" \t"), b = s.find_last_not_of(" \t");
  return a == std::string_view::npos ? std::string() : std::string(s.substr(a, b - a + 1));
}

std::chrono::milliseconds ms(double seconds) {
  return std::chrono::milliseconds(int64_t(std::max(0.0, seconds) * 1000.0));
}

// "HTTP/1.1 <status> <reason>" plus headers; `length` < 0: chunked (HTTP/1.1) or until close.
std::string response_head(int status, int version, const std::string& content_type,
                          const HeaderList& extra, int64_t length, bool keep_alive) {
  const auto r = http::obsolete_reason(http::status(unsigned(status)));
  std::string h = "HTTP/1.1 " + std::to_string(status) + " " + std::string(r.data(), r.size()) + "\r\n";
  if (!content_type.empty()) h += "Content-Type: " + content_type + "\r\n";
  if (length >= 0) h += "Content-Length: " + std::to_string(length) + "\r\n";
  else if (version >= 11) h += "Transfer-Encoding: chunked\r\n";
  for (const auto& [k, v] : extra) h += k + ": " + v + "\r\n";
  h += keep_alive ? "Connection: keep-alive\r\n\r\n" : "Connection: close\r\n\r\n";
  return h;
}

std::string chunk(std::string_view data) {
  char n[24];
  std::snprintf(n, sizeof n, "%zx\r\n", data.size());
  std::string s = n;
  s.append(data.data(), data.size());
  s += "\r\n";
  return s;
}

// gzip or zlib ("deflate") body -> out, at most `limit` bytes. 0 ok, 413 too large, 400 corrupt.
int inflate_body(const std::string& in, size_t limit, std::string& out) {
  z_stream zs{};
  if (inflateInit2(&zs, 15 + 32) != Z_OK) return 400;  // +32: gzip or zlib header
  zs.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(in.data()));
  zs.avail_in = uInt(in.size());
  out.clear();
  char buf[64 << 10];
  int rc = Z_OK, status = 0;
  while (rc != Z_STREAM_END) {
    zs.next_out = reinterpret_cast<Bytef*>(buf);
    zs.avail_out = sizeof buf;
    rc = inflate(&zs, Z_NO_FLUSH);
    if (rc != Z_OK && rc != Z_STREAM_END) {
      status = 400;
      break;
    }
    const size_t got = sizeof buf - zs.avail_out;
    if (out.size() + got > limit) {
      status = 413;
      break;
    }
    out.append(buf, got);
    if (rc == Z_OK && got == 0 && zs.avail_in == 0) {
      status = 400;  // truncated stream
      break;
    }
  }
  inflateEnd(&zs);
  if (status) out.clear();
  return status;
}

class WorkerPool {
 public:
  explicit WorkerPool(int n) {
    for (int i = 0; i < std::max(1, n); ++i) threads_.emplace_back([this] { run(); });
  }
  ~WorkerPool() { join(); }
  void post(std::function<void()> f) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      q_.push_back(std::move(f));
    }
    cv_.notify_one();
  }
  void join() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_)
      if (t.joinable()) t.join();
  }

 private:
  void run() {
    for (;;) {
      std::function<void()> f;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return stop_ || !q_.empty(); });
        if (q_.empty()) return;  // stopping and drained
        f = std::move(q_.front());
        q_.pop_front();
      }
      f();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> q_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace

struct Conn;

struct HttpTransport::Impl {
  Impl(TransportLimits l, TransportHooks h)
      : limits(l), hooks(std::move(h)), acceptor(ioc), pool(l.workers), retry(ioc) {}
  TransportLimits limits;
  TransportHooks hooks;
  net::io_context ioc;
  tcp::acceptor acceptor;
  WorkerPool pool;
  net::steady_timer retry;  // accept back-off after an error (e.g. out of descriptors)
  std::unordered_set<Conn*> conns;  // reactor thread only
  std::atomic<int> n_conns{0};
  std::atomic<bool> stopping{false};
  char drain[16 << 10];  // what lingering closes discard (reactor thread only)

  void accept();
  std::string error_response(int status, const std::string& msg) {
    const std::string body = hooks.error_body ? hooks.error_body(status, msg) : msg;
    return response_head(status, 11, "application/json", {}, int64_t(body.size()), false) + body;
  }
};

struct Conn : std::enable_shared_from_this<Conn> {
  Conn(HttpTransport::Impl& t, tcp::socket s) : t(t), sock(std::move(s)), timer(t.ioc) {}
  HttpTransport::Impl& t;
  tcp::socket sock;
  net::steady_timer timer;
  beast::flat_buffer buf;
  std::optional<http::request_parser<http::string_body>> parser;
  bool timed_out = false;
  bool closed = false;
  std::atomic<bool> in_worker{false};
  std::string path = "other";

  void arm(double seconds) {
    timed_out = false;
    timer.expires_after(ms(seconds));
    timer.async_wait([w = weak_from_this()](const error_code& ec) {
      auto self = w.lock();
      if (ec || !self || self->closed) return;
      self->timed_out = true;
      error_code ig;
      self->sock.cancel(ig);
    });
  }

  void read_next(bool first) {
    if (t.stopping.load()) return close();
    parser.emplace();
    parser->header_limit(uint32_t(std::min<size_t>(t.limits.max_header_bytes, UINT32_MAX)));
    parser->body_limit(uint64_t(t.limits.max_body_bytes));
    path = "other";
    arm(first ? t.limits.header_timeout_s : t.limits.keep_alive_s);
    http::async_read_header(sock, buf, *parser,
                            [self = shared_from_this()](const error_code& ec, size_t) {
                              self->on_header(ec);
                            });
  }

  // A read error: answer what deserves an answer, then close.
  void on_read_error(const error_code& ec, bool started) {
    if (timed_out) {
      if (started) return reply_and_close(408, "the request was not received in time");
      return close();
    }
    if (ec == http::error::header_limit)
      return reply_and_close(431, "the request header is too large");
    if (ec == http::error::body_limit)
      return reply_and_close(413, "the request body is too large (limit " +
                                      std::to_string(t.limits.max_body_bytes) + " bytes)");
    if (ec == http::error::end_of_stream || ec == net::error::eof ||
        ec == net::error::connection_reset || ec == net::error::operation_aborted ||
        ec == http::error::partial_message || ec == net::error::broken_pipe)
      return close();
    return reply_and_close(400, "malformed HTTP request: " + ec.message());
  }

  void on_header(const error_code& ec) {
    timer.cancel();
    if (ec) return on_read_error(ec, buf.size() > 0 || parser->got_some());
    const auto& h = parser->get();
    path = std::string(h.target().substr(0, h.target().find('?')));
    if (std::distance(h.begin(), h.end()) > t.limits.max_header_fields)
      return reply_and_close(431, "the request has more than " +
                                      std::to_string(t.limits.max_header_fields) + " header fields");
    const std::string enc = lower(trim(std::string(h[http::field::content_encoding])));
    if (!enc.empty() && enc != "identity" && enc != "gzip" && enc != "x-gzip" && enc != "deflate")
      return reply_and_close(415, "unsupported Content-Encoding '" + enc +
                                      "' (gzip, deflate or none)");
    if (parser->is_done()) return dispatch();
    arm(t.limits.request_timeout_s);
    auto read_body = [self = shared_from_this()] {
      http::async_read(self->sock, self->buf, *self->parser,
                       [self](const error_code& ec, size_t) { self->on_body(ec); });
    };
    if (lower(trim(std::string(h[http::field::expect]))) == "100-continue") {
      auto msg = std::make_shared<std::string>("HTTP/1.1 100 Continue\r\n\r\n");
      net::async_write(sock, net::buffer(*msg), [self = shared_from_this(), msg, read_body](
                                                    const error_code& ec, size_t) {
        if (ec) return self->close();
        read_body();
      });
      return;
    }
    read_body();
  }

  void on_body(const error_code& ec) {
    timer.cancel();
    if (ec) return on_read_error(ec, true);
    dispatch();
  }

  void dispatch() {
    auto msg = parser->release();
    parser.reset();
    auto req = std::make_shared<HttpRequest>();
    req->method = std::string(msg.method_string());
    req->target = std::string(msg.target());
    req->path = path;
    req->version = msg.version() >= 11 ? 11 : 10;
    for (const auto& f : msg) req->headers.emplace_back(lower(std::string(f.name_string())), std::string(f.value()));
    const bool keep = msg.keep_alive();
    req->body = std::move(msg.body());
    const std::string enc = lower(trim(req->header("content-encoding")));
    if (!enc.empty() && enc != "identity") {
      std::string out;
      const int st = inflate_body(req->body, t.limits.max_body_bytes, out);
      if (st == 413)
        return reply_and_close(413, "the decoded request body is too large (limit " +
                                        std::to_string(t.limits.max_body_bytes) + " bytes)");
      if (st) return reply_and_close(400, "the request body is not valid " + enc + " data");
      req->body = std::move(out);
    }
    HttpResponse quick;
    if (t.hooks.quick && t.hooks.quick(*req, quick)) {
      const bool k = keep && !t.stopping.load();
      if (t.hooks.on_response) t.hooks.on_response(path, quick.status);
      return send_then(response_head(quick.status, req->version, quick.content_type, quick.headers,
                                     int64_t(quick.body.size()), k) + quick.body, k);
    }
    in_worker = true;
    t.pool.post([self = shared_from_this(), req, keep] { self->work(*req, keep); });
  }

  void work(const HttpRequest& req, bool keep);  // worker thread

  // Reactor: write `bytes`, then read the next request or close.
  void send_then(std::string bytes, bool keep) {
    auto p = std::make_shared<std::string>(std::move(bytes));
    arm(t.limits.write_timeout_s);
    net::async_write(sock, net::buffer(*p), [self = shared_from_this(), p, keep](const error_code& ec, size_t) {
      self->timer.cancel();
      if (ec || !keep) return self->close();
      self->read_next(false);
    });
  }

  // Writes an error response, stops sending and discards what the client still sends for a
  // short while, so that it reads the answer instead of a reset (a lingering close).
  void reply_and_close(int status, const std::string& msg) {
    if (t.hooks.on_response) t.hooks.on_response(path, status);
    auto p = std::make_shared<std::string>(t.error_response(status, msg));
    arm(t.limits.write_timeout_s);
    net::async_write(sock, net::buffer(*p), [self = shared_from_this(), p](const error_code& ec, size_t) {
      self->timer.cancel();
      if (ec) return self->close();
      error_code ig;
      self->sock.shutdown(tcp::socket::shutdown_send, ig);
      self->arm(2.0);
      self->discard();
    });
  }
  void discard() {
    sock.async_read_some(net::buffer(t.drain), [self = shared_from_this()](const error_code& ec, size_t) {
      if (ec) return self->close();
      self->discard();
    });
  }

  void close() {
    if (closed) return;
    closed = true;
    error_code ig;
    timer.cancel();
    sock.shutdown(tcp::socket::shutdown_both, ig);
    sock.close(ig);
    t.conns.erase(this);
    t.n_conns.fetch_sub(1);
  }
};

namespace {

// The worker's side of one request: writes go straight to the socket (the reactor does not
// touch it until the worker hands it back).
class WorkerExchange final : public HttpExchange {
 public:
  WorkerExchange(Conn& c, const HttpRequest& req, bool keep)
      : c_(c), req_(req), keep_(keep), fd_(c.sock.native_handle()), watch_(fd_) {}

  const HttpRequest& request() const override { return req_; }

  void respond(const HttpResponse& r) override {
    if (head_sent_) return;
    head_sent_ = true;
    note(r.status);
    keep_ = keep_ && !watch_.saw_eof();
    write(response_head(r.status, req_.version, r.content_type, r.headers, int64_t(r.body.size()), keep_) +
          r.body);
  }
  bool begin_stream(int status, const std::string& content_type, const HeaderList& h) override {
    if (head_sent_) return false;
    head_sent_ = streaming_ = true;
    note(status);
    chunked_ = req_.version >= 11;
    if (!chunked_) keep_ = false;  // HTTP/1.0: the body ends with the connection
    return write(response_head(status, req_.version, content_type, h, -1, keep_));
  }
  bool write_chunk(std::string_view data) override {
    if (data.empty()) return !failed_;
    return write(chunked_ ? chunk(data) : std::string(data));
  }
  void end_stream() override {
    if (chunked_) write("0\r\n\r\n");
  }
  bool peer_gone() override {
    if (failed_ || gone_) return true;
    // Before the response head: an interim 100 (HTTP/1.1 clients must accept one); inside a
    // stream: an SSE comment line.
    std::string probe;
    if (!head_sent_) probe = req_.version >= 11 ? "HTTP/1.1 100 Continue\r\n\r\n" : "";
    else if (streaming_) probe = chunked_ ? chunk(":\n\n") : ":\n\n";
    if (watch_.gone(probe)) gone_ = true;
    return gone_;
  }

  bool responded() const { return head_sent_; }
  // The handler found the client gone (peer_gone()) and left without an answer: there is no
  // one to send one to. Counted as 499 (nginx's "client closed request"), not as a 500.
  bool client_left() const { return gone_ || failed_; }
  void note_client_left() {
    note(499);
    keep_ = false;
  }
  bool keep() const { return keep_ && !failed_ && !watch_.saw_eof() && (!streaming_ || chunked_); }

 private:
  void note(int status) {
    if (c_.t.hooks.on_response) c_.t.hooks.on_response(req_.path, status);
  }
  bool write(const std::string& s) {
    if (failed_) return false;
    const auto deadline = std::chrono::steady_clock::now() + ms(c_.t.limits.write_timeout_s);
    size_t off = 0;
    while (off < s.size()) {
      const ssize_t n = send(fd_, s.data() + off, s.size() - off, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) {
        off += size_t(n);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            deadline - std::chrono::steady_clock::now()).count();
        pollfd p{fd_, POLLOUT, 0};
        if (left > 0 && poll(&p, 1, int(std::min<int64_t>(left, 1000))) >= 0 &&
            !(p.revents & (POLLERR | POLLHUP | POLLNVAL)))
          continue;  // writable again, or a slice of the deadline passed: try once more
      }
      failed_ = true;
      return false;
    }
    return true;
  }

  Conn& c_;
  const HttpRequest& req_;
  bool keep_;
  int fd_;
  PeerWatch watch_;
  bool head_sent_ = false, streaming_ = false, chunked_ = false, failed_ = false, gone_ = false;
};

}  // namespace

void Conn::work(const HttpRequest& req, bool keep) {
  WorkerExchange ex(*this, req, keep && !t.stopping.load());
  try {
    t.hooks.handle(ex);
  } catch (const std::exception& e) {
    if (!ex.responded()) {
      HttpResponse r;
      r.status = 500;
      r.body = t.hooks.error_body ? t.hooks.error_body(500, std::string("internal error: ") + e.what())
                                  : e.what();
      ex.respond(r);
    }
  }
  if (!ex.responded() && ex.client_left()) {
    ex.note_client_left();
  } else if (!ex.responded()) {
    HttpResponse r;
    r.status = 500;
    r.body = t.hooks.error_body ? t.hooks.error_body(500, "no response was produced") : "";
    ex.respond(r);
  }
  const bool k = ex.keep();
  net::post(t.ioc, [self = shared_from_this(), k] {
    self->in_worker = false;
    if (k && !self->t.stopping.load()) self->read_next(false);
    else self->close();
  });
}

void HttpTransport::Impl::accept() {
  acceptor.async_accept(ioc, [this](const error_code& ec, tcp::socket s) {
    if (stopping.load() || !acceptor.is_open()) return;
    if (ec) {
      // Out of descriptors or the like: try again shortly instead of spinning.
      retry.expires_after(std::chrono::milliseconds(50));
      retry.async_wait([this](const error_code& e) {
        if (!e) accept();
      });
      return;
    }
    error_code ig;
    s.set_option(tcp::no_delay(true), ig);
    auto c = std::make_shared<Conn>(*this, std::move(s));
    conns.insert(c.get());
    const int n = n_conns.fetch_add(1) + 1;
    if (n > limits.max_connections)
      c->reply_and_close(503, "the server has too many open connections (" +
                                  std::to_string(limits.max_connections) + "); retry later");
    else
      c->read_next(true);
    accept();
  });
}

HttpTransport::HttpTransport(TransportLimits limits, TransportHooks hooks)
    : impl_(std::make_shared<Impl>(limits, std::move(hooks))) {
  SPADE_CHECK(impl_->hooks.handle, "HttpTransport: no request handler");
}

HttpTransport::~HttpTransport() {
  stop();
  impl_->pool.join();
}

int HttpTransport::bind(const std::string& host, int port) {
  Impl& m = *impl_;
  error_code ec;
  tcp::resolver res(m.ioc);
  auto eps = res.resolve(host, std::to_string(port), ec);
  SPADE_CHECK(!ec && !eps.empty(), "cannot listen on ", host, ":", port, ": ", ec.message());
  const tcp::endpoint ep = eps.begin()->endpoint();
  m.acceptor.open(ep.protocol(), ec);
  if (!ec) m.acceptor.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) m.acceptor.bind(ep, ec);
  if (!ec) m.acceptor.listen(net::socket_base::max_listen_connections, ec);
  SPADE_CHECK(!ec, "cannot listen on ", host, ":", port, " (", ec.message(), ")");
  return m.acceptor.local_endpoint().port();
}

void HttpTransport::serve() {
  Impl& m = *impl_;
  m.accept();
  m.ioc.run();
  m.pool.join();
}

void HttpTransport::stop() {
  Impl* m = impl_.get();  // ~HttpTransport joins the workers before the Impl goes
  if (m->stopping.exchange(true)) return;
  net::post(m->ioc, [m] {
    error_code ig;
    m->acceptor.close(ig);
    m->retry.cancel();
    std::vector<Conn*> all(m->conns.begin(), m->conns.end());
    for (Conn* c : all) {
      if (c->in_worker.load()) {
        // The worker owns the socket: cut it so its writes fail and it sees the peer gone.
        ::shutdown(c->sock.native_handle(), SHUT_RDWR);
      } else {
        c->close();
      }
    }
    m->ioc.stop();
  });
}

int HttpTransport::open_connections() const { return impl_->n_conns.load(); }

}  // namespace spade::server
