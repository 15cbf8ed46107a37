// The OpenAI-compatible HTTP server (docs/server.md) over HttpTransport (http_transport.h:
// limits, deadlines, connections that cost no thread while idle): routes, API-key check,
// request -> EngineRequest (tokenization, chat template, defaults, sparse method), and the
// responses, whole or streamed as Server-Sent Events. Generation runs in the Scheduler;
// worker threads only wait on their request's channel, and cancel it when the client
// goes away.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "engine/scheduler.h"
#include "server/metrics_text.h"
#include "server/sparse_adapter.h"

namespace spade {
class Tokenizer;
}

namespace spade::server {

struct ServerOptions {
  std::string model_id = "spade";
  std::string api_key;              // empty: no authentication
  int http_threads = 0;             // 0: max_batch + max_queue + 8
  size_t max_body_bytes = 16 << 20;        // decoded (chunked, gzip) request body
  size_t max_header_bytes = 32 << 10;      // request line + header fields: else 431
  int max_header_fields = 100;             // else 431
  int max_connections = 1024;              // open connections (capped by the descriptor limit): else 503
  int64_t default_completion_tokens = 16;  // /v1/completions without max_tokens
  double keep_alive_seconds = 5;           // idle connection between requests
  double header_timeout_seconds = 10;      // a new connection's request header: else 408
  double io_timeout_seconds = 30;          // a request body; one stalled response write
  bool log_requests = true;                // one stderr line per generation request (--quiet: off)
};

class HttpServer {
 public:
  HttpServer(Scheduler& sched, const Tokenizer& tok, const TokenText& text,
             SparseMethods& sparse, const ModelConfig& cfg, ServerOptions opt);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Binds the listening socket (port 0: any free port); returns the port. Throws on failure.
  int bind(const std::string& host, int port);
  // Serves until stop(); returns after in-flight connections have been handled.
  void serve();
  // New generation requests get 503 and /health reports "draining".
  void begin_drain();
  // Closes the listener and ends serve(). In-flight streams are cut: drain first.
  void stop();
  // Generation requests whose response is still being produced.
  int active() const;
  HttpCounts http_counts() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace spade::server
