#include "sparse/methods/lycheedecode.h"
#include "sparse/methods/common.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "sparse/topk.h"

namespace spade::sparse {

namespace {

const char* mode_name(LdMode m) {
  switch (m) {
    case LdMode::TopK: return "topk";
    case LdMode::TopP: return "topp";
    case LdMode::Threshold: return "threshold";
    case LdMode::Ratio: return "ratio";
  }
  return "?";
}

}  // namespace

LdMode LdRule::parse_mode(const std::string& s) {
  if (s == "topk") return LdMode::TopK;
  if (s == "topp") return LdMode::TopP;
  if (s == "threshold") return LdMode::Threshold;
  if (s == "ratio") return LdMode::Ratio;
  fail("lycheedecode: unknown mode '", s, "'; valid modes: topk, topp, threshold, ratio");
}

std::string LdRule::describe() const {
  std::string s = cat("mode=", mode_name(mode));
  switch (mode) {
    case LdMode::TopK: s += cat(" budget=", budget); break;
    case LdMode::TopP: s += cat(" p=", p); break;
    case LdMode::Threshold: s += cat(" tau=", tau); break;
    case LdMode::Ratio: s += cat(" ratio=", ratio); break;
  }
  return s + cat(" block=", block);
}

int64_t ld_select(const float* w, int64_t L, const LdRule& r, SelectScratch& sc,
                  std::vector<int32_t>& out) {
  SPADE_CHECK(L > 0, "ld_select: empty context");
  const int64_t B = std::max(1, r.block);
  const int64_t U = (L + B - 1) / B;
  const float* uw = w;
  if (B > 1) {  // unit weight = the block's weight sum
    float* u = SelectScratch::ensure(sc.f1, size_t(U));
    for (int64_t i = 0; i < U; ++i) {
      double s = 0;
      for (int64_t j = i * B; j < std::min(L, (i + 1) * B); ++j) s += w[j];
      u[i] = float(s);
    }
    uw = u;
  }
  auto ceil_div = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  int64_t k = U;  // number of units kept
  std::vector<int32_t>& idx = sc.i0;
  bool ranked = false;  // idx[0..k) holds the kept units (any order)
  switch (r.mode) {
    case LdMode::TopK: k = ceil_div(std::max<int64_t>(1, r.budget), B); break;
    case LdMode::Ratio:
      k = ceil_div(std::max<int64_t>(1, int64_t(std::ceil(r.ratio * double(L)))), B);
      break;
    case LdMode::TopP: {
      top_k_range(uw, 0, int32_t(U), U, idx);  // full ranking, best first
      double cum = 0;
      k = U;
      for (int64_t i = 0; i < U; ++i) {
        const float x = uw[idx[size_t(i)]];
        if (x == x) cum += x;
        if (cum >= r.p) {
          k = i + 1;
          break;
        }
      }
      ranked = true;
      break;
    }
    case LdMode::Threshold: {
      if (idx.size() < size_t(U)) idx.resize(size_t(U));
      k = 0;
      int32_t best = 0;
      for (int64_t i = 0; i < U; ++i) {
        if (uw[i] > r.tau) idx[size_t(k++)] = int32_t(i);
        if (ranks_before(uw, int32_t(i), best)) best = int32_t(i);
      }
      if (k == 0) idx[size_t(k++)] = best;
      ranked = true;
      break;
    }
  }
  k = std::clamp<int64_t>(k, 1, U);
  out.clear();
  if (k == U) {  // every unit: every token
    for (int64_t j = 0; j < L; ++j) out.push_back(int32_t(j));
    return L;
  }
  if (!ranked) top_k_range(uw, 0, int32_t(U), k, idx);
  std::sort(idx.begin(), idx.begin() + k);
  for (int64_t i = 0; i < k; ++i) {
    const int64_t u = idx[size_t(i)];
    for (int64_t j = u * B; j < std::min(L, (u + 1) * B); ++j) out.push_back(int32_t(j));
  }
  return int64_t(out.size());
}

void ld_group_weights(const StepContext& c, int head, float* w) {
  const int D = c.D, G = c.G;
  SPADE_CHECK(D <= kLdMaxHeadDim, "lycheedecode: head_dim ", D, " above ", kLdMaxHeadDim);
  float qbar[kLdMaxHeadDim];
  for (int d = 0; d < D; ++d) {
    double s = 0;
    for (int g = 0; g < G; ++g) s += c.q[int64_t(head * G + g) * D + d];
    qbar[d] = float(s / G);
  }
  const int64_t L = c.L;
  float mx = -INFINITY;
  for (int64_t j = 0; j < L; ++j) {
    float k[kLdMaxHeadDim];
    c.kv->load_k(c.layer, *c.pt, j, head, 1, k);
    float s = 0.f;
    for (int d = 0; d < D; ++d) s += qbar[d] * k[d];
    w[j] = s * c.scale;
    mx = std::max(mx, w[j]);
  }
  double sum = 0;
  for (int64_t j = 0; j < L; ++j) sum += (w[j] = std::exp(w[j] - mx));
  const float inv = float(1.0 / sum);
  for (int64_t j = 0; j < L; ++j) w[j] *= inv;
}

LycheeDecodeMethod::LycheeDecodeMethod(HeadRoles roles, LdRule rule, bool correction,
                                       int64_t correction_every)
    : roles_(std::move(roles)), rule_(rule), correction_(correction), every_(correction_every) {
  roles_.check();
  SPADE_CHECK(rule_.budget > 0, "lycheedecode: budget must be positive");
  SPADE_CHECK(rule_.p > 0 && rule_.p <= 1, "lycheedecode: p must be in (0, 1]");
  SPADE_CHECK(rule_.tau >= 0 && rule_.tau < 1, "lycheedecode: tau must be in [0, 1)");
  SPADE_CHECK(rule_.ratio > 0 && rule_.ratio <= 1, "lycheedecode: ratio must be in (0, 1]");
  SPADE_CHECK(rule_.block >= 1, "lycheedecode: block must be at least 1");
  SPADE_CHECK(every_ >= 1, "lycheedecode: correction_every must be at least 1");
}

std::string LycheeDecodeMethod::describe() const {
  return cat("lycheedecode ", rule_.describe(), " roles=", roles_.source,
             roles_.model.empty() ? "" : cat(" (", roles_.model, ")"), " retrieval heads ",
             roles_.count_retrieval(), "/", roles_.n_layers * roles_.n_kv_heads,
             roles_.identity_order() ? "" : " reordered", " correction=",
             correction_ ? cat("every ", every_) : std::string("off"));
}

std::unique_ptr<MethodState> LycheeDecodeMethod::new_state() const {
  auto s = std::make_unique<LdState>();
  const size_t H = size_t(roles_.n_kv_heads);
  s->set.resize(H);
  s->all.assign(H, 0);
  s->step.assign(H, -1);
  s->length.assign(H, 0);
  return s;
}

void LycheeDecodeMethod::select(StepContext& c, Selection& out) const {
  auto& st = static_cast<LdState&>(*c.state);
  const int l = c.layer, Hkv = c.Hkv;
  SPADE_CHECK((c.shard.Hkv_all ? c.shard.Hkv_all : Hkv) == roles_.n_kv_heads && c.n_layers == roles_.n_layers,
              "lycheedecode: roles do not match the model");
  // Tensor parallelism: the rank's KV heads are the model's [kv0, kv0 + Hkv); roles and token
  // sets are indexed by the model's heads. A set flows to the same original head of the next
  // layer, so it stays on its rank unless the heads were reordered (appendix F).
  const int kv0 = c.shard.kv0;
  SPADE_CHECK(!c.shard.split() || roles_.identity_order(), "lycheedecode: reordered head roles "
              "move token sets between KV heads of different tensor-parallel ranks (use --tp 1 "
              "or roles in the model's head order)");
  const std::vector<int>& col = roles_.origin[size_t(l)];
  // This layer's selection: retrieval heads read everything, sparse heads their inherited set.
  bool dense = true;
  for (int i = 0; i < Hkv; ++i) {
    if (roles_.is_retrieval(l, kv0 + i)) continue;
    const size_t h = size_t(col[size_t(kv0 + i)]);
    SPADE_CHECK(st.step[h] == c.step && st.length[h] == c.L, "lycheedecode: layer ", l,
                " head ", i, " has no token set from this step");
    dense = dense && st.all[h];
  }
  if (dense) {
    out.set_dense(Hkv, c.L);
  } else {
    out.begin_per_head(Hkv, c.L);
    for (int i = 0; i < Hkv; ++i) {
      const size_t h = size_t(col[size_t(kv0 + i)]);
      if (roles_.is_retrieval(l, kv0 + i) || st.all[h]) {
        for (int64_t j = 0; j < c.L; ++j) out.push(int32_t(j));
      } else {
        for (int32_t p : st.set[h]) out.push(p);
      }
      out.close_head();
    }
  }
  // Retrieval heads select the sets of the same heads in the next layer.
  if (l + 1 >= c.n_layers) return;
  for (int i = 0; i < Hkv; ++i) {
    if (!roles_.is_retrieval(l, kv0 + i)) continue;
    const size_t h = size_t(col[size_t(kv0 + i)]);
    float* w = SelectScratch::ensure(c.scratch.f0, size_t(c.L));
    ld_group_weights(c, i, w);
    const int64_t n = ld_select(w, c.L, rule_, c.scratch, st.set[h]);
    st.all[h] = n == c.L;
    st.step[h] = c.step;
    st.length[h] = c.L;
  }
}

namespace {
// A roles value names a file unless it is "auto" (the shipped table) or an inline pattern.
bool roles_names_file(const std::string& v) {
  if (v == "auto" || v.empty()) return false;
  for (char c : v)
    if (c != 'R' && c != 'S' && c != 'r' && c != 's' && c != '/') return true;
  return false;
}
}  // namespace

std::vector<OptionSpec> lycheedecode_options() {
  using S = OptionSpec;
  std::vector<OptionSpec> v = {
      S{"roles", OptKind::String, "auto",
        "head roles: JSON file, inline R/S pattern 'RRR/SRS/...', or auto (configs/head_roles/ "
        "file trained for this model)"}
          .names_file(roles_names_file),
      S{"mode", OptKind::String, "topk", "topk | topp | threshold | ratio (paper section 4.4.1)"}
          .one_of({"topk", "topp", "threshold", "ratio"}),
      S{"budget", OptKind::Int, "4096",
        "topk: tokens per sparse head (paper K=4096; 1024/2048 also reported)"}
          .range(1, kMaxTokenCount),
      S{"p", OptKind::Float, "0.99", "topp: attention mass to reach (paper 0.99/0.995/0.999)"}
          .range(0, 1)
          .open_lo(),
      S{"tau", OptKind::Float, "1e-4", "threshold: minimum weight (paper 1e-4/1e-5/1e-6)"}
          .range(0, 1)
          .open_hi(),
      S{"ratio", OptKind::Float, "0.3",
        "ratio: kept fraction of L (0.3 = 70% sparsity, the training budget)"}
          .range(0, 1)
          .open_lo(),
      S{"block", OptKind::Int, "1",
        "selection unit in tokens: 1 = tokens, 64 = blocks (the paper's kernel)"}
          .range(1, kMaxTile),
  };
  for (OptionSpec& s : correction_options()) v.push_back(std::move(s));
  return v;
}

std::unique_ptr<SparseMethod> make_lycheedecode(const MethodOptions& o, const ModelConfig& cfg) {
  SPADE_CHECK(cfg.head_dim >= 1 && cfg.head_dim <= kLdMaxHeadDim, "lycheedecode: head_dim ",
              cfg.head_dim, " outside [1, ", kLdMaxHeadDim, "]");
  LdRule r;
  r.mode = LdRule::parse_mode(o.str("mode"));
  r.budget = o.integer("budget");
  r.p = o.number("p");
  r.tau = o.number("tau");
  r.ratio = o.number("ratio");
  r.block = int(o.integer("block"));
  return std::make_unique<LycheeDecodeMethod>(resolve_head_roles(o.str("roles"), cfg), r,
                                              correction_every_option(o) != 0,
                                              o.integer("correction_every"));
}


}  // namespace spade::sparse
