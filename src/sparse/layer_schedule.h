// Layer roles of the TidalDecode backbone (TidalDecode, LessIsMore): layers below
// `dense_layers` attend fully; a selection layer attends fully and picks a token set from
// its scores; every other layer reuses the set of the latest selection layer before it.
#pragma once
#include <string>
#include <vector>

#include "model/config.h"
#include "sparse/options.h"

namespace spade::sparse {

struct LayerSchedule {
  enum class Role { Dense, Select, Reuse };
  int dense_layers = 2;
  std::vector<int> selection_layers;

  Role role(int layer) const;
  // Reads options `dense_layers` and `selection_layers` ("auto": model_defaults.h table)
  // and checks them against the model's depth.
  static LayerSchedule from_options(const MethodOptions& o, const ModelConfig& cfg);
  std::string describe() const;  // "dense 0-1, select 2,12"
};

// Option specs shared by the methods that use a LayerSchedule.
OptionSpec dense_layers_option();
OptionSpec selection_layers_option();

}  // namespace spade::sparse
