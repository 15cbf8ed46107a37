// `spade eval ppl` (perplexity of real text scored in decode mode after a dense prefix) and
// `spade eval recall` (attention recall and density per layer / head).
#include <algorithm>
#include <cmath>

#include "eval_common.h"
#include "eval/longgen.h"
#include "eval/rng.h"
#include "eval/scoring.h"

namespace spade::cli::eval_cmd {

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

}  // namespace spade::cli::eval_cmd
