// lessismore (LessIsMore, Algorithm 1 of papers/lessismore.md) on the TidalDecode backbone
// (same dense and selection layers). At a selection layer (full attention) with budget K,
// recency ratio r and s sink tokens:
//   n_recent = round(K*r); the unified part has K - n_recent tokens, the s sinks included
//   (the paper's "4 tokens reserved for attention sink").
//   1. each query head ranks positions [s, L - n_recent) by its own score q.k/sqrt(D)
//      (ties: lower position) and keeps its top K - n_recent - s;
//   2. the per-head lists merge into one ranking by each token's rank within its head
//      (ties: lower head index), duplicates dropped, cut to K - n_recent - s tokens;
//   3. set = sinks [0, s) + the merged tokens + the most recent n_recent positions.
// The one set (a Shared selection, stored once) is read by every head of every following
// layer until the next selection layer. K >= L: every token (full attention).
#pragma once
#include <memory>
#include <vector>

#include "model/config.h"
#include "sparse/layer_schedule.h"
#include "sparse/method.h"
#include "sparse/options.h"

namespace spade::sparse {

class LessIsMoreMethod final : public SparseMethod {
 public:
  LessIsMoreMethod(int64_t budget, double recent_ratio, int sinks, LayerSchedule sched);
  std::string name() const override { return "lessismore"; }
  std::string describe() const override;
  std::unique_ptr<MethodState> new_state() const override;
  void select(StepContext& ctx, Selection& out) const override;
  void on_scores(StepContext& ctx, const Selection& sel, const float* scores) const override;
  int64_t n_recent() const { return n_recent_; }

 private:
  int64_t budget_;
  double ratio_;
  int sinks_;
  int64_t n_recent_;
  LayerSchedule sched_;
};

std::vector<OptionSpec> lessismore_options();
std::unique_ptr<SparseMethod> make_lessismore(const MethodOptions& o, const ModelConfig& cfg);

}  // namespace spade::sparse
