#include "server/http_server.h"

#include <httplib.h>

#include <chrono>
#include <nlohmann/json.hpp>
#include <random>

#include "server/openai_response.h"
#include "server/socket_probe.h"
#include "tokenizer/tokenizer.h"

namespace spade::server {

using json = nlohmann::json;
using namespace std::chrono_literals;

namespace {

constexpr auto kPoll = 50ms;  // how often a waiting handler checks its client

ApiError api_error(int status, std::string message, std::string code = {}, std::string param = {}) {
  ApiError e;
  e.status = status;
  e.message = std::move(message);
  e.code = std::move(code);
  e.param = std::move(param);
  switch (status) {
    case 401: e.type = "authentication_error"; break;
    case 404: e.type = "not_found_error"; break;
    case 429: e.type = "rate_limit_error"; break;
    case 500: e.type = "server_error"; break;
    case 503: e.type = "service_unavailable"; break;
    default: e.type = "invalid_request_error"; break;
  }
  return e;
}

void send_error(httplib::Response& res, const ApiError& e) {
  res.status = e.status;
  res.set_content(error_json(e), "application/json");
}

uint64_t splitmix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Rendering for models without a chat template (e.g. base models): plain "role: text"
// lines and an "assistant:" cue.
std::string plain_chat(const std::vector<ApiMessage>& msgs, bool add_generation_prompt) {
  std::string s;
  for (const ApiMessage& m : msgs) s += m.role + ": " + m.content + "\n";
  if (add_generation_prompt) s += "assistant:";
  return s;
}

bool constant_time_equal(const std::string& a, const std::string& b) {
  if (a.size() != b.size() || b.empty()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= uint8_t(a[i] ^ b[i]);
  return diff == 0;
}

// One streamed response: pulls deltas from the channel and writes SSE events.
struct StreamState {
  std::shared_ptr<RequestChannel> ch;
  ResponseMeta meta;
  int fd = -1;
  bool include_usage = false;
  bool started = false;
  std::string echo;
  size_t offset = 0;
  RequestDelta delta;

  bool write(httplib::DataSink& sink, const std::string& s) {
    return s.empty() || sink.write(s.data(), s.size());
  }
  // One call of cpp-httplib's content provider; false aborts the connection.
  bool pump(httplib::DataSink& sink) {
    if (!started) {
      started = true;
      if (meta.kind == ApiKind::Chat && !write(sink, stream_chunk(meta, "", {}, nullptr, true, 0)))
        return fail();
      if (!echo.empty()) {
        if (!write(sink, stream_chunk(meta, echo, {}, nullptr, false, 0))) return fail();
        offset += echo.size();
      }
    }
    if (peer_closed(fd)) return fail();
    if (!ch->wait_take(delta, kPoll)) return true;  // nothing yet: called again
    if (!delta.text.empty() || !delta.logprobs.empty()) {
      if (!write(sink, stream_chunk(meta, delta.text, delta.logprobs, nullptr, false, offset)))
        return fail();
      offset += delta.text.size();
    }
    if (!delta.finished) return true;
    std::string tail;
    if (delta.reason == FinishReason::Error || delta.reason == FinishReason::Cancelled) {
      tail = stream_error(delta.reason == FinishReason::Error
                              ? api_error(500, delta.error.empty() ? "generation failed" : delta.error)
                              : api_error(503, delta.error.empty() ? "the request was cancelled"
                                                                   : delta.error));
    } else {
      tail = stream_chunk(meta, "", {}, api_finish_reason(delta.reason), false, offset);
      if (include_usage) tail += usage_chunk(meta, delta.prompt_tokens, delta.completion_tokens);
    }
    tail += stream_done();
    if (!write(sink, tail)) return fail();
    sink.done();
    return true;
  }
  bool fail() {
    ch->cancel();
    return false;
  }
};

}  // namespace

struct HttpServer::Impl {
  Impl(Scheduler& s, const Tokenizer& t, const TokenText& tt, SparseMethods& sp,
       const ModelConfig& c, ServerOptions o)
      : sched(s), tok(t), text(tt), sparse(sp), cfg(c), opt(std::move(o)) {
    salt = splitmix(uint64_t(std::random_device{}()) ^
                    uint64_t(std::chrono::steady_clock::now().time_since_epoch().count()));
  }

  Scheduler& sched;
  const Tokenizer& tok;
  const TokenText& text;
  SparseMethods& sparse;
  const ModelConfig& cfg;
  ServerOptions opt;
  httplib::Server svr;
  std::atomic<bool> draining{false};
  std::atomic<int> active{0};
  std::atomic<uint64_t> counter{0};
  uint64_t salt = 0;
  mutable std::mutex count_mu;
  HttpCounts counts;

  std::string new_id(const char* prefix) {
    char b[40];
    std::snprintf(b, sizeof b, "%s%016llx", prefix,
                  (unsigned long long)splitmix(salt + counter.fetch_add(1)));
    return b;
  }

  void setup();
  void generate(const httplib::Request& req, httplib::Response& res, ApiKind kind);
  void tokenize(const httplib::Request& req, httplib::Response& res);
  void detokenize(const httplib::Request& req, httplib::Response& res);
  std::string render_chat(const std::vector<ApiMessage>& msgs, bool add_generation_prompt);
  std::vector<int32_t> chat_tokens(const std::vector<ApiMessage>& msgs, bool add_generation_prompt);
};

std::string HttpServer::Impl::render_chat(const std::vector<ApiMessage>& msgs,
                                          bool add_generation_prompt) {
  const ChatTemplate* t = tok.chat_template();
  if (!t) return plain_chat(msgs, add_generation_prompt);
  std::vector<ChatMessage> cm;
  cm.reserve(msgs.size());
  for (const ApiMessage& m : msgs) cm.push_back({m.role, m.content});
  return t->render(cm, add_generation_prompt);
}

std::vector<int32_t> HttpServer::Impl::chat_tokens(const std::vector<ApiMessage>& msgs,
                                                   bool add_generation_prompt) {
  const std::string s = render_chat(msgs, add_generation_prompt);
  // A real template writes its own BOS text; the plain fallback gets the tokenizer's.
  return tok.encode(s, /*add_special=*/tok.chat_template() == nullptr, /*parse_special=*/true);
}

void HttpServer::Impl::generate(const httplib::Request& req, httplib::Response& res, ApiKind kind) {
  if (draining.load()) return send_error(res, api_error(503, "the server is shutting down", "server_shutting_down"));
  ParseResult pr = kind == ApiKind::Chat ? parse_chat_request(req.body) : parse_completion_request(req.body);
  if (!pr.ok()) return send_error(res, pr.error);
  ApiRequest& a = *pr.request;
  const int32_t vocab = std::min<int32_t>(tok.vocab_size(), cfg.vocab);

  EngineRequest er;
  std::string echo;
  try {
    if (kind == ApiKind::Chat) {
      er.prompt = chat_tokens(a.messages, a.add_generation_prompt);
    } else if (a.prompt_is_ids) {
      er.prompt = std::move(a.prompt_ids);
      for (int32_t id : er.prompt)
        if (id >= vocab)
          return send_error(res, api_error(400, cat("prompt token id ", id, " is outside the vocabulary [0, ",
                                                    vocab, ")"), "invalid_value", "prompt"));
      if (a.echo) echo = tok.decode(er.prompt);
    } else {
      er.prompt = tok.encode(a.prompt, true, true);
      if (a.echo) echo = a.prompt;
    }
  } catch (const std::exception& e) {
    return send_error(res, api_error(400, cat(kind == ApiKind::Chat ? "cannot apply the chat template: "
                                                                    : "cannot tokenize the prompt: ",
                                              e.what()),
                                     "invalid_value", kind == ApiKind::Chat ? "messages" : "prompt"));
  }
  if (er.prompt.empty())
    return send_error(res, api_error(400, "the prompt is empty (no tokens)", "invalid_value", "prompt"));
  const int64_t P = int64_t(er.prompt.size()), ctx = sched.max_context();
  if (a.max_tokens) {
    er.max_tokens = *a.max_tokens;
  } else {
    const int64_t def = kind == ApiKind::Chat ? ctx : opt.default_completion_tokens;
    er.max_tokens = std::max<int64_t>(1, std::min(def, ctx - P));
  }
  er.sampling.temperature = float(a.temperature);
  er.sampling.top_p = float(a.top_p);
  er.sampling.top_k = a.top_k > 0 ? int(std::min<int64_t>(a.top_k, vocab)) : 0;
  er.sampling.min_p = float(a.min_p);
  er.sampling.repetition_penalty = float(a.repetition_penalty);
  er.sampling.seed = a.seed ? *a.seed : splitmix(salt ^ (counter.fetch_add(1) << 1));
  er.stop = std::move(a.stop);
  if (!a.ignore_eos) er.stop_ids = tok.eos_ids();
  for (int32_t id : a.stop_token_ids) {
    if (id >= vocab)
      return send_error(res, api_error(400, cat("stop token id ", id, " is outside the vocabulary"),
                                       "invalid_value", "stop_token_ids"));
    er.stop_ids.push_back(id);
  }
  er.logprobs = a.logprobs;
  try {
    ResolvedSparse sp = sparse.resolve(a.sparse);
    er.method = sp.method;
    er.attention = std::move(sp.maker);
  } catch (const std::exception& e) {
    return send_error(res, api_error(400, e.what(), "invalid_value", "sparse"));
  }

  std::shared_ptr<RequestChannel> ch;
  try {
    ch = sched.submit(std::move(er));
  } catch (const SubmitError& e) {
    ApiError err = api_error(e.status, e.what(), e.code);
    if (e.status == 429 || e.status == 503) res.set_header("Retry-After", "1");
    return send_error(res, err);
  }

  ResponseMeta meta;
  meta.kind = kind;
  meta.id = new_id(kind == ApiKind::Chat ? "chatcmpl-" : "cmpl-");
  meta.created = std::chrono::duration_cast<std::chrono::seconds>(
                     std::chrono::system_clock::now().time_since_epoch()).count();
  meta.model = opt.model_id;
  meta.logprobs = a.logprobs;
  meta.text = &text;
  const int fd = find_connection_socket(req.local_port, req.remote_port);

  if (a.stream) {
    auto st = std::make_shared<StreamState>();
    st->ch = ch;
    st->meta = meta;
    st->fd = fd;
    st->include_usage = a.include_usage;
    st->echo = std::move(echo);
    ++active;
    res.set_header("Cache-Control", "no-cache");
    res.set_header("X-Accel-Buffering", "no");
    res.set_chunked_content_provider(
        "text/event-stream", [st](size_t, httplib::DataSink& sink) { return st->pump(sink); },
        [st, this](bool) {
          if (!st->ch->finished()) st->ch->cancel();
          --active;
        });
    return;
  }

  ++active;
  struct Done {
    std::atomic<int>& n;
    ~Done() { --n; }
  } done{active};
  std::string out = std::move(echo);
  std::vector<TokenLogprob> lps;
  RequestDelta d;
  for (;;) {
    if (ch->wait_take(d, kPoll)) {
      out += d.text;
      for (auto& l : d.logprobs) lps.push_back(std::move(l));
      if (d.finished) break;
    }
    if (peer_closed(fd)) {
      ch->cancel();
      res.status = 499;  // client closed the request; nothing will be read
      return;
    }
  }
  if (d.reason == FinishReason::Error)
    return send_error(res, api_error(500, d.error.empty() ? "generation failed" : d.error));
  if (d.reason == FinishReason::Cancelled)
    return send_error(res, api_error(503, d.error.empty() ? "the request was cancelled" : d.error,
                                     "server_shutting_down"));
  res.set_content(full_response(meta, out, lps, d.reason, d.prompt_tokens, d.completion_tokens),
                  "application/json");
}

void HttpServer::Impl::tokenize(const httplib::Request& req, httplib::Response& res) {
  ApiError err;
  auto t = parse_tokenize_request(req.body, err);
  if (!t) return send_error(res, err);
  std::vector<int32_t> ids;
  try {
    if (t->is_chat) {
      ids = tok.encode(render_chat(t->messages, t->add_generation_prompt),
                       t->add_special_tokens || tok.chat_template() == nullptr, true);
    } else {
      ids = tok.encode(t->prompt, t->add_special_tokens, true);
    }
  } catch (const std::exception& e) {
    return send_error(res, api_error(400, e.what(), "invalid_value"));
  }
  json j = {{"tokens", ids}, {"count", ids.size()}, {"max_model_len", sched.max_context()}};
  res.set_content(j.dump(), "application/json");
}

void HttpServer::Impl::detokenize(const httplib::Request& req, httplib::Response& res) {
  ApiError err;
  auto t = parse_detokenize_request(req.body, err);
  if (!t) return send_error(res, err);
  for (int32_t id : t->tokens)
    if (id >= tok.vocab_size())
      return send_error(res, api_error(400, cat("token id ", id, " is outside the vocabulary [0, ",
                                                tok.vocab_size(), ")"), "invalid_value", "tokens"));
  json j = {{"prompt", tok.decode(t->tokens)}};
  res.set_content(j.dump(-1, ' ', false, json::error_handler_t::replace), "application/json");
}

void HttpServer::Impl::setup() {
  const int threads = opt.http_threads > 0
                          ? opt.http_threads
                          : sched.options().max_batch + sched.options().max_queue + 8;
  svr.new_task_queue = [threads] { return new httplib::ThreadPool(size_t(threads)); };
  svr.set_payload_max_length(opt.max_body_bytes);
  svr.set_keep_alive_timeout(opt.keep_alive_seconds);
  svr.set_read_timeout(opt.io_timeout_seconds, 0);
  svr.set_write_timeout(opt.io_timeout_seconds, 0);
  svr.set_tcp_nodelay(true);

  svr.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (opt.api_key.empty() || req.path == "/health" || req.path == "/metrics")
      return httplib::Server::HandlerResponse::Unhandled;
    std::string key = req.get_header_value("Authorization");
    if (key.rfind("Bearer ", 0) == 0) key = key.substr(7);
    else key = req.get_header_value("X-Api-Key");
    if (constant_time_equal(key, opt.api_key)) return httplib::Server::HandlerResponse::Unhandled;
    send_error(res, api_error(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                              "invalid_api_key"));
    return httplib::Server::HandlerResponse::Handled;
  });
  // Every error status gets an OpenAI-shaped body unless the handler wrote one.
  svr.set_error_handler(httplib::Server::HandlerWithResponse(
      [](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty() || res.status == 499) return httplib::Server::HandlerResponse::Unhandled;
    std::string msg;
    switch (res.status) {
      case 404: msg = "no route for " + req.method + " " + req.path; break;
      case 405: msg = "method " + req.method + " not allowed on " + req.path; break;
      case 413: msg = "the request body is too large"; break;
      case 414: msg = "the request URI is too long"; break;
      default: msg = "HTTP error " + std::to_string(res.status); break;
    }
    send_error(res, api_error(res.status, msg));
    return httplib::Server::HandlerResponse::Handled;
  }));
  svr.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string msg = "internal error";
    try {
      if (ep) std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      msg = std::string("internal error: ") + e.what();
    } catch (...) {
    }
    send_error(res, api_error(500, msg));
  });
  svr.set_logger([this](const httplib::Request& req, const httplib::Response& res) {
    static const char* known[] = {"/v1/completions", "/v1/chat/completions", "/v1/models",
                                  "/health", "/metrics", "/tokenize", "/detokenize"};
    std::string route = "other";
    for (const char* k : known)
      if (req.path == k) route = k;
    std::lock_guard<std::mutex> lk(count_mu);
    ++counts[{route, res.status}];
  });

  svr.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    if (draining.load()) {
      res.status = 503;
      res.set_content(R"({"status":"draining"})", "application/json");
    } else {
      res.set_content(R"({"status":"ok"})", "application/json");
    }
  });
  svr.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
    json m = {{"id", opt.model_id}, {"object", "model"}, {"created", 0}, {"owned_by", "spade"},
              {"max_model_len", sched.max_context()}};
    json j = {{"object", "list"}, {"data", json::array({m})}};
    res.set_content(j.dump(-1, ' ', false, json::error_handler_t::replace), "application/json");
  });
  svr.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    HttpCounts c;
    {
      std::lock_guard<std::mutex> lk(count_mu);
      c = counts;
    }
    res.set_content(prometheus_text(sched.metrics(), c, opt.model_id),
                    "text/plain; version=0.0.4; charset=utf-8");
  });
  svr.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
    generate(req, res, ApiKind::Completion);
  });
  svr.Post("/v1/chat/completions", [this](const httplib::Request& req, httplib::Response& res) {
    generate(req, res, ApiKind::Chat);
  });
  svr.Post("/tokenize", [this](const httplib::Request& req, httplib::Response& res) { tokenize(req, res); });
  svr.Post("/detokenize", [this](const httplib::Request& req, httplib::Response& res) { detokenize(req, res); });
}

HttpServer::HttpServer(Scheduler& sched, const Tokenizer& tok, const TokenText& text,
                       SparseMethods& sparse, const ModelConfig& cfg, ServerOptions opt)
    : impl_(std::make_unique<Impl>(sched, tok, text, sparse, cfg, std::move(opt))) {
  impl_->setup();
}

HttpServer::~HttpServer() { stop(); }

int HttpServer::bind(const std::string& host, int port) {
  if (port == 0) {
    const int p = impl_->svr.bind_to_any_port(host);
    SPADE_CHECK(p > 0, "cannot listen on ", host, " (any port)");
    return p;
  }
  SPADE_CHECK(impl_->svr.bind_to_port(host, port), "cannot listen on ", host, ":", port,
              " (address in use or not available)");
  return port;
}

void HttpServer::serve() { impl_->svr.listen_after_bind(); }

void HttpServer::begin_drain() { impl_->draining.store(true); }

void HttpServer::stop() {
  if (impl_->svr.is_running()) impl_->svr.stop();
}

int HttpServer::active() const { return impl_->active.load(); }

HttpCounts HttpServer::http_counts() const {
  std::lock_guard<std::mutex> lk(impl_->count_mu);
  return impl_->counts;
}

}  // namespace spade::server
