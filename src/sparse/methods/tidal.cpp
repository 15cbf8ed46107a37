#include "sparse/methods/tidal.h"

#include <algorithm>

#include "core/error.h"
#include "sparse/methods/common.h"
#include "sparse/topk.h"

namespace spade::sparse {

TidalMethod::TidalMethod(int64_t budget, LayerSchedule sched, int64_t correction_every)
    : budget_(budget), sched_(std::move(sched)), correction_every_(correction_every) {
  SPADE_CHECK(budget > 0, "tidal: budget must be positive");
  SPADE_CHECK(correction_every >= 0, "tidal: correction_every must be >= 0");
}

std::string TidalMethod::describe() const {
  return cat("tidal budget=", budget_, " (", sched_.describe(), ")",
             correction_every_ ? cat(" correction=every ", correction_every_) : std::string());
}

std::unique_ptr<MethodState> TidalMethod::new_state() const {
  return std::make_unique<ScheduledSet>();
}

void TidalMethod::select(StepContext& c, Selection& out) const {
  select_scheduled(sched_, budget_, "tidal", c, out);
}

void TidalMethod::on_scores(StepContext& c, const Selection&, const float* scores) const {
  auto& st = static_cast<ScheduledSet&>(*c.state);
  const int64_t L = c.L;
  float* avg = SelectScratch::ensure(c.scratch.f0, size_t(L));
  st.set.begin_per_head(c.Hkv, L);
  for (int h = 0; h < c.Hkv; ++h) {
    const float* s = scores + int64_t(h) * c.G * L;
    for (int64_t j = 0; j < L; ++j) avg[j] = s[j];
    for (int g = 1; g < c.G; ++g)
      for (int64_t j = 0; j < L; ++j) avg[j] += s[int64_t(g) * L + j];
    const float inv = 1.f / float(c.G);
    for (int64_t j = 0; j < L; ++j) avg[j] *= inv;
    const int64_t k = top_k_range(avg, 0, int32_t(L), budget_, c.scratch.i0);
    std::sort(c.scratch.i0.begin(), c.scratch.i0.begin() + k);
    for (int64_t j = 0; j < k; ++j) st.set.push(c.scratch.i0[size_t(j)]);
    st.set.close_head();
  }
  st.step = c.step;
}

std::vector<OptionSpec> tidal_options() {
  std::vector<OptionSpec> v = {budget_option(), dense_layers_option(), selection_layers_option()};
  for (OptionSpec& s : correction_options()) v.push_back(std::move(s));
  return v;
}

std::unique_ptr<SparseMethod> make_tidal(const MethodOptions& o, const ModelConfig& cfg) {
  return std::make_unique<TidalMethod>(o.integer("budget"), LayerSchedule::from_options(o, cfg),
                                       correction_every_option(o));
}

}  // namespace spade::sparse
