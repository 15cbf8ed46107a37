// `spade eval`'s shared pieces (eval_common.h): the setup of a sweep from the options, the
// result file, its records' common fields, task prompts and the end of a sweep.
#include "eval_common.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <sstream>

#include "kv_args.h"
#include "core/thread_pool.h"
#include "core/tuning.h"
#include "eval/report.h"
#include "eval/rng.h"
#include "tokenizer/chat_template.h"
#include "spade_version.h"  // generated: SPADE_COMMIT

namespace spade::cli::eval_cmd {
namespace {

std::vector<int64_t> parse_list(const std::string& s, const char* what) {
  std::vector<int64_t> out;
  for (int v : sparse::parse_int_list(s, what)) {
    SPADE_CHECK(v > 0, what, " must be positive");
    out.push_back(v);
  }
  SPADE_CHECK(!out.empty(), what, " is empty");
  return out;
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

void write_report(const ResultFile& f, const std::string& md) {
  std::ofstream o(md);
  SPADE_CHECK(o.good(), "cannot write '", md, "'");
  o << markdown_report(f.doc());
}

}  // namespace

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

std::string md_path(const Args& a, const std::string& out) {
  if (a.has("--md")) return a.str("--md");
  const size_t dot = out.rfind(".json");
  return (dot == std::string::npos ? out : out.substr(0, dot)) + ".md";
}

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

void finish_sweep(const Args& a, Progress& prog, ResultFile& file, const std::string& out,
                  const char* kind) {
  prog.finish();
  file.save();
  write_report(file, md_path(a, out));
  std::fprintf(stderr, "[eval %s] wrote %s and %s\n", kind, out.c_str(), md_path(a, out).c_str());
}

}  // namespace spade::cli::eval_cmd
