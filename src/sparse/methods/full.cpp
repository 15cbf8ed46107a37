#include "sparse/methods/full.h"

namespace spade::sparse {

std::vector<OptionSpec> full_options() { return {}; }

std::unique_ptr<SparseMethod> make_full(const MethodOptions&, const ModelConfig&) {
  return std::make_unique<FullMethod>();
}

}  // namespace spade::sparse
