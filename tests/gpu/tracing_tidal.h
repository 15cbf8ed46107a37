// Test helper: a TidalMethod whose selection of every (step, selection layer, request, KV
// head) is compared with the sets the GPU model traced (CudaModel::QuestTrace::sel, scores) and
// replaced by them up to near-ties (test_cuda_tidal.cpp's header states the rule), so that a
// near-tie does not cascade. Also the base of the Twilight model test's traced stack over
// tidal (test_cuda_twilight_model.cpp).
#pragma once
#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "gpu_model_util.h"
#include "model/cuda_model.h"
#include "sparse/layer_schedule.h"
#include "sparse/methods/tidal.h"

namespace spade::test {

// TidalMethod that compares every selection with the GPU's (and adopts it up to near-ties).
class TracingTidal final : public sparse::SparseMethod {
 public:
  TracingTidal(int64_t budget, sparse::LayerSchedule s) : budget_(budget), inner_(budget, s) {}
  std::string name() const override { return "tidal"; }
  std::string describe() const override { return inner_.describe(); }
  std::unique_ptr<sparse::MethodState> new_state() const override { return inner_.new_state(); }
  void select(sparse::StepContext& c, sparse::Selection& out) const override {
    inner_.select(c, out);
  }
  void on_scores(sparse::StepContext& c, const sparse::Selection& sel,
                 const float* scores) const override {
    inner_.on_scores(c, sel, scores);
    if (!gpu) return;
    auto& st = static_cast<sparse::ScheduledSet&>(*c.state);
    const int r = req_of.at(c.pt);
    ASSERT_GT(gpu->sel.size(), size_t(c.layer)) << "GPU selection missing, layer " << c.layer;
    const auto& gl = gpu->sel[size_t(c.layer)];
    const int64_t L = c.L, k = std::min<int64_t>(budget_, L);
    bool all_tie = true;
    for (int h = 0; h < c.Hkv; ++h) {
      std::vector<float> avg(size_t(L), 0.f);
      for (int g = 0; g < c.G; ++g)
        for (int64_t j = 0; j < L; ++j) avg[size_t(j)] += scores[(int64_t(h) * c.G + g) * L + j];
      for (auto& x : avg) x /= float(c.G);
      std::set<int32_t> cs(st.set.head(h), st.set.head(h) + st.set.count(h));
      const auto& g_h = gl.at(size_t(r * c.Hkv + h));
      std::set<int32_t> g(g_h.begin(), g_h.end());
      ++rows;
      EXPECT_EQ(int64_t(g_h.size()), k) << "layer " << c.layer << " request " << r;
      if (g == cs) {
        ++identical;
        continue;
      }
      const auto& gs = gpu->scores.at(size_t(c.layer)).at(size_t(r * c.Hkv + h));
      EXPECT_EQ(int64_t(gs.size()), L);
      float err = 0;
      for (int64_t j = 0; j < std::min<int64_t>(L, int64_t(gs.size())); ++j)
        err = std::max(err, std::fabs(gs[size_t(j)] - avg[size_t(j)]));
      max_err = std::max(max_err, double(err));
      float mx = 0;
      for (float x : avg) mx = std::max(mx, std::fabs(x));
      max_rel_err = std::max(max_rel_err, double(err) / std::max(1e-30, double(mx)));
      double frac = 0;
      const bool tie = differ_by_near_ties(g_h, std::vector<int32_t>(cs.begin(), cs.end()), avg, k,
                                           err, &frac);
      max_diff_frac = std::max(max_diff_frac, frac);
      if (tie) {
        ++near_tie;
      } else {
        ++bad;
        all_tie = false;
        ADD_FAILURE() << "step " << c.step << " layer " << c.layer << " request " << r << " head "
                      << h << ": selections differ beyond a near-tie";
      }
    }
    if (!all_tie) return;
    st.set.begin_per_head(c.Hkv, L);  // teacher-forced selection: the GPU's sets
    for (int h = 0; h < c.Hkv; ++h) {
      for (int32_t t : gl[size_t(r * c.Hkv + h)]) st.set.push(t);
      st.set.close_head();
    }
  }
  const CudaModel::QuestTrace* gpu = nullptr;
  std::map<const PageTable*, int> req_of;
  mutable int rows = 0, identical = 0, near_tie = 0, bad = 0;
  mutable double max_err = 0;        // largest |GPU - CPU| group-mean score seen
  mutable double max_rel_err = 0;    // ... relative to its row's largest |score|
  mutable double max_diff_frac = 0;  // largest share of a set swapped by near-ties

 private:
  int64_t budget_;
  sparse::TidalMethod inner_;
};

}  // namespace spade::test
