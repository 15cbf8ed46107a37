// `spade eval tasks` (exact-match scores of RULER-style tasks) and `spade eval agree` (generation
// with a method against full attention: first divergence, per-step KL).
#include <algorithm>
#include <cmath>
#include <map>
#include <optional>

#include "eval_common.h"
#include "eval/longgen.h"
#include "eval/scoring.h"
#include "kv_args.h"

namespace spade::cli::eval_cmd {
namespace {

std::string one_line(std::string s) {
  std::replace(s.begin(), s.end(), '\n', ' ');
  return s;
}

}  // namespace

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
  // --ref-kv-dtype T: each run's reference is the same method over a KV cache of type T (the
  // greedy agreement of one cache type with another, per method), not full attention.
  std::optional<KvDtype> ref_dtype;
  if (a.has("--ref-kv-dtype")) {
    ref_dtype = s.device == Device::CPU ? kv_dtype_from_args(a, "cpu", "f32", "--ref-kv-dtype")
                                        : kv_dtype_from_args(a, "cuda", "bf16", "--ref-kv-dtype");
    SPADE_CHECK(*ref_dtype != s.ro.kv_dtype, "--ref-kv-dtype ", kv_dtype_name(*ref_dtype),
                " is the sweep's own --kv-dtype: nothing to compare");
  }
  json meta = s.meta;
  meta["tasks"] = tasks;
  meta["reference"] = ref_dtype ? cat("each method over a ", kv_dtype_name(*ref_dtype), " KV cache")
                                : std::string("full attention on each run's backend");
  if (ref_dtype) meta["reference_kv_dtype"] = kv_dtype_name(*ref_dtype);
  ResultFile file = open_results(out, "agree", meta, cmd);
  s.ro.max_prompt = *std::max_element(s.lengths.begin(), s.lengths.end());
  s.ro.max_new = 128;
  EvalRunner runner(*s.w, s.runs, s.place, s.methods, s.ro, s.tok.get());
  std::unique_ptr<EvalRunner> ref_runner;
  if (ref_dtype) {
    eval::RunnerOptions ro = s.ro;
    ro.kv_dtype = *ref_dtype;
    ro.kv_scale = 0.f;
    ref_runner = std::make_unique<EvalRunner>(*s.w, s.runs, s.place, s.methods, ro, s.tok.get());
  }
  const int V = s.w->config.vocab;
  Progress prog("eval agree", int64_t(s.lengths.size() * tasks.size()) * s.samples *
                                  int64_t(s.runs.size()));
  sweep_task_prompts(s, runner, file, "agree", tasks, hay, prog,
                     [&](const std::string& task, int64_t L, int k, const Prompt& p,
                         const std::vector<size_t>& todo) {
        DecodeOptions opt;
        opt.max_new = std::min<int64_t>(cap, p.sample.max_new_tokens);
        opt.stop = s.tok->eos_ids();
        // The reference's greedy answer and its log-probabilities per step: full attention once
        // per backend (a method is compared with full attention of its own backend's numerics),
        // or with --ref-kv-dtype the run's own method over the other cache type.
        struct Ref {
          DecodeResult r;
          std::vector<std::vector<float>> logp;
          std::string text;
        };
        std::map<size_t, Ref> refs;  // by runner.gpu(m), or by m with --ref-kv-dtype
        std::vector<float> tmp;
        if (ref_runner) ref_runner->set_prompt(p.tokens);
        for (size_t m : todo) {
          const size_t rk = ref_runner ? m : size_t(runner.gpu(m));
          if (!refs.count(rk)) {
            Ref& R = refs[rk];
            opt.on_logits = [&](int64_t, const float* lg) {
              log_softmax_into(lg, V, tmp);
              R.logp.push_back(tmp);
            };
            R.r = ref_runner ? ref_runner->decode(m, opt) : runner.decode_full(m, opt);
            opt.on_logits = nullptr;
            R.text = s.tok->decode(R.r.tokens, true);
          }
          const Ref& own = refs.at(rk);
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
                      {"reference", ref_dtype ? cat(s.runs[m].label, " kv ", kv_dtype_name(*ref_dtype))
                                              : std::string("full")},
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

}  // namespace spade::cli::eval_cmd
