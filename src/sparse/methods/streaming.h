// streaming (StreamingLLM, Xiao et al. 2023): every head of every sparse layer reads the
// first `sinks` tokens and the most recent `budget - sinks` tokens (one shared set).
#pragma once
#include <memory>
#include <vector>

#include "model/config.h"
#include "sparse/method.h"
#include "sparse/options.h"

namespace spade::sparse {

class StreamingMethod final : public SparseMethod {
 public:
  StreamingMethod(int64_t budget, int sinks, int dense_layers);
  std::string name() const override { return "streaming"; }
  std::string describe() const override;
  void select(StepContext& ctx, Selection& out) const override;

 private:
  int64_t budget_;
  int sinks_;
  int dense_layers_;
};

std::vector<OptionSpec> streaming_options();
std::unique_ptr<SparseMethod> make_streaming(const MethodOptions& o, const ModelConfig& cfg);

}  // namespace spade::sparse
