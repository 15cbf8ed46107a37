// Small helpers shared by the method implementations.
#pragma once
#include "sparse/options.h"

namespace spade::sparse {

inline OptionSpec budget_option() {
  return OptionSpec{"budget", OptKind::Int, "2048",
                    "tokens attended per KV head in a sparse layer (K); >= context length means "
                    "full"}
      .range(1, kMaxTokenCount);
}

// Leading full-attention layers, [0, n_layers].
inline OptionSpec dense_layers_count(const char* def, const char* help) {
  return OptionSpec{"dense_layers", OptKind::Int, def, help}
      .range(0, kMaxTokenCount)
      .upto(ModelBound::Layers);
}

}  // namespace spade::sparse
