// quest (Quest, Tang et al. 2024; mit-han-lab/Quest). Per page of `page_size` tokens and KV
// head the KV pool keeps the element-wise min and max of the keys (kv_pool.h). A page's
// score for query q is the upper bound
//     bound(q, page) = sum_d max(q_d * max_d, q_d * min_d)  >=  max_{k in page} q.k .
// GQA: a KV head's page score is the max over its G query heads of their bounds (option
// group=max; still an upper bound of the group's largest q.k in the page), or their sum
// (group=sum). Each KV head takes its top budget/page_size - 1 pages plus the current
// (last) page, and reads every token of those pages. The first `dense_layers` layers are
// full. page_size must be a multiple of the KV cache's page size (several KV pages form
// one Quest page; their min/max combine element-wise).
#pragma once
#include <memory>
#include <vector>

#include "model/config.h"
#include "sparse/method.h"
#include "sparse/options.h"

namespace spade::sparse {

// The Quest page bound of one query head: sum_d max(q_d * kmax_d, q_d * kmin_d).
float quest_page_bound(const float* q, const float* kmin, const float* kmax, int D);

class QuestMethod final : public SparseMethod {
 public:
  enum class Group { Max, Sum };
  QuestMethod(int64_t budget, int page_size, int dense_layers, Group group);
  std::string name() const override { return "quest"; }
  std::string describe() const override;
  void check_kv_layout(const KVLayout& layout) const override;
  void select(StepContext& ctx, Selection& out) const override;

 private:
  int64_t budget_;
  int page_;
  int dense_layers_;
  Group group_;
};

std::vector<OptionSpec> quest_options();
std::unique_ptr<SparseMethod> make_quest(const MethodOptions& o, const ModelConfig& cfg);

}  // namespace spade::sparse
