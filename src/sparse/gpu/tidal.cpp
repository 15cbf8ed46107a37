// TidalDecode on the GPU (the CPU's TidalMethod, token units): layer roles from the schedule
// (dense / select / reuse). A selection layer runs the dense kernel, which also emits the
// group-mean scores of each (request, KV head); their top-`budget` tokens become, on a side
// stream that overlaps the layer's GEMMs, the token lists the following layers read (joined
// before the next layer's attention).
//
// Layout / bytes (after SelectingMethod's lists, selecting.h): f32 group-mean scores
// [max_batch * Hkv][seq_pages_cap * page_size], i32 row lengths [max_batch * Hkv], i32 strided
// top-k [max_batch * Hkv][k] (k = min(budget, max_context)), + 3 x 256 B; the lists hold
// max_batch * Hkv * k entries; the long-row top-k scratch where it applies; Twilight's stage
// over the token lists when stacked (`tidal+twilight`: SelectingMethod::twilight_bytes; the
// reuse layers' lists are pruned, the selection layers stay dense with their scores).
#if defined(SPADE_HAVE_CUDA)
#include <algorithm>

#include "backend/cuda/attention.h"
#include "core/error.h"
#include "sparse/gpu/registry.h"
#include "sparse/gpu/selecting.h"

namespace spade {

namespace {

cudaStream_t S_(void* p) { return static_cast<cudaStream_t>(p); }

class GpuTidal final : public TokenTopKMethod {
 public:
  GpuTidal(const GpuMethodContext& ctx, const CudaSparse& sp)
      : TokenTopKMethod(ctx, sp, k_of(ctx, sp), ctx.cfg.n_kv_heads) {}

  static int k_of(const GpuMethodContext& ctx, const CudaSparse& sp) {
    return int(std::min<int64_t>(sp.budget, ctx.cfg.max_context));
  }
  static int64_t cap(const GpuMethodContext& ctx, const CudaSparse& sp) {
    return int64_t(ctx.max_batch) * ctx.cfg.n_kv_heads * std::min<int64_t>(sp.budget, ctx.cfg.max_context);
  }
  static size_t arena_bytes_of(const GpuMethodContext& ctx, const CudaSparse& sp) {
    const int64_t mb = ctx.max_batch, Hkv = ctx.cfg.n_kv_heads, P = ctx.page_size;
    const int64_t k = std::min<int64_t>(sp.budget, ctx.cfg.max_context);
    const size_t own = size_t(mb * Hkv) * size_t(ctx.seq_pages_cap * P) * 4 +
                       size_t(mb * Hkv) * 4 + size_t(mb * Hkv * k) * 4 + 3 * 256;
    return base_bytes(ctx, sp) + lists_bytes(ctx, cap(ctx, sp), 1) + own +
           topk_bytes(ctx, k_of(ctx, sp), ctx.cfg.n_kv_heads) +
           twilight_bytes(ctx, sp, cap(ctx, sp), ctx.cfg.n_kv_heads, cuda::SelGran::Token);
  }
  static std::string describe_spec(const CudaSparse& sp) {
    return cat("tidal budget=", sp.budget, " ", sp.schedule.describe(),
               " (selection layers: scores from the dense kernel, token top-k on the GPU)");
  }

  void begin_step() override {
    if (!sparse_step_) return;
    cuda::row_lengths(sparse_->dev_kv_len(), step_B_, ctx_.cfg.n_kv_heads, tidal_rown_,
                      S_(run_));
  }

  void attend(int l, const void* q, const void* kc, const void* vc, void* att,
              float scale) override {
    if (sparse_step_ && sp_.schedule.role(l) == sparse::LayerSchedule::Role::Select)
      select_layer(l, q, kc, vc, att, scale);
    else
      TokenTopKMethod::attend(l, q, kc, vc, att, scale);
  }

 private:
  bool uses_side_stream() const override { return true; }
  int64_t sel_cap() const override { return cap(ctx_, sp_); }
  int64_t list_rows(int l, int64_t L) const override {
    const int64_t b = std::min<int64_t>(sp_.budget, L);
    return int64_t(ctx_.cfg.n_kv_heads) *
           (sp_.schedule.role(l) == sparse::LayerSchedule::Role::Reuse ? b : L);
  }
  void alloc_scores(cuda::DeviceArena& A) override {
    const int64_t rows = int64_t(ctx_.max_batch) * ctx_.cfg.n_kv_heads;
    sel_scores_ = A.alloc_n<float>(size_t(rows) * size_t(score_ld()), "tidal scores");
    tidal_rown_ = A.alloc_n<int32_t>(size_t(rows), "tidal row lengths");
    tidal_strided_ = A.alloc_n<int32_t>(
        size_t(rows) * size_t(std::min<int64_t>(sp_.budget, ctx_.cfg.max_context)), "tidal top-k");
  }

  // Full attention that also emits the group-mean scores; the top-k of each (request, KV
  // head) becomes the token lists of the following layers.
  void select_layer(int l, const void* q_, const void* kc_, const void* vc_, void* att_,
                    float scale) {
    using cuda::bf16;
    const bf16* q = static_cast<const bf16*>(q_);
    const bf16* kc = static_cast<const bf16*>(kc_);
    const bf16* vc = static_cast<const bf16*>(vc_);
    bf16* att = static_cast<bf16*>(att_);
    cudaStream_t st = S_(run_);
    const int Hkv = ctx_.cfg.n_kv_heads;
    const int tidal_k = int(std::min<int64_t>(sp_.budget, ctx_.cfg.max_context));
    const cuda::DecodeScores ds{sel_scores_, score_ld()};
    attn_->run(q, kc, vc, att, scale, st, {}, &ds);
    cudaStream_t ss = S_(fork_selection());
    select_topk(sel_scores_, tidal_rown_, step_B_ * Hkv, tidal_k, tidal_strided_, ss);
    cuda::token_compact_lists(tidal_strided_, sparse_->dev_kv_len(), step_B_, Hkv, tidal_k,
                              sel_off_, sel_idx_, ss);
    if (trace) trace_lists(l), trace_scores(l);
  }
};

}  // namespace

const GpuMethodKind gpu_tidal = SPADE_GPU_METHOD_KIND(GpuTidal);

}  // namespace spade
#endif  // SPADE_HAVE_CUDA
