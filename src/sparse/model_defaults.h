// Per-model defaults of the layer-structured methods (TidalDecode, LessIsMore): how many
// leading layers stay dense and which layers (re-)select tokens. Keyed by architecture,
// layer count and (where two models share those) hidden size and KV-head count; every
// value is overridable with the methods' `dense_layers` / `selection_layers` options.
#pragma once
#include <string>
#include <vector>

#include "model/config.h"

namespace spade::sparse {

struct LayerDefaults {
  int dense_layers = 2;               // layers [0, dense_layers) are full attention
  std::vector<int> selection_layers;  // full attention + token selection (sorted)
  std::string source;                 // where the numbers come from (for --help / logs)
};

LayerDefaults layer_defaults(const ModelConfig& cfg);

}  // namespace spade::sparse
