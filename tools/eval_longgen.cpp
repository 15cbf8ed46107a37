// `spade eval longgen`: a short prompt and thousands of generated tokens against full attention.
#include <algorithm>
#include <cmath>
#include <map>

#include "eval_common.h"
#include "eval/longgen.h"
#include "eval/rng.h"
#include "eval/scoring.h"

namespace spade::cli::eval_cmd {

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

}  // namespace spade::cli::eval_cmd
