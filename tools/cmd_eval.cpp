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
// This file: the help, the dispatch and `report`; eval_common.h the shared pieces;
// eval_tasks.cpp (tasks, agree), eval_text.cpp (ppl, recall), eval_longgen.cpp the sweeps.
#include <cstdio>
#include <fstream>

#include "command.h"
#include "eval_common.h"
#include "eval/report.h"

namespace spade::cli {
namespace {

using namespace eval_cmd;

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
  --ref-kv-dtype T      agree: each method's reference is the same method over a KV cache of
                        type T (e.g. --kv-dtype fp8 --ref-kv-dtype bf16: fp8's greedy agreement
                        with bf16 per method), instead of full attention
  --max-new N           cap on generated tokens per answer (default: the task's own)
  --recall              tasks: also measure attention recall (slower; CPU only)
ppl / recall:
  --decode N            tokens scored / decoded after the prefix (default ppl 64, recall 32)
recall runs on the CPU only (it needs each step's full attention weights).
)";

std::string command_line(int argc, char** argv) {
  std::string s = "spade";
  for (int i = 0; i < argc; ++i) {
    std::string a = argv[i];
    const bool quote = a.find_first_of(" ;\"'$*?") != std::string::npos || a.empty();
    s += " " + (quote ? "'" + a + "'" : a);
  }
  return s;
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
          "--decode", "--prompt-tokens", "--window", "--cpu-weights", "--kv-dtype", "--kv-scale", "--ref-kv-dtype"},
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
