#include "sparse/layer_schedule.h"

#include <algorithm>

#include "core/error.h"
#include "sparse/model_defaults.h"

namespace spade::sparse {

LayerSchedule::Role LayerSchedule::role(int layer) const {
  if (layer < dense_layers) return Role::Dense;
  if (std::binary_search(selection_layers.begin(), selection_layers.end(), layer))
    return Role::Select;
  return Role::Reuse;
}

LayerSchedule LayerSchedule::from_options(const MethodOptions& o, const ModelConfig& cfg) {
  LayerDefaults d = layer_defaults(cfg);
  LayerSchedule s;
  s.dense_layers = o.is_auto("dense_layers") ? d.dense_layers : int(o.integer("dense_layers"));
  s.selection_layers =
      o.is_auto("selection_layers") ? d.selection_layers : o.int_list("selection_layers");
  std::sort(s.selection_layers.begin(), s.selection_layers.end());
  s.selection_layers.erase(std::unique(s.selection_layers.begin(), s.selection_layers.end()),
                           s.selection_layers.end());
  const std::string m = o.method();
  SPADE_CHECK(s.dense_layers >= 0 && s.dense_layers <= cfg.n_layers, m, ": dense_layers=",
              s.dense_layers, " outside [0, ", cfg.n_layers, "]");
  for (int l : s.selection_layers)
    SPADE_CHECK(l >= 0 && l < cfg.n_layers, m, ": selection layer ", l, " outside [0, ",
                cfg.n_layers, ")");
  // The first layer that reuses a set must have a layer of role Select before it. A selection
  // layer below dense_layers is a dense layer: it attends fully and never selects.
  for (int l = 0; l < cfg.n_layers; ++l) {
    if (s.role(l) != Role::Reuse) continue;
    bool selects_before = false;
    for (int x : s.selection_layers) selects_before |= x < l && s.role(x) == Role::Select;
    SPADE_CHECK(selects_before, m, ": layer ", l, " would reuse a token set but no selection "
                "layer at or above dense_layers=", s.dense_layers, " comes before it (",
                s.describe(), "; a selection layer below dense_layers is dense and never "
                "selects)");
    break;
  }
  return s;
}

std::string LayerSchedule::describe() const {
  std::string s = dense_layers ? cat("dense 0-", dense_layers - 1) : std::string("dense none");
  s += ", select ";
  for (size_t i = 0; i < selection_layers.size(); ++i)
    s += (i ? "," : "") + std::to_string(selection_layers[i]);
  if (selection_layers.empty()) s += "none";
  return s;
}

void select_scheduled(const LayerSchedule& sched, int64_t budget, const char* method,
                      StepContext& c, Selection& out) {
  auto& st = static_cast<ScheduledSet&>(*c.state);
  switch (sched.role(c.layer)) {
    case LayerSchedule::Role::Dense:
      out.set_dense(c.Hkv, c.L);
      return;
    case LayerSchedule::Role::Select:
      out.set_dense(c.Hkv, c.L);
      if (budget >= c.L) {
        st.set.set_dense(c.Hkv, c.L);
        st.step = c.step;
      } else {
        c.request_scores();
      }
      return;
    case LayerSchedule::Role::Reuse:
      SPADE_CHECK(st.step == c.step && st.set.length == c.L,
                  method, ": layer ", c.layer, " has no token set from this step");
      out = st.set;  // vector assignment reuses capacity
      return;
  }
}

OptionSpec dense_layers_option() {
  return OptionSpec{"dense_layers", OptKind::Int, "auto",
                    "leading full-attention layers (auto: per-model table, 2; TidalDecode)"}
      .range(0, kMaxTokenCount)
      .upto(ModelBound::Layers);
}
OptionSpec selection_layers_option() {
  return OptionSpec{"selection_layers", OptKind::IntList, "auto",
                    "token (re-)selection layers, comma list (auto: per-model table, e.g. 2,13 "
                    "for Llama-3-8B, 2,14 for SmolLM2-135M)"}
      .range(0, kMaxTokenCount)
      .upto(ModelBound::LayerIndex);
}

}  // namespace spade::sparse
