// oracle-topk / oracle-topp: selections from the true full-attention weights of the layer
// (a measurement: StepContext::full_weights), the upper bounds of recall. Not fast.
//
// Selections are per KV head (the Selection granularity), so for GQA the group's query
// heads share a set:
//   oracle-topk  top-`budget` positions by W_j = sum over the G query heads of their true
//                weight on token j (ties: lower position). This maximizes the group-mean
//                recall over all sets of `budget` tokens per KV head, so no method reading
//                at most `budget` tokens per KV head can have a higher mean recall.
//   oracle-topp  group=union (default): each query head keeps its smallest top set whose
//                true weight reaches p, and the KV head reads the union (every query head's
//                recall >= p); group=mean: smallest top set of W/G reaching p.
#pragma once
#include <memory>
#include <vector>

#include "model/config.h"
#include "sparse/method.h"
#include "sparse/options.h"

namespace spade::sparse {

class OracleTopKMethod final : public SparseMethod {
 public:
  OracleTopKMethod(int64_t budget, int dense_layers);
  std::string name() const override { return "oracle-topk"; }
  std::string describe() const override;
  void select(StepContext& ctx, Selection& out) const override;

 private:
  int64_t budget_;
  int dense_layers_;
};

class OracleTopPMethod final : public SparseMethod {
 public:
  OracleTopPMethod(double p, bool union_group, int dense_layers);
  std::string name() const override { return "oracle-topp"; }
  std::string describe() const override;
  void select(StepContext& ctx, Selection& out) const override;

 private:
  double p_;
  bool union_;
  int dense_layers_;
};

std::vector<OptionSpec> oracle_topk_options();
std::unique_ptr<SparseMethod> make_oracle_topk(const MethodOptions& o, const ModelConfig& cfg);
std::vector<OptionSpec> oracle_topp_options();
std::unique_ptr<SparseMethod> make_oracle_topp(const MethodOptions& o, const ModelConfig& cfg);

}  // namespace spade::sparse
