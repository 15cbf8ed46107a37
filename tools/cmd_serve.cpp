// `spade serve`: the OpenAI-compatible HTTP server (docs/server.md). Loads the model and
// tokenizer, sizes the KV pool, starts the continuous-batching scheduler and the HTTP
// layer, and shuts down gracefully on SIGINT / SIGTERM: stop taking requests, let running
// ones finish (up to --shutdown-timeout), cancel the rest, close the listener.
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "args.h"
#include "command.h"
#include "core/thread_pool.h"
#include "engine/scheduler.h"
#include "engine/step_model.h"
#include "model/cpu_model.h"
#if defined(SPADE_HAVE_CUDA)
#include "model/cuda_step_model.h"
#endif
#include "model/loader.h"
#include "server/http_server.h"
#include "server/sparse_adapter.h"
#include "server/tokenizer_text.h"
#include "sparse/options.h"
#include "sparse/registry.h"
#include "tokenizer/tokenizer.h"

namespace spade::cli {
namespace {

const char* kHelp = R"(usage: spade serve --model PATH [options]

OpenAI-compatible HTTP server: POST /v1/completions, /v1/chat/completions (stream or not),
GET /v1/models, /health, /metrics (Prometheus), POST /tokenize, /detokenize.

  --model PATH            GGUF file or Hugging Face model directory
  --tokenizer PATH        tokenizer file or directory (default: the model's)
  --model-name NAME       id reported by /v1/models and in responses (default: file name)
  --host H                address to listen on (default 127.0.0.1)
  --port N                port (default 8080; 0 = any free port, printed on stderr)
  --api-key KEY           require 'Authorization: Bearer KEY' (or env SPADE_API_KEY)
  --max-batch N           sequences per engine step (default 16)
  --max-queue N           requests waiting for admission before 429 (default 64)
  --max-step-tokens N     tokens per engine step: decode + prefill chunks (default 512)
  --kv-pages N            KV cache pages (default: max(context, max-batch x 1024) tokens)
  --page-size N           KV cache page size in tokens (default 16)
  --default-max-tokens N  /v1/completions max_tokens when not given (default 16)
  --sparse NAME[:k=v,..]  default sparse method for requests without "sparse" (default full)
  --budget N              shorthand for the default method's budget option
  --sparse-opt k=v,...    more options of the default method
  --sparse-config FILE    default method from a JSON file
  --device cpu|cuda       where the model runs (default cpu). cuda (CUDA builds): bf16
                          weights and the KV cache on the GPU; every request runs the
                          server's --sparse method (full, streaming, quest, tidal, lessismore,
                          lycheedecode, twilight, blasst);
                          a request asking for another method gets a 400
  --deterministic         with --device cuda: decode attention with the static schedule only
                          (bit-identical reruns; default: long steps with splits draw their
                          chunks, faster, last bits may vary; env SPADE_DETERMINISTIC=1)
  --threads N             CPU threads for the model (default: all cores)
  --http-threads N        HTTP worker threads for requests that tokenize or generate
                          (default max-batch + max-queue + 8); idle or slow connections
                          take none
  --max-connections N     open connections; the next gets 503 (default 1024, and at most
                          the process's descriptor limit less 64)
  --header-timeout S      seconds a connection has to send a request's header (default 10;
                          408 and close after it); its body then has 30 s
  --shutdown-timeout S    seconds to let running requests finish on SIGTERM (default 30)
  --quiet                 no per-request log line on stderr (one per finished
                          completion / chat request: id, path, status, finish reason,
                          prompt and completion tokens, latency)
)";

std::atomic<int> g_signals{0}, g_last_signal{0};
extern "C" void on_signal(int sig) {
  g_last_signal.store(sig);
  g_signals.fetch_add(1);
}

std::string default_model_name(const std::string& path) {
  std::string p = path;
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  std::string base = p.substr(p.find_last_of('/') == std::string::npos ? 0 : p.find_last_of('/') + 1);
  if (base.size() > 5 && base.substr(base.size() - 5) == ".gguf") base.resize(base.size() - 5);
  return base.empty() ? "spade" : base;
}

int run(int argc, char** argv) {
  Args a(argc, argv,
         {"--model", "--tokenizer", "--model-name", "--host", "--port", "--api-key", "--max-batch", "--max-queue",
          "--max-step-tokens", "--kv-pages", "--page-size", "--default-max-tokens", "--sparse",
          "--budget", "--sparse-opt", "--sparse-config", "--threads", "--http-threads", "--device",
          "--max-connections", "--header-timeout",
          "--shutdown-timeout"},
         {"--help", "--deterministic", "--quiet"});
  if (a.has("--help")) {
    std::fputs(kHelp, stdout);
    return 0;
  }
  SPADE_CHECK(a.has("--model"), "--model is required (see --help)");
  SPADE_CHECK(a.positional().empty(), "unexpected argument '", a.positional().empty() ? "" : a.positional()[0], "'");

  // SIGINT / SIGTERM only bump a counter (async-signal-safe); a watcher thread acts on it.
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  std::signal(SIGPIPE, SIG_IGN);

  if (a.has("--threads")) ThreadPool::set_global_threads(a.integer("--threads", 0));
  const std::string path = a.str("--model");
  auto weights = load_model(path);
  auto tok = Tokenizer::load(a.str("--tokenizer", path));
  const ModelConfig& cfg = weights->config;

  SchedulerOptions so;
  const int64_t max_batch = a.integer("--max-batch", 16), max_queue = a.integer("--max-queue", 64);
  SPADE_CHECK(max_batch >= 1 && max_batch <= 4096, "--max-batch must be in [1, 4096]");
  SPADE_CHECK(max_queue >= 1 && max_queue <= 100000, "--max-queue must be in [1, 100000]");
  so.max_batch = int(max_batch);
  so.max_queue = int(max_queue);
  so.max_step_tokens = a.integer("--max-step-tokens", 512);
  SPADE_CHECK(so.max_step_tokens >= 1 && so.max_step_tokens <= (1 << 20),
              "--max-step-tokens must be in [1, 1048576]");

  const int64_t page_size = a.integer("--page-size", 16);
  SPADE_CHECK(page_size >= 1 && page_size <= 4096, "--page-size must be in [1, 4096]");
  KVLayout layout{cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, int(page_size)};
  const int64_t want_tokens =
      std::max<int64_t>(cfg.max_context, int64_t(so.max_batch) * std::min<int64_t>(cfg.max_context, 1024));
  const int64_t pages = a.integer("--kv-pages", (want_tokens + layout.page_size - 1) / layout.page_size);
  SPADE_CHECK(pages >= 1, "--kv-pages must be positive");
  const std::string device = a.str("--device", "cpu");
  SPADE_CHECK(device == "cpu" || device == "cuda", "--device must be cpu or cuda, got '", device, "'");
  // The CPU pool also backs the sparse sessions; on the GPU the pool lives on the device and
  // the host pool is not allocated.
  sparse::SparseConfig sc;
  if (a.has("--sparse-config")) sc.merge_json_file(a.str("--sparse-config"));
  if (a.has("--sparse")) {
    sparse::SparseConfig s = sparse::SparseConfig::parse_spec(a.str("--sparse"));
    sc.method = s.method;
    for (auto& [k, v] : s.options) sc.options[k] = v;
  }
  if (a.has("--budget")) sc.set("budget", a.str("--budget"));
  if (a.has("--sparse-opt")) sc.set_options(a.str("--sparse-opt"));
  std::unique_ptr<KVPool> kv;
  std::unique_ptr<CpuModel> cpu_model;
  std::unique_ptr<StepModel> model;
#if defined(SPADE_HAVE_CUDA)
  std::unique_ptr<CudaModel> gpu_model;
#endif
  double kv_mib = 0;
  if (device == "cuda") {
#if defined(SPADE_HAVE_CUDA)
    CudaModelOptions copt;
    copt.kv_pages = pages;
    copt.page_size = layout.page_size;
    copt.max_batch = so.max_batch;
    copt.deterministic = a.has("--deterministic");
    so.max_step_tokens = std::max<int64_t>(so.max_step_tokens, so.max_batch);
    copt.max_step_tokens = so.max_step_tokens;
    // CudaModel's default logit rows; the scheduler cuts prompt-scoring chunks to fit them.
    copt.max_logit_rows = std::max<int64_t>(so.max_batch, 64);
    so.max_logit_rows = copt.max_logit_rows;
    // The server's method runs inside the GPU model for every request.
    SPADE_CHECK(!sc.measure_recall, "--recall is CPU-only (spade serve --device cpu)");
    copt.sparse = cuda_sparse_config(sc, cfg, layout.page_size);
    // Requests may name any GPU method: keep every method's per-page data (Quest's page
    // min/max, the INT4 keys Twilight reads) on every append.
    copt.any_method = true;
    gpu_model = std::make_unique<CudaModel>(*weights, copt);
    model = std::make_unique<CudaStepModel>(*gpu_model);
    kv_mib = double(pages) * layout.page_size * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 2 * 2 / (1024.0 * 1024.0);
#else
    fail("--device cuda: this build has no CUDA backend");
#endif
  } else {
    kv = std::make_unique<KVPool>(layout, pages);
    cpu_model = std::make_unique<CpuModel>(*weights, *kv);
    model = std::make_unique<CpuStepModel>(*cpu_model);
    kv_mib = double(kv->bytes()) / (1024.0 * 1024.0);
  }

  server::SparseSpec fallback;
  fallback.method = sc.method;
  for (auto& [k, v] : sc.options) fallback.options.emplace_back(k, v);
  if (sc.measure_recall) fallback.options.emplace_back("recall", "1");
  server::SparseMethods::DeviceCheck device_check;
#if defined(SPADE_HAVE_CUDA)
  if (!kv)  // the checks and defaults the GPU model applies when it adds the method
    device_check = [&cfg, P = layout.page_size](const sparse::SparseConfig& c) {
      (void)cuda_sparse_config(c, cfg, P);
    };
#endif
  server::SparseMethods methods(cfg, kv.get(), fallback, kv ? std::string() : model->device(),
                                std::move(device_check));

  server::TokenizerText text(*tok);
  Scheduler sched(*model, text, so);

  server::ServerOptions opt;
  opt.model_id = a.has("--model-name") ? a.str("--model-name") : default_model_name(path);
  opt.api_key = a.str("--api-key");
  if (opt.api_key.empty())
    if (const char* k = std::getenv("SPADE_API_KEY")) opt.api_key = k;
  const int64_t http_threads = a.integer("--http-threads", 0);
  SPADE_CHECK(http_threads >= 0 && http_threads <= 4096, "--http-threads must be in [1, 4096]");
  opt.http_threads = int(http_threads);
  const int64_t max_conn = a.integer("--max-connections", 1024);
  SPADE_CHECK(max_conn >= 1 && max_conn <= 1000000, "--max-connections must be in [1, 1000000]");
  opt.max_connections = int(max_conn);
  opt.header_timeout_seconds = a.number("--header-timeout", 10);
  SPADE_CHECK(opt.header_timeout_seconds > 0 && opt.header_timeout_seconds <= 3600,
              "--header-timeout must be in (0, 3600] seconds");
  opt.log_requests = !a.has("--quiet");
  opt.default_completion_tokens = a.integer("--default-max-tokens", 16);
  SPADE_CHECK(opt.default_completion_tokens >= 1, "--default-max-tokens must be positive");
  const double shutdown_timeout = a.number("--shutdown-timeout", 30);
  SPADE_CHECK(shutdown_timeout >= 0 && shutdown_timeout <= 86400,
              "--shutdown-timeout must be in [0, 86400] seconds");

  server::HttpServer http(sched, *tok, text, methods, cfg, opt);
  const std::string host = a.str("--host", "127.0.0.1");
  const long long port_arg = a.integer("--port", 8080);
  SPADE_CHECK(port_arg >= 0 && port_arg <= 65535, "--port must be in [0, 65535]");
  const int port = http.bind(host, int(port_arg));
  std::fprintf(stderr,
               "[spade] serving %s (%s) on http://%s:%d | context %lld tokens | KV %lld pages x %d "
               "tokens (%.1f MiB) | max batch %d, queue %d | default sparse: %s | %s, threads %d%s\n",
               opt.model_id.c_str(), arch_name(cfg.arch), host.c_str(), port,
               (long long)sched.max_context(), (long long)pages, layout.page_size,
               kv_mib, so.max_batch, so.max_queue, sc.to_string().c_str(), model->device().c_str(),
               ThreadPool::global().size(),
               opt.api_key.empty() ? "" : " | API key required");
  std::fflush(stderr);

  std::atomic<bool> serving_done{false};
  std::thread sig_thread([&] {
    while (!serving_done.load() && g_signals.load() == 0)
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    if (g_signals.load() == 0) return;  // the server ended on its own
    std::fprintf(stderr, "[spade] %s: draining (finishing running requests, up to %.0f s; "
                         "signal again to cancel them)\n",
                 g_last_signal.load() == SIGINT ? "SIGINT" : "SIGTERM", shutdown_timeout);
    http.begin_drain();
    sched.stop_accepting();
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::milliseconds(int64_t(shutdown_timeout * 1000));
    while (std::chrono::steady_clock::now() < deadline && g_signals.load() < 2)
      if (sched.wait_idle(std::chrono::milliseconds(50))) break;
    sched.shutdown();  // cancels whatever is left; handlers send their final bytes
    const auto flush_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (http.active() > 0 && std::chrono::steady_clock::now() < flush_deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    http.stop();
  });
  http.serve();
  serving_done.store(true);
  sig_thread.join();
  sched.shutdown();
  const EngineMetrics m = sched.metrics();
  std::fprintf(stderr, "[spade] stopped: %llu requests finished (%llu cancelled), %llu prompt + %llu "
                       "generated tokens, KV pages in use %lld\n",
               (unsigned long long)(m.finished_stop + m.finished_length + m.finished_cancelled +
                                    m.finished_error),
               (unsigned long long)m.finished_cancelled, (unsigned long long)m.prompt_tokens,
               (unsigned long long)m.generation_tokens, (long long)m.kv_pages_used);
  return 0;
}

Registrar reg("serve", "OpenAI-compatible HTTP server with continuous batching", run);

}  // namespace
}  // namespace spade::cli
