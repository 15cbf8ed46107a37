// `spade generate`: load a model, tokenize the prompt, stream the generated text to stdout.
// Statistics (load time, prefill and decode speed) go to stderr only.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "args.h"
#include "command.h"
#include "core/thread_pool.h"
#include "engine/generator.h"
#include "model/loader.h"
#include "tokenizer/tokenizer.h"

namespace spade::cli {
namespace {

const char* kHelp = R"(usage: spade generate --model PATH (--prompt TEXT | --prompt-file F) [options]

  --model PATH          GGUF file or Hugging Face model directory
  --prompt TEXT         prompt text
  --prompt-file F       read the prompt from a file
  --chat                wrap the prompt as a user message with the model's chat template
  --system TEXT         system message (with --chat)
  -n, --max-tokens N    tokens to generate (default 128)
  --temperature T       0 = greedy (default 0)
  --top-k K             (default 0 = off)      --top-p P   (default 1 = off)
  --min-p P             (default 0 = off)      --repeat-penalty R (default 1 = off)
  --seed S              RNG seed (default 0)
  --no-bos              do not add the BOS token
  --ignore-eos          keep generating after end-of-sequence tokens
  --threads N           CPU threads (default: all cores)
  --page-size N         KV cache page size in tokens (default 16)
  --prefill-chunk N     prompt tokens per forward pass (default 1024)
  --stats               print token counts and speeds to stderr
)";

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  SPADE_CHECK(f.good(), "cannot read prompt file '", path, "'");
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

int run(int argc, char** argv) {
  Args a(argc, argv,
         {"--model", "--prompt", "--prompt-file", "--system", "-n", "--max-tokens",
          "--temperature", "--top-k", "--top-p", "--min-p", "--repeat-penalty", "--seed",
          "--threads", "--page-size", "--prefill-chunk"},
         {"--help", "--chat", "--no-bos", "--ignore-eos", "--stats"});
  if (a.has("--help")) {
    std::fputs(kHelp, stdout);
    return 0;
  }
  SPADE_CHECK(a.has("--model"), "--model is required (see --help)");
  SPADE_CHECK(a.has("--prompt") != a.has("--prompt-file"),
              "give exactly one of --prompt and --prompt-file");
  if (a.has("--threads")) ThreadPool::set_global_threads(int(a.integer("--threads", 0)));
  std::string text = a.has("--prompt") ? a.str("--prompt") : read_file(a.str("--prompt-file"));

  using clock = std::chrono::steady_clock;
  auto t0 = clock::now();
  auto weights = load_model(a.str("--model"));
  auto tok = Tokenizer::load(a.str("--model"));
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

  GenerateOptions opt;
  long long n = a.has("-n") ? a.integer("-n", 128) : a.integer("--max-tokens", 128);
  SPADE_CHECK(n >= 0, "--max-tokens must be >= 0");
  opt.max_new_tokens = n;
  opt.prefill_chunk = a.integer("--prefill-chunk", 1024);
  opt.sampling.temperature = float(a.number("--temperature", 0));
  opt.sampling.top_k = int(a.integer("--top-k", 0));
  opt.sampling.top_p = float(a.number("--top-p", 1));
  opt.sampling.min_p = float(a.number("--min-p", 0));
  opt.sampling.repetition_penalty = float(a.number("--repeat-penalty", 1));
  opt.sampling.seed = uint64_t(a.integer("--seed", 0));
  if (!a.has("--ignore-eos")) opt.stop_ids = tok->eos_ids();

  const int64_t need = int64_t(prompt.size()) + n;
  SPADE_CHECK(int64_t(prompt.size()) <= cfg.max_context, "the prompt has ", prompt.size(),
              " tokens, more than the model's context of ", cfg.max_context, " tokens");
  KVLayout layout{cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, int(a.integer("--page-size", 16))};
  SPADE_CHECK(layout.page_size > 0, "--page-size must be positive");
  int64_t tokens = std::min<int64_t>(need, cfg.max_context);
  KVPool kv(layout, (tokens + layout.page_size - 1) / layout.page_size);
  CpuModel model(*weights, kv);
  PageTable pt;
  StreamDecoder dec(*tok);
  GenerateStats st = generate(model, pt, prompt, opt, [&](int32_t id) {
    if (tok->is_special(id)) return true;  // end markers are not text
    std::string s = dec.push(id);
    std::fwrite(s.data(), 1, s.size(), stdout);
    std::fflush(stdout);
    return true;
  });
  std::string rest = dec.flush();
  std::fwrite(rest.data(), 1, rest.size(), stdout);
  std::fputc('\n', stdout);
  if (a.has("--stats")) {
    std::fprintf(stderr,
                 "[spade] model load %.2f s | prompt %lld tokens, %.1f tok/s | generated %lld "
                 "tokens, %.1f tok/s | threads %d\n",
                 load_s, (long long)st.prompt_tokens,
                 st.prompt_tokens / std::max(1e-9, st.prefill_seconds),
                 (long long)st.generated_tokens,
                 st.generated_tokens / std::max(1e-9, st.decode_seconds),
                 ThreadPool::global().size());
  }
  if (st.generated_tokens < n && !st.stopped_by_stop_id)
    std::fprintf(stderr, "[spade] stopped at the model's context of %d tokens\n", cfg.max_context);
  return 0;
}

Registrar reg("generate", "generate text from a prompt", run);

}  // namespace
}  // namespace spade::cli
