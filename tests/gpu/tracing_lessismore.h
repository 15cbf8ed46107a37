// Test helper: a LessIsMoreMethod run, at every (step, selection layer, request), on the GPU
// model's traced per-head scores (CudaModel::QuestTrace::scores), whose set must equal the
// GPU's traced list (test_cuda_lessismore.cpp's header states the rule); the CPU then
// attends over it. Also the base of the Twilight model test's traced stack over lessismore
// (test_cuda_twilight_model.cpp).
#pragma once
#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "gpu_model_util.h"
#include "model/cuda_model.h"
#include "sparse/layer_schedule.h"
#include "sparse/methods/lessismore.h"

namespace spade::test {

// LessIsMoreMethod run on the GPU's per-head scores of each selection layer (trace): its set
// must equal the GPU's list, and the CPU attends over it.
class TracingLessIsMore final : public sparse::SparseMethod {
 public:
  explicit TracingLessIsMore(std::shared_ptr<const sparse::SparseMethod> inner)
      : inner_(std::move(inner)) {}
  std::string name() const override { return "lessismore"; }
  std::string describe() const override { return inner_->describe(); }
  std::unique_ptr<sparse::MethodState> new_state() const override { return inner_->new_state(); }
  void select(sparse::StepContext& c, sparse::Selection& out) const override {
    inner_->select(c, out);
  }
  void on_scores(sparse::StepContext& c, const sparse::Selection& sel,
                 const float* scores) const override {
    if (!gpu) return inner_->on_scores(c, sel, scores);
    const int r = req_of.at(c.pt);
    const int64_t L = c.L;
    ASSERT_GT(gpu->scores.size(), size_t(c.layer)) << "GPU scores missing, layer " << c.layer;
    std::vector<float> gs(size_t(c.Hq) * size_t(L));
    for (int h = 0; h < c.Hq; ++h) {
      const auto& row = gpu->scores[size_t(c.layer)].at(size_t(r * c.Hq + h));
      ASSERT_EQ(int64_t(row.size()), L);
      float err = 0, mx = 0;
      for (int64_t j = 0; j < L; ++j) {
        err = std::max(err, std::fabs(row[size_t(j)] - scores[int64_t(h) * L + j]));
        mx = std::max(mx, std::fabs(scores[int64_t(h) * L + j]));
      }
      max_rel_err = std::max(max_rel_err, double(err) / std::max(1e-30, double(mx)));
      std::copy(row.begin(), row.end(), gs.begin() + int64_t(h) * L);
    }
    inner_->on_scores(c, sel, gs.data());  // the CPU method on the GPU's scores
    auto& st = static_cast<sparse::ScheduledSet&>(*c.state);
    const std::vector<int32_t> cs(st.set.head(0), st.set.head(0) + st.set.count(0));
    const auto& g = gpu->sel.at(size_t(c.layer)).at(size_t(r));
    ++sets;
    if (cs == g) ++identical;
    else ADD_FAILURE() << "step " << c.step << " layer " << c.layer << " request " << r
                       << ": GPU list differs from the CPU method on the same scores";
  }
  const CudaModel::QuestTrace* gpu = nullptr;
  std::map<const PageTable*, int> req_of;
  mutable int sets = 0, identical = 0;
  mutable double max_rel_err = 0;

 private:
  std::shared_ptr<const sparse::SparseMethod> inner_;
};

}  // namespace spade::test
