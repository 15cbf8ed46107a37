// `spade generate`: load a model, tokenize the prompt, stream the generated text to stdout.
// Statistics go to stderr only: --stats a summary at the end (stop reason, prefill and decode
// speed; with a sparse method mean density and recall), --stats-steps also a line per decode
// step, --stats-jsonl FILE one JSON object per generated token (docs/cli.md).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>

#include "args.h"
#include "command.h"
#include "progress.h"
#include "sampling_args.h"
#include "kv_args.h"
#include "sparse_args.h"
#include "tp_args.h"
#include "tokenizer_args.h"
#include "core/thread_pool.h"
#include "engine/generator.h"
#include "engine/runner.h"
#include "model/cuda_methods.h"
#include "model/loader.h"
#if defined(SPADE_HAVE_CUDA)
#include "model/cuda_model.h"
#include "model/cuda_step_model.h"
#endif
#include "sparse/methods/blasst.h"
#include "sparse/methods/twilight.h"
#include "sparse/registry.h"
#include "sparse/session.h"
#include "tokenizer/tokenizer.h"
#include "nlohmann/json.hpp"

namespace spade::cli {
namespace {

const char* kHelp = R"(usage: spade generate --model PATH (--prompt TEXT | --prompt-file F) [options]

  -m, --model PATH      GGUF file or Hugging Face model directory
  --tokenizer PATH      tokenizer to use instead of the model's own: a tokenizer.json,
                        tokenizer.model, GGUF file (a model or vocabulary only) or a directory
                        holding one (as `spade tokenize --model` takes)
  -p, --prompt TEXT     prompt text
  --prompt-file F       read the prompt from a file
  --chat                wrap the prompt as a user message with the model's chat template
  --system TEXT         system message (with --chat)
  -n, --max-tokens N    tokens to generate (default 128)
  -c, --ctx-size N      longest sequence, prompt + generated (default: the model's context)
  --temperature, --temp T   0 = greedy (default %TEMP%, as in every spade command; at most 100)
  --top-k K             (default 0 = off)      --top-p P   (default 1 = off)
  --min-p P             (default 0 = off)      --repeat-penalty R (default 1 = off)
  --seed S              RNG seed (default 0)
  --no-bos              do not add the BOS token
  --ignore-eos          keep generating after end-of-sequence tokens
  -t, --threads N       CPU threads (default: all cores)
  --page-size N         KV cache page size in tokens (default 16)
  --prefill-chunk N     prompt tokens per forward pass (default 1024)
  --stats               summary on stderr at the end: stop reason (eos, max-tokens, context),
                        prompt tokens and prefill tok/s, generated tokens and decode tok/s,
                        decode step times; with a sparse method its mean density (and recall
                        with --recall)
  --stats-steps         --stats, and a line per decode step on stderr (its time, density,
                        recall)
  --stats-jsonl FILE    write one JSON object per generated token to FILE: i, phase, id, text,
                        ms, length, and on the CPU the step's density, tokens_per_head (recall)
  --progress-after S    show a prefill progress line with ETA on stderr when the prefill
                        runs over S seconds (default 2; -1: never); on a terminal one line
                        rewritten in place, else a line every 5 s
  --cpu-weights f32|native  CPU weights: native (the default for quantized GGUF files) multiplies
                        by the weights as stored, no fp32 copy; f32 dequantizes them at load
                        (the reference; the default for other models)
  --kv-dtype f32|bf16|f16|fp8  CPU KV cache element type (default bf16: half the bytes a
                        decode step reads; f32 is the reference; f16 is llama.cpp's; fp8 is
                        E4M3 with scales: a quarter of f32's bytes); the GPU cache is bf16
  --kv-scale auto|X     fp8 scales per (layer, KV head), K and V apart: auto (default) from
                        the first prefill (its largest |value| at most half of fp8's 448),
                        then fixed; X: every scale X (rounded up to a power of two)
  --tp N                tensor parallelism over N processes of this host (default 1; cpu,
                        full attention): heads and KV heads must divide by N (docs/cli.md)
  --device cpu|cuda     where the model runs (default cpu; cuda: bf16 weights on the GPU,
                        dense attention or --sparse streaming|quest|tidal|lessismore|lycheedecode|
                        twilight|blasst; quest on the GPU
                        needs page_size 16, group=max; --sparse-opt gpu_scores=fast uses
                        tensor-core page scores)
  --deterministic       GPU decode attention with the static schedule only: bit-identical
                        reruns (default: long steps with splits draw their chunks, faster,
                        last bits may vary; env SPADE_DETERMINISTIC=1 does the same)
  --synthetic NAME      no weights: random weights of NAME's shapes on the GPU (llama3-8b,
                        qwen3-8b, smollm2-135m, or a config.json path); the prompt is --prompt-len random
                        token ids and the output is token ids (speed measurements)
  --prompt-len N        prompt tokens for --synthetic (default 128)

sparse attention (prefill is dense; decode steps read only the selected tokens):
  --sparse NAME[:k=v,..] method and options (default full): )" "%METHODS%" R"(
  --budget N            tokens attended per KV head in sparse layers (method option budget)
  --sparse-opt K=V      method option; repeatable, or a comma list K=V,K=V
  --sparse-config F     JSON file: {"method": "quest", "budget": 2048, "recall": true, ...}
                        (command-line options override it)
  --recall              measure attention recall against full attention (slower)

methods and options (defaults from the papers; docs/sparse.md):
)";


std::string help_text() {
  std::string h = kHelp;
  h.replace(h.find("%METHODS%"), 9, sparse::method_names());
  char t[32];
  std::snprintf(t, sizeof t, "%g", kDefaultTemperature);
  h.replace(h.find("%TEMP%"), 6, t);
  return h + sparse::methods_help();
}

// Per-token records of --stats-steps (stderr) and --stats-jsonl FILE: one per generated
// token; token 0 comes from the prefill, token i > 0 from decode step i (which fed token
// i - 1 at position prompt + i - 1, so its sequence length is prompt + i).
class StepLog {
 public:
  StepLog(const Args& a, int64_t prompt_tokens) : prompt_(prompt_tokens) {
    lines_ = a.has("--stats-steps");
    if (a.has("--stats-jsonl")) {
      const std::string path = a.str("--stats-jsonl");
      SPADE_CHECK(!path.empty(), "--stats-jsonl needs a file name");
      jsonl_ = std::fopen(path.c_str(), "w");
      SPADE_CHECK(jsonl_, "--stats-jsonl: cannot write '", path, "'");
    }
    last_ = std::chrono::steady_clock::now();
  }
  ~StepLog() {
    if (jsonl_) std::fclose(jsonl_);
  }
  StepLog(const StepLog&) = delete;
  StepLog& operator=(const StepLog&) = delete;
  bool active() const { return lines_ || jsonl_; }
  // Restarts the clock at the start of the prefill.
  void start() { last_ = std::chrono::steady_clock::now(); }
  // The session's statistics of the decode step that produced the next token.
  void step_stats(const sparse::StepStats& s) { pending_ = s, has_pending_ = true; }
  void token(int32_t id, const std::string& text) {
    const auto now = std::chrono::steady_clock::now();
    const double ms = 1e3 * std::chrono::duration<double>(now - last_).count();
    last_ = now;
    const int64_t i = n_++, length = prompt_ + i;
    const bool st = has_pending_ && i > 0;
    has_pending_ = false;
    if (lines_ && i > 0) {
      std::fprintf(stderr, "[spade] step %lld L=%lld %.3f ms", (long long)i, (long long)length, ms);
      if (st) {
        std::fprintf(stderr, " tokens/head %.1f density %.4f (sparse layers %.4f)",
                     pending_.tokens_per_head(), pending_.density(), pending_.sparse_density());
        if (pending_.has_recall())
          std::fprintf(stderr, " recall %.4f (sparse layers %.4f, min %.4f)", pending_.mean_recall(),
                       pending_.sparse_recall(), pending_.min_recall());
      }
      std::fputc('\n', stderr);
    }
    if (jsonl_) {
      nlohmann::json j = {{"i", i}, {"phase", i == 0 ? "prefill" : "decode"}, {"id", id},
                          {"text", text}, {"ms", std::round(ms * 1e3) / 1e3}, {"length", length}};
      if (st) {
        j["tokens_per_head"] = pending_.tokens_per_head();
        j["density"] = pending_.density();
        j["sparse_density"] = pending_.sparse_density();
        if (pending_.has_recall()) {
          j["recall"] = pending_.mean_recall();
          j["sparse_recall"] = pending_.sparse_recall();
          j["min_recall"] = pending_.min_recall();
        }
      }
      const std::string line = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
      std::fprintf(jsonl_, "%s\n", line.c_str());
    }
  }

 private:
  int64_t prompt_, n_ = 0;
  bool lines_ = false;
  std::FILE* jsonl_ = nullptr;
  std::chrono::steady_clock::time_point last_;
  sparse::StepStats pending_;
  bool has_pending_ = false;
};

// Decode rate: tokens after the first (which the prefill produced) over the decode time.
double decode_rate(const GenerateStats& st, double excluded_s = 0) {
  return double(std::max<int64_t>(0, st.generated_tokens - 1)) /
         std::max(1e-9, st.decode_seconds - excluded_s);
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  SPADE_CHECK(f.good(), "cannot read prompt file '", path, "'");
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Modifier stages' own counters: Twilight's kept budget, BLASST's skipped tiles.
void print_modifier_stats(sparse::MethodState* state) {
  if (const sparse::TwilightStats* ts = sparse::twilight_stats(state)) {
    double base = 0, kept = 0;
    int64_t n = 0;
    for (size_t i = 0; i < ts->steps.size(); ++i) {
      base += ts->base_sum[i];
      kept += ts->kept_sum[i];
      n += ts->steps[i];
    }
    if (n > 0)
      std::fprintf(stderr, "[spade] twilight: per pruned (layer, KV head, step) base %.1f tokens, kept %.1f\n",
                   base / double(n), kept / double(n));
  }
  if (sparse::BlasstState* bs = sparse::blasst_state(state))
    std::fprintf(stderr, "[spade] blasst: tiles skipped in prefill %.1f%%, in decode %.1f%%\n",
                 100.0 * bs->stats.prefill_sparsity(), 100.0 * bs->stats.decode_sparsity());
}

// Decode step times: the median (the steady state) and the slowest steps (one-off work: graph
// captures, a LycheeCluster index build or lazy update).
void print_step_times(std::vector<float> ms) {
  if (ms.empty()) return;
  const float first = ms.front();
  std::vector<float> sorted(ms);
  std::sort(sorted.begin(), sorted.end());
  double total = 0;
  for (float x : ms) total += x;
  std::fprintf(stderr, "[spade] decode steps: %zu, median %.3f ms, mean %.3f ms, first %.2f ms, "
               "max %.2f ms, sum of the steps over 2x the median %.1f ms\n",
               ms.size(), sorted[sorted.size() / 2], total / double(ms.size()), first, sorted.back(),
               [&] {
                 double s = 0;
                 for (float x : ms) s += x > 2 * sorted[sorted.size() / 2] ? x : 0;
                 return s;
               }());
}


// --synthetic: random weights with a real model's shapes on the GPU; random prompt ids.
int run_synthetic(const Args& a, const sparse::SparseConfig& scfg, KvDtype kv_dtype, float kv_scale) {
#if defined(SPADE_HAVE_CUDA)
  ModelConfig cfg = synthetic_config(a.str("--synthetic"));
  long long n = a.has("-n") ? a.integer("-n", 128) : a.integer("--max-tokens", 128);
  const int64_t plen = a.integer("--prompt-len", 128);
  SPADE_CHECK(plen > 0 && n >= 0, "--prompt-len must be positive and --max-tokens >= 0");
  GenerateOptions opt;
  opt.max_new_tokens = n;
  opt.prefill_chunk = std::min<long long>(a.integer("--prefill-chunk", 1024), 8192);
  opt.sampling = sampling_from_args(a);
  CudaModelOptions copt;
  copt.page_size = int(a.integer("--page-size", 16));
  copt.max_tokens = std::min<int64_t>(plen + n, cfg.max_context);
  copt.max_batch = 1;
  copt.max_step_tokens = opt.prefill_chunk;
  copt.deterministic = a.has("--deterministic");
  copt.sparse = cuda_sparse_config(scfg, cfg, copt.page_size);
  // The GPU cache: fp8 (--kv-dtype fp8, --kv-scale) or bf16; a method that does not read fp8 is
  // refused by the model, by name.
  copt.kv_dtype = kv_dtype == KvDtype::FP8 ? KvDtype::FP8 : KvDtype::BF16;
  copt.kv_scale = kv_dtype == KvDtype::FP8 ? kv_scale : 0.f;
  const bool stats = a.has("--stats") || a.has("--stats-steps");
  if (stats)
    std::fprintf(stderr, "[spade] attention (GPU): %s\n", copt.sparse.describe().c_str());
  CudaModel model(cfg, copt, uint64_t(a.integer("--seed", 0)) + 1);
  std::mt19937 rng(uint32_t(a.integer("--seed", 0)));
  std::vector<int32_t> prompt(static_cast<size_t>(plen));
  for (auto& t : prompt) t = int32_t(rng() % uint32_t(cfg.vocab));
  PageTable pt;
  // Random ids have no text: LycheeCluster chunks them into fixed 16-token chunks.
  auto state = model.new_request_state();
  CudaStepModel runner(model);
  StepLog steps(a, plen);
  steps.start();
  GenerateStats st = generate(runner, pt, prompt, opt, [&](int32_t id) {
    std::printf("%d ", id);
    std::fflush(stdout);
    steps.token(id, "");
    return true;
  }, state.get());
  std::fputc('\n', stdout);
  if (st.stop_reason == StopReason::kContext)
    std::fprintf(stderr, "[spade] stopped at the model's context of %d tokens\n", cfg.max_context);
  if (stats) {
    std::fprintf(stderr,
                 "[spade] synthetic %s on %s | prompt %lld tokens, %.1f tok/s | generated %lld "
                 "tokens, %.2f ms/token | stop %s\n",
                 a.str("--synthetic").c_str(), cuda::device_summary().c_str(),
                 (long long)st.prompt_tokens, st.prompt_tokens / std::max(1e-9, st.prefill_seconds),
                 (long long)st.generated_tokens,
                 1e3 * st.decode_seconds / double(std::max<int64_t>(1, st.generated_tokens - 1)),
                 stop_reason_name(st.stop_reason));
    print_step_times(st.step_ms);
  }
  return 0;
#else
  fail("--synthetic needs the CUDA backend (this build has none)");
#endif
}

int run(int argc, char** argv) {
  Args a(argc, argv,
         {"--model", "--prompt", "--prompt-file", "--system", "-n", "--max-tokens",
          "--temperature", "--top-k", "--top-p", "--min-p", "--repeat-penalty", "--seed",
          "--threads", "--page-size", "--prefill-chunk", "--sparse", "--budget", "--sparse-opt",
          "--sparse-config", "--device", "--synthetic", "--prompt-len", "--ctx-size", "--tokenizer",
          "--stats-jsonl", "--progress-after", "--cpu-weights", "--kv-dtype", "--kv-scale", "--tp",
          "--tp-rank", "--dist-init"},
         {"--help", "--chat", "--no-bos", "--ignore-eos", "--stats", "--stats-steps", "--recall",
          "--deterministic"});
  if (a.has("--help")) {
    std::fputs(help_text().c_str(), stdout);
    return 0;
  }
  a.no_positionals();
  (void)sampling_from_args(a);  // flags checked before the model loads
  const double progress_after = a.number("--progress-after", 2);
  SPADE_CHECK(!std::isnan(progress_after), "--progress-after expects a number of seconds");
  // Sparse configuration: JSON file, then flags.
  sparse::SparseConfig scfg = sparse_from_args(a);
  if (a.has("--recall")) scfg.measure_recall = true;
  const std::string device = a.str("--device", a.has("--synthetic") ? "cuda" : "cpu");
  SPADE_CHECK(device == "cpu" || device == "cuda", "--device must be cpu or cuda");
  // GPU sparse decode (cuda_sparse_config checks the options once the model's config is
  // known); methods without a GPU path fail here, before the model loads.
  SPADE_CHECK(device == "cpu" || has_cuda_path(scfg.method), "--device cuda: sparse method '",
              scfg.method, "' has no GPU path (GPU methods: ", cuda_method_list(),
              "; the others run with --device cpu)");
  SPADE_CHECK(device == "cpu" || !scfg.measure_recall, "--recall is CPU-only (--device cpu)");
  const KvDtype kv_dtype = kv_dtype_from_args(a, device);
  const float kv_scale = kv_scale_from_args(a, kv_dtype);
  TpLaunch tp(a, argc, argv);  // tensor parallelism: checked now, ranks started once the model loads
  SPADE_CHECK(tp.size() == 1 || !a.has("--synthetic"), "--tp does not run --synthetic models yet");
  if (a.has("--synthetic")) return run_synthetic(a, scfg, kv_dtype, kv_scale);
  SPADE_CHECK(a.has("--model"), "--model is required (see --help)");
  SPADE_CHECK(a.has("--prompt") != a.has("--prompt-file"),
              "give exactly one of --prompt and --prompt-file");
  if (a.has("--threads")) ThreadPool::set_global_threads(a.integer("--threads", 0));
  std::string text = a.has("--prompt") ? a.str("--prompt") : read_file(a.str("--prompt-file"));

  using clock = std::chrono::steady_clock;
  auto t0 = clock::now();
  SPADE_CHECK(device == "cpu" || !a.has("--cpu-weights"), "--cpu-weights is for --device cpu");
  auto weights = load_model(a.str("--model"), device == "cpu"
                                                  ? parse_cpu_weights(a.str("--cpu-weights", "auto"))
                                                  : CpuWeights::F32);
  if (tp.follower()) return tp.follow(*weights);
  auto tok = tokenizer_from_args(a);
  const ModelConfig& cfg = weights->config;
  double load_s = std::chrono::duration<double>(clock::now() - t0).count();

  if (a.has("--chat")) {
    const ChatTemplate* tmpl = tok->chat_template();
    SPADE_CHECK(tmpl, "--chat: the model has no chat template");
    std::vector<ChatMessage> msgs;
    if (a.has("--system")) msgs.push_back({"system", a.str("--system")});
    msgs.push_back({"user", text});
    text = tmpl->render(msgs, true);
  }
  // A chat template already writes its own BOS text; parse it as a special token.
  std::vector<int32_t> prompt = tok->encode(text, !a.has("--no-bos") && !a.has("--chat"), true);
  check_token_ids(prompt, cfg.vocab, a);

  GenerateOptions opt;
  long long n = a.has("-n") ? a.integer("-n", 128) : a.integer("--max-tokens", 128);
  SPADE_CHECK(n >= 0, "--max-tokens must be >= 0");
  opt.max_new_tokens = n;
  opt.prefill_chunk = a.integer("--prefill-chunk", 1024);
  SPADE_CHECK(opt.prefill_chunk >= 1, "--prefill-chunk must be positive");
  opt.sampling = sampling_from_args(a);
  if (!a.has("--ignore-eos")) opt.stop_ids = tok->eos_ids();

  const int64_t need = int64_t(prompt.size()) + n;
  const int64_t ctx = a.integer("--ctx-size", cfg.max_context);
  SPADE_CHECK(ctx >= 1 && ctx <= cfg.max_context, "--ctx-size must be in [1, ", cfg.max_context,
              "] (the model's context), got ", ctx);
  opt.max_context = ctx;
  SPADE_CHECK(int64_t(prompt.size()) <= ctx, "the prompt has ", prompt.size(),
              " tokens, more than the context of ", ctx, " tokens");
  const int64_t page_size = a.integer("--page-size", 16);
  SPADE_CHECK(page_size >= 1 && page_size <= 4096, "--page-size must be in [1, 4096]");
  const int64_t tokens = std::min<int64_t>(need, ctx);
  // One runner (engine/runner.h) whatever the device: the CPU model over a host pool, or the
  // GPU model running the method itself.
  RunnerOptions ro;
  ro.device = device;
  ro.page_size = int(page_size);
  ro.kv_pages = (tokens + page_size - 1) / page_size;
  ro.kv_dtype = kv_dtype;
  ro.kv_scale = kv_scale;
  ro.max_batch = 1;
  ro.max_step_tokens = device == "cuda" ? std::min<int64_t>(opt.prefill_chunk, 8192) : opt.prefill_chunk;
  ro.deterministic = a.has("--deterministic");
  ro.sparse = scfg;
  ro.per_request_methods = false;
  tp.start(*weights, ro);
  Runner runner = make_runner(*weights, ro);
  StepModel& model = *runner.model;
  opt.prefill_chunk = std::min<int64_t>(opt.prefill_chunk, runner.max_step_tokens);
  PageTable pt;
  auto method = sparse::make_method(scfg, cfg);
  opt.correction_every = method->correction_every();  // cache correction (the method's option)
  // The method: a SparseSession over the runner's host pool (CPU), or the runner's own (GPU),
  // whose request state goes with every step.
  std::unique_ptr<sparse::SparseSession> session;
  std::unique_ptr<sparse::MethodState> state;
  const bool stats = a.has("--stats") || a.has("--stats-steps");
  StepLog steps(a, int64_t(prompt.size()));
  const bool sparse_method = method->name() != "full";
  if (runner.host_pool) {
    session = std::make_unique<sparse::SparseSession>(method, cfg, *runner.host_pool,
                                                      sparse::SessionOptions{scfg.measure_recall, false});
    session->reserve(tokens);
    opt.attention = &session->attention();
    if (stats)
      std::fprintf(stderr, "[spade] attention: %s%s\n", method->describe().c_str(),
                   scfg.measure_recall ? " (measuring recall)" : "");
    if (steps.active()) session->on_step = [&](const sparse::StepStats& s) { steps.step_stats(s); };
  } else {
    state = model.new_request_state(nullptr);
    if (stats) std::fprintf(stderr, "[spade] attention (%s): %s\n", device.c_str(), method->describe().c_str());
  }
  // Token text for methods that chunk by it (LycheeCluster): the prompt now, each generated
  // token before the step that feeds it.
  auto append_text = [&](int32_t id) {
    if (session && session->wants_token_text()) session->append_token_text(tok->token_bytes(id));
    if (state && state->wants_token_text()) state->append_token_text(tok->token_bytes(id));
  };
  for (int32_t id : prompt) append_text(id);
  StreamDecoder dec(*tok);
  auto emit = [&](int32_t id) {
    append_text(id);
    if (tok->is_special(id)) {  // end markers are not text
      steps.token(id, "");
      return true;
    }
    std::string s = dec.push(id);
    std::fwrite(s.data(), 1, s.size(), stdout);
    std::fflush(stdout);
    steps.token(id, s);
    return true;
  };
  PrefillProgress progress(progress_after);
  opt.on_prefill_chunk = [&](int64_t done, int64_t total) {
    progress.update(done, total);
    return true;
  };
  progress.start();
  steps.start();
  const GenerateStats st = generate(model, pt, prompt, opt, emit, state.get());
  std::string rest = dec.flush();
  std::fwrite(rest.data(), 1, rest.size(), stdout);
  std::fputc('\n', stdout);
  if (stats && session && sparse_method) {
    const sparse::SessionTotals& t = session->totals();
    std::fprintf(stderr, "[spade] %s: %lld decode steps, mean density %.4f (sparse layers %.4f), "
                 "tokens/head %.1f",
                 method->name().c_str(), (long long)t.steps, t.mean_density(),
                 t.mean_sparse_density(), t.mean_tokens_per_head());
    if (scfg.measure_recall)
      std::fprintf(stderr, ", mean recall %.4f (sparse layers %.4f, min %.4f)", t.mean_recall(),
                   t.mean_sparse_recall(), t.min_recall);
    std::fputc('\n', stderr);
    print_modifier_stats(session->state());
  }
  if (stats)
    if (const std::string r = model.stats_text(); !r.empty()) std::fprintf(stderr, "[spade] %s\n", r.c_str());
  if (stats) {
    // The summary: one line (prefill and decode rates, stop reason), the method's means above.
    std::fprintf(stderr,
                 "[spade] stop %s | prompt %lld tokens, %.1f tok/s prefill | generated %lld "
                 "tokens, %.1f tok/s decode | model load %.2f s | threads %d (process %d)\n",
                 stop_reason_name(st.stop_reason), (long long)st.prompt_tokens,
                 st.prompt_tokens / std::max(1e-9, st.prefill_seconds),
                 (long long)st.generated_tokens,
                 decode_rate(st, session ? session->totals().measure_seconds : 0.0), load_s,
                 ThreadPool::global().size(), process_threads());
    if (scfg.measure_recall && session)
      std::fprintf(stderr, "[spade] decode speed excludes %.2f s of recall measurement\n",
                   session->totals().measure_seconds);
    print_step_times(st.step_ms);
    if (opt.correction_every > 0)
      std::fprintf(stderr, "[spade] cache corrections: %lld (every %lld decoded tokens)\n",
                   (long long)st.corrections, (long long)opt.correction_every);
  }
  if (st.stop_reason == StopReason::kContext)
    std::fprintf(stderr, "[spade] stopped at the context of %lld tokens (--ctx-size)\n", (long long)ctx);
  return 0;
}

Registrar reg("generate", "generate text from a prompt", run);

}  // namespace
}  // namespace spade::cli
