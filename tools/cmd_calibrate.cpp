// `spade calibrate blasst`: BLASST's Algorithm 2 on real text: per calibration length, sweep
// lambda, keep the one whose measured sparsity is nearest the target, fit lambda = a / L,
// write {a, fit quality, per-length measurements} to a JSON config that
// `--sparse blasst --sparse-opt config=FILE` reads; then verify: the sparsity reached with
// lambda = a / L and with one fixed lambda at every length (the paper's table 5).
//
// `spade calibrate twilight`: Twilight (or any method stack) against full attention on real
// text, teacher-forced decode: kept budget vs the base budget per head, attention recall,
// perplexity, top-1 agreement and KL vs full (docs/twilight_blasst.md).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "args.h"
#include "command.h"
#include "core/thread_pool.h"
#include "model/cuda_blasst_probe.h"
#include "model/loader.h"
#include "sparse/blasst_calibration.h"
#include "sparse/methods/blasst.h"
#include "sparse/methods/full.h"
#include "sparse/options.h"
#include "sparse/registry.h"
#include "tokenizer/tokenizer.h"

namespace spade::cli {
namespace {

using namespace spade::sparse;
using json = nlohmann::json;
using clock_type = std::chrono::steady_clock;

const char* kHelp = R"(usage: spade calibrate blasst   --model M --text F --target-sparsity S [options]
       spade calibrate twilight --model M --text F [options]

blasst (BLASST Algorithm 2):
  --lengths L1,L2,...   calibration context lengths (default 512,1024,2048,4096)
  --phase P             prefill (default: one prefill of L tokens) or decode (dense
                        prefill of L tokens, then --decode-steps BLASST decode steps)
  --measure M           exact (default: one BLASST run per lambda) or gaps (one unskipped
                        run per length traces every tile's gap: the skip decision of every
                        lambda, teacher-forced)
  --lambda-min X --lambda-max Y --per-decade K   lambda grid (1e-6, 1, 4)
  --refine N            bisection steps between the grid points bracketing S (default 6)
  --delta D             keep a length only if |sparsity - S| < D (default 0.05)
  --samples N           text samples per length, at different offsets (default 1)
  --decode-steps N      (decode phase, default 16)
  --tile T --prefill-tile T --q-block Q --order O   BLASST kernel options
  --target-sparsity S1,S2,...  one calibration (and config file, suffix _s<percent>) per target
  --fixed-lambda X      fixed lambda to compare against (default: lambda_best of the median
                        length)
  --verify V            exact (default: BLASST runs at lambda = a/L and at the fixed lambda),
                        gaps (from the gap traces) or none
  --verify-lengths L,.. lengths of the verification (default: the calibration lengths)
  --gaps-dir D          cache the gap traces in D (reused by later runs)
  --out F               write the config JSON (default configs/blasst_calibrated.json)
  --device cpu|cuda     where the BLASST runs happen (default cpu). cuda: the GPU kernels'
                        own tiles (decode: 16-token warp chunks with a seeded running max;
                        prefill: 64 rows x 128 keys at head_dim 128, 32 rows x 64 keys at
                        head_dim 64), exact measurement only; the --tile options are the CPU's
  --sparse X+blasst[:k=v,...]  (--device cuda, --phase decode) calibrate BLASST where it
                        will run: inside GPU selector X's lists (e.g. quest+blasst:budget=2048;
                        the selection kernel's 16-row chunks and X's dense launches). The sweep
                        runs lambda = a / L per request as the method does (a = lambda * L for
                        each swept lambda, so the selection's own length, length=selected, is
                        the method's), and the fitted a is the one to give that stack
                        (--sparse X+blasst --sparse-opt config=OUT). Without it, or with X =
                        full: over full attention
twilight (decode comparison against full attention, teacher forced):
  --length L            context length before decoding (default 2048)
  --decode N            decode steps (default 32)
  --p P1,P2,...         Twilight thresholds (default 0.8,0.9,0.95,0.99)
  --bases B1,B2,...     base selectors (default quest,full); quest uses --budget
  --budget N            quest base budget (default L/4)
  --methods S1;S2;...   extra method specs (name:k=v,...; stacks with base=a+b)
  --json F              write every measurement to F
  --own-prefill         every method runs its own prefill too (BLASST prefill skipping);
                        by default one dense prefill is shared and only decode differs
common:
  --text F              calibration text, plain (docs/twilight_blasst.md makes one from
                        Debian's bible-kjv-text)
  --offset N            first token of the text to use (default 0)
  --threads N           CPU threads
)";

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  SPADE_CHECK(f.good(), "cannot read text file '", path, "'");
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::vector<int64_t> parse_lengths(const std::string& s) {
  std::vector<int64_t> out;
  for (int v : parse_int_list(s, "--lengths")) {
    SPADE_CHECK(v > 0, "--lengths must be positive");
    out.push_back(v);
  }
  SPADE_CHECK(!out.empty(), "--lengths is empty");
  return out;
}

std::vector<double> parse_floats(const std::string& s, const std::string& what) {
  std::vector<double> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(parse_float(item, what));
  return out;
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, sep))
    if (!item.empty()) out.push_back(item);
  return out;
}

struct Loaded {
  std::unique_ptr<ModelWeights> w;
  std::vector<int32_t> tokens;
};

Loaded load(const Args& a) {
  SPADE_CHECK(a.has("--model"), "--model is required (see --help)");
  SPADE_CHECK(a.has("--text"), "--text is required (see --help)");
  if (a.has("--threads")) ThreadPool::set_global_threads(a.integer("--threads", 0));
  Loaded l;
  l.w = load_model(a.str("--model"));
  auto tok = Tokenizer::load(a.str("--model"));
  l.tokens = tok->encode(read_text(a.str("--text")), false, false);
  const int64_t off = a.integer("--offset", 0);
  SPADE_CHECK(off >= 0 && off < int64_t(l.tokens.size()), "--offset outside the text");
  l.tokens.erase(l.tokens.begin(), l.tokens.begin() + off);
  std::fprintf(stderr, "[calibrate] %s: %zu tokens of text\n", a.str("--text").c_str(),
               l.tokens.size());
  return l;
}

double seconds_since(clock_type::time_point t) {
  return std::chrono::duration<double>(clock_type::now() - t).count();
}

// ---------------------------------------------------------------- blasst

std::string out_path(const std::string& base, double target, size_t n_targets) {
  if (n_targets == 1) return base;
  const std::string suffix = cat("_s", int(std::lround(target * 100)));
  const size_t dot = base.rfind(".json");
  return dot == std::string::npos ? base + suffix : base.substr(0, dot) + suffix + ".json";
}

int run_blasst(const Args& a) {
  SPADE_CHECK(a.has("--target-sparsity"), "--target-sparsity is required");
  const auto targets = parse_floats(a.str("--target-sparsity"), "--target-sparsity");
  const auto lengths = parse_lengths(a.str("--lengths", "512,1024,2048,4096"));
  const std::string phase = a.str("--phase", "prefill"), mode = a.str("--measure", "exact");
  const std::string verify = a.str("--verify", "exact");
  SPADE_CHECK(phase == "prefill" || phase == "decode", "--phase must be prefill or decode");
  SPADE_CHECK(mode == "exact" || mode == "gaps", "--measure must be exact or gaps");
  SPADE_CHECK(verify == "exact" || verify == "gaps" || verify == "none",
              "--verify must be exact, gaps or none");
  SPADE_CHECK(verify != "gaps" || mode == "gaps", "--verify gaps needs --measure gaps");
  const std::string device = a.str("--device", "cpu");
  SPADE_CHECK(device == "cpu" || device == "cuda", "--device must be cpu or cuda");
  // --sparse X+blasst: BLASST inside selector X (the placement it will run in).
  const std::string placement_spec = a.str("--sparse", "");
  SparseConfig placement_cfg;
  bool in_selector = false;
  if (!placement_spec.empty()) {
    placement_cfg = SparseConfig::parse_spec(placement_spec);
    const std::string& m = placement_cfg.method;
    const std::string tail = "+blasst";
    const bool stack = m.size() > tail.size() && m.compare(m.size() - tail.size(), tail.size(), tail) == 0;
    SPADE_CHECK(stack || m == "blasst", "--sparse '", placement_spec, "': calibrate blasst takes "
                "a BLASST stack, X+blasst (e.g. quest+blasst:budget=2048) or blasst:base=X");
    const std::string base = stack ? m.substr(0, m.size() - tail.size())
                             : placement_cfg.options.count("base") ? placement_cfg.options.at("base")
                                                                   : std::string("full");
    in_selector = base != "full";
    SPADE_CHECK(!in_selector || device == "cuda", "--sparse '", placement_spec, "': BLASST "
                "inside a selector calibrates on the GPU only (--device cuda); the CPU "
                "calibration runs over full attention");
    SPADE_CHECK(!in_selector || phase == "decode", "--sparse '", placement_spec, "': --phase "
                "decode only (prefill skipping runs the dense prefill kernels whatever the "
                "selector: calibrate it without --sparse)");
  }
  if (device == "cuda") {
    SPADE_CHECK(mode == "exact", "--device cuda measures exact runs only (--measure exact)");
    for (const char* o : {"--tile", "--prefill-tile", "--q-block", "--order", "--gaps-dir"})
      SPADE_CHECK(!a.has(o), o, " is a CPU option: the GPU kernels fix their tiles and order");
#if !defined(SPADE_HAVE_CUDA)
    fail("--device cuda: this build has no CUDA backend");
#endif
  }
  const auto verify_lengths =
      a.has("--verify-lengths") ? parse_lengths(a.str("--verify-lengths")) : lengths;
  const auto grid = log_grid(a.number("--lambda-min", 1e-6), a.number("--lambda-max", 1.0),
                             int(a.integer("--per-decade", 4)));
  const int refine = int(a.integer("--refine", 6));
  const double delta = a.number("--delta", 0.05);
  const int samples = int(a.integer("--samples", 1));
  const int64_t dsteps = phase == "decode" ? a.integer("--decode-steps", 16) : 0;
  SPADE_CHECK(samples >= 1, "--samples must be >= 1");
  Loaded ld = load(a);
  const ModelConfig& cfg = ld.w->config;
  std::vector<int64_t> all_lengths(lengths);
  all_lengths.insert(all_lengths.end(), verify_lengths.begin(), verify_lengths.end());
  std::sort(all_lengths.begin(), all_lengths.end());
  all_lengths.erase(std::unique(all_lengths.begin(), all_lengths.end()), all_lengths.end());
  const int64_t maxL = all_lengths.back(), need = maxL + dsteps;
  SPADE_CHECK(need <= cfg.max_context, "length ", need, " exceeds the model's context ",
              cfg.max_context);
  SPADE_CHECK(int64_t(ld.tokens.size()) >= need, "the text has ", ld.tokens.size(),
              " tokens; the longest length needs ", need);
  // Sample s starts at s * stride so the samples spread over the text.
  const int64_t stride = samples > 1 ? (int64_t(ld.tokens.size()) - need) / (samples - 1) : 0;
  auto sample_tokens = [&](int s, int64_t L) {
    const int64_t off = int64_t(s) * stride;
    return std::vector<int32_t>(ld.tokens.begin() + off, ld.tokens.begin() + off + L + dsteps);
  };

  BlasstMethod::Params base_prm;
  base_prm.tile = a.integer("--tile", 64);
  base_prm.prefill_tile = a.integer("--prefill-tile", 128);
  base_prm.q_block = a.integer("--q-block", 128);
  base_prm.order = cpu::parse_tile_order(a.str("--order", "sequential"));
  base_prm.prefill = phase == "prefill";
  base_prm.decode = phase == "decode";
  auto full = std::make_shared<FullMethod>();
  auto method_for = [&](double lambda, double a_over_l) {
    BlasstMethod::Params p = base_prm;
    p.lambda = lambda;
    p.a = a_over_l;
    return std::make_shared<BlasstMethod>(full, p);
  };
  // Decode: one dense prefill per (sample, L), kept (KVPool::fork) for every lambda.
  int64_t pool_tokens = need + 4 * (dsteps + 64);
  if (phase == "decode")
    for (int64_t L : all_lengths) pool_tokens += samples * (L + 64);
  ModelRunner runner(*ld.w, device == "cuda" ? 64 : pool_tokens);  // CPU runs only
  std::map<std::pair<int, int64_t>, PageTable> prefixes;
  auto resume_prefix = [&](int k, int64_t L, const std::vector<int32_t>& toks) {
    auto key = std::make_pair(k, L);
    auto it = prefixes.find(key);
    if (it == prefixes.end()) {
      runner.reset();
      runner.prefill(toks.data(), L, nullptr);
      it = prefixes.emplace(key, runner.keep()).first;
    }
    runner.resume(it->second);
  };
  // Gap traces per (sample, L), optionally cached on disk (--gaps-dir).
  std::map<std::pair<int, int64_t>, std::vector<float>> gap_cache;
  const std::string gaps_dir = a.str("--gaps-dir", "");
  auto gaps_file = [&](int k, int64_t L) {
    return cat(gaps_dir, "/gaps_", phase, "_t", phase == "prefill" ? base_prm.prefill_tile : base_prm.tile,
               "_q", base_prm.q_block, "_d", dsteps, "_", cpu::tile_order_name(base_prm.order),
               "_L", L, "_s", k, "of", samples, "_o", a.integer("--offset", 0), ".bin");
  };
  int64_t runs = 0;
  auto gaps_for = [&](int k, int64_t L) -> const std::vector<float>& {
    auto key = std::make_pair(k, L);
    auto it = gap_cache.find(key);
    if (it != gap_cache.end()) return it->second;
    std::vector<float> g;
    if (!gaps_dir.empty()) {
      std::ifstream f(gaps_file(k, L), std::ios::binary);
      if (f.good()) {
        f.seekg(0, std::ios::end);
        g.resize(size_t(f.tellg()) / sizeof(float));
        f.seekg(0);
        f.read(reinterpret_cast<char*>(g.data()), std::streamsize(g.size() * sizeof(float)));
      }
    }
    if (g.empty()) {
      auto toks = sample_tokens(k, L);
      if (phase == "prefill") {
        g = prefill_tile_gaps(runner, toks, L, base_prm.prefill_tile, base_prm.q_block,
                              base_prm.order);
      } else {
        resume_prefix(k, L, toks);
        g = decode_tile_gaps(runner, toks, L, dsteps, base_prm.tile, true, base_prm.order);
      }
      ++runs;
      if (!gaps_dir.empty()) {
        std::ofstream f(gaps_file(k, L), std::ios::binary);
        f.write(reinterpret_cast<const char*>(g.data()), std::streamsize(g.size() * sizeof(float)));
      }
    }
    return gap_cache.emplace(key, std::move(g)).first->second;
  };
#if defined(SPADE_HAVE_CUDA)
  std::unique_ptr<CudaBlasstProbe> gpu;
  if (device == "cuda") {
    int64_t gpu_tokens = need + 64;
    if (phase == "decode")
      for (int64_t L : all_lengths) gpu_tokens += samples * (L + dsteps + 32);
    CudaSparse where;
    if (in_selector) {
      where = cuda_sparse_config(placement_cfg, cfg, 16);
      SPADE_CHECK(where.blasst_sel, "--sparse '", placement_spec, "': not BLASST inside a GPU "
                  "selector on this model (", where.describe(), ")");
      std::fprintf(stderr, "[calibrate] placement: %s\n", where.describe().c_str());
    }
    gpu = std::make_unique<CudaBlasstProbe>(*ld.w, gpu_tokens, phase == "decode",
                                            in_selector ? &where : nullptr);
  }
#endif
  // Exact runs of BLASST with lambda (>= 0) or lambda = a / L (lambda < 0); `layers`
  // (optional) receives the skip ratio per layer (over heads, samples).
  auto measure_exact = [&](double lambda, double a_over_l, int64_t L,
                           std::vector<double>* layers = nullptr) {
    double s = 0;
    BlasstStats st;
    if (layers) layers->assign(size_t(cfg.n_layers), 0.0);
#if defined(SPADE_HAVE_CUDA)
    if (gpu) {
      std::vector<double> pl;
      for (int k = 0; k < samples; ++k) {
        s += gpu->measure(k, sample_tokens(k, L), L, dsteps, lambda, a_over_l, layers ? &pl : nullptr);
        if (layers)
          for (int l = 0; l < cfg.n_layers; ++l) (*layers)[size_t(l)] += pl[size_t(l)] / samples;
        ++runs;
      }
      return s / samples;
    }
#endif
    const auto m = method_for(lambda, a_over_l);
    for (int k = 0; k < samples; ++k) {
      auto toks = sample_tokens(k, L);
      if (phase == "prefill") {
        s += measure_blasst_prefill(runner, m, toks, L, &st);
      } else {
        resume_prefix(k, L, toks);
        s += measure_blasst_decode(runner, m, toks, L, dsteps, true, &st);
      }
      if (layers)
        for (int l = 0; l < cfg.n_layers; ++l)
          (*layers)[size_t(l)] +=
              phase == "prefill" ? BlasstStats::layer_ratio(st.prefill, l, cfg.n_heads) / samples
                                 : BlasstStats::layer_ratio(st.decode, l, cfg.n_kv_heads) / samples;
      ++runs;
    }
    return s / samples;
  };
  auto measure_gaps = [&](double lambda, int64_t L) {
    double s = 0;
    for (int k = 0; k < samples; ++k) s += sparsity_from_gaps(gaps_for(k, L), lambda);
    return s / samples;
  };
  // Inside a selector the swept lambda runs as lambda = a / L with a = lambda * L, the
  // method's own form: its L is the request's selection (length=selected) or its context, so
  // the fitted a is the one the method needs whatever its length.
  SparsityFn measure = [&](double lambda, int64_t L) {
    if (mode == "gaps") return measure_gaps(lambda, L);
    return in_selector ? measure_exact(-1, lambda * double(L), L) : measure_exact(lambda, -1, L);
  };

  for (double target : targets) {
    const auto t0 = clock_type::now();
    const int64_t runs0 = runs;
    BlasstCalibration cal = calibrate_blasst(measure, target, lengths, grid, delta, refine);
    const double cal_s = seconds_since(t0);
    std::printf("BLASST calibration (%s, %s measurement, target sparsity %.3f, %d sample(s))\n",
                phase.c_str(), mode.c_str(), target, samples);
    std::printf("%8s %14s %10s %10s %6s\n", "L", "lambda_best", "sparsity", "lambda*L", "used");
    for (const auto& l : cal.lengths)
      std::printf("%8lld %14.4g %10.4f %10.4g %6s\n", (long long)l.length, l.lambda_best,
                  l.sparsity, l.lambda_best * double(l.length), l.kept ? "yes" : "no");
    std::printf("fit lambda = a / L: a = %.6g  R^2 = %.4f  (%d lengths, %.1f s, %lld model runs)\n",
                cal.a, cal.r2, cal.used, cal_s, (long long)(runs - runs0));
    json j;
    j["method"] = "blasst";
    j["a"] = cal.a;
    j["fit_r2"] = std::isnan(cal.r2) ? json(nullptr) : json(cal.r2);
    j["target_sparsity"] = target;
    j["phase"] = phase;
    j["measure"] = mode;
    j["delta"] = delta;
    j["samples"] = samples;
    j["model"] = a.str("--model");
    j["text"] = a.str("--text");
    j["device"] = device;
    j["placement"] = in_selector ? placement_spec : std::string("full");
    if (in_selector) {  // the selection kernel's chunks
      j["tile"] = 16;
      j["tile_note"] = "16-row chunks of each warp's share of the selection (first kept); the "
                       "selector's dense launches as over full attention";
      j["lambda_form"] = "a / L per request, L as the stack's length option";
    } else if (device == "cuda") {  // the GPU kernels' own tiles
      j["tile"] = phase == "prefill" ? 128 : 16;
      if (phase == "prefill") j["q_block"] = 64;
      if (phase == "decode") j["tile_note"] = "16-token warp chunks, running max seeded with the first and last chunk";
    } else {
      j["tile"] = phase == "prefill" ? base_prm.prefill_tile : base_prm.tile;
      if (phase == "prefill") j["q_block"] = base_prm.q_block;
    }
    if (phase == "decode") j["decode_steps"] = dsteps;
    j["order"] = cpu::tile_order_name(base_prm.order);
    j["calibration_seconds"] = cal_s;
    for (const auto& l : cal.lengths) {
      json p = {{"length", l.length}, {"lambda_best", l.lambda_best}, {"sparsity", l.sparsity},
                {"a_point", l.lambda_best * double(l.length)}, {"used", l.kept}};
      json sw = json::array();
      for (const auto& s : l.sweep) sw.push_back({s.lambda, s.sparsity});
      p["sweep_lambda_sparsity"] = sw;
      j["points"].push_back(p);
    }
    if (verify != "none") {
      // Table 5: lambda = a / L vs one fixed lambda.
      const double fixed = a.has("--fixed-lambda")
                               ? a.number("--fixed-lambda", 0)
                               : cal.lengths[cal.lengths.size() / 2].lambda_best;
      std::printf("verification (%s): achieved sparsity, target %.3f\n",
                  verify == "exact" ? "exact BLASST runs" : "gap traces, teacher-forced", target);
      std::printf("%8s %14s %10s %14s %10s\n", "L", "lambda=a/L", "sparsity", "fixed lambda",
                  "sparsity");
      double err_cal = 0, err_fixed = 0;
      for (int64_t L : verify_lengths) {
        const double lc = std::min(1.0, cal.a / double(L));
        std::vector<double> per_layer;
        const double sc = verify == "exact" ? measure_exact(-1, cal.a, L, &per_layer)
                                            : measure_gaps(lc, L);
        const double sf = verify == "exact" ? measure_exact(fixed, -1, L)
                                            : measure_gaps(fixed, L);
        err_cal += std::fabs(sc - target);
        err_fixed += std::fabs(sf - target);
        std::printf("%8lld %14.4g %10.4f %14.4g %10.4f\n", (long long)L, lc, sc, fixed, sf);
        json row = {{"length", L}, {"lambda", lc}, {"sparsity", sc}, {"fixed_lambda", fixed},
                    {"fixed_sparsity", sf}};
        if (!per_layer.empty()) row["sparsity_per_layer"] = per_layer;
        j["verify"].push_back(row);
      }
      const double n = double(verify_lengths.size());
      std::printf("mean |sparsity - target|: calibrated %.4f, fixed %.4f\n\n", err_cal / n,
                  err_fixed / n);
      j["verify_mode"] = verify;
      j["verify_mean_abs_error"] = err_cal / n;
      j["fixed_mean_abs_error"] = err_fixed / n;
    }
    const std::string out = out_path(a.str("--out", "configs/blasst_calibrated.json"), target,
                                     targets.size());
    std::ofstream f(out);
    SPADE_CHECK(f.good(), "cannot write '", out, "'");
    f << j.dump(2) << "\n";
    std::printf("wrote %s (use: --sparse %s --sparse-opt config=%s)\n\n", out.c_str(),
                in_selector ? placement_spec.c_str() : "blasst", out.c_str());
  }
  for (auto& [k, pt] : prefixes) runner.release(pt);
  return 0;
}

// ---------------------------------------------------------------- twilight

int run_twilight(const Args& a) {
  Loaded ld = load(a);
  const ModelConfig& cfg = ld.w->config;
  const int64_t L = a.integer("--length", 2048), N = a.integer("--decode", 32);
  SPADE_CHECK(L > 0 && N > 0 && L + N <= cfg.max_context, "--length + --decode must fit the "
              "model's context of ", cfg.max_context);
  SPADE_CHECK(int64_t(ld.tokens.size()) >= L + N, "the text has ", ld.tokens.size(),
              " tokens, need ", L + N);
  const int64_t budget = a.integer("--budget", L / 4);
  const bool own_prefill = a.has("--own-prefill");
  std::vector<std::string> specs;
  if (!a.has("--methods") || a.has("--p")) {
    for (const auto& base : split(a.str("--bases", "quest,full"), ','))
      for (double p : parse_floats(a.str("--p", "0.8,0.9,0.95,0.99"), "--p")) {
        std::string s = cat("twilight:base=", base, ",p=", p);
        if (base == "quest") s += cat(",budget=", budget);
        specs.push_back(s);
      }
    for (const auto& base : split(a.str("--bases", "quest,full"), ','))
      if (base == "quest") specs.insert(specs.begin(), cat("quest:budget=", budget));
  }
  for (const auto& s : split(a.str("--methods", ""), ';')) specs.push_back(s);
  // One dense prefill, shared by every method through KVPool::fork: the methods differ in
  // decode only (Twilight and the selectors index lazily or from the pool's page metadata).
  ModelRunner runner(*ld.w, (own_prefill ? 2 * (L + N) : L) + 2 * N + 64);
  auto t0 = clock_type::now();
  const float* lg = runner.prefill(ld.tokens.data(), L, nullptr);
  const std::vector<float> prefix_logits(lg, lg + cfg.vocab);
  PageTable kept = runner.keep();
  std::fprintf(stderr, "[calibrate] prefill of %lld tokens: %.1f s\n", (long long)L,
               seconds_since(t0));
  t0 = clock_type::now();
  const DecodeEval ref =
      eval_decode_from(runner, kept, prefix_logits.data(), ld.tokens, L, N, nullptr, true);
  std::fprintf(stderr, "[calibrate] full decode: %.1f s\n", seconds_since(t0));
  json j;
  j["model"] = a.str("--model");
  j["text"] = a.str("--text");
  j["length"] = L;
  j["decode_steps"] = N;
  std::printf("teacher-forced decode of %lld tokens after %lld tokens; sparse layers = layers >= 2\n",
              (long long)N, (long long)L);
  std::printf("%-44s %9s %9s %8s %8s %8s %8s %7s %9s %8s\n", "method", "base/head", "kept/head",
              "kept%", "recall", "minrec", "ppl", "top1", "KL", "skip");
  std::printf("%-44s %9s %9s %8s %8s %8s %8.3f %7s %9s %8s\n", "full", "-", "-", "-", "1", "1",
              compare_decode(ref, ref).ppl_ref, "1", "0", "-");
  for (const auto& spec : specs) {
    SparseConfig sc = SparseConfig::parse_spec(spec);
    auto m = make_method(sc, cfg);
    ProbeSession s(m, cfg, runner.kv(), true);
    json steps = json::array();  // kept budget per step, flat [layer * Hkv + head]
    auto t1 = clock_type::now();
    auto record_step = [&] {
      if (const TwilightStats* ts = s.twilight()) steps.push_back(ts->kept_count);
    };
    // --own-prefill: the method also runs the prefill (BLASST prefill skipping).
    const DecodeEval ev =
        own_prefill ? eval_decode(runner, ld.tokens, L, N, &s.attention(), true)
                    : eval_decode_from(runner, kept, prefix_logits.data(), ld.tokens, L, N,
                                       &s.attention(), true, record_step);
    const double secs = seconds_since(t1);
    const Agreement ag = compare_decode(ref, ev);
    const TwilightStats* ts = s.twilight();
    const BlasstStats* bs = s.blasst();
    const double base = ts ? ts->mean_base() : s.mean_attended(2);
    const double kept_h = ts ? ts->mean_kept() : s.mean_attended(2);
    char skip[32] = "-";
    if (bs)
      std::snprintf(skip, sizeof skip, "%.3f", own_prefill && bs->prefill_sparsity() > 0
                                                   ? bs->prefill_sparsity()
                                                   : bs->decode_sparsity());
    std::printf("%-44s %9.1f %9.1f %8.2f %8.4f %8.4f %8.3f %7.3f %9.5f %8s\n", spec.c_str(), base,
                kept_h, 100.0 * kept_h / double(s.mean_length()), s.mean_recall(2), s.min_recall(2),
                ag.ppl, ag.top1, ag.kl, skip);
    json r = {{"spec", spec},
              {"describe", m->describe()},
              {"mean_context", s.mean_length()},
              {"base_per_head", base},
              {"kept_per_head", kept_h},
              {"recall_mean", s.mean_recall(2)},
              {"recall_min", s.min_recall(2)},
              {"ppl", ag.ppl},
              {"ppl_full", ag.ppl_ref},
              {"top1_agreement", ag.top1},
              {"kl", ag.kl},
              {"seconds", secs}};
    if (ts) {
      json per_head = json::array();
      for (int l = 0; l < ts->n_layers; ++l) {
        json row = json::array();
        for (int h = 0; h < ts->n_kv_heads; ++h) row.push_back(ts->mean_kept(l, h));
        per_head.push_back(row);
      }
      r["kept_mean_per_layer_head"] = per_head;
      r["kept_per_step_layer_head"] = steps;  // flat [layer * Hkv + head] per step
    }
    if (bs && own_prefill) r["prefill_skip_ratio"] = bs->prefill_sparsity();
    if (bs) {
      r["decode_skip_ratio"] = bs->decode_sparsity();
      json per = json::array();  // [layer][kv_head] skipped / tiles over the decode steps
      for (int l = 0; l < bs->n_layers; ++l) {
        json row = json::array();
        for (int h = 0; h < bs->n_kv_heads; ++h) {
          const auto& c = bs->decode[size_t(l * bs->n_kv_heads + h)];
          row.push_back(c.tiles ? double(c.skipped) / double(c.tiles) : 0.0);
        }
        per.push_back(row);
      }
      r["decode_skip_per_layer_head"] = per;
    }
    j["results"].push_back(r);
  }
  runner.release(kept);
  if (a.has("--json")) {
    std::ofstream f(a.str("--json"));
    SPADE_CHECK(f.good(), "cannot write '", a.str("--json"), "'");
    f << j.dump(1) << "\n";
  }
  return 0;
}

int run(int argc, char** argv) {
  Args a(argc, argv,
         {"--model", "--text", "--target-sparsity", "--lengths", "--phase", "--measure",
          "--lambda-min", "--lambda-max", "--per-decade", "--refine", "--delta", "--samples",
          "--decode-steps", "--tile", "--prefill-tile", "--q-block", "--order", "--fixed-lambda",
          "--verify", "--verify-lengths", "--gaps-dir", "--device", "--sparse",
          "--out", "--offset", "--threads", "--length", "--decode", "--p", "--bases", "--budget",
          "--methods", "--json"},
         {"--help", "--own-prefill"});
  if (a.has("--help") || a.positional().empty()) {
    std::fputs(kHelp, a.has("--help") ? stdout : stderr);
    return a.has("--help") ? 0 : 2;
  }
  const std::string what = a.positional()[0];
  if (what == "blasst") return run_blasst(a);
  if (what == "twilight") return run_twilight(a);
  fail("calibrate: unknown target '", what, "' (blasst or twilight)");
}

Registrar reg("calibrate", "calibrate sparse methods (BLASST's lambda = a/L; Twilight budgets)",
              run);

}  // namespace
}  // namespace spade::cli
