// Test helper: a LycheeDecodeMethod whose next-layer sets are compared, at every (step, layer
// with retrieval heads, request, retrieval head), with the sets the GPU model traced
// (CudaModel::QuestTrace), and replaced by them up to near-ties (test_cuda_lycheedecode.cpp's
// header states the rule), so that a near-tie does not cascade through the layers.
#pragma once
#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "gpu_model_util.h"
#include "model/cuda_model.h"
#include "sparse/methods/lycheedecode.h"

namespace spade::test {

// LycheeDecodeMethod whose next-layer sets are compared with the GPU's (and replaced by them
// up to near-ties).
class TracingLychee final : public sparse::SparseMethod, public TracedSets {
 public:
  explicit TracingLychee(std::shared_ptr<const sparse::SparseMethod> inner)
      : inner_(std::move(inner)), ld_(static_cast<const sparse::LycheeDecodeMethod&>(*inner_)) {}
  std::string name() const override { return "lycheedecode"; }
  std::string describe() const override { return inner_->describe(); }
  std::unique_ptr<sparse::MethodState> new_state() const override { return inner_->new_state(); }
  void select(sparse::StepContext& c, sparse::Selection& out) const override {
    inner_->select(c, out);
    if (!gpu || c.layer + 1 >= c.n_layers) return;
    auto& st = static_cast<sparse::LdState&>(*c.state);
    const int r = req_of.at(c.pt);
    const int64_t L = c.L, k = std::min<int64_t>(ld_.rule().budget, L);
    for (int h = 0; h < c.Hkv; ++h) {
      if (!ld_.roles().is_retrieval(c.layer, h)) continue;
      ASSERT_GT(gpu->sel.size(), size_t(c.layer)) << "GPU sets missing, layer " << c.layer;
      const auto& g_h = gpu->sel[size_t(c.layer)].at(size_t(r * c.Hkv + h));
      const auto& gs = gpu->scores.at(size_t(c.layer)).at(size_t(r * c.Hkv + h));
      ++rows;
      EXPECT_EQ(int64_t(g_h.size()), k) << "layer " << c.layer << " request " << r;
      std::vector<int32_t> cs = st.all[size_t(h)] ? std::vector<int32_t>() : st.set[size_t(h)];
      if (st.all[size_t(h)])
        for (int32_t j = 0; j < L; ++j) cs.push_back(j);
      if (cs == g_h) {
        ++identical;
        continue;
      }
      std::vector<float> w(static_cast<size_t>(L)), wg(static_cast<size_t>(L));
      sparse::ld_group_weights(c, h, w.data());
      ASSERT_EQ(int64_t(gs.size()), L);
      const float mx = *std::max_element(gs.begin(), gs.end());
      double sum = 0;
      for (int64_t j = 0; j < L; ++j) sum += (wg[size_t(j)] = std::exp(gs[size_t(j)] - mx));
      float err = 0;
      for (int64_t j = 0; j < L; ++j)
        err = std::max(err, std::fabs(float(wg[size_t(j)] / sum) - w[size_t(j)]));
      max_err = std::max(max_err, double(err));
      double frac = 0;
      const bool tie = differ_by_near_ties(g_h, cs, w, k, err, &frac);
      max_diff_frac = std::max(max_diff_frac, frac);
      if (!tie) {
        ++bad;
        ADD_FAILURE() << "step " << c.step << " layer " << c.layer << " request " << r << " head "
                      << h << ": sets differ beyond a near-tie";
        continue;
      }
      ++near_tie;
      st.set[size_t(h)] = g_h;  // teacher-forced: the GPU's set
      st.all[size_t(h)] = int64_t(g_h.size()) == L;
    }
  }

 private:
  std::shared_ptr<const sparse::SparseMethod> inner_;
  const sparse::LycheeDecodeMethod& ld_;
};

}  // namespace spade::test
