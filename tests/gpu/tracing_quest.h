// Test helper: a QuestMethod whose selection of every (step, sparse layer, request, KV head)
// is compared with the pages the GPU model traced (CudaModel::QuestTrace::sel) and replaced by
// them up to near-ties (test_cuda_sparse_model.cpp's header states the rule), so that a
// near-tie does not cascade. Also the base of the Twilight model test's traced stack.
#pragma once
#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "gpu_model_util.h"
#include "model/cuda_model.h"
#include "sparse/methods/quest.h"

namespace spade::test {

// QuestMethod (group max, page 16) that also keeps the CPU page scores of each (request,
// layer, head) of the current step for the near-tie rule.
class TracingQuest final : public sparse::SparseMethod {
 public:
  TracingQuest(int64_t budget, int dense_layers)
      : budget_(budget), inner_(budget, 16, dense_layers, sparse::QuestMethod::Group::Max) {}
  std::string name() const override { return "quest"; }
  std::string describe() const override { return inner_.describe(); }
  void select(sparse::StepContext& c, sparse::Selection& out) const override {
    const int64_t np = (c.L + 15) / 16;
    auto& rw = scores[c.pt][c.layer];
    rw.assign(size_t(c.Hkv), {});
    for (int h = 0; h < c.Hkv; ++h)
      for (int64_t i = 0; i + 1 < np; ++i) {
        const int32_t pg = c.pt->pages[size_t(i)];
        float m = -INFINITY;
        for (int g = 0; g < c.G; ++g)
          m = std::max(m, sparse::quest_page_bound(c.q + (int64_t(h) * c.G + g) * c.D,
                                                   c.kv->page_kmin(c.layer, pg, h),
                                                   c.kv->page_kmax(c.layer, pg, h), c.D));
        rw[size_t(h)].push_back(m);
      }
    inner_.select(c, out);
    if (out.dense() || !gpu) return;
    const int r = req_of.at(c.pt);
    const int k_pages = int(budget_ / 16);
    ASSERT_GT(gpu->sel.size(), size_t(c.layer)) << "GPU selection missing, layer " << c.layer;
    const auto& gl = gpu->sel[size_t(c.layer)];
    bool all_tie = true;
    for (int h = 0; h < c.Hkv; ++h) {
      std::set<int32_t> cs;
      for (int64_t j = 0; j < out.count(h); ++j) cs.insert(out.head(h)[j] / 16);
      const auto& g_h = gl.at(size_t(r * c.Hkv + h));
      std::set<int32_t> g(g_h.begin(), g_h.end());
      ++rows;
      EXPECT_EQ(int64_t(g_h.size()), k_pages) << "layer " << c.layer << " request " << r;
      if (g == cs) {
        ++identical;
        continue;
      }
      const std::vector<float>& sc = rows_of(c)[size_t(h)];
      std::vector<float> sorted(sc);
      std::sort(sorted.begin(), sorted.end(), std::greater<float>());
      const float kth = sorted[size_t(k_pages - 2)];
      float mx = 0;
      for (float x : sc) mx = std::max(mx, std::fabs(x));
      std::vector<int32_t> diff;
      std::set_symmetric_difference(g.begin(), g.end(), cs.begin(), cs.end(),
                                    std::back_inserter(diff));
      bool tie = true;
      for (int32_t p : diff)
        if (p >= int32_t(sc.size()) || std::fabs(sc[size_t(p)] - kth) > kTie * mx) tie = false;
      if (tie) {
        ++near_tie;
      } else {
        ++bad;
        all_tie = false;
        ADD_FAILURE() << "step " << c.step << " layer " << c.layer << " request " << r
                      << " head " << h << ": selections differ beyond a near-tie";
      }
    }
    if (!all_tie) return;
    // Teacher-forced selection: the GPU's pages (equal to the CPU's up to near-ties).
    out.begin_per_head(c.Hkv, c.L);
    for (int h = 0; h < c.Hkv; ++h) {
      for (int32_t p : gl[size_t(r * c.Hkv + h)])
        for (int64_t t = int64_t(p) * 16; t < std::min<int64_t>(int64_t(p) * 16 + 16, c.L); ++t)
          out.push(int32_t(t));
      out.close_head();
    }
  }
  static constexpr float kTie = 2e-2f;
  const CudaModel::QuestTrace* gpu = nullptr;
  std::map<const PageTable*, int> req_of;
  mutable int rows = 0, identical = 0, near_tie = 0, bad = 0;
  mutable std::map<const PageTable*, std::map<int, std::vector<std::vector<float>>>> scores;

 private:
  const std::vector<std::vector<float>>& rows_of(const sparse::StepContext& c) const {
    return scores[c.pt][c.layer];
  }
  int64_t budget_;
  sparse::QuestMethod inner_;
};

}  // namespace spade::test
