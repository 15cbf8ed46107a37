// StreamingLLM on the GPU (the CPU's StreamingMethod): sinks + the recent window, one list per
// request shared by its KV heads, written on the device each step (streaming_lists) from the
// planned context lengths; attention over it in layers >= dense_layers.
//
// Layout / bytes (after SelectingMethod's lists, selecting.h): nothing of its own; the lists
// hold max_batch * min(budget, max_context) token entries (one list per request).
#if defined(SPADE_HAVE_CUDA)
#include <algorithm>

#include "core/error.h"
#include "sparse/gpu/registry.h"
#include "sparse/gpu/selecting.h"

namespace spade {

namespace {

class GpuStreaming final : public SelectingMethod {
 public:
  GpuStreaming(const GpuMethodContext& ctx, const CudaSparse& sp) : SelectingMethod(ctx, sp) {}

  static int64_t cap(const GpuMethodContext& ctx, const CudaSparse& sp) {
    return int64_t(ctx.max_batch) * std::min<int64_t>(sp.budget, ctx.cfg.max_context);
  }
  static size_t arena_bytes_of(const GpuMethodContext& ctx, const CudaSparse& sp) {
    return base_bytes(ctx, sp) + lists_bytes(ctx, cap(ctx, sp), 1);
  }
  static std::string describe_spec(const CudaSparse& sp) {
    return cat("streaming budget=", sp.budget, " sinks=", sp.sinks, " dense_layers=",
               sp.dense_layers);
  }

  void begin_step() override {
    if (!sparse_step_) return;
    cuda::streaming_lists(sparse_->dev_kv_len(), step_B_, int(sp_.budget), sp_.sinks, sel_off_,
                          sel_idx_, static_cast<cudaStream_t>(run_));
  }

 private:
  int64_t sel_cap() const override { return cap(ctx_, sp_); }
  int lists_per_req() const override { return 1; }
};

}  // namespace

const GpuMethodKind gpu_streaming = SPADE_GPU_METHOD_KIND(GpuStreaming);

}  // namespace spade
#endif  // SPADE_HAVE_CUDA
