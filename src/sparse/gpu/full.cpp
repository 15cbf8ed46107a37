// Full attention on the GPU ("full"): the base GpuMethod as it is, the dense attention
// workspace over the method's rows in every layer (split-KV decode, tensor-core prefill).
// Twilight over full (`full+twilight`, twilight:base=full; CudaSparse::twilight_sel) is a
// SelectingMethod whose every layer is the selector's dense one (dense_layers = n_layers):
// decode layers >= twilight_dense_layers prune every 16-token chunk of the context
// (TwilightStage::full_lists) and attend over the kept tokens; the others run dense.
//
// Layout / bytes: the base's only (method.h): the dense AttentionWorkspace + 1 MiB. With
// Twilight: + SelectingMethod's lists (one entry: the full method writes none; the
// SparseAttention plan holds the step's page tables and lengths the pruner reads) + Twilight's
// stage (twilight_stage.h: the pruner and the chunk lists for the longest context, the kept
// lists' SparseAttention).
#if defined(SPADE_HAVE_CUDA)
#include <algorithm>

#include "sparse/gpu/method.h"
#include "sparse/gpu/registry.h"
#include "sparse/gpu/selecting.h"

namespace spade {

namespace {

class GpuFull final : public GpuMethod {
 public:
  GpuFull(const GpuMethodContext& ctx, const CudaSparse& sp) : GpuMethod(ctx, sp) {}
  static size_t arena_bytes_of(const GpuMethodContext& ctx, const CudaSparse& sp) {
    return base_bytes(ctx, sp);
  }
  static std::string describe_spec(const CudaSparse&) { return "full"; }
};

class GpuFullTwilight final : public SelectingMethod {
 public:
  GpuFullTwilight(const GpuMethodContext& ctx, const CudaSparse& sp) : SelectingMethod(ctx, sp) {}
  static size_t arena_bytes_of(const GpuMethodContext& ctx, const CudaSparse& sp) {
    return base_bytes(ctx, sp) + lists_bytes(ctx, 1, 1) +
           twilight_bytes(ctx, sp, 1, ctx.cfg.n_kv_heads, cuda::SelGran::Token);
  }

 private:
  int64_t sel_cap() const override { return 1; }
  // Every list is the whole context (the pruner's bounds; the selector writes no list).
  void list_entries(const SeqInput* seqs, int n, bool&) override {
    for (int i = 0; i < n; ++i) {
      const int64_t L = seqs[i].pages->length + 1;
      for (int h = 0; h < lists_per_req(); ++h) plan_max_entries_.push_back(int(L));
    }
  }
  int64_t list_rows(int, int64_t L) const override { return int64_t(ctx_.cfg.n_kv_heads) * L; }
};

size_t full_arena_bytes(const GpuMethodContext& ctx, const CudaSparse& sp) {
  return sp.twilight_sel ? GpuFullTwilight::arena_bytes_of(ctx, sp) : GpuFull::arena_bytes_of(ctx, sp);
}
std::unique_ptr<GpuMethod> make_full(const GpuMethodContext& ctx, const CudaSparse& sp) {
  if (sp.twilight_sel) return make_gpu_method<GpuFullTwilight>(ctx, sp);
  return make_gpu_method<GpuFull>(ctx, sp);
}

}  // namespace

const GpuMethodKind gpu_full = {&full_arena_bytes, &make_full, &GpuFull::describe_spec};

}  // namespace spade
#endif  // SPADE_HAVE_CUDA
