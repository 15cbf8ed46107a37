#include "sparse/methods/streaming.h"

#include "core/error.h"
#include "sparse/methods/common.h"

namespace spade::sparse {

StreamingMethod::StreamingMethod(int64_t budget, int sinks, int dense_layers)
    : budget_(budget), sinks_(sinks), dense_layers_(dense_layers) {
  SPADE_CHECK(sinks >= 0 && budget > sinks, "streaming: budget (", budget,
              ") must exceed sinks (", sinks, ")");
}

std::string StreamingMethod::describe() const {
  return cat("streaming budget=", budget_, " sinks=", sinks_, " dense_layers=", dense_layers_);
}

void StreamingMethod::select(StepContext& c, Selection& out) const {
  if (c.layer < dense_layers_ || budget_ >= c.L) {
    out.set_dense(c.Hkv, c.L);
    return;
  }
  out.begin_shared(c.Hkv, c.L);
  for (int32_t p = 0; p < sinks_; ++p) out.push(p);
  for (int64_t p = c.L - (budget_ - sinks_); p < c.L; ++p) out.push(int32_t(p));
  out.close_head();
}

std::vector<OptionSpec> streaming_options() {
  return {budget_option(),
          OptionSpec{"sinks", OptKind::Int, "4",
                     "attention-sink tokens kept at the start (StreamingLLM: 4)"}
              .range(0, kMaxTokenCount - 1),
          dense_layers_count("0", "leading full-attention layers (StreamingLLM: 0)")};
}

std::unique_ptr<SparseMethod> make_streaming(const MethodOptions& o, const ModelConfig&) {
  return std::make_unique<StreamingMethod>(o.integer("budget"), int(o.integer("sinks")),
                                           int(o.integer("dense_layers")));
}

}  // namespace spade::sparse
