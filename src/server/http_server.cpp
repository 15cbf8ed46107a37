#include "server/http_server.h"

#include <sys/resource.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>

#include "server/http_transport.h"
#include "server/openai_response.h"
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

HttpResponse error_response(const ApiError& e) {
  HttpResponse r;
  r.status = e.status;
  r.body = error_json(e);
  return r;
}

void send_error(HttpExchange& ex, const ApiError& e) { ex.respond(error_response(e)); }

HttpResponse json_response(std::string body) {
  HttpResponse r;
  r.body = std::move(body);
  return r;
}

// "Authorization: Bearer KEY" (the scheme is case-insensitive, RFC 9110) or "X-Api-Key: KEY".
std::string presented_key(const HttpRequest& req) {
  const std::string auth = req.header("authorization");
  const size_t sp = auth.find(' ');
  if (sp != std::string::npos) {
    std::string scheme = auth.substr(0, sp);
    for (char& c : scheme) c = char(std::tolower(static_cast<unsigned char>(c)));
    if (scheme == "bearer") {
      const size_t k = auth.find_first_not_of(' ', sp);
      return k == std::string::npos ? std::string() : auth.substr(k);
    }
  }
  return req.header("x-api-key");
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

// One choice of a generation request (an engine request of its own): what has come back.
struct Choice {
  std::shared_ptr<RequestChannel> ch;
  PromptScores prompt;         // echoed / scored prompt (when asked for)
  std::string text;            // whole responses: the generated text
  std::vector<TokenLogprob> lps;
  bool first_pending = true;   // streams: the chunk that opens the choice is not sent yet
  size_t offset = 0;           // streams: text sent so far (for text_offset)
  bool done = false;
  RequestDelta last;           // the final delta (reason, usage, error)
};

// usage.sparse's density: the mean over the choices that had decode steps (< 0: none had).
double mean_density(const std::vector<Choice>& cs) {
  double sum = 0;
  int n = 0;
  for (const Choice& c : cs)
    if (c.last.density >= 0) sum += c.last.density, ++n;
  return n ? sum / n : -1.0;
}

// A generation request's log line on stderr when it ends (ServerOptions::log_requests).
struct RequestLog {
  bool enabled = true;
  std::string id, path, sparse;
  int status = 0;
  std::string finish = "-";
  int64_t prompt_tokens = 0, completion_tokens = 0, n = 1;
  bool stream = false;
  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();

  ~RequestLog() {
    if (!enabled) return;
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    // One fprintf: stdio locks the stream for the call, so lines of concurrent requests do not mix.
    std::fprintf(stderr,
                 "[spade] request id=%s method=POST path=%s status=%d finish=%s prompt_tokens=%lld "
                 "completion_tokens=%lld latency_ms=%.1f n=%lld stream=%s sparse=%s\n",
                 id.c_str(), path.c_str(), status, finish.c_str(), (long long)prompt_tokens,
                 (long long)completion_tokens, ms, (long long)n, stream ? "true" : "false",
                 sparse.empty() ? "-" : sparse.c_str());
  }
  void finished(const std::vector<Choice>& cs) {
    finish.clear();
    completion_tokens = 0;
    for (const Choice& c : cs) {
      if (!finish.empty()) finish += ',';
      finish += c.done ? finish_reason_name(c.last.reason) : "none";
      completion_tokens += c.last.completion_tokens;
      prompt_tokens = std::max(prompt_tokens, c.last.prompt_tokens);
    }
  }
};

// One streamed response: pulls deltas from the choices' channels and writes SSE events until
// every choice finished, one failed, or the client went away.
struct StreamState {
  std::vector<Choice>* choices = nullptr;
  ResponseMeta meta;
  bool include_usage = false;
  bool echo = false;           // the prompt text opens each choice
  std::string echo_text;
  bool scores = false;         // the opening chunk carries prompt scores: wait for them
  RequestLog* log = nullptr;

  bool open(HttpExchange& ex, Choice& c, int index) {
    ChoiceOut o;
    o.index = index;
    if (echo) o.text = echo_text;
    if (scores) o.prompt = &c.prompt;
    o.text_offset = echo_text.size();
    c.first_pending = false;
    c.offset = echo ? echo_text.size() : 0;
    if (o.text.empty() && !o.prompt) return true;
    return ex.write_chunk(stream_chunk(meta, o));
  }

  void run(HttpExchange& ex) {
    std::vector<Choice>& cs = *choices;
    const int n = int(cs.size());
    if (!ex.begin_stream(200, "text/event-stream", {{"Cache-Control", "no-cache"}, {"X-Accel-Buffering", "no"}}))
      return fail(cs);
    for (int i = 0; i < n; ++i) {
      if (meta.kind == ApiKind::Chat) {
        ChoiceOut o;
        o.index = i;
        o.role_header = true;
        if (!ex.write_chunk(stream_chunk(meta, o))) return fail(cs);
      }
      if (!scores && !open(ex, cs[size_t(i)], i)) return fail(cs);
    }
    RequestDelta delta;
    int left = n;
    const FinishReason* failed = nullptr;
    Choice* failed_choice = nullptr;
    while (left > 0 && !failed) {
      if (ex.peer_gone()) return fail(cs);
      // One choice: wait on its channel. Several: wait briefly on the first unfinished one
      // and only look at the others, so that none waits behind another.
      bool waited = false;
      for (int i = 0; i < n && !failed; ++i) {
        Choice& c = cs[size_t(i)];
        if (c.done) continue;
        const auto timeout = waited ? std::chrono::milliseconds(0) : n == 1 ? kPoll : 5ms;
        waited = true;
        if (!c.ch->wait_take(delta, timeout)) continue;
        for (auto& l : delta.prompt_logprobs) c.prompt.scores.push_back(std::move(l));
        if (c.first_pending &&
            (c.prompt.scores.size() + 1 >= c.prompt.ids.size() || !delta.tokens.empty() || delta.finished) &&
            !open(ex, c, i))
          return fail(cs);
        if (!delta.text.empty() || !delta.logprobs.empty()) {
          ChoiceOut o;
          o.index = i;
          o.text = delta.text;
          o.logprobs = &delta.logprobs;
          o.text_offset = c.offset;
          if (!ex.write_chunk(stream_chunk(meta, o))) return fail(cs);
          c.offset += delta.text.size();
        }
        if (!delta.finished) continue;
        c.done = true;
        --left;
        c.last.reason = delta.reason;
        c.last.error = delta.error;
        c.last.prompt_tokens = delta.prompt_tokens;
        c.last.completion_tokens = delta.completion_tokens;
        c.last.density = delta.density;
        if (delta.reason == FinishReason::Error || delta.reason == FinishReason::Cancelled) {
          failed = &c.last.reason;
          failed_choice = &c;
          break;
        }
        ChoiceOut o;
        o.index = i;
        o.text_offset = c.offset;
        o.finish_reason = api_finish_reason(delta.reason);
        if (!ex.write_chunk(stream_chunk(meta, o))) return fail(cs);
      }
    }
    std::string tail;
    if (log) log->finished(cs);
    if (failed) {
      for (Choice& c : cs) c.ch->cancel();  // the others are not wanted any more
      const std::string& err = failed_choice->last.error;
      tail = stream_error(*failed == FinishReason::Error
                              ? api_error(500, err.empty() ? "generation failed" : err)
                              : api_error(503, err.empty() ? "the request was cancelled" : err));
      if (log) log->status = *failed == FinishReason::Error ? 500 : 503;
    } else if (include_usage) {
      meta.density = mean_density(cs);
      tail = usage_chunk(meta, log ? log->prompt_tokens : cs[0].last.prompt_tokens,
                         log ? log->completion_tokens : cs[0].last.completion_tokens);
    }
    tail += stream_done();
    if (!ex.write_chunk(tail)) return fail(cs);
    ex.end_stream();
  }
  void fail(std::vector<Choice>& cs) {
    for (Choice& c : cs) c.ch->cancel();
    if (log) {
      log->finished(cs);
      log->status = 499;
      log->finish = "client_gone";
    }
  }
};

// Longest text a single token decodes to: a prompt of B bytes has at least B / this many
// tokens (tokenizers do not shrink text by more than 2x in normalization, hence the 2).
size_t longest_piece(const TokenText& text, int32_t vocab) {
  size_t m = 1;
  for (int32_t id = 0; id < vocab; ++id) m = std::max(m, text.piece(id).size());
  return m;
}

}  // namespace

struct HttpServer::Impl {
  Impl(Scheduler& s, const Tokenizer& t, const TokenText& tt, SparseMethods& sp,
       const ModelConfig& c, ServerOptions o)
      : sched(s), tok(t), text(tt), sparse(sp), cfg(c), opt(std::move(o)) {
    salt = splitmix(uint64_t(std::random_device{}()) ^
                    uint64_t(std::chrono::steady_clock::now().time_since_epoch().count()));
    const size_t piece = longest_piece(text, std::min<int32_t>(tok.vocab_size(), cfg.vocab));
    max_prompt_bytes = std::min<size_t>(opt.max_body_bytes, size_t(sched.max_context()) * piece * 2);
  }

  Scheduler& sched;
  const Tokenizer& tok;
  const TokenText& text;
  SparseMethods& sparse;
  const ModelConfig& cfg;
  ServerOptions opt;
  size_t max_prompt_bytes = 0;  // longer prompt text cannot fit the context: 400 before tokenizing
  std::unique_ptr<HttpTransport> transport;
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
  bool quick(const HttpRequest& req, HttpResponse& out);
  void handle(HttpExchange& ex);
  void generate(HttpExchange& ex, ApiKind kind);
  void tokenize(HttpExchange& ex);
  void detokenize(HttpExchange& ex);
  std::optional<ApiError> check_text_size(size_t bytes, const char* param) const;
  std::string render_chat(const std::vector<ApiMessage>& msgs, bool add_generation_prompt);
  std::vector<int32_t> chat_tokens(const std::vector<ApiMessage>& msgs, bool add_generation_prompt);
};

std::optional<ApiError> HttpServer::Impl::check_text_size(size_t bytes, const char* param) const {
  if (bytes <= max_prompt_bytes) return std::nullopt;
  return api_error(400, cat("the prompt text has ", bytes, " bytes; this model's context of ",
                            sched.max_context(), " tokens holds at most ", max_prompt_bytes,
                            " bytes of text. Please reduce the length of the prompt."),
                   "context_length_exceeded", param);
}

static size_t message_bytes(const std::vector<ApiMessage>& msgs) {
  size_t n = 0;
  for (const ApiMessage& m : msgs) n += m.role.size() + m.content.size();
  return n;
}

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

void HttpServer::Impl::generate(HttpExchange& ex, ApiKind kind) {
  const HttpRequest& req = ex.request();
  RequestLog log;
  log.enabled = opt.log_requests;
  log.path = req.path;
  log.id = new_id(kind == ApiKind::Chat ? "chatcmpl-" : "cmpl-");
  auto reject = [&](const ApiError& e) {
    log.status = e.status;
    log.finish = e.code.empty() ? "error" : e.code;
    send_error(ex, e);
  };
  if (draining.load()) return reject(api_error(503, "the server is shutting down", "server_shutting_down"));
  ParseResult pr = kind == ApiKind::Chat ? parse_chat_request(req.body) : parse_completion_request(req.body);
  if (!pr.ok()) return reject(pr.error);
  ApiRequest& a = *pr.request;
  log.n = a.n;
  log.stream = a.stream;
  if (!a.model.empty() && a.model != opt.model_id) {
    ApiError e = api_error(404, cat("The model '", a.model, "' does not exist: this server serves '",
                                    opt.model_id, "' (GET /v1/models)"),
                           "model_not_found", "model");
    e.type = "invalid_request_error";  // OpenAI's shape for an unknown model
    return reject(e);
  }
  if (auto e = check_text_size(kind == ApiKind::Chat ? message_bytes(a.messages) : a.prompt.size(),
                               kind == ApiKind::Chat ? "messages" : "prompt"))
    return reject(*e);
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
          return reject(api_error(400, cat("prompt token id ", id, " is outside the vocabulary [0, ",
                                           vocab, ")"), "invalid_value", "prompt"));
      if (a.echo) echo = tok.decode(er.prompt);
    } else {
      er.prompt = tok.encode(a.prompt, true, true);
      if (a.echo) echo = a.prompt;
    }
  } catch (const std::exception& e) {
    return reject(api_error(400, cat(kind == ApiKind::Chat ? "cannot apply the chat template: "
                                                           : "cannot tokenize the prompt: ",
                                     e.what()),
                            "invalid_value", kind == ApiKind::Chat ? "messages" : "prompt"));
  }
  if (er.prompt.empty())
    return reject(api_error(400, "the prompt is empty (no tokens)", "invalid_value", "prompt"));
  const int64_t P = int64_t(er.prompt.size()), ctx = sched.max_context();
  log.prompt_tokens = P;
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
  er.stop = std::move(a.stop);
  if (!a.ignore_eos) er.stop_ids = tok.eos_ids();
  for (int32_t id : a.stop_token_ids) {
    if (id >= vocab)
      return reject(api_error(400, cat("stop token id ", id, " is outside the vocabulary"),
                              "invalid_value", "stop_token_ids"));
    er.stop_ids.push_back(id);
  }
  er.logprobs = a.logprobs;
  // The prompt's scores: echoed with logprobs (OpenAI's loglikelihood requests) and / or the
  // prompt_logprobs extension; the engine computes the larger top k once.
  const int echo_top = a.echo && a.logprobs >= 0 ? a.logprobs : -1;
  er.prompt_logprobs = std::max(echo_top, a.prompt_logprobs);
  const bool scored = er.prompt_logprobs >= 0;
  std::string sparse_description;
  try {
    ResolvedSparse sp = sparse.resolve(a.sparse);
    sparse_description = sp.description;
    er.method = sp.method;
    er.attention = std::move(sp.maker);
    er.device_method = std::move(sp.device_method);
    er.correction_every = sp.correction_every;
  } catch (const std::exception& e) {
    return reject(api_error(400, e.what(), "invalid_value", "sparse"));
  }
  log.sparse = er.method;

  PromptScores base;
  if (scored) {
    base.ids = er.prompt;
    base.echo_top = echo_top;
    base.prompt_top = a.prompt_logprobs;
    // text_offset of each prompt token in the echoed text, decoded as it was: token ids with
    // their special tokens (decode()), a text prompt without the ones encode() added.
    base.offsets.resize(base.ids.size());
    StreamDecoder dec(tok, /*skip_special=*/kind != ApiKind::Completion || !a.prompt_is_ids);
    size_t at = 0;
    for (size_t i = 0; i < base.ids.size(); ++i) {
      base.offsets[i] = std::min(at, echo.size());
      at += dec.push(base.ids[i]).size();
    }
  }

  // n choices: n engine requests, each an independent sample (seed + i when a seed is given).
  std::vector<Choice> cs(size_t(a.n));
  for (size_t i = 0; i < cs.size(); ++i) {
    EngineRequest ri;
    if (i + 1 < cs.size()) ri = er;
    else ri = std::move(er);
    ri.sampling.seed = a.seed ? *a.seed + i : splitmix(salt ^ (counter.fetch_add(1) << 1));
    try {
      cs[i].ch = sched.submit(std::move(ri));
    } catch (const SubmitError& e) {
      for (size_t j = 0; j < i; ++j) cs[j].ch->cancel();
      HttpResponse r = error_response(api_error(e.status, e.what(), e.code));
      if (e.status == 429 || e.status == 503) r.headers.emplace_back("Retry-After", "1");
      log.status = e.status;
      log.finish = e.code;
      return ex.respond(r);
    }
    if (scored) cs[i].prompt = base;
  }

  ResponseMeta meta;
  meta.kind = kind;
  meta.id = log.id;
  meta.created = std::chrono::duration_cast<std::chrono::seconds>(
                     std::chrono::system_clock::now().time_since_epoch()).count();
  meta.model = opt.model_id;
  meta.logprobs = a.logprobs;
  meta.text = &text;
  meta.sparse_method = log.sparse;
  meta.sparse_options = a.sparse ? a.sparse->options : sparse.fallback().options;
  meta.sparse_description = std::move(sparse_description);

  ++active;
  struct Done {
    std::atomic<int>& n;
    ~Done() { --n; }
  } done{active};
  if (a.stream) {
    log.status = 200;
    StreamState st;
    st.choices = &cs;
    st.meta = meta;
    st.include_usage = a.include_usage;
    st.echo = a.echo;
    st.echo_text = std::move(echo);
    st.scores = scored;
    st.log = &log;
    st.run(ex);
    return;
  }
  RequestDelta d;
  for (Choice& c : cs) {
    while (!c.done) {
      if (c.ch->wait_take(d, kPoll)) {
        c.text += d.text;
        for (auto& l : d.logprobs) c.lps.push_back(std::move(l));
        for (auto& l : d.prompt_logprobs) c.prompt.scores.push_back(std::move(l));
        if (d.finished) {
          c.done = true;
          c.last.reason = d.reason;
          c.last.error = d.error;
          c.last.prompt_tokens = d.prompt_tokens;
          c.last.completion_tokens = d.completion_tokens;
          c.last.density = d.density;
          break;
        }
      }
      if (ex.peer_gone()) {
        for (Choice& o : cs) o.ch->cancel();  // the client left: nothing will be read
        log.finished(cs);
        log.status = 499;
        log.finish = "client_gone";
        return;
      }
    }
    if (c.last.reason == FinishReason::Error || c.last.reason == FinishReason::Cancelled) {
      for (Choice& o : cs) o.ch->cancel();
      log.finished(cs);
      const ApiError e = c.last.reason == FinishReason::Error
                             ? api_error(500, c.last.error.empty() ? "generation failed" : c.last.error)
                             : api_error(503, c.last.error.empty() ? "the request was cancelled" : c.last.error,
                                         "server_shutting_down");
      log.status = e.status;
      return send_error(ex, e);
    }
  }
  log.finished(cs);
  log.status = 200;
  meta.density = mean_density(cs);
  std::vector<ChoiceOut> outs(cs.size());
  for (size_t i = 0; i < cs.size(); ++i) {
    ChoiceOut& o = outs[i];
    o.index = int(i);
    o.text = echo + cs[i].text;
    o.logprobs = &cs[i].lps;
    o.text_offset = echo.size();
    o.prompt = scored ? &cs[i].prompt : nullptr;
    o.finish_reason = api_finish_reason(cs[i].last.reason);
  }
  ex.respond(json_response(full_response(meta, outs, log.prompt_tokens, log.completion_tokens)));
}

void HttpServer::Impl::tokenize(HttpExchange& ex) {
  ApiError err;
  auto t = parse_tokenize_request(ex.request().body, err);
  if (!t) return send_error(ex, err);
  if (auto e = check_text_size(t->is_chat ? message_bytes(t->messages) : t->prompt.size(),
                               t->is_chat ? "messages" : "prompt"))
    return send_error(ex, *e);
  std::vector<int32_t> ids;
  try {
    if (t->is_chat) {
      ids = tok.encode(render_chat(t->messages, t->add_generation_prompt),
                       t->add_special_tokens || tok.chat_template() == nullptr, true);
    } else {
      ids = tok.encode(t->prompt, t->add_special_tokens, true);
    }
  } catch (const std::exception& e) {
    return send_error(ex, api_error(400, e.what(), "invalid_value"));
  }
  json j = {{"tokens", ids}, {"count", ids.size()}, {"max_model_len", sched.max_context()}};
  ex.respond(json_response(j.dump()));
}

void HttpServer::Impl::detokenize(HttpExchange& ex) {
  ApiError err;
  auto t = parse_detokenize_request(ex.request().body, err);
  if (!t) return send_error(ex, err);
  for (int32_t id : t->tokens)
    if (id >= tok.vocab_size())
      return send_error(ex, api_error(400, cat("token id ", id, " is outside the vocabulary [0, ",
                                                tok.vocab_size(), ")"), "invalid_value", "tokens"));
  json j = {{"prompt", tok.decode(t->tokens)}};
  ex.respond(json_response(j.dump(-1, ' ', false, json::error_handler_t::replace)));
}

namespace {
const char* const kRoutes[] = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health",
                               "/metrics", "/tokenize", "/detokenize"};
bool is_get_route(const std::string& p) { return p == "/health" || p == "/v1/models" || p == "/metrics"; }
bool is_known_route(const std::string& p) {
  return std::find_if(std::begin(kRoutes), std::end(kRoutes), [&](const char* r) { return p == r; }) !=
         std::end(kRoutes);
}
}  // namespace

// Reactor thread: authentication, routing errors and the cheap GET routes.
bool HttpServer::Impl::quick(const HttpRequest& req, HttpResponse& out) {
  if (!opt.api_key.empty() && req.path != "/health" && req.path != "/metrics" &&
      !constant_time_equal(presented_key(req), opt.api_key)) {
    out = error_response(api_error(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                                   "invalid_api_key"));
    return true;
  }
  if (!is_known_route(req.path)) {
    out = error_response(api_error(404, "no route for " + req.method + " " + req.path));
    return true;
  }
  const bool get = is_get_route(req.path);
  if (req.method != (get ? "GET" : "POST")) {
    out = error_response(api_error(405, "method " + req.method + " not allowed on " + req.path));
    out.headers.emplace_back("Allow", get ? "GET" : "POST");
    return true;
  }
  if (req.path == "/health") {
    out.status = draining.load() ? 503 : 200;
    out.body = draining.load() ? R"({"status":"draining"})" : R"({"status":"ok"})";
    return true;
  }
  if (req.path == "/v1/models") {
    json m = {{"id", opt.model_id}, {"object", "model"}, {"created", 0}, {"owned_by", "spade"},
              {"max_model_len", sched.max_context()}};
    json j = {{"object", "list"}, {"data", json::array({m})}};
    out.body = j.dump(-1, ' ', false, json::error_handler_t::replace);
    return true;
  }
  if (req.path == "/metrics") {
    HttpCounts c;
    {
      std::lock_guard<std::mutex> lk(count_mu);
      c = counts;
    }
    out.content_type = "text/plain; version=0.0.4; charset=utf-8";
    out.body = prometheus_text(sched.metrics(), c, opt.model_id);
    return true;
  }
  return false;
}

// Worker thread: the routes that tokenize or generate.
void HttpServer::Impl::handle(HttpExchange& ex) {
  const std::string& p = ex.request().path;
  try {
    if (p == "/v1/completions") return generate(ex, ApiKind::Completion);
    if (p == "/v1/chat/completions") return generate(ex, ApiKind::Chat);
    if (p == "/tokenize") return tokenize(ex);
    if (p == "/detokenize") return detokenize(ex);
    send_error(ex, api_error(404, "no route for " + ex.request().method + " " + p));
  } catch (const std::exception& e) {
    send_error(ex, api_error(500, std::string("internal error: ") + e.what()));
  }
}

void HttpServer::Impl::setup() {
#if defined(__GLIBC__)
  // Request bodies of megabytes are allocated and freed on many worker threads. glibc's
  // default raises its mmap threshold to the largest block freed (up to 32 MiB), after
  // which such blocks come from per-thread arenas that keep the memory: a fixed threshold
  // gives every block over 1 MiB back to the system when it is freed.
  mallopt(M_MMAP_THRESHOLD, 1 << 20);
#endif
  TransportLimits lim;
  lim.workers = opt.http_threads > 0 ? opt.http_threads
                                     : sched.options().max_batch + sched.options().max_queue + 8;
  lim.max_body_bytes = opt.max_body_bytes;
  lim.max_header_bytes = opt.max_header_bytes;
  lim.max_header_fields = opt.max_header_fields;
  lim.header_timeout_s = opt.header_timeout_seconds;
  lim.request_timeout_s = opt.io_timeout_seconds;
  lim.write_timeout_s = opt.io_timeout_seconds;
  lim.keep_alive_s = opt.keep_alive_seconds;
  // Every connection is a descriptor: raise the soft limit as far as allowed, and keep the
  // connection cap under it (model files, pipes and the listener need some).
  rlimit rl{};
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0) {
    if (rl.rlim_cur < rl.rlim_max) {
      rlimit want = rl;
      want.rlim_cur = std::min<rlim_t>(rl.rlim_max, 65536);
      if (setrlimit(RLIMIT_NOFILE, &want) == 0) rl = want;
    }
    lim.max_connections = int(std::min<rlim_t>(rlim_t(opt.max_connections),
                                               rl.rlim_cur > 128 ? rl.rlim_cur - 64 : rl.rlim_cur / 2));
  } else {
    lim.max_connections = opt.max_connections;
  }
  TransportHooks hooks;
  hooks.quick = [this](const HttpRequest& r, HttpResponse& out) { return quick(r, out); };
  hooks.handle = [this](HttpExchange& ex) { handle(ex); };
  hooks.error_body = [](int status, const std::string& msg) { return error_json(api_error(status, msg)); };
  hooks.on_response = [this](const std::string& path, int status) {
    const std::string route = is_known_route(path) ? path : "other";
    std::lock_guard<std::mutex> lk(count_mu);
    ++counts[{route, status}];
  };
  transport = std::make_unique<HttpTransport>(lim, std::move(hooks));
}

HttpServer::HttpServer(Scheduler& sched, const Tokenizer& tok, const TokenText& text,
                       SparseMethods& sparse, const ModelConfig& cfg, ServerOptions opt)
    : impl_(std::make_unique<Impl>(sched, tok, text, sparse, cfg, std::move(opt))) {
  impl_->setup();
}

HttpServer::~HttpServer() { stop(); }

int HttpServer::bind(const std::string& host, int port) { return impl_->transport->bind(host, port); }

void HttpServer::serve() { impl_->transport->serve(); }

void HttpServer::begin_drain() { impl_->draining.store(true); }

void HttpServer::stop() { impl_->transport->stop(); }

int HttpServer::active() const { return impl_->active.load(); }

HttpCounts HttpServer::http_counts() const {
  std::lock_guard<std::mutex> lk(impl_->count_mu);
  return impl_->counts;
}

}  // namespace spade::server
