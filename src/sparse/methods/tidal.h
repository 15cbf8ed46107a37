// tidal (TidalDecode, Yang et al. 2024). Layers below dense_layers attend fully. A token
// selection layer attends fully and, from its scores, takes per KV head the top-`budget`
// positions ranked by the group-averaged score (mean over the G query heads of
// q.k/sqrt(D); ties: lower position); every following layer reads that per-head set until
// the next selection layer re-selects. Defaults (dense 0-1, select at 2 and a per-model
// re-selection layer) come from model_defaults.h. Cache correction (the paper's option):
// correction=1,correction_every=N (SparseMethod::correction_every).
#pragma once
#include <memory>
#include <vector>

#include "model/config.h"
#include "sparse/layer_schedule.h"
#include "sparse/method.h"
#include "sparse/options.h"

namespace spade::sparse {

class TidalMethod final : public SparseMethod {
 public:
  TidalMethod(int64_t budget, LayerSchedule sched, int64_t correction_every = 0);
  std::string name() const override { return "tidal"; }
  std::string describe() const override;
  std::unique_ptr<MethodState> new_state() const override;
  void select(StepContext& ctx, Selection& out) const override;
  void on_scores(StepContext& ctx, const Selection& sel, const float* scores) const override;
  const LayerSchedule& schedule() const { return sched_; }
  int64_t correction_every() const override { return correction_every_; }

 private:
  int64_t budget_;
  LayerSchedule sched_;
  int64_t correction_every_;
};

std::vector<OptionSpec> tidal_options();
std::unique_ptr<SparseMethod> make_tidal(const MethodOptions& o, const ModelConfig& cfg);

}  // namespace spade::sparse
