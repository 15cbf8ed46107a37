#include "sparse/methods/lessismore.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "sparse/methods/common.h"
#include "sparse/topk.h"

namespace spade::sparse {

LessIsMoreMethod::LessIsMoreMethod(int64_t budget, double recent_ratio, int sinks,
                                   LayerSchedule sched)
    : budget_(budget), ratio_(recent_ratio), sinks_(sinks), sched_(std::move(sched)) {
  SPADE_CHECK(recent_ratio >= 0 && recent_ratio <= 1, "lessismore: recent_ratio ", recent_ratio,
              " outside [0, 1]");
  SPADE_CHECK(sinks >= 0, "lessismore: sinks must be >= 0");
  n_recent_ = std::llround(double(budget) * recent_ratio);
  SPADE_CHECK(budget > 0 && budget - n_recent_ >= sinks, "lessismore: budget ", budget,
              " leaves ", budget - n_recent_, " tokens after the recency window, fewer than the ",
              sinks, " sinks");
}

std::string LessIsMoreMethod::describe() const {
  return cat("lessismore budget=", budget_, " recent_ratio=", ratio_, " (", n_recent_,
             " recent) sinks=", sinks_, " (", sched_.describe(), ")");
}

std::unique_ptr<MethodState> LessIsMoreMethod::new_state() const {
  return std::make_unique<ScheduledSet>();
}

void LessIsMoreMethod::select(StepContext& c, Selection& out) const {
  select_scheduled(sched_, budget_, "lessismore", c, out);
}

void LessIsMoreMethod::on_scores(StepContext& c, const Selection&, const float* scores) const {
  auto& st = static_cast<ScheduledSet&>(*c.state);
  const int64_t L = c.L;
  const int64_t hi = L - n_recent_;                    // candidates [sinks, hi)
  const int64_t n_uni = budget_ - n_recent_ - sinks_;  // merged tokens besides the sinks
  // 1. per query head top lists, rank order, stored [Hq][n_uni].
  int32_t* lists = SelectScratch::ensure(c.scratch.i1, size_t(std::max<int64_t>(1, c.Hq * n_uni)));
  int64_t k = 0;
  for (int hq = 0; hq < c.Hq; ++hq) {
    k = top_k_range(scores + int64_t(hq) * L, sinks_, int32_t(hi), n_uni, c.scratch.i0);
    std::copy_n(c.scratch.i0.begin(), k, lists + int64_t(hq) * n_uni);
  }
  // Tensor parallelism: the merge spans every query head of the model, so each rank's lists
  // travel to all ranks (each rank writes its heads' rows of a zeroed [Hq_all][n_uni] table,
  // the all-reduce sums one value and zeros per entry: exact), and every rank merges the same
  // lists in the same order, the one-rank set.
  int Hq = c.Hq;
  if (c.shard.split()) {
    SPADE_CHECK(L < (int64_t(1) << 24), "lessismore: a context of ", L, " tokens is too long to "
                "gather over tensor-parallel ranks (positions travel as floats, exact below 2^24)");
    Hq = c.shard.Hq_all;
    const size_t n = size_t(std::max<int64_t>(1, int64_t(Hq) * n_uni));
    float* g = SelectScratch::ensure(c.scratch.f1, n);
    std::fill_n(g, n, 0.f);
    for (int hq = 0; hq < c.Hq; ++hq)
      for (int64_t r = 0; r < k; ++r)
        g[int64_t(c.shard.q0 + hq) * n_uni + r] = float(lists[int64_t(hq) * n_uni + r]);
    c.shard.all_reduce_sum(g, int64_t(Hq) * n_uni);
    lists = SelectScratch::ensure(c.scratch.i1, n);
    for (size_t i = 0; i < n; ++i) lists[i] = int32_t(g[i]);
  }
  // 2. merge by (rank within head, head index), dropping duplicates.
  uint8_t* mark = SelectScratch::ensure(c.scratch.mark, size_t(L));
  std::fill_n(mark, L, uint8_t(0));
  int32_t* uni = SelectScratch::ensure(c.scratch.i2, size_t(std::max<int64_t>(1, n_uni)));
  int64_t count = 0;
  for (int64_t r = 0; r < k && count < n_uni; ++r)
    for (int hq = 0; hq < Hq && count < n_uni; ++hq) {
      const int32_t p = lists[int64_t(hq) * n_uni + r];
      if (!mark[p]) {
        mark[p] = 1;
        uni[count++] = p;
      }
    }
  std::sort(uni, uni + count);
  // 3. sinks + merged + recency window (disjoint ranges, so already sorted).
  st.set.begin_shared(c.Hkv, L);
  for (int32_t p = 0; p < sinks_; ++p) st.set.push(p);
  for (int64_t i = 0; i < count; ++i) st.set.push(uni[i]);
  for (int64_t p = hi; p < L; ++p) st.set.push(int32_t(p));
  st.set.close_head();
  st.step = c.step;
}

std::vector<OptionSpec> lessismore_options() {
  return {budget_option(),
          OptionSpec{"recent_ratio", OptKind::Float, "0.25",
                     "share r of the budget for the most recent tokens (LessIsMore: 0.25)"}
              .range(0, 1),
          OptionSpec{"sinks", OptKind::Int, "4",
                     "attention-sink tokens inside the budget (LessIsMore: 4)"}
              .range(0, kMaxTokenCount),
          dense_layers_option(), selection_layers_option()};
}

std::unique_ptr<SparseMethod> make_lessismore(const MethodOptions& o, const ModelConfig& cfg) {
  return std::make_unique<LessIsMoreMethod>(o.integer("budget"), o.number("recent_ratio"),
                                            int(o.integer("sinks")),
                                            LayerSchedule::from_options(o, cfg));
}

}  // namespace spade::sparse
