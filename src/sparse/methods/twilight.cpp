#include "sparse/methods/twilight.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "core/error.h"
#include "sparse/methods/blasst.h"
#include "sparse/methods/common.h"
#include "sparse/registry.h"

namespace spade::sparse {

// ---------------------------------------------------------------- Algorithm 1

TopPResult topp_binary_search(const float* w, int64_t n, double p, double eps,
                              int max_iterations) {
  TopPResult res;
  if (n <= 0) return res;
  float mx = w[0];
  for (int64_t i = 1; i < n; ++i) mx = std::max(mx, w[i]);
  auto mass_at_least = [&](double t) {
    double s = 0;
    for (int64_t i = 0; i < n; ++i)
      if (w[i] >= t) s += w[i];
    return s;
  };
  // The largest weight(s) alone may already reach p: then they are the answer.
  if (mass_at_least(mx) >= p) {
    res.threshold = mx;
    return res;
  }
  double l = 0, r = mx;  // invariant: mass(>= l) >= p (or l = 0), mass(>= r) < p
  while (r - l >= eps && res.iterations < max_iterations) {
    const double m = 0.5 * (l + r);
    if (mass_at_least(m) >= p)
      l = m;
    else
      r = m;
    ++res.iterations;
    // Algorithm 1's test: W1 = where(W <= l, INF, W), W2 = where(W > r, -INF, W); stop once
    // the weights still undecided, those in [l, r), lie within eps of each other.
    float lo = INFINITY, hi = -INFINITY;
    for (int64_t i = 0; i < n; ++i)
      if (w[i] >= l && w[i] < r) {
        lo = std::min(lo, w[i]);
        hi = std::max(hi, w[i]);
      }
    if (!(hi - lo >= float(eps))) break;  // none undecided, or all within eps
  }
  // The threshold as a float that keeps exactly { w >= l }.
  float t = float(l);
  if (double(t) > l) t = std::nextafter(t, -INFINITY);
  res.threshold = t;
  return res;
}

void softmax_weights(float* w, int64_t n) {
  float mx = -INFINITY;
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, w[i]);
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += (w[i] = std::exp(w[i] - mx));
  const float inv = float(1.0 / sum);
  for (int64_t i = 0; i < n; ++i) w[i] *= inv;
}

// ---------------------------------------------------------------- composition

ComposedMethod::ComposedMethod(std::shared_ptr<const SparseMethod> base) : base_(std::move(base)) {
  SPADE_CHECK(base_, "a modifier stage needs a base method");
}

ComposedMethod::BaseScope::BaseScope(StepContext& c) : ctx(c), saved(c.state) {
  auto* st = static_cast<ComposedState*>(c.state);
  c.state = st ? st->base.get() : nullptr;
}

void ComposedMethod::on_prefill(StepContext& ctx, int64_t p0, int64_t T) const {
  BaseScope s(ctx);
  base_->on_prefill(ctx, p0, T);
}
void ComposedMethod::on_append(StepContext& ctx) const {
  BaseScope s(ctx);
  base_->on_append(ctx);
}
void ComposedMethod::select(StepContext& ctx, Selection& out) const {
  BaseScope s(ctx);
  base_->select(ctx, out);
}
void ComposedMethod::prune(StepContext& ctx, Selection& sel) const {
  BaseScope s(ctx);
  base_->prune(ctx, sel);
}
void ComposedMethod::on_scores(StepContext& ctx, const Selection& sel, const float* scores) const {
  BaseScope s(ctx);
  base_->on_scores(ctx, sel, scores);
}

bool ComposedMethod::attend_decode(StepContext& ctx, const Selection& sel, float* out) const {
  BaseScope s(ctx);
  return base_->attend_decode(ctx, sel, out);
}
bool ComposedMethod::attend_prefill(StepContext& ctx, const float* q, int64_t p0, int64_t T,
                                    float* out) const {
  BaseScope s(ctx);
  return base_->attend_prefill(ctx, q, p0, T, out);
}
const Selection* ComposedMethod::read_selection(StepContext& ctx) const {
  BaseScope s(ctx);
  return base_->read_selection(ctx);
}

std::vector<std::string> split_stack(const std::string& spec) {
  std::vector<std::string> out;
  size_t a = 0;
  while (true) {
    size_t b = spec.find('+', a);
    std::string s = spec.substr(a, b == std::string::npos ? std::string::npos : b - a);
    size_t x = s.find_first_not_of(" \t"), y = s.find_last_not_of(" \t");
    s = x == std::string::npos ? std::string() : s.substr(x, y - x + 1);
    SPADE_CHECK(!s.empty(), "empty stage in sparse method stack '", spec, "'");
    out.push_back(s);
    SPADE_CHECK(out.size() <= size_t(kMaxStackStages), "sparse method stack '", spec,
                "' has more than ", kMaxStackStages, " stages");
    if (b == std::string::npos) break;
    a = b + 1;
  }
  return out;
}

namespace {

bool is_modifier(const std::string& name) { return name == "twilight" || name == "blasst"; }

// Keys a stage declares itself (modifiers: their own options only).
std::set<std::string> stage_keys(const std::string& name) {
  std::set<std::string> keys;
  std::vector<OptionSpec> specs = name == "twilight" ? twilight_own_options()
                                  : name == "blasst" ? blasst_own_options()
                                                     : find_method(name).options();
  for (const auto& s : specs) keys.insert(s.key);
  keys.erase("base");
  return keys;
}

std::string join_stack(const std::vector<std::string>& st, size_t n) {
  std::string s;
  for (size_t i = 0; i < n; ++i) s += (i ? "+" : "") + st[i];
  return s;
}

}  // namespace

std::shared_ptr<const SparseMethod> make_stack(const std::string& spec,
                                               const std::map<std::string, std::string>& options,
                                               const ModelConfig& cfg) {
  const std::vector<std::string> st = split_stack(spec);
  const std::string& outer = st.back();
  std::map<std::string, std::string> opts = options;
  if (st.size() > 1) {
    SPADE_CHECK(is_modifier(outer), "sparse stack '", spec, "': '", outer,
                "' cannot stack on a base (only twilight and blasst are modifiers)");
    SPADE_CHECK(!opts.count("base"), "sparse stack '", spec, "' and option base=",
                opts.count("base") ? opts.at("base") : "", " both name a base");
    opts["base"] = join_stack(st, st.size() - 1);
  }
  const MethodInfo& info = find_method(outer);
  MethodOptions o(info.name, info.options(), opts, cfg);
  return std::shared_ptr<const SparseMethod>(info.make(o, cfg));
}

std::vector<OptionSpec> with_forwarded_options(const std::string& self,
                                               std::vector<OptionSpec> own) {
  // A modifier's list includes the other modifiers' lists: recurse one level only.
  thread_local int depth = 0;
  if (depth > 0) return own;
  struct Guard {
    Guard() { ++depth; }
    ~Guard() { --depth; }
  } guard;
  std::set<std::string> keys;
  for (const auto& s : own) keys.insert(s.key);
  for (const auto& m : all_methods()) {
    if (m.name == self) continue;
    for (const auto& s : m.options())
      if (keys.insert(s.key).second)
        own.push_back({s.key, OptKind::String, "-", cat("forwarded to the base (", m.name, ")")});
  }
  return own;
}

std::map<std::string, std::string> given_options(const MethodOptions& o) {
  std::map<std::string, std::string> g;
  for (const auto& s : o.specs())
    if (o.given(s.key)) g[s.key] = o.str(s.key);
  return g;
}

std::map<std::string, std::string> route_to_base(const std::string& self,
                                                 const std::vector<OptionSpec>& own,
                                                 const std::string& base_spec,
                                                 const std::map<std::string, std::string>& given) {
  std::set<std::string> mine, theirs;
  for (const auto& s : own) mine.insert(s.key);
  for (const auto& stage : split_stack(base_spec))
    for (const auto& k : stage_keys(stage)) theirs.insert(k);
  std::map<std::string, std::string> out;
  for (const auto& [k, v] : given) {
    if (k == "base") continue;
    const bool m = mine.count(k) > 0, t = theirs.count(k) > 0;
    if (t) out[k] = v;
    SPADE_CHECK(m || t, self, ": option '", k, "' belongs neither to ", self,
                " nor to its base '", base_spec, "'");
  }
  return out;
}

// ---------------------------------------------------------------- Twilight stats

void TwilightStats::init(int layers, int hkv) {
  n_layers = layers;
  n_kv_heads = hkv;
  const size_t n = size_t(layers) * size_t(hkv);
  base_count.assign(n, 0);
  kept_count.assign(n, 0);
  pruned.assign(size_t(layers), 0);
  base_sum.assign(n, 0);
  kept_sum.assign(n, 0);
  steps.assign(n, 0);
}

void TwilightStats::clear() { init(n_layers, n_kv_heads); }

double TwilightStats::mean_base() const {
  double s = 0;
  int64_t k = 0;
  for (size_t i = 0; i < base_sum.size(); ++i) s += base_sum[i], k += steps[i];
  return k ? s / double(k) : 0;
}
double TwilightStats::mean_kept() const {
  double s = 0;
  int64_t k = 0;
  for (size_t i = 0; i < kept_sum.size(); ++i) s += kept_sum[i], k += steps[i];
  return k ? s / double(k) : 0;
}
double TwilightStats::mean_kept(int layer, int head) const {
  const size_t i = size_t(layer * n_kv_heads + head);
  return steps[i] ? kept_sum[i] / double(steps[i]) : 0;
}

TwilightState* twilight_state(MethodState* state) { return find_stage_state<TwilightState>(state); }

const TwilightStats* twilight_stats(const MethodState* state) {
  TwilightState* t = twilight_state(const_cast<MethodState*>(state));
  return t ? &t->stats : nullptr;
}

// ---------------------------------------------------------------- Twilight

TwilightMethod::TwilightMethod(std::shared_ptr<const SparseMethod> base, Params prm,
                               std::string base_spec, std::map<std::string, std::string> base_options,
                               const ModelConfig* cfg)
    : ComposedMethod(std::move(base)),
      prm_(prm),
      base_spec_(std::move(base_spec)),
      base_options_(std::move(base_options)) {
  SPADE_CHECK(prm_.p > 0 && prm_.p <= 1, "twilight: p ", prm_.p, " outside (0, 1]");
  SPADE_CHECK(prm_.eps > 0, "twilight: eps must be positive");
  SPADE_CHECK(prm_.dense_layers >= 0, "twilight: dense_layers must be >= 0");
  SPADE_CHECK(!prm_.auto_budget || (cfg && !base_spec_.empty()),
              "twilight: budget=auto needs the base spec");
  if (cfg) cfg_ = *cfg;
}

std::string TwilightMethod::describe() const {
  return cat("twilight p=", prm_.p, " eps=", prm_.eps,
             " head_combine=", prm_.combine == Combine::Union ? "union" : "mean",
             " keys=", prm_.keys == Keys::Int4 ? "int4" : "exact", " dense_layers=",
             prm_.dense_layers,
             prm_.auto_budget ? cat(" budget=auto(max(", prm_.auto_budget_min, ", L/4))")
                              : std::string(),
             " over [", base_->describe(), "]");
}

std::unique_ptr<MethodState> TwilightMethod::new_state() const {
  auto st = std::make_unique<TwilightState>();
  st->base = base_->new_state();
  return st;
}

namespace {
TwilightState& tw_state(StepContext& c) {
  auto* st = dynamic_cast<TwilightState*>(c.state);
  SPADE_CHECK(st, "twilight: the step context carries no twilight state");
  if (!st->keys.initialized()) st->keys.init(c.n_layers, c.Hkv, c.D);
  if (st->stats.n_layers != c.n_layers) st->stats.init(c.n_layers, c.Hkv);
  return *st;
}
}  // namespace

void TwilightMethod::on_prefill(StepContext& ctx, int64_t p0, int64_t T) const {
  ComposedMethod::on_prefill(ctx, p0, T);
  if (prm_.keys != Keys::Int4 || ctx.layer < prm_.dense_layers) return;
  TwilightState& st = tw_state(ctx);
  if (ctx.layer == prm_.dense_layers) st.keys.reserve(ctx.pt->capacity(ctx.kv->layout().page_size));
  st.keys.sync(*ctx.kv, ctx.layer, *ctx.pt, p0 + T);
}

void TwilightMethod::on_append(StepContext& ctx) const {
  ComposedMethod::on_append(ctx);
  if (prm_.keys != Keys::Int4 || ctx.layer < prm_.dense_layers) return;
  tw_state(ctx).keys.sync(*ctx.kv, ctx.layer, *ctx.pt, ctx.L);  // the new token's row
}

const SparseMethod& TwilightMethod::base_for(int64_t L) const {
  if (!prm_.auto_budget) return *base_;
  const int64_t want = (L / 4 + 1023) / 1024 * 1024;
  if (want <= prm_.auto_budget_min) return *base_;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = by_budget_.find(want);
  if (it == by_budget_.end()) {
    auto opts = base_options_;
    opts["budget"] = std::to_string(want);
    it = by_budget_.emplace(want, make_stack(base_spec_, opts, cfg_)).first;
  }
  return *it->second;
}

void TwilightMethod::select(StepContext& ctx, Selection& out) const {
  BaseScope s(ctx);
  base_for(ctx.L).select(ctx, out);
}

void TwilightMethod::prune(StepContext& c, Selection& sel) const {
  ComposedMethod::prune(c, sel);
  TwilightState& st = tw_state(c);
  TwilightStats& S = st.stats;
  const int Hkv = c.Hkv, G = c.G, D = c.D;
  const int64_t L = c.L;
  for (int h = 0; h < Hkv; ++h) S.base_count[size_t(c.layer * Hkv + h)] = sel.count(h);
  if (c.layer < prm_.dense_layers || c.scores_requested()) {
    S.pruned[size_t(c.layer)] = 0;
    for (int h = 0; h < Hkv; ++h) S.kept_count[size_t(c.layer * Hkv + h)] = sel.count(h);
    return;
  }
  if (prm_.keys == Keys::Int4) st.keys.sync(*c.kv, c.layer, *c.pt, L);  // no-op after on_append
  SPADE_CHECK(prm_.keys == Keys::Int4 || D <= 512, "twilight: exact keys need head_dim <= 512 (got ",
              D, ")");
  int64_t max_n = 1;
  for (int h = 0; h < Hkv; ++h) max_n = std::max(max_n, sel.count(h));
  float* w = SelectScratch::ensure(st.w, size_t(G + 1) * size_t(max_n));  // + the mean row
  float* qs = SelectScratch::ensure(st.qs, size_t(G));
  uint8_t* mark = SelectScratch::ensure(st.mark, size_t(max_n));
  Selection& kept = st.kept;
  kept.begin_per_head(Hkv, L);
  for (int h = 0; h < Hkv; ++h) {
    const int64_t n = sel.count(h);
    const int32_t* pos = sel.head(h);  // nullptr: [0, n)
    const float* qh = c.q + int64_t(h) * G * D;
    // Estimated logits q.k' * scale, [G][n].
    for (int g = 0; g < G; ++g) {
      float s = 0;
      for (int d = 0; d < D; ++d) s += qh[g * D + d];
      qs[g] = s;
    }
    for (int64_t i = 0; i < n; ++i) {
      const int64_t p = pos ? pos[i] : i;
      if (prm_.keys == Keys::Int4) {
        const uint8_t* code = st.keys.codes(c.layer, p, h);
        const float sc = st.keys.scale(c.layer, p, h), z = st.keys.zero(c.layer, p, h);
        for (int g = 0; g < G; ++g)
          w[g * n + i] = c.scale * int4_dot(qh + g * D, qs[g], code, sc, z, D);
      } else {
        float k[512];
        c.kv->load_k(c.layer, *c.pt, p, h, 1, k);
        for (int g = 0; g < G; ++g) {
          float s = 0;
          for (int d = 0; d < D; ++d) s += qh[g * D + d] * k[d];
          w[g * n + i] = c.scale * s;
        }
      }
    }
    for (int g = 0; g < G; ++g) softmax_weights(w + int64_t(g) * n, n);  // per query head
    std::fill_n(mark, n, uint8_t(0));
    if (prm_.combine == Combine::Union) {
      for (int g = 0; g < G; ++g) {
        const float* r = w + int64_t(g) * n;
        const float t = topp_binary_search(r, n, prm_.p, prm_.eps).threshold;
        for (int64_t i = 0; i < n; ++i) mark[i] |= r[i] >= t;
      }
    } else {
      float* mean = w + int64_t(G) * n;  // the extra row of the scratch
      for (int64_t i = 0; i < n; ++i) {
        float s = 0;
        for (int g = 0; g < G; ++g) s += w[g * n + i];
        mean[i] = s / float(G);
      }
      const float t = topp_binary_search(mean, n, prm_.p, prm_.eps).threshold;
      for (int64_t i = 0; i < n; ++i) mark[i] = mean[i] >= t;
    }
    for (int64_t i = 0; i < n; ++i)
      if (mark[i]) kept.push(int32_t(pos ? pos[i] : i));
    kept.close_head();
  }
  std::swap(sel, kept);  // both keep their capacity
  S.pruned[size_t(c.layer)] = 1;
  for (int h = 0; h < Hkv; ++h) {
    const size_t i = size_t(c.layer * Hkv + h);
    S.kept_count[i] = sel.count(h);
    S.base_sum[i] += double(S.base_count[i]);
    S.kept_sum[i] += double(S.kept_count[i]);
    S.steps[i] += 1;
  }
}

std::vector<OptionSpec> twilight_own_options() {
  return {{"base", OptKind::String, "quest",
           "base selector, a method or a stack a+b (Twilight: quest; full, lycheecluster, ...)"},
          OptionSpec{"budget", OptKind::Int, "auto",
                     "base budget; auto = max(8192, L/4) (Twilight 5.1); shared with the base"}
              .range(1, kMaxTokenCount),
          OptionSpec{"p", OptKind::Float, "0.95",
                     "estimated attention mass kept per query head (Twilight: 0.95 Llama, 0.85 "
                     "LongChat)"}
              .range(0, 1)
              .open_lo(),
          OptionSpec{"eps", OptKind::Float, "1e-6",
                     "binary-search resolution on the weight threshold"}
              .range(0, 1)
              .open_lo(),
          OptionSpec{"head_combine", OptKind::String, "union",
                     "GQA: union of the query heads' top-p sets, or mean (top-p of the group "
                     "mean)"}
              .one_of({"union", "mean"}),
          OptionSpec{"keys", OptKind::String, "int4",
                     "keys for the estimate: int4 (the paper's INT4 K copy) or exact (fp32, for "
                     "tests)"}
              .one_of({"int4", "exact"}),
          dense_layers_count("2", "leading layers not pruned (Twilight: 2); shared")};
}

std::vector<OptionSpec> twilight_options() {
  return with_forwarded_options("twilight", twilight_own_options());
}

std::unique_ptr<SparseMethod> make_twilight(const MethodOptions& o, const ModelConfig& cfg) {
  const std::string base_spec = o.str("base");
  const auto stages = split_stack(base_spec);
  for (const auto& s : stages)
    SPADE_CHECK(s != "blasst", "twilight: blasst skips inside attention and must be the last "
                "stage (use blasst with base=", base_spec, "+twilight)");
  auto base_opts = route_to_base("twilight", twilight_own_options(), base_spec, given_options(o));
  TwilightMethod::Params prm;
  prm.p = o.number("p");
  prm.eps = o.number("eps");
  const std::string hc = o.str("head_combine"), keys = o.str("keys");  // checked choices
  prm.combine = hc == "union" ? TwilightMethod::Combine::Union : TwilightMethod::Combine::Mean;
  prm.keys = keys == "int4" ? TwilightMethod::Keys::Int4 : TwilightMethod::Keys::Exact;
  prm.dense_layers = int(o.integer("dense_layers"));  // [0, n_layers]: MethodOptions
  // budget=auto: only meaningful when some base stage has a budget.
  bool base_has_budget = false;
  for (const auto& s : stages) base_has_budget |= stage_keys(s).count("budget") > 0;
  if (o.is_auto("budget") && base_has_budget) {
    prm.auto_budget = true;
    base_opts["budget"] = std::to_string(prm.auto_budget_min);
  }
  auto base = make_stack(base_spec, base_opts, cfg);
  return std::make_unique<TwilightMethod>(std::move(base), prm, base_spec, base_opts, &cfg);
}

}  // namespace spade::sparse
