// Small helpers shared by the method implementations.
#pragma once
#include "sparse/options.h"

namespace spade::sparse {

inline OptionSpec budget_option() {
  return {"budget", OptKind::Int, "2048",
          "tokens attended per KV head in a sparse layer (K); >= context length means full"};
}

}  // namespace spade::sparse
