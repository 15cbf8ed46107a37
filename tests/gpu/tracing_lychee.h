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

// LycheeDecodeMethod with a selection rule other than topk on tokens (mode ratio / topp /
// threshold, or any block size > 1; issue 37 item 6): at every (step, layer with retrieval
// heads, request, retrieval head) the GPU's next-layer set against the CPU's, unit by unit
// (units of `block` tokens; a set must hold whole units), up to the rule's near-ties on the
// unit weights (err = the row's largest |GPU - CPU| unit weight; GPU weights: the softmax of
// the GPU's traced scores):
//   topk, ratio  the same number of units, a differing unit within 2 err of the k-th
//                largest (differ_by_near_ties);
//   topp         top-p near-ties at p (MassRanks, gpu_model_util.h);
//   threshold    a differing unit within 2 err of tau or of the heaviest unit (the set of
//                one when no unit is above tau).
// Near-tie sets replace the CPU's (teacher-forced) so that one does not cascade.
class TracingLycheeRule final : public sparse::SparseMethod, public TracedSets {
 public:
  explicit TracingLycheeRule(std::shared_ptr<const sparse::SparseMethod> inner)
      : inner_(std::move(inner)), ld_(static_cast<const sparse::LycheeDecodeMethod&>(*inner_)) {}
  std::string name() const override { return "lycheedecode"; }
  std::string describe() const override { return inner_->describe(); }
  std::unique_ptr<sparse::MethodState> new_state() const override { return inner_->new_state(); }
  void select(sparse::StepContext& c, sparse::Selection& out) const override {
    inner_->select(c, out);
    if (!gpu || c.layer + 1 >= c.n_layers) return;
    auto& st = static_cast<sparse::LdState&>(*c.state);
    const sparse::LdRule& rule = ld_.rule();
    const int r = req_of.at(c.pt);
    const int64_t L = c.L, Bk = std::max(1, rule.block), U = (L + Bk - 1) / Bk;
    for (int h = 0; h < c.Hkv; ++h) {
      if (!ld_.roles().is_retrieval(c.layer, h)) continue;
      ASSERT_GT(gpu->sel.size(), size_t(c.layer)) << "GPU sets missing, layer " << c.layer;
      const auto& g_h = gpu->sel[size_t(c.layer)].at(size_t(r * c.Hkv + h));
      const auto& gs = gpu->scores.at(size_t(c.layer)).at(size_t(r * c.Hkv + h));
      ++rows;
      std::vector<int32_t> cs = st.all[size_t(h)] ? std::vector<int32_t>() : st.set[size_t(h)];
      if (st.all[size_t(h)])
        for (int32_t j = 0; j < L; ++j) cs.push_back(j);
      if (cs == g_h) {
        ++identical;
        continue;
      }
      // Unit weights, the CPU's and the GPU's.
      std::vector<float> w(static_cast<size_t>(L));
      sparse::ld_group_weights(c, h, w.data());
      ASSERT_EQ(int64_t(gs.size()), L);
      const float mx = *std::max_element(gs.begin(), gs.end());
      std::vector<double> e(static_cast<size_t>(L));
      double sum = 0;
      for (int64_t j = 0; j < L; ++j) sum += (e[size_t(j)] = std::exp(double(gs[size_t(j)]) - mx));
      std::vector<float> cu(static_cast<size_t>(U)), gu(static_cast<size_t>(U));
      float err = 0;
      for (int64_t i = 0; i < U; ++i) {
        double a = 0, b = 0;
        for (int64_t j = i * Bk; j < std::min(L, (i + 1) * Bk); ++j) a += w[size_t(j)], b += e[size_t(j)] / sum;
        cu[size_t(i)] = float(a), gu[size_t(i)] = float(b);
        err = std::max(err, std::fabs(cu[size_t(i)] - gu[size_t(i)]));
      }
      max_err = std::max(max_err, double(err));
      // The sets as units (whole units only).
      auto units = [&](const std::vector<int32_t>& t, std::vector<int32_t>& u) {
        u.clear();
        for (int32_t x : t)
          if (u.empty() || u.back() != x / Bk) u.push_back(int32_t(x / Bk));
        int64_t n = 0;
        for (int32_t x : u) n += std::min(L, (x + 1) * Bk) - x * Bk;
        return n == int64_t(t.size()) && std::is_sorted(t.begin(), t.end());
      };
      std::vector<int32_t> gun, cun;
      const bool whole = units(g_h, gun) && units(cs, cun);
      EXPECT_TRUE(whole) << "layer " << c.layer << " request " << r << " head " << h
                         << ": a set that is not whole units";
      double frac = 0, dummy = 0;
      bool tie = whole;
      if (tie && (rule.mode == sparse::LdMode::TopK || rule.mode == sparse::LdMode::Ratio)) {
        tie = gun.size() == cun.size() &&
              differ_by_near_ties(gun, cun, cu, int64_t(cun.size()), err, &frac);
      } else if (tie && rule.mode == sparse::LdMode::TopP) {
        tie = topp_sets_near_ties(gun, cun, {{&cu, &gu}}, rule.p, &frac, &dummy);
      } else if (tie) {
        std::vector<int32_t> diff;
        std::set_symmetric_difference(gun.begin(), gun.end(), cun.begin(), cun.end(),
                                      std::back_inserter(diff));
        frac = double(diff.size()) / 2.0 / double(std::max<size_t>(1, cun.size()));
        const float best = *std::max_element(cu.begin(), cu.end());
        for (int32_t x : diff)
          tie = tie && x >= 0 && x < U &&
                (std::fabs(double(cu[size_t(x)]) - rule.tau) <= 2.0 * err ||
                 std::fabs(cu[size_t(x)] - best) <= 2.f * err);
      }
      max_diff_frac = std::max(max_diff_frac, frac);
      {
        std::vector<int32_t> d;
        std::set_symmetric_difference(gun.begin(), gun.end(), cun.begin(), cun.end(),
                                      std::back_inserter(d));
        max_diff_units = std::max(max_diff_units, int(d.size() + 1) / 2);
      }
      if (!tie) {
        ++bad;
        ADD_FAILURE() << "step " << c.step << " layer " << c.layer << " request " << r << " head "
                      << h << ": sets differ beyond a near-tie (" << rule.describe() << ")";
        continue;
      }
      ++near_tie;
      st.set[size_t(h)] = g_h;  // teacher-forced: the GPU's set
      st.all[size_t(h)] = int64_t(g_h.size()) == L;
    }
  }
  // The most units a near-tie swapped in one set (sets of a few 64-token blocks swap a large
  // fraction with one unit).
  mutable int max_diff_units = 0;

 private:
  std::shared_ptr<const sparse::SparseMethod> inner_;
  const sparse::LycheeDecodeMethod& ld_;
};

}  // namespace spade::test
