// Small helpers shared by the method implementations.
#pragma once
#include <vector>

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

// Cache correction (LycheeDecode section 4.2.2; TidalDecode's option): every
// correction_every decoded tokens, the decode loop recomputes those tokens' K/V with a dense
// pass (SparseMethod::correction_every). `correction` 1 turns it on.
inline std::vector<OptionSpec> correction_options() {
  return {OptionSpec{"correction", OptKind::Int, "0",
                     "1: cache correction (dense K/V recompute of decoded tokens, run by the "
                     "decode loop)"}
              .range(0, 1),
          OptionSpec{"correction_every", OptKind::Int, "32",
                     "decoded tokens between corrections (paper 32)"}
              .range(1, kMaxTile)};
}
inline int64_t correction_every_option(const MethodOptions& o) {
  return o.integer("correction") != 0 ? o.integer("correction_every") : 0;
}

}  // namespace spade::sparse
