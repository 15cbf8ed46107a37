// full: exact attention over the whole cache at every layer (the reference; METHODS.md).
#pragma once
#include <memory>
#include <vector>

#include "model/config.h"
#include "sparse/method.h"
#include "sparse/options.h"

namespace spade::sparse {

class FullMethod final : public SparseMethod {
 public:
  std::string name() const override { return "full"; }
  std::string describe() const override { return "full"; }
  void select(StepContext& ctx, Selection& out) const override { out.set_dense(ctx.Hkv, ctx.L); }
};

std::vector<OptionSpec> full_options();
std::unique_ptr<SparseMethod> make_full(const MethodOptions& o, const ModelConfig& cfg);

}  // namespace spade::sparse
