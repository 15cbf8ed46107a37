// `spade eval`: how much of the model's quality each attention method keeps (issue 11,
// docs/eval.md). Sub-commands:
//   tasks   RULER-style long-context tasks (src/eval/tasks.h), exact-match scores
//   ppl     perplexity of real text scored in decode mode after a dense prefix
//   agree   generation with a method vs full attention: first divergence, per-step KL
//   recall  attention recall and density per layer / head during teacher-forced decoding
//   longgen a short prompt and thousands of generated tokens against full attention
//   report  regenerate the Markdown report from a JSON file
// Every sweep crosses methods x budgets x lengths x samples. --device cpu: each prompt is
// prefilled once (dense) and every method decodes from a fork of its KV cache
// (src/eval/decode.h); --device cuda: GPU methods on CudaModels, the others on the CPU in the
// same sweep (src/eval/runner.h). Results
// go to a JSON file that also makes the sweep resumable (src/eval/results.h), a Markdown
// report next to it (src/eval/report.h); scripts/eval_plot.py draws the plots.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <map>
#include <sstream>

#include "args.h"
#include "command.h"
#include "kv_args.h"
#include "core/thread_pool.h"
#include "core/tuning.h"
#include "eval/decode.h"
#include "eval/longgen.h"
#include "eval/methods.h"
#include "eval/progress.h"
#include "eval/report.h"
#include "eval/results.h"
#include "eval/rng.h"
#include "eval/runner.h"
#include "eval/scoring.h"
#include "eval/tasks.h"
#include "model/loader.h"
#include "sparse/registry.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"
#include "spade_version.h"  // generated: SPADE_COMMIT

namespace spade::cli {
namespace {

using json = nlohmann::json;
using namespace spade::eval;

const char* kHelp = R"(usage: spade eval tasks|ppl|agree|recall --model M --text F [options]
       spade eval report RESULTS.json [--md OUT.md]

  tasks    RULER-style tasks: greedy answers, exact-match score per task
  ppl      perplexity of the last --decode tokens of real text, decoded with each method
           after a dense prefill of a prefix of each --lengths value
  agree    greedy generation with each method vs full attention on task prompts: tokens
           until the first divergence, per-step KL(full || method), same output, score
  recall   attention recall and density per layer and head (teacher-forced decoding of real
           text after a dense prefix)
  longgen  long generation: a short prompt (--prompt-tokens of --text, default 64), then
           --lengths tokens (default 2048; EOS ignored) with full attention as the reference:
           where each method's free-running text first diverges, and along the reference's
           tokens (teacher forced) per-step KL(full || method) (over full's top 1024 tokens
           plus one tail bucket: a lower bound), its means per --window steps (256), top-1
           agreement, perplexity, density; --recall: recall (CPU); --follow-text: teacher
           forced along the text's own continuation instead of full attention's tokens
  report   rewrite the Markdown report of a results JSON

common options:
  --model PATH          GGUF file or Hugging Face model directory
  --text F              long real text: the haystack of the needle tasks, the text of
                        ppl / recall (docs/eval.md makes one from Debian's bible-kjv-text)
  --methods LIST        ';'-separated specs NAME[:k=v,...]
                        (default "full;streaming;quest;tidal;lessismore;oracle-topk")
  --budgets B1,B2,...   budgets of the methods that take one and set none (default 256)
  --lengths L1,L2,...   prompt lengths in tokens (ppl / recall: prefix lengths)
                        (default 2048,4096,8000 capped by the model's context)
  --samples N           samples per (task, length) (default 3)
  --seed S              base seed (default 1); sample s of (task, length) uses a seed mixed
                        from S, the task, the length and s
  --out F               results JSON (default eval_<sub-command>.json); an existing file of
                        the same sub-command is resumed: its records are skipped
  --md F                Markdown report (default: --out with .md)
  --cpu-weights f32|native|auto  CPU weights: native (the default for quantized GGUF files)
                        multiplies by the weights as stored; f32 dequantizes them at load
  --device cpu|cuda     backend (default cpu). cuda (tasks, ppl, agree): the methods with a
                        GPU path run on CudaModel, one model per method (the prompt
                        prefilled on each); the others run on the CPU in the same sweep.
                        Each record's "backend" says where it ran
  --threads N           CPU threads (default: all cores)
  --page-size N         KV page size (default 16)
  --prefill-chunk N     prompt tokens per forward pass (default 1024)
  --kv-dtype f32|bf16|f16|fp8  the CPU runs' KV cache (default f32, the reference; fp8: E4M3
                        with scales; a sweep of another type wants its own --out)
  --kv-scale auto|X     fp8 scales: auto (default: from each prompt's prefill) or X (rounded
                        up to a power of two)
  --deterministic       with --device cuda: decode attention with the static schedule only,
                        so a sweep gives the same bits on every run (also SPADE_DETERMINISTIC=1)
tasks / agree:
  --tasks LIST          comma-separated task names or "all" (default all; agree:
                        niah_single_number,niah_multikey,json_lookup)
  --max-new N           cap on generated tokens per answer (default: the task's own)
  --recall              tasks: also measure attention recall (slower; CPU only)
ppl / recall:
  --decode N            tokens scored / decoded after the prefix (default ppl 64, recall 32)
recall runs on the CPU only (it needs each step's full attention weights).
)";

std::vector<int64_t> parse_list(const std::string& s, const char* what) {
  std::vector<int64_t> out;
  for (int v : sparse::parse_int_list(s, what)) {
    SPADE_CHECK(v > 0, what, " must be positive");
    out.push_back(v);
  }
  SPADE_CHECK(!out.empty(), what, " is empty");
  return out;
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  SPADE_CHECK(f.good(), "cannot read '", path, "'");
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream ss(text);
  std::string l;
  while (std::getline(ss, l))
    if (!l.empty()) out.push_back(l);
  return out;
}

std::string command_line(int argc, char** argv) {
  std::string s = "spade";
  for (int i = 0; i < argc; ++i) {
    std::string a = argv[i];
    const bool quote = a.find_first_of(" ;\"'$*?") != std::string::npos || a.empty();
    s += " " + (quote ? "'" + a + "'" : a);
  }
  return s;
}

std::string cpu_name() {
  std::ifstream f("/proc/cpuinfo");
  std::string l;
  while (std::getline(f, l))
    if (l.rfind("model name", 0) == 0) {
      auto p = l.find(':');
      return p == std::string::npos ? l : l.substr(p + 2);
    }
  return "unknown CPU";
}

std::string md_path(const Args& a, const std::string& out) {
  if (a.has("--md")) return a.str("--md");
  const size_t dot = out.rfind(".json");
  return (dot == std::string::npos ? out : out.substr(0, dot)) + ".md";
}

void write_report(const ResultFile& f, const std::string& md) {
  std::ofstream o(md);
  SPADE_CHECK(o.good(), "cannot write '", md, "'");
  o << markdown_report(f.doc());
}

std::string one_line(std::string s) {
  std::replace(s.begin(), s.end(), '\n', ' ');
  return s;
}

struct Setup {
  std::unique_ptr<ModelWeights> w;
  std::unique_ptr<Tokenizer> tok;
  std::vector<MethodRun> runs;
  Device device = Device::CPU;
  std::vector<Placement> place;  // per run: GPU or CPU
  std::vector<std::shared_ptr<const sparse::SparseMethod>> methods;  // CPU runs (else null)
  RunnerOptions ro;  // page size and prefill chunk (each sub-command sets the lengths)
  std::vector<int64_t> lengths;
  int samples = 3;
  uint64_t seed = 1;
  std::string text;
  json meta;
};

Setup setup(const Args& a, const std::string& kind) {
  SPADE_CHECK(a.has("--model"), "--model is required (see --help)");
  SPADE_CHECK(a.has("--text"), "--text is required (see --help)");
  if (a.has("--threads")) ThreadPool::set_global_threads(a.integer("--threads", 0));
  Setup s;
  s.device = parse_device(a.str("--device", "cpu"));
  SPADE_CHECK(s.device == Device::CPU || kind != "recall",
              "eval recall runs on the CPU only: it needs every step's full attention weights, "
              "which the GPU kernels do not produce (drop --device cuda)");
  SPADE_CHECK(s.device == Device::CPU || !a.has("--recall"),
              "--recall measures attention recall on the CPU only (drop --device cuda)");
  s.ro.page_size = int(a.integer("--page-size", 16));
  s.ro.chunk = a.integer("--prefill-chunk", 1024);
  s.ro.deterministic = a.has("--deterministic");
  // The KV cache: default f32 (the CPU runs' reference; GPU runs then keep bf16). --device cuda
  // takes bf16 or fp8 (both devices' runs use it; a GPU method that does not read fp8 yet is
  // refused by name before any prompt runs).
  s.ro.kv_dtype = s.device == Device::CPU || !a.has("--kv-dtype")
                      ? kv_dtype_from_args(a, "cpu", "f32")
                      : kv_dtype_from_args(a, "cuda");
  s.ro.kv_scale = kv_scale_from_args(a, s.ro.kv_dtype);
  std::vector<int64_t> budgets = parse_list(a.str("--budgets", "256"), "--budgets");
  s.runs = expand_methods(a.str("--methods", "full;streaming;quest;tidal;lessismore;oracle-topk"),
                          budgets);
  s.samples = int(a.integer("--samples", 3));
  SPADE_CHECK(s.samples >= 1, "--samples must be >= 1");
  s.seed = uint64_t(a.integer("--seed", 1));
  SPADE_CHECK(s.device == Device::CPU || !a.has("--cpu-weights"), "--cpu-weights is for --device cpu");
  // CPU runs decode on the weights as stored (the default for quantized GGUF files); the GPU
  // runs upload fp32-dequantized weights.
  s.w = load_model(a.str("--model"), s.device == Device::CPU
                                         ? parse_cpu_weights(a.str("--cpu-weights", "auto"))
                                         : CpuWeights::F32);
  s.tok = Tokenizer::load(a.str("--model"));
  const ModelConfig& cfg = s.w->config;
  s.place = place_runs(s.runs, s.device, [&](const MethodRun& r) {
    return gpu_config_error(r, cfg, s.ro.page_size);
  });
  for (size_t i = 0; i < s.runs.size(); ++i)
    s.methods.push_back(s.place[i].gpu ? nullptr : sparse::make_method(s.runs[i].config, cfg));
  if (a.has("--lengths")) {
    s.lengths = parse_list(a.str("--lengths"), "--lengths");
  } else {
    for (int64_t L : {2048, 4096, 8000})
      if (L + 128 <= cfg.max_context) s.lengths.push_back(L);
  }
  s.text = read_file(a.str("--text"));
  const std::time_t now = std::time(nullptr);
  char date[32];
  std::strftime(date, sizeof date, "%Y-%m-%d", std::gmtime(&now));
  char host[256] = "";
  gethostname(host, sizeof host - 1);
  s.meta = {{"model", a.str("--model")},
            {"commit", SPADE_COMMIT},
            {"model_shape", cat(cfg.n_layers, " layers, ", cfg.n_heads, " query / ",
                                cfg.n_kv_heads, " KV heads, head dim ", cfg.head_dim, ", context ",
                                cfg.max_context)},
            {"text", a.str("--text")},
            {"backend", device_name(s.device)},
            {"machine", cat(cpu_name(), ", ", ThreadPool::global().size(), " threads")},
            {"date", date},
            {"seed", s.seed},
            {"samples", s.samples},
            {"kv_dtype", kv_dtype_name(s.ro.kv_dtype)}};
  if (s.ro.kv_dtype == KvDtype::FP8)
    s.meta["kv_scale"] = s.ro.kv_scale > 0 ? json(s.ro.kv_scale) : json("auto");
  if (s.device == Device::CUDA) {
    s.meta["gpu"] = gpu_summary();
    s.meta["placement"] = placement_line(s.runs, s.place);
    // Whether the GPU decode was bit-reproducible (the flag, or the env var the workspace reads).
    s.meta["deterministic_decode"] = s.ro.deterministic || tuning().deterministic;
  }
  std::fprintf(stderr, "[eval %s] device %s: %s\n", kind.c_str(), device_name(s.device),
               placement_line(s.runs, s.place).c_str());
  std::fprintf(stderr, "[eval %s] %zu method runs, lengths", kind.c_str(), s.runs.size());
  for (auto L : s.lengths) std::fprintf(stderr, " %lld", (long long)L);
  std::fprintf(stderr, ", %d samples, %d threads\n", s.samples, ThreadPool::global().size());
  return s;
}

json method_fields(const Setup& s, const EvalRunner& run, size_t m) {
  const MethodRun& r = s.runs[m];
  return {{"method", r.label}, {"method_name", r.name},
          {"budget", r.budget >= 0 ? json(r.budget) : json(nullptr)},
          {"describe", run.describe(m)}, {"backend", run.backend(m)}};
}

// A fresh file, or a resumed one of the same backend (records of one table stay comparable).
ResultFile open_results(const std::string& out, const std::string& kind, const json& meta,
                        const std::string& cmd) {
  ResultFile f(out, kind, meta, cmd);
  const std::string was = f.doc().at("meta").value("backend", "cpu");
  SPADE_CHECK(was == meta.at("backend").get<std::string>(), "'", out, "' holds a --device ", was,
              " sweep: resume it with --device ", was, " or give another --out");
  return f;
}

// The session's counters (CPU); the GPU keeps none but the request's density (attended /
// dense decode rows, BLASST's skipped tiles not attended): the other fields null.
json totals_fields(const DecodeResult& r, bool recall) {
  if (r.gpu) return {{"density", r.gpu_density >= 0 ? json(r.gpu_density) : json(nullptr)},
                     {"sparse_density", nullptr}, {"tokens_per_head", nullptr}, {"steps", nullptr}};
  const sparse::SessionTotals& t = r.totals;
  json j = {{"density", t.mean_density()},
            {"sparse_density", t.mean_sparse_density()},
            {"tokens_per_head", t.mean_tokens_per_head()},
            {"steps", t.steps}};
  if (recall) {
    j["recall"] = t.mean_recall();
    j["sparse_recall"] = t.mean_sparse_recall();
    j["min_recall"] = t.min_recall;
  }
  return j;
}

// ---------------------------------------------------------------- task prompts

struct Prompt {
  TaskSample sample;
  std::vector<int32_t> tokens;
};

Prompt task_prompt(const Setup& s, const std::vector<std::string>& hay, const std::string& task,
                   int64_t L, int sample) {
  const ChatTemplate* tmpl = s.tok->chat_template();
  SPADE_CHECK(tmpl, "the model has no chat template");
  auto count = [&](const std::string& user, const std::string& prefix) {
    return int64_t(s.tok->encode(render_prompt(*tmpl, user, prefix), false, true).size());
  };
  Prompt p;
  p.sample = make_task(task, L, mix_seed(s.seed, task, L, sample), hay, count);
  p.tokens = s.tok->encode(render_prompt(*tmpl, p.sample.user, p.sample.answer_prefix), false, true);
  return p;
}

std::string key_of(const std::string& kind, const std::string& what, int64_t L, int sample,
                   const std::string& method) {
  return cat(kind, "|", what, "|", L, "|", sample, "|", method);
}

// ---------------------------------------------------------------- tasks

// The frame of the task sweeps (tasks, agree): for every (length, task, sample) with runs not
// yet in the result file, the prompt (set on the runner) and those runs' indices; the file is
// saved after each prompt.
template <typename Body>
void sweep_task_prompts(Setup& s, EvalRunner& runner, ResultFile& file, const char* kind,
                        const std::vector<std::string>& tasks, const std::vector<std::string>& hay,
                        Progress& prog, Body&& body) {
  for (int64_t L : s.lengths)
    for (const auto& task : tasks)
      for (int k = 0; k < s.samples; ++k) {
        std::vector<size_t> todo;
        for (size_t m = 0; m < s.runs.size(); ++m)
          if (file.has(key_of(kind, task, L, k, s.runs[m].label))) prog.skip();
          else todo.push_back(m);
        if (todo.empty()) continue;
        Prompt p = task_prompt(s, hay, task, L, k);
        runner.set_prompt(p.tokens);
        body(task, L, k, p, todo);
        file.save();
      }
}

// The end of a sweep (tasks, agree, ppl, recall): progress line, final save, the Markdown report
// beside the JSON.
void finish_sweep(const Args& a, Progress& prog, ResultFile& file, const std::string& out,
                  const char* kind) {
  prog.finish();
  file.save();
  write_report(file, md_path(a, out));
  std::fprintf(stderr, "[eval %s] wrote %s and %s\n", kind, out.c_str(), md_path(a, out).c_str());
}

int run_tasks(const Args& a, const std::string& cmd) {
  Setup s = setup(a, "tasks");
  const auto tasks = parse_task_list(a.str("--tasks", "all"));
  const std::vector<std::string> hay = lines_of(s.text);
  const bool recall = a.has("--recall");
  const int64_t cap = a.integer("--max-new", 1 << 20);
  const std::string out = a.str("--out", "eval_tasks.json");
  json meta = s.meta;
  meta["tasks"] = tasks;
  ResultFile file = open_results(out, "tasks", meta, cmd);
  s.ro.max_prompt = *std::max_element(s.lengths.begin(), s.lengths.end());
  s.ro.max_new = 128;
  EvalRunner runner(*s.w, s.runs, s.place, s.methods, s.ro, s.tok.get());
  Progress prog("eval tasks", int64_t(s.lengths.size() * tasks.size()) * s.samples *
                                  int64_t(s.runs.size()));
  sweep_task_prompts(s, runner, file, "tasks", tasks, hay, prog,
                     [&](const std::string& task, int64_t L, int k, const Prompt& p,
                         const std::vector<size_t>& todo) {
        DecodeOptions opt;
        opt.max_new = std::min<int64_t>(cap, p.sample.max_new_tokens);
        opt.stop = s.tok->eos_ids();
        opt.measure_recall = recall;
        for (size_t m : todo) {
          const DecodeResult r = runner.decode(m, opt);
          const std::string answer = s.tok->decode(r.tokens, true);
          const double score = score_answer(p.sample, answer);
          json rec = {{"key", key_of("tasks", task, L, k, s.runs[m].label)},
                      {"task", task},
                      {"length", L},
                      {"sample", k},
                      {"seed", p.sample.seed},
                      {"prompt_tokens", p.tokens.size()},
                      {"filler", p.sample.filler},
                      {"answers", p.sample.answers},
                      {"output", answer},
                      {"score", score},
                      {"new_tokens", r.tokens.size()},
                      {"decode_seconds", r.seconds},
                      {"prefill_seconds", r.prefill_seconds}};
          rec.update(method_fields(s, runner, m));
          rec.update(totals_fields(r, recall));
          file.add(rec);
          prog.done(1, cat(task, " L=", L, " #", k, " ", s.runs[m].label, " score ", score, ": ",
                           one_line(answer).substr(0, 40)));
        }
      });
  finish_sweep(a, prog, file, out, "tasks");
  return 0;
}

// ---------------------------------------------------------------- agree


int run_agree(const Args& a, const std::string& cmd) {
  Setup s = setup(a, "agree");
  const auto tasks = parse_task_list(a.str("--tasks", "niah_single_number,niah_multikey,json_lookup"));
  const std::vector<std::string> hay = lines_of(s.text);
  const int64_t cap = a.integer("--max-new", 1 << 20);
  const std::string out = a.str("--out", "eval_agree.json");
  json meta = s.meta;
  meta["tasks"] = tasks;
  ResultFile file = open_results(out, "agree", meta, cmd);
  s.ro.max_prompt = *std::max_element(s.lengths.begin(), s.lengths.end());
  s.ro.max_new = 128;
  EvalRunner runner(*s.w, s.runs, s.place, s.methods, s.ro, s.tok.get());
  const int V = s.w->config.vocab;
  Progress prog("eval agree", int64_t(s.lengths.size() * tasks.size()) * s.samples *
                                  int64_t(s.runs.size()));
  sweep_task_prompts(s, runner, file, "agree", tasks, hay, prog,
                     [&](const std::string& task, int64_t L, int k, const Prompt& p,
                         const std::vector<size_t>& todo) {
        DecodeOptions opt;
        opt.max_new = std::min<int64_t>(cap, p.sample.max_new_tokens);
        opt.stop = s.tok->eos_ids();
        // Full attention's greedy answer and its log-probabilities per step, once per backend
        // (a method is compared with full attention of its own backend's numerics).
        struct Ref {
          DecodeResult r;
          std::vector<std::vector<float>> logp;
          std::string text;
        };
        std::map<bool, Ref> refs;  // by runner.gpu(m)
        std::vector<float> tmp;
        for (size_t m : todo) {
          if (!refs.count(runner.gpu(m))) {
            Ref& R = refs[runner.gpu(m)];
            opt.on_logits = [&](int64_t, const float* lg) {
              log_softmax_into(lg, V, tmp);
              R.logp.push_back(tmp);
            };
            R.r = runner.decode_full(m, opt);
            opt.on_logits = nullptr;
            R.text = s.tok->decode(R.r.tokens, true);
          }
          const Ref& own = refs.at(runner.gpu(m));
          const DecodeResult& ref = own.r;
          const auto& ref_logp = own.logp;
          const std::string& ref_text = own.text;
          const DecodeResult free_run = runner.decode(m, opt);
          size_t div = 0;
          while (div < ref.tokens.size() && div < free_run.tokens.size() &&
                 ref.tokens[div] == free_run.tokens[div])
            ++div;
          // Teacher forced along full attention's tokens: KL(full || method) per step.
          DecodeOptions tf;
          tf.max_new = int64_t(ref.tokens.size());
          tf.forced = &ref.tokens;
          std::vector<double> kl;
          double top1 = 0;
          tf.on_logits = [&](int64_t i, const float* lg) {
            log_softmax_into(lg, V, tmp);
            const auto& rp = ref_logp[size_t(i)];
            double d = 0;
            int32_t arg = 0;
            for (int v = 0; v < V; ++v) {
              d += std::exp(double(rp[size_t(v)])) * (double(rp[size_t(v)]) - double(tmp[size_t(v)]));
              if (tmp[size_t(v)] > tmp[size_t(arg)]) arg = v;
            }
            kl.push_back(std::max(0.0, d));
            top1 += arg == ref.tokens[size_t(i)];
          };
          runner.decode(m, tf);
          double kl_mean = 0;  // step 0 comes from the (dense) prefill: not the method's decode
          for (size_t i = 1; i < kl.size(); ++i) kl_mean += kl[i];
          kl_mean = kl.size() > 1 ? kl_mean / double(kl.size() - 1) : 0.0;
          const std::string text = s.tok->decode(free_run.tokens, true);
          json rec = {{"key", key_of("agree", task, L, k, s.runs[m].label)},
                      {"task", task},
                      {"length", L},
                      {"sample", k},
                      {"seed", p.sample.seed},
                      {"prompt_tokens", p.tokens.size()},
                      {"full_output", ref_text},
                      {"output", text},
                      {"first_divergence", div},
                      {"full_tokens", ref.tokens.size()},
                      {"same_output", free_run.tokens == ref.tokens ? 1 : 0},
                      {"kl_mean", kl_mean},
                      {"kl_per_step", kl},
                      {"top1_agreement", kl.empty() ? 1.0 : top1 / double(kl.size())},
                      {"score", score_answer(p.sample, text)},
                      {"score_full", score_answer(p.sample, ref_text)}};
          rec.update(method_fields(s, runner, m));
          rec.update(totals_fields(free_run, false));
          file.add(rec);
          prog.done(1, cat(task, " L=", L, " #", k, " ", s.runs[m].label, " diverges at ", div,
                           " KL ", kl_mean));
        }
      });
  finish_sweep(a, prog, file, out, "agree");
  return 0;
}

// ---------------------------------------------------------------- ppl / recall

// ---------------------------------------------------------------- longgen

// A short prompt (an excerpt of --text), then --gen tokens: full attention's greedy tokens
// (EOS ignored) are the reference; each method runs free (first divergence) and teacher
// forced along them (per-step KL over the reference's top tokens + a tail bucket, top-1
// agreement, perplexity of the reference tokens, density; recall on the CPU with --recall).
int run_longgen(const Args& a, const std::string& cmd) {
  Setup s = setup(a, "longgen");
  const ModelConfig& cfg = s.w->config;
  const int64_t P = a.integer("--prompt-tokens", 64);
  const std::vector<int64_t> gens =
      a.has("--lengths") ? s.lengths : std::vector<int64_t>{std::min<int64_t>(2048, cfg.max_context - P)};
  const int64_t window = a.integer("--window", 256);
  const bool recall = a.has("--recall");
  // --follow-text: teacher forcing along the text after the prompt (full attention teacher
  // forced on it is the KL reference) instead of full attention's greedy tokens, which a small
  // model soon turns into a loop of one line (issue 37: cache correction measured on such a
  // loop raised the KL; along the text it lowers it).
  const bool follow = a.has("--follow-text");
  SPADE_CHECK(P >= 1 && window >= 1, "--prompt-tokens and --window must be >= 1");
  const int64_t maxG = *std::max_element(gens.begin(), gens.end());
  SPADE_CHECK(*std::min_element(gens.begin(), gens.end()) >= 2, "--lengths (tokens generated) must be >= 2");
  SPADE_CHECK(P + maxG <= cfg.max_context, "--prompt-tokens ", P, " + ", maxG, " generated tokens exceed the context ",
              cfg.max_context);
  const std::vector<int32_t> toks = s.tok->encode(s.text, false, false);
  const int64_t span = P + (follow ? maxG : 0);  // text tokens a sample reads
  SPADE_CHECK(int64_t(toks.size()) > span, "the text has ", toks.size(), " tokens, need ", span + 1);
  const std::string out = a.str("--out", "eval_longgen.json");
  json meta = s.meta;
  meta["prompt_tokens"] = P;
  meta["kl_top_k"] = kLongGenTopK;
  meta["window"] = window;
  meta["reference"] = follow ? "text" : "full";
  ResultFile file = open_results(out, "longgen", meta, cmd);
  s.ro.max_prompt = P;
  s.ro.max_new = maxG + 16;
  EvalRunner runner(*s.w, s.runs, s.place, s.methods, s.ro, s.tok.get());
  const int V = cfg.vocab;
  Progress prog("eval longgen", int64_t(gens.size()) * s.samples * int64_t(s.runs.size()));
  for (int64_t G : gens)
    for (int k = 0; k < s.samples; ++k) {
      std::vector<size_t> todo;
      for (size_t m = 0; m < s.runs.size(); ++m)
        if (file.has(key_of("longgen", follow ? "follow" : "text", G, k, s.runs[m].label))) prog.skip();
        else todo.push_back(m);
      if (todo.empty()) continue;
      Rng r(mix_seed(s.seed, "longgen", P, k));
      const int64_t off = int64_t(r.below(uint64_t(int64_t(toks.size()) - span)));
      const std::vector<int32_t> prompt(toks.begin() + off, toks.begin() + off + P);
      runner.set_prompt(prompt);
      DecodeOptions opt;
      opt.max_new = G;  // no stop token: every run emits G tokens
      // Full attention's tokens and compact distributions, once per backend.
      struct Ref {
        DecodeResult r;
        std::vector<int32_t> text;  // --follow-text: the G tokens after the prompt
        std::vector<TopLogp> top;   // along the teacher-forcing tokens
        double nll = 0;  // of the teacher-forcing tokens (its own argmax tokens), steps >= 1
        const std::vector<int32_t>& forced() const { return text.empty() ? r.tokens : text; }
      };
      std::map<bool, Ref> refs;
      std::vector<float> tmp;
      for (size_t m : todo) {
        if (!refs.count(runner.gpu(m))) {
          Ref& R = refs[runner.gpu(m)];
          DecodeOptions ro = opt;
          if (follow) {
            R.r = runner.decode_full(m, opt);  // full attention's greedy tokens (divergence)
            R.text.assign(toks.begin() + off + P, toks.begin() + off + P + G);
            ro.forced = &R.text;
          }
          ro.on_logits = [&](int64_t i, const float* lg) {
            log_softmax_into(lg, V, tmp);
            R.top.push_back(top_logp(tmp, kLongGenTopK));
            // The token of step i: the text's, or (greedy, not chosen yet) the argmax.
            if (i > 0)
              R.nll -= follow ? double(tmp[size_t(R.text[size_t(i)])]) : double(R.top.back().logp[0]);
          };
          const DecodeResult fr = runner.decode_full(m, ro);
          if (!follow) R.r = fr;
          R.nll /= double(std::max<size_t>(1, R.forced().size() - 1));
        }
        const Ref& ref = refs.at(runner.gpu(m));
        const DecodeResult free_run = runner.decode(m, opt);
        size_t div = 0;
        while (div < ref.r.tokens.size() && div < free_run.tokens.size() &&
               ref.r.tokens[div] == free_run.tokens[div])
          ++div;
        DecodeOptions tf;
        tf.max_new = int64_t(ref.forced().size());
        tf.forced = &ref.forced();
        tf.measure_recall = recall && !runner.gpu(m);
        std::vector<double> kl;
        double top1 = 0, nll = 0;
        tf.on_logits = [&](int64_t i, const float* lg) {
          if (i == 0) return;  // step 0 comes from the dense prefill, not the method's decode
          log_softmax_into(lg, V, tmp);
          kl.push_back(bucket_kl(ref.top[size_t(i)], tmp));
          nll -= double(tmp[size_t(ref.forced()[size_t(i)])]);
          // Top-1 agreement with full attention's argmax (the forced token unless --follow-text).
          const int32_t want = ref.top[size_t(i)].ids[0];
          top1 += size_t(std::max_element(tmp.begin(), tmp.end()) - tmp.begin()) == size_t(want);
        };
        const DecodeResult forced = runner.decode(m, tf);
        const double n = double(std::max<size_t>(1, kl.size()));
        double kl_mean = 0;
        for (double v : kl) kl_mean += v;
        kl_mean /= n;
        json rec = {{"key", key_of("longgen", follow ? "follow" : "text", G, k, s.runs[m].label)},
                    {"length", G},
                    {"reference", follow ? "text" : "full"},
                    {"sample", k},
                    {"prompt_offset", off},
                    {"prompt_tokens", P},
                    {"first_divergence", div},
                    {"same_output", free_run.tokens == ref.r.tokens ? 1 : 0},
                    {"kl_mean", kl_mean},
                    {"kl_windows", window_means(kl, window)},
                    {"top1_agreement", kl.empty() ? 1.0 : top1 / n},
                    {"ppl", std::exp(nll / n)},
                    {"ppl_full", std::exp(ref.nll)},
                    {"corrections", forced.corrections},
                    {"decode_seconds", free_run.seconds}};
        rec.update(method_fields(s, runner, m));
        rec.update(totals_fields(forced, tf.measure_recall));
        file.add(rec);
        prog.done(1, cat("gen ", G, " #", k, " ", s.runs[m].label, " diverges at ", div, " KL ", kl_mean));
      }
    }
  finish_sweep(a, prog, file, out, "longgen");
  return 0;
}

int run_text(const Args& a, const std::string& cmd, const std::string& kind) {
  Setup s = setup(a, kind);
  const bool recall = kind == "recall";
  const int64_t N = a.integer("--decode", recall ? 32 : 64);
  SPADE_CHECK(N >= 1, "--decode must be >= 1");
  const ModelConfig& cfg = s.w->config;
  const std::vector<int32_t> toks = s.tok->encode(s.text, false, false);
  const std::string out = a.str("--out", "eval_" + kind + ".json");
  json meta = s.meta;
  meta["scored_tokens"] = N;
  meta["text_tokens"] = toks.size();
  ResultFile file = open_results(out, kind, meta, cmd);
  const int64_t maxL = *std::max_element(s.lengths.begin(), s.lengths.end());
  SPADE_CHECK(maxL + N <= cfg.max_context, "length ", maxL, " + ", N, " exceeds the context ",
              cfg.max_context);
  SPADE_CHECK(int64_t(toks.size()) > maxL + N, "the text has ", toks.size(), " tokens, need ",
              maxL + N + 1);
  s.ro.max_prompt = maxL;
  s.ro.max_new = N + 16;
  EvalRunner runner(*s.w, s.runs, s.place, s.methods, s.ro, s.tok.get());
  Progress prog("eval " + kind, int64_t(s.lengths.size()) * s.samples * int64_t(s.runs.size()));
  const int nl = cfg.n_layers, hq = cfg.n_heads, hkv = cfg.n_kv_heads;
  for (int64_t L : s.lengths)
    for (int k = 0; k < s.samples; ++k) {
      std::vector<size_t> todo;
      for (size_t m = 0; m < s.runs.size(); ++m)
        if (file.has(key_of(kind, "text", L, k, s.runs[m].label))) prog.skip();
        else todo.push_back(m);
      if (todo.empty()) continue;
      Rng r(mix_seed(s.seed, kind == "recall" ? "ppl" : kind, L, k));
      const int64_t off = int64_t(r.below(uint64_t(int64_t(toks.size()) - L - N)));
      const std::vector<int32_t> prefix(toks.begin() + off, toks.begin() + off + L);
      const std::vector<int32_t> scored(toks.begin() + off + L, toks.begin() + off + L + N);
      runner.set_prompt(prefix);
      for (size_t m : todo) {
        DecodeOptions opt;
        opt.max_new = N;
        opt.forced = &scored;
        opt.measure_recall = recall;
        std::vector<double> nll;
        std::vector<float> tmp;
        opt.on_logits = [&](int64_t i, const float* lg) {
          const double lse = log_softmax_into(lg, cfg.vocab, tmp);
          nll.push_back(lse - double(lg[scored[size_t(i)]]));
        };
        std::vector<double> rec_lh(size_t(nl * hq), 0.0), dens_lh(size_t(nl * hkv), 0.0);
        int64_t steps = 0, rsteps = 0;
        opt.on_step = [&](const sparse::StepStats& st) {
          ++steps;
          for (size_t i = 0; i < dens_lh.size(); ++i)
            dens_lh[i] += double(st.attended[i]) / double(st.length);
          if (st.has_recall()) {
            ++rsteps;
            for (size_t i = 0; i < rec_lh.size(); ++i) rec_lh[i] += st.recall[i];
          }
        };
        if (runner.gpu(m)) opt.on_step = nullptr;  // no per-step counters on the GPU
        const DecodeResult res = runner.decode(m, opt);
        double nll_mean = 0;
        for (double v : nll) nll_mean += v;
        nll_mean /= double(nll.size());
        json rec = {{"key", key_of(kind, "text", L, k, s.runs[m].label)},
                    {"length", L},
                    {"sample", k},
                    {"offset", off},
                    {"nll_mean", nll_mean},
                    {"ppl", std::exp(nll_mean)},
                    {"decode_seconds", res.seconds}};
        rec.update(method_fields(s, runner, m));
        rec.update(totals_fields(res, recall));
        if (recall) {
          json rl = json::array(), dl = json::array(), rlh = json::array(), dlh = json::array();
          for (int l = 0; l < nl; ++l) {
            double rs = 0, ds = 0;
            json rrow = json::array(), drow = json::array();
            for (int h = 0; h < hq; ++h) {
              const double v = rsteps ? rec_lh[size_t(l * hq + h)] / double(rsteps) : 1.0;
              rs += v;
              rrow.push_back(v);
            }
            for (int h = 0; h < hkv; ++h) {
              const double v = steps ? dens_lh[size_t(l * hkv + h)] / double(steps) : 1.0;
              ds += v;
              drow.push_back(v);
            }
            rl.push_back(rs / hq);
            dl.push_back(ds / hkv);
            rlh.push_back(rrow);
            dlh.push_back(drow);
          }
          rec["recall_per_layer"] = rl;
          rec["density_per_layer"] = dl;
          rec["recall_per_layer_head"] = rlh;
          rec["density_per_layer_kv_head"] = dlh;
        }
        file.add(rec);
        prog.done(1, cat("L=", L, " #", k, " ", s.runs[m].label, " ppl ", std::exp(nll_mean),
                         recall ? cat(" recall ", res.totals.mean_recall()) : std::string()));
      }
      file.save();
    }
  finish_sweep(a, prog, file, out, kind.c_str());
  return 0;
}

int run_report(const Args& a) {
  SPADE_CHECK(a.positional().size() >= 2, "usage: spade eval report RESULTS.json [--md OUT.md]");
  const std::string in = a.positional()[1];
  const json doc = json::parse(read_file(in));
  const std::string md = md_path(a, in);
  std::ofstream o(md);
  SPADE_CHECK(o.good(), "cannot write '", md, "'");
  o << markdown_report(doc);
  std::fprintf(stderr, "[eval report] wrote %s\n", md.c_str());
  return 0;
}

int run(int argc, char** argv) {
  Args a(argc, argv,
         {"--model", "--text", "--methods", "--budgets", "--lengths", "--samples", "--seed",
          "--out", "--md", "--threads", "--device", "--page-size", "--prefill-chunk", "--tasks", "--max-new",
          "--decode", "--prompt-tokens", "--window", "--cpu-weights", "--kv-dtype", "--kv-scale"},
         {"--help", "--recall", "--deterministic", "--follow-text"});
  if (a.has("--help") || a.positional().empty()) {
    std::fputs(kHelp, a.has("--help") ? stdout : stderr);
    if (a.has("--help")) {
      std::fputs("\ntasks:\n", stdout);
      for (const auto& t : all_tasks())
        std::printf("  %-20s %s\n", t.name.c_str(), t.summary.c_str());
      std::fputs("\nmethods and options:\n", stdout);
      std::fputs(sparse::methods_help().c_str(), stdout);
    }
    return a.has("--help") ? 0 : 2;
  }
  const std::string what = a.positional()[0];
  const std::string cmd = command_line(argc, argv);
  if (what == "tasks") return run_tasks(a, cmd);
  if (what == "agree") return run_agree(a, cmd);
  if (what == "longgen") return run_longgen(a, cmd);
  if (what == "ppl" || what == "recall") return run_text(a, cmd, what);
  if (what == "report") return run_report(a);
  fail("eval: unknown sub-command '", what, "' (tasks, ppl, agree, recall, longgen, report)");
}

Registrar reg("eval", "evaluate attention methods: tasks, perplexity, agreement, recall, long generation", run);

}  // namespace
}  // namespace spade::cli
