// `spade chat`: interactive chat on stdin/stdout with the model's own chat template.
// Each user line is appended to the conversation, which is re-rendered with the template.
// The KV cache keeps the tokens the model has already seen: when the new rendering starts
// with exactly those tokens (the usual case), only the new suffix is prefilled; otherwise
// (a template that rewrites earlier turns, e.g. one that drops old thinking blocks) the
// conversation is prefilled again from scratch. Both give the same tokens.
// Ctrl-C while an answer is prefilled or generated stops that answer, not the program: a
// SIGINT handler, installed only for the generation, sets a flag that the per-token and
// per-prefill-chunk callbacks check. At the prompt SIGINT has its default action again, so a
// second Ctrl-C there ends the program (as does end of input).
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <string>

#include "args.h"
#include "kv_args.h"
#include "command.h"
#include "progress.h"
#include "sampling_args.h"
#include "sparse_args.h"
#include "tokenizer_args.h"
#include "tp_args.h"
#include "core/thread_pool.h"
#include "engine/generator.h"
#include "engine/runner.h"
#include "model/loader.h"
#include "sparse/registry.h"
#include "sparse/session.h"
#include "tokenizer/tokenizer.h"

namespace spade::cli {
namespace {

const char* kHelp = R"(usage: spade chat --model PATH [options]

Reads one user message per line from stdin and streams each answer to stdout, using the
model's own chat template (tokenizer_config.json / chat_template.jinja, or the GGUF's).
An empty line or end of input ends the chat; the line /reset starts a new conversation.
Prompts ("> ") and statistics go to stderr, so stdout holds only the answers.
Ctrl-C stops the answer being written (it stays in the conversation as far as it got; during
the prompt's prefill the message is dropped) and returns to the prompt; Ctrl-C at the prompt
exits.

  -m, --model PATH      GGUF file or Hugging Face model directory
  --tokenizer PATH      tokenizer (and chat template) instead of the model's own, as in generate
  --system TEXT         system message
  --thinking on|off     sets the template's enable_thinking (Qwen3); default: the template's
  -n, --max-tokens N    tokens per answer at most (default 512)
  -c, --ctx-size N      longest conversation in tokens (default: the model's context)
  --temperature, --temp T   0 = greedy (default %TEMP%, as in every spade command; at most 100)
  --top-k K  --top-p P  --min-p P  --repeat-penalty R  --seed S
  --ignore-eos          keep generating after end-of-sequence tokens (for testing)
  -t, --threads N       CPU threads (default: all cores)
  --cpu-weights f32|native  CPU weights: native (the default for quantized GGUF files) multiplies
                        by the weights as stored, no fp32 copy; f32 dequantizes them at load
                        (the reference; the default for other models)
  --kv-dtype f32|bf16|f16|fp8  CPU KV cache element type (default bf16: half the bytes a
                        decode step reads; f32 is the reference; f16 is llama.cpp's; fp8 is
                        E4M3 with scales: a quarter of f32's bytes); the GPU cache is bf16
  --kv-scale auto|X     fp8 scales per (layer, KV head), K and V apart: auto (default) from
                        the first prefill (its largest |value| at most half of fp8's 448),
                        then fixed; X: every scale X (rounded up to a power of two)
  --device cpu|cuda     where the model runs (default cpu; cuda: CUDA builds)
  --sparse NAME[:k=v,..] sparse attention method for the answers' decode steps (default full;
                        `spade generate --help` lists them); --budget N, --sparse-opt k=v,...
                        and --sparse-config FILE as in generate
  --deterministic       with --device cuda: bit-identical reruns
  --tp N                tensor parallelism over N processes of this host, as in generate
                        (default 1; --device cuda: a GPU per rank)
  --no-cache-reuse      prefill the whole conversation every turn (for testing)
  --stats               per turn on stderr: conversation and prefilled tokens, prefill tok/s,
                        generated tokens, decode tok/s, stop reason (eos, max-tokens, context,
                        interrupted)
  --progress-after S    prefill progress line with ETA on stderr when a turn's prefill runs
                        over S seconds (default 2; -1: never), as in generate
)";

std::string help_text() {
  std::string h = kHelp;
  char t[32];
  std::snprintf(t, sizeof t, "%g", kDefaultTemperature);
  h.replace(h.find("%TEMP%"), 6, t);
  return h;
}

// Ctrl-C during an answer: the handler only sets the flag (lock-free atomic: async-signal-safe).
std::atomic<bool> g_interrupted{false};
static_assert(std::atomic<bool>::is_always_lock_free);
extern "C" void on_sigint(int) { g_interrupted.store(true); }

// SIGINT sets g_interrupted while this lives; the previous action (the default: exit) comes
// back when it ends.
class InterruptScope {
 public:
  InterruptScope() {
    g_interrupted.store(false);
    struct sigaction sa {};
    sa.sa_handler = on_sigint;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &old_);
  }
  ~InterruptScope() { sigaction(SIGINT, &old_, nullptr); }
  InterruptScope(const InterruptScope&) = delete;
  InterruptScope& operator=(const InterruptScope&) = delete;
  static bool interrupted() { return g_interrupted.load(); }

 private:
  struct sigaction old_ {};
};

struct Conversation {
  std::vector<ChatMessage> messages;
  std::vector<int32_t> seen;  // tokens whose K/V are in `pt`, in order
  PageTable pt;
};

int run(int argc, char** argv) {
  Args a(argc, argv,
         {"--model", "--system", "--thinking", "-n", "--max-tokens", "--temperature", "--top-k",
          "--top-p", "--min-p", "--repeat-penalty", "--seed", "--threads", "--device", "--cpu-weights", "--sparse",
          "--budget", "--sparse-opt", "--sparse-config", "--ctx-size", "--tokenizer",
          "--progress-after", "--kv-dtype", "--kv-scale", "--tp", "--tp-rank", "--dist-init"},
         {"--help", "--no-cache-reuse", "--stats", "--deterministic", "--ignore-eos"});
  if (a.has("--help")) {
    std::fputs(help_text().c_str(), stdout);
    return 0;
  }
  SPADE_CHECK(a.has("--model"), "--model is required (see --help)");
  a.no_positionals();
  (void)sampling_from_args(a);  // flags checked before the model loads
  const double progress_after = a.number("--progress-after", 2);
  SPADE_CHECK(!std::isnan(progress_after), "--progress-after expects a number of seconds");
  const sparse::SparseConfig scfg = sparse_from_args(a);
  const std::string device = a.str("--device", "cpu");
  SPADE_CHECK(device == "cpu" || device == "cuda", "--device must be cpu or cuda, got '", device, "'");
  const KvDtype kv_dtype = kv_dtype_from_args(a, device);
  const float kv_scale = kv_scale_from_args(a, kv_dtype);
  nlohmann::json extra = nlohmann::json::object();
  if (a.has("--thinking")) {
    const std::string t = a.str("--thinking");
    SPADE_CHECK(t == "on" || t == "off", "--thinking expects on or off, got '", t, "'");
    extra["enable_thinking"] = t == "on";
  }
  if (a.has("--threads")) ThreadPool::set_global_threads(a.integer("--threads", 0));
  SPADE_CHECK(device == "cpu" || !a.has("--cpu-weights"), "--cpu-weights is for --device cpu");
  TpLaunch tp(a, argc, argv);  // tensor parallelism: checked now, ranks started once the model loads
  auto weights = load_model(a.str("--model"), device == "cpu"
                                                  ? parse_cpu_weights(a.str("--cpu-weights", "auto"))
                                                  : CpuWeights::F32);
  if (tp.follower()) return tp.follow(*weights);  // ranks 1..N-1 read no stdin
  auto tok = tokenizer_from_args(a);
  const ChatTemplate* tmpl = tok->chat_template();
  SPADE_CHECK(tmpl, a.has("--tokenizer") ? "the tokenizer '" + a.str("--tokenizer") + "'"
                                         : "the model '" + a.str("--model") + "'",
              " has no chat template; use spade generate");
  const ModelConfig& cfg = weights->config;
  // One runner whatever the device (engine/runner.h), with room for the whole context.
  RunnerOptions ro;
  ro.device = device;
  const int64_t ctx = a.integer("--ctx-size", cfg.max_context);
  SPADE_CHECK(ctx >= 1 && ctx <= cfg.max_context, "--ctx-size must be in [1, ", cfg.max_context,
              "] (the model's context), got ", ctx);
  ro.kv_pages = (ctx + 15) / 16 + 1;
  ro.kv_dtype = kv_dtype;
  ro.kv_scale = kv_scale;
  ro.max_batch = 1;
  ro.max_step_tokens = 1024;
  ro.deterministic = a.has("--deterministic");
  ro.sparse = scfg;
  ro.per_request_methods = false;
  tp.start(*weights, ro);
  Runner runner = make_runner(*weights, ro);
  StepModel& model = *runner.model;
  auto method = sparse::make_method(scfg, cfg);

  GenerateOptions opt;
  opt.max_new_tokens = a.has("-n") ? a.integer("-n", 512) : a.integer("--max-tokens", 512);
  SPADE_CHECK(opt.max_new_tokens > 0, "--max-tokens must be positive");
  opt.sampling = sampling_from_args(a);
  if (!a.has("--ignore-eos")) opt.stop_ids = tok->eos_ids();
  opt.prefill_chunk = runner.max_step_tokens;
  opt.correction_every = method->correction_every();
  opt.max_context = ctx;
  const bool reuse = !a.has("--no-cache-reuse");

  // The method: a session over the host pool (CPU) or the runner's own, with its request
  // state (GPU); both fresh with each conversation, fed each token's text.
  std::unique_ptr<sparse::SparseSession> session;
  std::unique_ptr<sparse::MethodState> state;
  Conversation conv;
  auto reset = [&] {
    model.release(conv.pt);
    conv = Conversation{};
    if (a.has("--system")) conv.messages.push_back({"system", a.str("--system")});
    session.reset();
    state.reset();
    if (runner.host_pool) {
      session = std::make_unique<sparse::SparseSession>(method, cfg, *runner.host_pool);
      opt.attention = &session->attention();
    } else {
      state = model.new_request_state(nullptr);
    }
  };
  auto append_text = [&](int32_t id) {
    if (session && session->wants_token_text()) session->append_token_text(tok->token_bytes(id));
    if (state && state->wants_token_text()) state->append_token_text(tok->token_bytes(id));
  };
  reset();
  PrefillProgress progress(progress_after);
  std::string line;
  while (std::fputs("> ", stderr), std::getline(std::cin, line) && !line.empty()) {
    if (line == "/reset") {
      reset();
      continue;
    }
    conv.messages.push_back({"user", line});
    const std::vector<int32_t> ids = tok->encode(tmpl->render(conv.messages, true, extra), false, true);
    check_token_ids(ids, cfg.vocab, a);
    if (int64_t(ids.size()) >= ctx) {
      // Nothing is cut silently: say so and let the user start over.
      std::fprintf(stderr,
                   "[spade] the conversation is %zu tokens, the context (-c) is %lld; "
                   "type /reset to start a new one\n",
                   ids.size(), (long long)ctx);
      conv.messages.pop_back();
      continue;
    }
    // Reuse the cached prefix when the new rendering extends exactly what the model saw.
    const bool extends = reuse && conv.seen.size() < ids.size() &&
                         std::equal(conv.seen.begin(), conv.seen.end(), ids.begin());
    if (!extends) {
      model.release(conv.pt);
      conv.seen.clear();
      if (session || state) {  // the method's state follows the cache: start it afresh too
        const std::vector<ChatMessage> msgs = conv.messages;
        reset();
        conv.messages = msgs;
      }
    }
    const std::vector<int32_t> suffix(ids.begin() + int64_t(conv.seen.size()), ids.end());
    conv.seen = ids;
    GenerateOptions turn = opt;
    turn.max_new_tokens = std::min<int64_t>(opt.max_new_tokens, ctx - int64_t(ids.size()));
    StreamDecoder dec(*tok, /*skip_special=*/true);
    std::string answer;
    std::vector<int32_t> generated;
    for (int32_t id : suffix) append_text(id);
    progress.start();
    GenerateStats st;
    {
      InterruptScope ctrl_c;  // Ctrl-C stops this answer only
      turn.on_prefill_chunk = [&](int64_t done, int64_t total) {
        progress.update(done, total);
        return !InterruptScope::interrupted();
      };
      st = generate(model, conv.pt, suffix, turn, [&](int32_t id) {
        append_text(id);
        generated.push_back(id);
        const std::string s = dec.push(id);
        answer += s;
        std::fwrite(s.data(), 1, s.size(), stdout);
        std::fflush(stdout);
        return !InterruptScope::interrupted();
      }, state.get());
    }
    if (st.stop_reason == StopReason::kInterrupted && generated.empty()) {
      // Stopped in the prefill: the cache holds part of the message. Drop the message and
      // start the cache (and the method's state) afresh; the next turn prefills it all.
      std::fprintf(stderr, "\n[spade] interrupted during the prefill; the message is dropped\n");
      model.release(conv.pt);
      conv.seen.clear();
      conv.messages.pop_back();
      if (session || state) {
        const std::vector<ChatMessage> msgs = conv.messages;
        reset();
        conv.messages = msgs;
      }
      continue;
    }
    const std::string rest = dec.flush();
    answer += rest;
    std::fwrite(rest.data(), 1, rest.size(), stdout);
    std::fputc('\n', stdout);
    std::fflush(stdout);
    // generate() fed every generated token to the model except the last one.
    if (!generated.empty()) conv.seen.insert(conv.seen.end(), generated.begin(), generated.end() - 1);
    SPADE_CHECK(int64_t(conv.seen.size()) == conv.pt.length, "chat: cache bookkeeping is off (",
                conv.seen.size(), " vs ", conv.pt.length, ")");
    if (st.stop_reason == StopReason::kInterrupted)
      std::fprintf(stderr, "[spade] interrupted (Ctrl-C at the prompt exits)\n");
    else if (st.stop_reason != StopReason::kStopToken)
      std::fprintf(stderr, "[spade] the answer reached the %lld-token limit (%s)\n",
                   (long long)turn.max_new_tokens,
                   turn.max_new_tokens < opt.max_new_tokens ? "-c" : "-n");
    if (a.has("--stats"))
      std::fprintf(stderr,
                   "[spade] turn: %zu conversation tokens, %zu prefilled (%.1f tok/s prefill), %lld "
                   "generated (%.1f tok/s decode) | stop %s\n",
                   ids.size(), suffix.size(), double(suffix.size()) / std::max(1e-9, st.prefill_seconds),
                   (long long)st.generated_tokens,
                   double(std::max<int64_t>(0, st.generated_tokens - 1)) /
                       std::max(1e-9, st.decode_seconds),
                   stop_reason_name(st.stop_reason));
    conv.messages.push_back({"assistant", answer});
  }
  model.release(conv.pt);
  return 0;
}

Registrar reg("chat", "interactive chat with the model's chat template", run);

}  // namespace
}  // namespace spade::cli
