// Layer roles of the TidalDecode backbone (TidalDecode, LessIsMore): layers below
// `dense_layers` attend fully; a selection layer attends fully and picks a token set from
// its scores; every other layer reuses the set of the latest selection layer before it.
#pragma once
#include <string>
#include <vector>

#include "model/config.h"
#include "sparse/method.h"
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

// Per-request state of a scheduled method: the set chosen by the latest selection layer of
// the current decode step (filled by the method's on_scores).
struct ScheduledSet : MethodState {
  Selection set;
  int64_t step = -1;
};

// select() of a scheduled method (state: ScheduledSet): dense layers and selection layers
// attend fully (a selection layer asks for its scores unless budget >= L, where the set is
// everything); other layers reuse the step's set. `method` names it in errors.
void select_scheduled(const LayerSchedule& sched, int64_t budget, const char* method,
                      StepContext& c, Selection& out);

// Option specs shared by the methods that use a LayerSchedule.
OptionSpec dense_layers_option();
OptionSpec selection_layers_option();

}  // namespace spade::sparse
