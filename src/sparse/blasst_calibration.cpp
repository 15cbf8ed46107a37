#include "sparse/blasst_calibration.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "core/error.h"
#include "sparse/methods/blasst.h"
#include "sparse/methods/full.h"

namespace spade::sparse {

// ---------------------------------------------------------------- Algorithm 2

double fit_through_origin(const std::vector<double>& x, const std::vector<double>& y, double* r2) {
  SPADE_CHECK(x.size() == y.size(), "fit_through_origin: sizes differ");
  double sxy = 0, sxx = 0, mean = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    sxy += x[i] * y[i];
    sxx += x[i] * x[i];
    mean += y[i];
  }
  const double a = sxx > 0 ? sxy / sxx : NAN;
  if (r2) {
    *r2 = NAN;
    if (x.size() >= 2) {
      mean /= double(y.size());
      double res = 0, tot = 0;
      for (size_t i = 0; i < x.size(); ++i) {
        res += (y[i] - a * x[i]) * (y[i] - a * x[i]);
        tot += (y[i] - mean) * (y[i] - mean);
      }
      if (tot > 0) *r2 = 1 - res / tot;
    }
  }
  return a;
}

std::vector<double> log_grid(double lo, double hi, int per_decade) {
  SPADE_CHECK(lo > 0 && hi >= lo && per_decade > 0, "log_grid: bad range [", lo, ", ", hi, "]");
  std::vector<double> g;
  const double step = 1.0 / per_decade;
  const double e0 = std::log10(lo), e1 = std::log10(hi);
  for (int i = 0;; ++i) {
    const double e = e0 + i * step;
    if (e > e1 + 1e-9) break;
    g.push_back(std::pow(10.0, e));
  }
  if (g.back() < hi * (1 - 1e-9)) g.push_back(hi);
  return g;
}

double sparsity_from_gaps(const std::vector<float>& sorted_gaps, double lambda) {
  if (sorted_gaps.empty()) return 0;
  if (!(lambda > 0)) return 0;
  const float ll = float(std::log(std::min(lambda, 1.0)));
  const auto it = std::lower_bound(sorted_gaps.begin(), sorted_gaps.end(), ll);  // first >= ll
  return double(it - sorted_gaps.begin()) / double(sorted_gaps.size());
}

BlasstCalibration calibrate_blasst(const SparsityFn& measure, double target,
                                   const std::vector<int64_t>& lengths,
                                   const std::vector<double>& lambdas, double delta,
                                   int refine_steps) {
  SPADE_CHECK(target >= 0 && target <= 1, "calibrate: target sparsity ", target,
              " outside [0, 1]");
  SPADE_CHECK(!lambdas.empty() && !lengths.empty(), "calibrate: no lambdas or lengths");
  BlasstCalibration out;
  out.target = target;
  out.delta = delta;
  std::vector<double> xs, ys;
  for (int64_t L : lengths) {
    CalibrationLength cl;
    cl.length = L;
    cl.gap = INFINITY;
    auto sample = [&](double lam) {
      const double s = measure(lam, L);
      cl.sweep.push_back({lam, s});
      const double gap = std::fabs(s - target);
      if (gap < cl.gap) {  // Algorithm 2 lines 7-11
        cl.gap = gap;
        cl.lambda_best = lam;
        cl.sparsity = s;
      }
      return s;
    };
    std::vector<double> grid(lambdas);
    std::sort(grid.begin(), grid.end());
    std::vector<double> s(grid.size());
    for (size_t i = 0; i < grid.size(); ++i) s[i] = sample(grid[i]);
    // Bisection (log lambda) between grid neighbours that bracket the target.
    for (size_t i = 0; i + 1 < grid.size() && refine_steps > 0; ++i) {
      if (!(s[i] <= target && s[i + 1] >= target) || grid[i] <= 0) continue;
      double lo = grid[i], hi = grid[i + 1];
      for (int k = 0; k < refine_steps; ++k) {
        const double mid = std::sqrt(lo * hi);
        (sample(mid) < target ? lo : hi) = mid;
      }
      break;
    }
    std::sort(cl.sweep.begin(), cl.sweep.end(),
              [](const LambdaSample& a, const LambdaSample& b) { return a.lambda < b.lambda; });
    cl.kept = cl.gap < delta;  // line 13
    if (cl.kept) {
      xs.push_back(1.0 / double(L));
      ys.push_back(cl.lambda_best);
    }
    out.lengths.push_back(std::move(cl));
  }
  out.used = int(xs.size());
  if (xs.empty()) {
    // What each length measured: its closest lambda and the sparsity range of its sweep.
    std::string seen;
    for (const auto& cl : out.lengths) {
      double lo = 1, hi = 0;
      for (const LambdaSample& x : cl.sweep) lo = std::min(lo, x.sparsity), hi = std::max(hi, x.sparsity);
      seen += " L=" + std::to_string(cl.length) + ": closest " + std::to_string(cl.sparsity) +
              " at lambda " + std::to_string(cl.lambda_best) + ", swept " + std::to_string(lo) +
              ".." + std::to_string(hi) + ";";
    }
    SPADE_CHECK(false, "calibrate: no length reached the target sparsity ", target, " within delta ",
                delta, " (widen the lambda range or delta):", seen);
  }
  out.a = fit_through_origin(xs, ys, &out.r2);  // line 17
  return out;
}

// ---------------------------------------------------------------- probe session

ProbeSession::ProbeSession(std::shared_ptr<const SparseMethod> method, const ModelConfig& cfg,
                             KVPool& kv, bool measure_recall)
    : method_(std::move(method)), cfg_(cfg), kv_(kv), recall_(measure_recall) {
  SPADE_CHECK(method_, "ProbeSession: no method");
  ctx_.bind(cfg, kv_, &scratch_, "ProbeSession");
  reset();
  fn_ = [this](int layer, const PageTable& pt, const float* q, int64_t p0, int64_t T, float* out) {
    attend(layer, pt, q, p0, T, out);
  };
}

void ProbeSession::reset() {
  state_ = method_->new_state();
  ctx_.state = state_.get();
  ctx_.invalidate_weights();
  steps_ = 0;
  length_sum_ = 0;
  attended_sum_.assign(size_t(cfg_.n_layers) * size_t(cfg_.n_kv_heads), 0.0);
  recall_sum_.assign(size_t(cfg_.n_layers) * size_t(cfg_.n_heads), 0.0);
  recall_min_.assign(size_t(cfg_.n_layers) * size_t(cfg_.n_heads), 1.f);
}

const BlasstStats* ProbeSession::blasst() const {
  auto* st = dynamic_cast<const BlasstState*>(state_.get());
  return st && st->stats.n_layers ? &st->stats : nullptr;
}

void ProbeSession::attend(int layer, const PageTable& pt, const float* q, int64_t p0, int64_t T,
                           float* out) {
  if (T > 1) {  // prefill chunk: dense causal (or BLASST), then the method indexes it
    ctx_.begin_layer(layer, pt, q, p0 + T);
    if (!method_->attend_prefill(ctx_, q, p0, T, out))
      cpu::attention_dense(kv_, layer, pt, q, p0, T, cfg_.n_heads, ctx_.scale, out, scratch_);
    method_->on_prefill(ctx_, p0, T);
    return;
  }
  if (layer == 0) {
    ctx_.step = steps_;
    ctx_.invalidate_weights();
  }
  ctx_.begin_layer(layer, pt, q, p0 + 1);
  method_->on_append(ctx_);
  method_->select(ctx_, sel_);
  method_->prune(ctx_, sel_);
  validate(sel_, cfg_.n_kv_heads, p0 + 1);
  const Selection* read = nullptr;
  if (ctx_.scores_requested()) {
    SPADE_CHECK(sel_.uniform(), method_->name(), ": scores need a uniform selection");
    float* s = SelectScratch::ensure(scores_, size_t(cfg_.n_heads) * size_t(sel_.count(0)));
    cpu::attention_selected(kv_, layer, pt, q, cfg_.n_heads, ctx_.scale, sel_, out, scratch_, s);
    method_->on_scores(ctx_, sel_, s);
  } else if (!method_->attend_decode(ctx_, sel_, out)) {
    cpu::attention_selected(kv_, layer, pt, q, cfg_.n_heads, ctx_.scale, sel_, out, scratch_);
  } else {
    read = method_->read_selection(ctx_);  // fewer rows than selected (BLASST's kept tiles)
  }
  // Attended rows and recall over the rows the attention read (SparseSession's rule).
  const Selection& used = read ? *read : sel_;
  const int Hkv = cfg_.n_kv_heads, G = ctx_.G;
  for (int h = 0; h < Hkv; ++h) attended_sum_[size_t(layer * Hkv + h)] += double(used.count(h));
  if (recall_) {
    double* rs = recall_sum_.data() + size_t(layer) * size_t(cfg_.n_heads);
    float* rm = recall_min_.data() + size_t(layer) * size_t(cfg_.n_heads);
    if (used.dense()) {
      for (int g = 0; g < cfg_.n_heads; ++g) rs[g] += 1.0;
    } else {
      const float* w = ctx_.full_weights();
      const int64_t L = ctx_.L;
      for (int h = 0; h < Hkv; ++h) {
        const int32_t* pos = used.head(h);
        const int64_t n = used.count(h);
        for (int g = 0; g < G; ++g) {
          const float* wr = w + int64_t(h * G + g) * L;
          double s = 0;
          for (int64_t i = 0; i < n; ++i) s += wr[pos[i]];
          rs[h * G + g] += s;
          rm[h * G + g] = std::min(rm[h * G + g], float(s));
        }
      }
    }
  }
  if (layer == cfg_.n_layers - 1) {
    ++steps_;
    length_sum_ += p0 + 1;
  }
}

double ProbeSession::mean_attended(int first_layer) const {
  double s = 0;
  int64_t n = 0;
  for (int l = first_layer; l < cfg_.n_layers; ++l)
    for (int h = 0; h < cfg_.n_kv_heads; ++h, ++n) s += attended_sum_[size_t(l * cfg_.n_kv_heads + h)];
  return n && steps_ ? s / double(n) / double(steps_) : 0;
}

double ProbeSession::mean_recall(int first_layer) const {
  if (!recall_ || !steps_) return NAN;
  double s = 0;
  int64_t n = 0;
  for (int l = first_layer; l < cfg_.n_layers; ++l)
    for (int g = 0; g < cfg_.n_heads; ++g, ++n) s += recall_sum_[size_t(l * cfg_.n_heads + g)];
  return n ? s / double(n) / double(steps_) : NAN;
}

double ProbeSession::min_recall(int first_layer) const {
  if (!recall_ || !steps_) return NAN;
  float m = 1.f;
  for (int l = first_layer; l < cfg_.n_layers; ++l)
    for (int g = 0; g < cfg_.n_heads; ++g) m = std::min(m, recall_min_[size_t(l * cfg_.n_heads + g)]);
  return m;
}

// ---------------------------------------------------------------- model runs

ModelRunner::ModelRunner(const ModelWeights& w, int64_t max_tokens, int page_size)
    : kv_(KVLayout{w.config.n_layers, w.config.n_kv_heads, w.config.head_dim, page_size},
          (max_tokens + page_size - 1) / page_size + 1),
      model_(w, kv_) {}

void ModelRunner::reset() { kv_.release(pt_); }

void ModelRunner::rewind(int64_t length) {
  SPADE_CHECK(length <= pt_.length, "rewind to ", length, " > ", pt_.length);
  pt_.length = length;
}

const float* ModelRunner::prefill(const int32_t* tokens, int64_t n, const AttentionFn* attn,
                                  int64_t chunk) {
  const float* last = nullptr;
  std::vector<SeqInput> batch(1);
  batch[0].pages = &pt_;
  batch[0].attention = attn;
  for (int64_t off = 0; off < n; off += chunk) {
    batch[0].tokens = tokens + off;
    batch[0].n_tokens = std::min(chunk, n - off);
    const auto& logits = model_.forward(batch, row_of_);
    last = logits.data() + row_of_[0] * config().vocab;
  }
  return last;
}

const float* ModelRunner::step(int32_t token, const AttentionFn* attn) {
  return prefill(&token, 1, attn, 1);
}

void ModelRunner::resume(const PageTable& kept) {
  kv_.release(pt_);
  pt_ = kv_.fork(kept);
}

double measure_blasst_prefill(ModelRunner& r, std::shared_ptr<const SparseMethod> method,
                              const std::vector<int32_t>& tokens, int64_t L, BlasstStats* stats) {
  SPADE_CHECK(as_blasst(*method), "measure_blasst_prefill: not a blasst method");
  SPADE_CHECK(int64_t(tokens.size()) >= L, "measure: text has ", tokens.size(), " tokens < ", L);
  ProbeSession s(method, r.config(), r.kv());
  r.reset();
  r.prefill(tokens.data(), L, &s.attention(), L);
  if (stats) *stats = *s.blasst();
  return s.blasst()->prefill_sparsity();
}

double measure_blasst_decode(ModelRunner& r, std::shared_ptr<const SparseMethod> method,
                             const std::vector<int32_t>& tokens, int64_t L, int64_t decode_steps,
                             bool prefilled, BlasstStats* stats) {
  SPADE_CHECK(as_blasst(*method), "measure_blasst_decode: not a blasst method");
  SPADE_CHECK(int64_t(tokens.size()) >= L + decode_steps, "measure: text has ", tokens.size(),
              " tokens < ", L + decode_steps);
  ProbeSession s(method, r.config(), r.kv());
  if (prefilled) {
    r.rewind(L);
  } else {
    r.reset();
    r.prefill(tokens.data(), L, &s.attention(), 4096);
  }
  for (int64_t i = 0; i < decode_steps; ++i) r.step(tokens[size_t(L + i)], &s.attention());
  if (stats) *stats = *s.blasst();
  return s.blasst()->decode_sparsity();
}

std::vector<float> prefill_tile_gaps(ModelRunner& r, const std::vector<int32_t>& tokens,
                                     int64_t L, int64_t tile, int64_t q_block,
                                     cpu::TileOrder order) {
  BlasstMethod::Params prm;
  prm.order = order;
  prm.lambda = 0;  // never skip: the run is dense attention, tiles traced
  prm.prefill_tile = tile;
  prm.q_block = q_block;
  prm.prefill = true;
  prm.decode = false;
  auto m = std::make_shared<BlasstMethod>(std::make_shared<FullMethod>(), prm);
  ProbeSession s(m, r.config(), r.kv());
  std::vector<float> gaps;
  cpu::BlasstTrace trace;
  trace.gaps = &gaps;
  blasst_state(s.state())->trace = &trace;
  r.reset();
  r.prefill(tokens.data(), L, &s.attention(), L);
  std::sort(gaps.begin(), gaps.end());
  return gaps;
}

std::vector<float> decode_tile_gaps(ModelRunner& r, const std::vector<int32_t>& tokens,
                                    int64_t L, int64_t decode_steps, int64_t tile,
                                    bool prefilled, cpu::TileOrder order) {
  SPADE_CHECK(int64_t(tokens.size()) >= L + decode_steps, "decode_tile_gaps: text too short");
  BlasstMethod::Params prm;
  prm.order = order;
  prm.lambda = 0;
  prm.tile = tile;
  prm.prefill = false;
  auto m = std::make_shared<BlasstMethod>(std::make_shared<FullMethod>(), prm);
  ProbeSession s(m, r.config(), r.kv());
  std::vector<float> gaps;
  cpu::BlasstTrace trace;
  trace.gaps = &gaps;
  blasst_state(s.state())->trace = &trace;
  if (prefilled) {
    r.rewind(L);
  } else {
    r.reset();
    r.prefill(tokens.data(), L, &s.attention());
  }
  for (int64_t i = 0; i < decode_steps; ++i) r.step(tokens[size_t(L + i)], &s.attention());
  std::sort(gaps.begin(), gaps.end());
  return gaps;
}

// ---------------------------------------------------------------- decode comparisons

namespace {
void score_step(const float* logits, int V, int32_t truth, int64_t i, DecodeEval& e, bool keep) {
  float mx = logits[0];
  int32_t arg = 0;
  for (int v = 1; v < V; ++v)
    if (logits[v] > mx) mx = logits[v], arg = v;
  double sum = 0;
  for (int v = 0; v < V; ++v) sum += std::exp(double(logits[v]) - mx);
  const double lse = double(mx) + std::log(sum);
  e.nll.push_back(lse - logits[truth]);
  e.top1.push_back(arg);
  if (keep)
    for (int v = 0; v < V; ++v) e.logp[size_t(i) * size_t(V) + size_t(v)] = float(logits[v] - lse);
}
}  // namespace

DecodeEval eval_decode_from(ModelRunner& r, const PageTable& kept, const float* prefix_logits,
                            const std::vector<int32_t>& tokens, int64_t prefix, int64_t steps,
                            const AttentionFn* attn, bool keep_logp,
                            const std::function<void()>& on_step) {
  SPADE_CHECK(kept.length == prefix && int64_t(tokens.size()) >= prefix + steps,
              "eval_decode_from: the kept prefix has ", kept.length, " tokens, expected ", prefix);
  const int V = r.config().vocab;
  DecodeEval e;
  if (keep_logp) e.logp.resize(size_t(steps) * size_t(V));
  r.resume(kept);
  const float* logits = prefix_logits;
  for (int64_t i = 0; i < steps; ++i) {
    if (i > 0) {
      logits = r.step(tokens[size_t(prefix + i - 1)], attn);
      if (on_step) on_step();
    }
    score_step(logits, V, tokens[size_t(prefix + i)], i, e, keep_logp);
  }
  return e;
}

DecodeEval eval_decode(ModelRunner& r, const std::vector<int32_t>& tokens, int64_t prefix,
                       int64_t steps, const AttentionFn* attn, bool keep_logp) {
  SPADE_CHECK(prefix > 0 && int64_t(tokens.size()) >= prefix + steps, "eval_decode: text has ",
              tokens.size(), " tokens, need ", prefix + steps);
  const int V = r.config().vocab;
  DecodeEval e;
  if (keep_logp) e.logp.resize(size_t(steps) * size_t(V));
  r.reset();
  const float* logits = r.prefill(tokens.data(), prefix, attn);
  for (int64_t i = 0; i < steps; ++i) {
    if (i > 0) logits = r.step(tokens[size_t(prefix + i - 1)], attn);
    score_step(logits, V, tokens[size_t(prefix + i)], i, e, keep_logp);
  }
  return e;
}

Agreement compare_decode(const DecodeEval& ref, const DecodeEval& m) {
  SPADE_CHECK(ref.nll.size() == m.nll.size() && !ref.nll.empty(), "compare_decode: runs differ");
  Agreement a;
  const size_t n = ref.nll.size();
  double s0 = 0, s1 = 0, agree = 0;
  for (size_t i = 0; i < n; ++i) {
    s0 += ref.nll[i];
    s1 += m.nll[i];
    agree += ref.top1[i] == m.top1[i];
  }
  a.ppl_ref = std::exp(s0 / double(n));
  a.ppl = std::exp(s1 / double(n));
  a.top1 = agree / double(n);
  if (!ref.logp.empty() && ref.logp.size() == m.logp.size()) {
    const size_t V = ref.logp.size() / n;
    double kl = 0;
    for (size_t i = 0; i < n; ++i)
      for (size_t v = 0; v < V; ++v) {
        const double lp = ref.logp[i * V + v], lq = m.logp[i * V + v];
        kl += std::exp(lp) * (lp - lq);
      }
    a.kl = kl / double(n);
  }
  return a;
}

}  // namespace spade::sparse
