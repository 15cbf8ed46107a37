// `spade needle`: a needle-in-a-haystack question over a long real text, answered with
// several attention methods from one shared prefill. The prompt (haystack cut to a token
// target, needle inserted at a depth, question at the end, chat template) is prefilled once
// with dense attention; each method then decodes greedily from a fork of that KV cache
// (full pages shared, kv_pool.h) and prints its answer, density, recall (with --recall)
// and decode speed.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "args.h"
#include "kv_args.h"
#include "command.h"
#include "core/thread_pool.h"
#include "engine/sampler.h"
#include "model/cpu_model.h"
#include "model/loader.h"
#include "sparse/cache_correction.h"
#include "sparse/registry.h"
#include "sparse/session.h"
#include "tokenizer/tokenizer.h"

namespace spade::cli {
namespace {

const char* kHelp = R"(usage: spade needle --model PATH --haystack-file F --needle TEXT --question TEXT [options]

  --model PATH          GGUF file or Hugging Face model directory
  --haystack-file F     long text (lines); cut to fit --context-tokens
  --needle TEXT         sentence inserted into the haystack
  --question TEXT       asked after the haystack
  --expect TEXT         answer text to look for (case-insensitive) in each method's output
  --depth F             where the needle goes, fraction of the haystack lines (default 0.5)
  --context-tokens N    prompt length target (default: model context - max tokens - 16)
  --methods LIST        ';'-separated method specs NAME[:k=v,k=v]
                        (default "full;quest;tidal;lessismore;streaming")
  --budget N            budget of every method that takes one and was given none (default 256)
  -n, --max-tokens N    tokens to generate per method (default 24)
  --recall              measure attention recall against full attention (its time is
                        excluded from the decode speeds)
  --system TEXT         system message
  --threads N           CPU threads (default: all cores)
  --page-size N         KV page size (default 16)
  --kv-dtype f32|bf16|f16|fp8  KV cache element type (default bf16; f32 the reference)
  --kv-scale auto|X     fp8 scales: auto (default: from the prefill) or X (a power of two)
  --prefill-chunk N     prompt tokens per forward pass (default 1024)
  --prompt-out F        write the rendered prompt text to F
)";

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  SPADE_CHECK(f.good(), "cannot read haystack file '", path, "'");
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, sep))
    if (!item.empty()) out.push_back(item);
  return out;
}

std::string lower(std::string s) {
  for (auto& c : s) c = char(std::tolower((unsigned char)c));
  return s;
}

using clock_ = std::chrono::steady_clock;
double since(clock_::time_point t) {
  return std::chrono::duration<double>(clock_::now() - t).count();
}

int run(int argc, char** argv) {
  Args a(argc, argv,
         {"--model", "--haystack-file", "--needle", "--question", "--expect", "--depth",
          "--context-tokens", "--methods", "--budget", "-n", "--max-tokens", "--system",
          "--threads", "--page-size", "--prefill-chunk", "--prompt-out", "--kv-dtype", "--kv-scale"},
         {"--help", "--recall"});
  if (a.has("--help")) {
    std::fputs(kHelp, stdout);
    std::fputs("\nmethods and options:\n", stdout);
    std::fputs(sparse::methods_help().c_str(), stdout);
    return 0;
  }
  a.no_positionals();
  for (const char* req : {"--model", "--haystack-file", "--needle", "--question"})
    SPADE_CHECK(a.has(req), req, " is required (see --help)");
  if (a.has("--threads")) ThreadPool::set_global_threads(a.integer("--threads", 0));
  const long long n_new = a.has("-n") ? a.integer("-n", 24) : a.integer("--max-tokens", 24);
  SPADE_CHECK(n_new > 0, "--max-tokens must be positive");
  const double depth = a.number("--depth", 0.5);
  SPADE_CHECK(depth >= 0 && depth <= 1, "--depth must be in [0, 1]");
  const bool recall = a.has("--recall");

  // Method specs, validated before the model loads.
  std::vector<sparse::SparseConfig> specs;
  for (const auto& s : split(a.str("--methods", "full;quest;tidal;lessismore;streaming"), ';')) {
    sparse::SparseConfig c = sparse::SparseConfig::parse_spec(s);
    const auto& info = sparse::find_method(c.method);
    bool takes_budget = false;
    for (const auto& o : info.options()) takes_budget |= o.key == "budget";
    if (takes_budget && !c.options.count("budget"))
      c.set("budget", std::to_string(a.integer("--budget", 256)));
    c.measure_recall = recall;
    specs.push_back(c);
  }

  auto t_load = clock_::now();
  auto weights = load_model(a.str("--model"));
  auto tok = Tokenizer::load(a.str("--model"));
  const ModelConfig& cfg = weights->config;
  std::vector<std::shared_ptr<const sparse::SparseMethod>> methods;
  for (const auto& c : specs) methods.push_back(sparse::make_method(c, cfg));
  const double load_s = since(t_load);

  // The prompt: haystack lines with the needle at `depth`, cut to the token target.
  const ChatTemplate* tmpl = tok->chat_template();
  SPADE_CHECK(tmpl, "the model has no chat template");
  const std::vector<std::string> lines = split(read_text(a.str("--haystack-file")), '\n');
  SPADE_CHECK(!lines.empty(), "the haystack file is empty");
  const int64_t target = a.integer("--context-tokens", cfg.max_context - n_new - 16);
  SPADE_CHECK(target > 0 && target + n_new <= cfg.max_context, "--context-tokens ", target,
              " + ", n_new, " new tokens exceed the model's context of ", cfg.max_context);
  auto render = [&](size_t n_lines) {
    std::string hay;
    const size_t at = size_t(double(n_lines) * depth + 0.5);
    for (size_t i = 0; i <= n_lines; ++i) {
      if (i == at) hay += a.str("--needle") + "\n";
      if (i < n_lines) hay += lines[i] + "\n";
    }
    std::vector<ChatMessage> msgs;
    if (a.has("--system")) msgs.push_back({"system", a.str("--system")});
    msgs.push_back({"user", hay + "\n" + a.str("--question")});
    return tmpl->render(msgs, true);
  };
  auto count = [&](size_t n_lines) { return int64_t(tok->encode(render(n_lines), false, true).size()); };
  size_t lo = 0, hi = lines.size();
  if (count(hi) > target) {  // largest line count that fits
    while (lo < hi) {
      size_t mid = (lo + hi + 1) / 2;
      if (count(mid) <= target) lo = mid;
      else hi = mid - 1;
    }
    hi = lo;
  }
  const std::string text = render(hi);
  if (a.has("--prompt-out")) std::ofstream(a.str("--prompt-out"), std::ios::binary) << text;
  const std::vector<int32_t> prompt = tok->encode(text, false, true);
  SPADE_CHECK(int64_t(prompt.size()) <= target, "the question alone exceeds --context-tokens");

  // One dense prefill into a pool with room for the prompt and one method's decode.
  KVLayout layout{cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, int(a.integer("--page-size", 16))};
  SPADE_CHECK(layout.page_size > 0, "--page-size must be positive");
  layout.dtype = kv_dtype_from_args(a, "cpu");
  layout.kv_scale = kv_scale_from_args(a, layout.dtype);
  const int64_t P = layout.page_size;
  KVPool kv(layout, (int64_t(prompt.size()) + P - 1) / P + (n_new + P - 1) / P + 2);
  CpuModel model(*weights, kv);
  PageTable base;
  std::vector<int64_t> row_of;
  std::vector<SeqInput> batch(1);
  const int64_t chunk = std::max<long long>(1, a.integer("--prefill-chunk", 1024));
  auto t_pre = clock_::now();
  std::vector<float> last_logits;
  for (size_t off = 0; off < prompt.size(); off += size_t(chunk)) {
    batch[0] = {&base, prompt.data() + off, std::min<int64_t>(chunk, int64_t(prompt.size() - off)),
                false, nullptr};
    const auto& lg = model.forward(batch, row_of);
    last_logits.assign(lg.begin() + row_of[0] * cfg.vocab, lg.begin() + (row_of[0] + 1) * cfg.vocab);
  }
  const double pre_s = since(t_pre);
  std::printf("needle: %zu prompt tokens (%zu haystack lines, needle at depth %.2f), context %d\n",
              prompt.size(), hi, depth, cfg.max_context);
  std::printf("model load %.1f s, prefill %.1f s (%.0f tok/s, dense, shared by all methods), threads %d\n",
              load_s, pre_s, double(prompt.size()) / std::max(1e-9, pre_s), ThreadPool::global().size());
  std::printf("question: %s\n\n", a.str("--question").c_str());
  std::fflush(stdout);

  const std::string expect = lower(a.str("--expect"));
  int found = 0;
  for (size_t m = 0; m < methods.size(); ++m) {
    PageTable pt = kv.fork(base);
    sparse::SparseSession session(methods[m], cfg, kv, {recall, false});
    session.reserve(int64_t(prompt.size()) + n_new);
    const bool wants_text = session.wants_token_text();
    if (wants_text)
      for (int32_t id : prompt) session.append_token_text(tok->token_bytes(id));
    std::vector<int32_t> out;
    // The method's cache correction (dense re-feed of the last N decoded tokens).
    std::unique_ptr<sparse::CacheCorrection> cc;
    if (methods[m]->correction_every() > 0)
      cc = std::make_unique<sparse::CacheCorrection>(methods[m]->correction_every());
    std::vector<int64_t> corr_rows;
    auto dense = [&](const SeqInput& in) { model.forward({in}, corr_rows); };
    int32_t t = argmax(last_logits.data(), cfg.vocab);
    auto t_dec = clock_::now();
    int64_t steps = 0;
    for (long long i = 0; i < n_new; ++i) {
      out.push_back(t);
      if (wants_text) session.append_token_text(tok->token_bytes(t));
      const auto& eos = tok->eos_ids();
      if (std::find(eos.begin(), eos.end(), t) != eos.end() || i + 1 == n_new) break;
      batch[0] = {&pt, &out.back(), 1, false, &session.attention()};
      const auto& lg = model.forward(batch, row_of);
      t = argmax(lg.data() + row_of[0] * cfg.vocab, cfg.vocab);  // before a correction reruns it
      if (cc) cc->after_decode(dense, pt, out.back());
      ++steps;
    }
    const double dec_s = since(t_dec) - session.totals().measure_seconds;
    kv.release(pt);
    std::string answer = tok->decode(out, true);
    std::replace(answer.begin(), answer.end(), '\n', ' ');
    const bool ok = !expect.empty() && lower(answer).find(expect) != std::string::npos;
    found += ok;
    const sparse::SessionTotals& tot = session.totals();
    std::printf("[%s] %s\n", specs[m].method.c_str(), methods[m]->describe().c_str());
    std::printf("  answer: %s%s\n", answer.c_str(),
                expect.empty() ? "" : (ok ? "   [needle found]" : "   [needle NOT found]"));
    std::printf("  density %.4f (sparse layers %.4f, %.0f tokens/head)", tot.mean_density(),
                tot.mean_sparse_density(), tot.mean_tokens_per_head());
    if (recall)
      std::printf(" | recall %.4f (sparse layers %.4f, min %.4f)", tot.mean_recall(),
                  tot.mean_sparse_recall(), tot.min_recall);
    std::printf(" | decode %.2f tok/s (%lld steps, %.2f s%s)\n\n", double(steps) / std::max(1e-9, dec_s),
                (long long)steps, dec_s, recall ? ", recall measurement excluded" : "");
    std::fflush(stdout);
  }
  if (!expect.empty())
    std::printf("needle found by %d of %zu methods\n", found, methods.size());
  kv.release(base);
  return 0;
}

Registrar reg("needle", "needle-in-a-haystack answers with several attention methods", run);

}  // namespace
}  // namespace spade::cli
