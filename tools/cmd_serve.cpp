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
#include "kv_args.h"
#include "sparse_args.h"
#include "tp_args.h"
#include "command.h"
#include "core/thread_pool.h"
#include "engine/runner.h"
#include "engine/scheduler.h"
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
Sampling follows the OpenAI API: a request without "temperature" samples at 1.0 (send
"temperature": 0 for greedy decoding, the default of the other spade commands).

  --model PATH            GGUF file or Hugging Face model directory
  --tokenizer PATH        tokenizer file or directory (default: the model's)
  --model-name NAME       id reported by /v1/models and in responses (default: file name)
  --host H                address to listen on (default 127.0.0.1)
  --port N                port (default 8080; 0 = any free port, printed on stderr)
  --api-key KEY           require 'Authorization: Bearer KEY' (or env SPADE_API_KEY)
  --max-batch N           sequences per engine step (default 16)
  --max-queue N           requests waiting for admission before 429 (default 64)
  --max-step-tokens N     tokens per engine step: decode + prefill chunks (default 512)
  -c, --ctx-size N        longest request (prompt + completion; default: the model's context);
                          also sizes the default KV cache
  --kv-pages N            KV cache pages (default: max(ctx-size, max-batch x min(ctx-size,
                          1024)) tokens)
  --kv-mem GIB            KV cache pages that GIB GiB of K and V hold in --kv-dtype (fp8: twice
                          bf16's tokens); instead of --kv-pages
  --page-size N           KV cache page size in tokens (default 16)
  --default-max-tokens N  /v1/completions max_tokens when not given (default 16)
  --sparse NAME[:k=v,..]  default sparse method for requests without "sparse" (default full)
  --budget N              shorthand for the default method's budget option
  --sparse-opt k=v,...    more options of the default method
  --sparse-config FILE    default method from a JSON file
  --cpu-weights f32|native  CPU weights: native (the default for quantized GGUF files)
                          multiplies by the weights as stored, no fp32 copy; f32 dequantizes
                          them at load (the reference; the default for other models)
  --kv-dtype f32|bf16|f16|fp8  CPU KV cache element type (default bf16: half the bytes a
                          decode step reads; f32 is the reference; f16 is llama.cpp's; fp8
                          is E4M3 with scales: a quarter of f32's bytes); the GPU cache is bf16
  --kv-scale auto|X       fp8 scales per (layer, KV head), K and V apart: auto (default) from
                          the server's first forward step (its largest |value| at most half
                          of fp8's 448), then fixed for the server's life (later values beyond
                          448 x scale saturate); X: every scale X (rounded up to a power of two)
  --tp N                  tensor parallelism over N processes of this host (default 1; cpu,
                          full attention only): heads and KV heads must divide by N (docs/cli.md)
  --device cpu|cuda       where the model runs (default cpu). cuda (CUDA builds): bf16
                          weights and the KV cache on the GPU; each request runs its own
                          method (its "sparse" field, else --sparse) if the method has a
                          GPU path (docs/sparse.md lists them), side by side in one batch
  --deterministic         with --device cuda: bit-identical reruns, and a request's output
                          does not depend on the other requests of the load (static attention
                          schedule with fixed splits, batch-invariant projections, prefill
                          chunks in steps of their own); slower, prefill most of all
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
          "--max-step-tokens", "--ctx-size", "--kv-pages", "--kv-mem", "--page-size", "--default-max-tokens", "--sparse",
          "--budget", "--sparse-opt", "--sparse-config", "--threads", "--http-threads", "--device", "--cpu-weights", "--kv-dtype", "--kv-scale",
          "--max-connections", "--header-timeout",
          "--shutdown-timeout", "--tp", "--tp-rank", "--dist-init"},
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
  TpLaunch tp(a, argc, argv);  // tensor parallelism: checked now, ranks started once the model loads
  const std::string path = a.str("--model");
  const bool on_cpu = a.str("--device", "cpu") == "cpu";
  const KvDtype kv_dtype = kv_dtype_from_args(a, a.str("--device", "cpu"));
  const float kv_scale = kv_scale_from_args(a, kv_dtype);
  SPADE_CHECK(on_cpu || !a.has("--cpu-weights"), "--cpu-weights is for --device cpu");
  auto weights = load_model(
      path, on_cpu ? parse_cpu_weights(a.str("--cpu-weights", "auto")) : CpuWeights::F32);
  if (tp.follower()) return tp.follow(*weights);
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
  // --ctx-size: the longest request, and what the default KV allocation is sized for.
  const int64_t ctx = a.integer("--ctx-size", cfg.max_context);
  SPADE_CHECK(ctx >= 1 && ctx <= cfg.max_context, "--ctx-size must be in [1, ", cfg.max_context,
              "] (the model's context), got ", ctx);
  so.max_context = ctx;
  SPADE_CHECK(!(a.has("--kv-mem") && a.has("--kv-pages")),
              "--kv-mem and --kv-pages both size the KV cache: give one");
  const int64_t pages =
      a.has("--kv-mem") ? kv_pages_for_memory(cfg, layout.page_size, kv_dtype, a.number("--kv-mem", 0))
                        : a.integer("--kv-pages", default_kv_pages(ctx, so.max_batch, layout.page_size));
  SPADE_CHECK(pages >= 1, "--kv-pages must be positive");
  const std::string device = a.str("--device", "cpu");
  SPADE_CHECK(device == "cpu" || device == "cuda", "--device must be cpu or cuda, got '", device, "'");
  // The CPU pool also backs the sparse sessions; on the GPU the pool lives on the device and
  // the host pool is not allocated.
  const sparse::SparseConfig sc = sparse_from_args(a);
  RunnerOptions ro;
  ro.device = device;
  ro.kv_pages = pages;
  ro.kv_dtype = kv_dtype;
  ro.kv_scale = kv_scale;
  ro.page_size = layout.page_size;
  ro.max_batch = so.max_batch;
  ro.max_step_tokens = so.max_step_tokens;
  ro.deterministic = a.has("--deterministic");
  so.isolate_prefill = ro.deterministic;  // batch invariance: no step mixes prefill and decode
  ro.sparse = sc;
  tp.start(*weights, ro);
  Runner runner = make_runner(*weights, ro);
  StepModel* model = runner.model.get();
  so.max_step_tokens = runner.max_step_tokens;
  so.max_logit_rows = runner.max_logit_rows;  // the scheduler cuts prompt-scoring chunks to fit
  const double kv_mib = runner.kv_mib;

  server::SparseSpec fallback;
  fallback.method = sc.method;
  for (auto& [k, v] : sc.options) fallback.options.emplace_back(k, v);
  if (sc.measure_recall) fallback.options.emplace_back("recall", "1");
  // A host pool: CPU sparse sessions per request; none: the runner runs each request's method.
  server::SparseMethods methods(cfg, runner.host_pool, fallback,
                                runner.host_pool ? std::string() : model->device(),
                                runner.check_method);

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
