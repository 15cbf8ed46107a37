#include "sparse/methods/oracle.h"

#include <algorithm>

#include "core/error.h"
#include "sparse/methods/common.h"
#include "sparse/topk.h"

namespace spade::sparse {

OracleTopKMethod::OracleTopKMethod(int64_t budget, int dense_layers)
    : budget_(budget), dense_layers_(dense_layers) {
  SPADE_CHECK(budget > 0, "oracle-topk: budget must be positive");
}

std::string OracleTopKMethod::describe() const {
  return cat("oracle-topk budget=", budget_, " dense_layers=", dense_layers_);
}

void OracleTopKMethod::select(StepContext& c, Selection& out) const {
  if (c.layer < dense_layers_ || budget_ >= c.L) {
    out.set_dense(c.Hkv, c.L);
    return;
  }
  const int64_t L = c.L;
  const float* w = c.full_weights();
  float* W = SelectScratch::ensure(c.scratch.f0, size_t(L));
  out.begin_per_head(c.Hkv, L);
  for (int h = 0; h < c.Hkv; ++h) {
    const float* wh = w + int64_t(h) * c.G * L;
    std::copy_n(wh, L, W);
    for (int g = 1; g < c.G; ++g)
      for (int64_t j = 0; j < L; ++j) W[j] += wh[int64_t(g) * L + j];
    const int64_t k = top_k_range(W, 0, int32_t(L), budget_, c.scratch.i0);
    std::sort(c.scratch.i0.begin(), c.scratch.i0.begin() + k);
    for (int64_t j = 0; j < k; ++j) out.push(c.scratch.i0[size_t(j)]);
    out.close_head();
  }
}

OracleTopPMethod::OracleTopPMethod(double p, bool union_group, int dense_layers)
    : p_(p), union_(union_group), dense_layers_(dense_layers) {
  SPADE_CHECK(p > 0 && p <= 1, "oracle-topp: p ", p, " outside (0, 1]");
}

std::string OracleTopPMethod::describe() const {
  return cat("oracle-topp p=", p_, " group=", union_ ? "union" : "mean",
             " dense_layers=", dense_layers_);
}

void OracleTopPMethod::select(StepContext& c, Selection& out) const {
  if (c.layer < dense_layers_) {
    out.set_dense(c.Hkv, c.L);
    return;
  }
  const int64_t L = c.L;
  const float* w = c.full_weights();
  float* W = SelectScratch::ensure(c.scratch.f0, size_t(L));
  uint8_t* mark = SelectScratch::ensure(c.scratch.mark, size_t(L));
  // Marks the smallest best-first prefix of `s` whose mass reaches `target`.
  auto take = [&](const float* s, double target) {
    const int64_t n = top_k_range(s, 0, int32_t(L), L, c.scratch.i0);
    double acc = 0;
    for (int64_t j = 0; j < n; ++j) {
      const int32_t p = c.scratch.i0[size_t(j)];
      mark[p] = 1;
      acc += s[p];
      if (acc >= target) break;
    }
  };
  out.begin_per_head(c.Hkv, L);
  for (int h = 0; h < c.Hkv; ++h) {
    std::fill_n(mark, L, uint8_t(0));
    const float* wh = w + int64_t(h) * c.G * L;
    if (union_) {
      for (int g = 0; g < c.G; ++g) take(wh + int64_t(g) * L, p_);
    } else {
      std::copy_n(wh, L, W);
      for (int g = 1; g < c.G; ++g)
        for (int64_t j = 0; j < L; ++j) W[j] += wh[int64_t(g) * L + j];
      take(W, p_ * c.G);
    }
    for (int64_t j = 0; j < L; ++j)
      if (mark[j]) out.push(int32_t(j));
    out.close_head();
  }
}

std::vector<OptionSpec> oracle_topk_options() {
  return {budget_option(), dense_layers_count("0", "leading full-attention layers (oracle: 0)")};
}

std::unique_ptr<SparseMethod> make_oracle_topk(const MethodOptions& o, const ModelConfig&) {
  return std::make_unique<OracleTopKMethod>(o.integer("budget"), int(o.integer("dense_layers")));
}

std::vector<OptionSpec> oracle_topp_options() {
  return {OptionSpec{"p", OptKind::Float, "0.95",
                     "attention mass each query head keeps (0.95: Twilight's Llama-3 threshold)"}
              .range(0, 1)
              .open_lo(),
          OptionSpec{"group", OptKind::String, "union",
                     "GQA: union of the query heads' sets (each reaches p) or mean (group mean "
                     "reaches p)"}
              .one_of({"union", "mean"}),
          dense_layers_count("0", "leading full-attention layers (oracle: 0)")};
}

std::unique_ptr<SparseMethod> make_oracle_topp(const MethodOptions& o, const ModelConfig&) {
  return std::make_unique<OracleTopPMethod>(o.number("p"), o.str("group") == "union",
                                            int(o.integer("dense_layers")));
}

}  // namespace spade::sparse
