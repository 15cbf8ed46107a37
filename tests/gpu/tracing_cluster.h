// Test helpers of the GPU LycheeCluster model tests: token text for structure-aware chunks, and
// a LycheeClusterMethod whose lists of every (step, sparse layer, request, KV head) are checked
// against the lists the GPU model traced (CudaModel::QuestTrace::sel; the exact and statistical
// rules of test_cuda_lycheecluster_model.cpp's header) and replaced by them (teacher-forced
// selection). Also the base of the Twilight model test's traced stack over lycheecluster
// (test_cuda_twilight_model.cpp).
#pragma once
#include <algorithm>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "gpu_model_util.h"
#include "model/cuda_model.h"
#include "sparse/methods/lycheecluster.h"

namespace spade::test {

// Token text with delimiters of every level, so structure-aware chunks vary in length.
inline std::string cluster_text_piece(int32_t id) {
  switch (id % 11) {
    case 0: return ".";
    case 1: return ",";
    case 2: return id % 3 ? "\n" : "\n\n";
    case 3: return "}";
    default: return " w" + std::to_string(id);
  }
}

class TracingCluster final : public sparse::SparseMethod {
 public:
  explicit TracingCluster(std::shared_ptr<const sparse::SparseMethod> inner)
      : inner_(std::move(inner)),
        p_(static_cast<const sparse::LycheeClusterMethod&>(*inner_).params()) {}
  std::string name() const override { return "lycheecluster"; }
  std::string describe() const override { return inner_->describe(); }
  std::unique_ptr<sparse::MethodState> new_state() const override { return inner_->new_state(); }
  void select(sparse::StepContext& c, sparse::Selection& out) const override {
    inner_->select(c, out);
    if (!gpu || c.layer < p_.dense_layers) return;
    const int r = req_of.at(c.pt);
    const int64_t L = c.L;
    ASSERT_GT(gpu->sel.size(), size_t(c.layer)) << "GPU lists missing, layer " << c.layer;
    const auto& layer = gpu->sel[size_t(c.layer)];
    std::vector<std::vector<int32_t>> g(size_t(c.Hkv));
    for (int h = 0; h < c.Hkv; ++h) g[size_t(h)] = layer.at(size_t(r * c.Hkv + h));
    if (out.dense()) {
      for (int h = 0; h < c.Hkv; ++h) {
        ++dense_rows;
        ASSERT_EQ(int64_t(g[size_t(h)].size()), L) << "dense list, layer " << c.layer;
        for (int64_t j = 0; j < L; ++j) ASSERT_EQ(g[size_t(h)][size_t(j)], j);
      }
      return;
    }
    const auto* st = sparse::lycheecluster_state(c.state);
    ASSERT_TRUE(st);
    const auto& starts = st->chunk_starts();
    const int32_t have = st->indexed_chunks(c.layer);
    const int64_t sink = std::min<int64_t>(p_.sink, L);
    const int64_t rb = std::max<int64_t>(have > 0 ? starts[size_t(have)] : sink, sink);
    for (int h = 0; h < c.Hkv; ++h) {
      ++rows;
      const std::vector<int32_t>& gl = g[size_t(h)];
      const std::vector<int32_t> cl(out.head(h), out.head(h) + out.count(h));
      identical += gl == cl;
      // Sink prefix and tail suffix exactly the CPU's.
      ASSERT_GE(int64_t(gl.size()), sink + (L - rb)) << "layer " << c.layer << " head " << h;
      for (int64_t j = 0; j < sink; ++j) ASSERT_EQ(gl[size_t(j)], j);
      const size_t tail0 = gl.size() - size_t(L - rb);
      for (int64_t j = rb; j < L; ++j) ASSERT_EQ(gl[tail0 + size_t(j - rb)], j) << "tail";
      // Middle: whole CPU chunks, within the budget.
      std::set<int32_t> gm(gl.begin() + sink, gl.begin() + long(tail0));
      const size_t ctail0 = cl.size() - size_t(L - rb);
      std::set<int32_t> cm(cl.begin() + sink, cl.begin() + long(ctail0));
      for (int32_t t : gm) {
        const auto it = std::upper_bound(starts.begin(), starts.begin() + have + 1, t);
        ASSERT_TRUE(it != starts.begin() && it != starts.begin() + have + 1) << "token " << t;
        const int32_t ch = int32_t(it - starts.begin()) - 1;
        for (int32_t u = starts[size_t(ch)]; u < starts[size_t(ch) + 1]; ++u)
          ASSERT_TRUE(gm.count(u)) << "chunk " << ch << " taken in part";
      }
      if (!p_.budget_total) {
        EXPECT_LE(int64_t(gm.size()), p_.budget);
      }
      size_t inter = 0;
      for (int32_t t : gm) inter += cm.count(t);
      const size_t uni = gm.size() + cm.size() - inter;
      jaccard_sum += uni ? double(inter) / double(uni) : 1.0;
    }
    // Teacher-forced: the CPU attends over the GPU's lists.
    out.begin_per_head(c.Hkv, L);
    for (int h = 0; h < c.Hkv; ++h) {
      for (int32_t t : g[size_t(h)]) out.push(t);
      out.close_head();
    }
  }
  const CudaModel::QuestTrace* gpu = nullptr;
  std::map<const PageTable*, int> req_of;
  mutable int rows = 0, dense_rows = 0, identical = 0;
  mutable double jaccard_sum = 0;

 private:
  std::shared_ptr<const sparse::SparseMethod> inner_;
  sparse::LycheeClusterParams p_;
};

}  // namespace spade::test
