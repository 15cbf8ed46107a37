// LessIsMore on the GPU (Algorithm 1, the CPU's LessIsMoreMethod): layer roles from the
// schedule. A selection layer runs the dense kernel, which also emits every query head's
// scores; their per-head top-k, merged by rank, plus the sinks and the recency window become
// the ONE list of each request (shared by its KV heads), built on a side stream that the
// next layer joins.
//
// Layout / bytes (after SelectingMethod's lists, selecting.h): f32 per-head scores
// [max_batch * Hq][seq_pages_cap * page_size], i32 row counts [max_batch * Hq + max_batch],
// i32 per-head top-k [max_batch * Hq][n_uni], f32 merge keys [max_batch][seq_pages_cap *
// page_size], i32 merged top-k [max_batch][n_uni] (n_uni = budget - recent - sinks), + 5 x
// 256 B; the lists hold max_batch * min(budget, max_context) entries; the long-row top-k
// scratch (rows of max_batch * Hq, k = n_uni) where it applies; Twilight's stage when stacked
// (`lessismore+twilight`: SelectingMethod::twilight_bytes; the one list of a request is
// copied per KV head and pruned per KV head in the reuse layers).
#if defined(SPADE_HAVE_CUDA)
#include <algorithm>

#include "backend/cuda/attention.h"
#include "core/error.h"
#include "dist/device_collectives.h"
#include "sparse/gpu/registry.h"
#include "sparse/gpu/selecting.h"

namespace spade {

namespace {

cudaStream_t S_(void* p) { return static_cast<cudaStream_t>(p); }

class GpuLessIsMore final : public TokenTopKMethod {
 public:
  GpuLessIsMore(const GpuMethodContext& ctx, const CudaSparse& sp)
      : TokenTopKMethod(ctx, sp, k_of(sp), ctx.cfg.n_heads) {}

  static int k_of(const CudaSparse& sp) { return int(std::max<int64_t>(1, sp.lim_unified())); }
  static int64_t cap(const GpuMethodContext& ctx, const CudaSparse& sp) {
    return int64_t(ctx.max_batch) * std::min<int64_t>(sp.budget, ctx.cfg.max_context);
  }
  static size_t arena_bytes_of(const GpuMethodContext& ctx, const CudaSparse& sp) {
    const int64_t mb = ctx.max_batch, Hq = ctx.cfg.n_heads, P = ctx.page_size,
                  c = ctx.seq_pages_cap;
    const int64_t nu = sp.lim_unified();
    const size_t own = size_t(mb * Hq) * size_t(c * P) * 4 + size_t(mb * Hq + mb) * 4 +
                       size_t(mb * Hq * nu) * 4 + size_t(mb) * size_t(c * P) * 4 +
                       size_t(mb * nu) * 4 + 5 * 256 + gather_bytes(ctx);
    return base_bytes(ctx, sp) + lists_bytes(ctx, cap(ctx, sp), 1) + own +
           topk_bytes(ctx, k_of(sp), ctx.cfg.n_heads) +
           twilight_bytes(ctx, sp, cap(ctx, sp), 1, cuda::SelGran::Token);
  }
  // Tensor parallelism: the merge keys of every rank, f32 [ranks][max_batch][ld] (+ 256 B).
  static size_t gather_bytes(const GpuMethodContext& ctx) {
    if (!ctx.tp) return 0;
    return size_t(ctx.tp->size()) * size_t(ctx.max_batch) * size_t(ctx.seq_pages_cap * ctx.page_size) *
               4 + 256;
  }
  static std::string describe_spec(const CudaSparse& sp) {
    return cat("lessismore budget=", sp.budget, " recent=", sp.recent, " sinks=", sp.sinks, " ",
               sp.schedule.describe(), " (selection layers: per-head scores from the dense "
               "kernel, per-head top-k and rank merge on the GPU; one list per request)");
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
  int lists_per_req() const override { return 1; }
  int64_t list_rows(int l, int64_t L) const override {
    const int64_t b = std::min<int64_t>(sp_.budget, L);
    return int64_t(ctx_.cfg.n_kv_heads) *
           (sp_.schedule.role(l) == sparse::LayerSchedule::Role::Reuse ? b : L);
  }
  void alloc_scores(cuda::DeviceArena& A) override {
    const int64_t mb = ctx_.max_batch, Hq = ctx_.cfg.n_heads, ld = score_ld();
    const int64_t nu = sp_.lim_unified();
    sel_scores_ = A.alloc_n<float>(size_t(mb * Hq) * size_t(ld), "lessismore scores");
    lim_row_n_ = A.alloc_n<int32_t>(size_t(mb * Hq + mb), "lessismore row counts");
    lim_head_top_ = A.alloc_n<int32_t>(size_t(mb * Hq * nu), "lessismore head top-k");
    lim_keys_ = A.alloc_n<float>(size_t(mb) * size_t(ld), "lessismore merge keys");
    lim_merged_ = A.alloc_n<int32_t>(size_t(mb * nu), "lessismore merged top-k");
    if (ctx_.tp)
      lim_gather_ = A.alloc_n<float>(size_t(ctx_.tp->size()) * size_t(mb) * size_t(ld),
                                     "lessismore rank keys");
  }

  // Full attention that also emits every query head's scores; their merged ranking, the
  // sinks and the recency window become the one list of each request.
  void select_layer(int l, const void* q_, const void* kc_, const void* vc_, void* att_,
                    float scale) {
    using cuda::bf16;
    const bf16* q = static_cast<const bf16*>(q_);
    const bf16* kc = static_cast<const bf16*>(kc_);
    const bf16* vc = static_cast<const bf16*>(vc_);
    bf16* att = static_cast<bf16*>(att_);
    cudaStream_t st = S_(run_);
    const int64_t ld = score_ld();
    const cuda::DecodeScores ds{sel_scores_, ld, true};
    attn_->run(q, kc, vc, att, scale, st, {}, &ds);
    cuda::LessIsMoreArgs la;
    la.scores = sel_scores_, la.ld = ld, la.kv_len = sparse_->dev_kv_len();
    la.B = step_B_, la.Hq = ctx_.cfg.n_heads;
    la.budget = int(std::min<int64_t>(sp_.budget, ctx_.cfg.max_context));
    la.n_recent = int(sp_.recent), la.sinks = sp_.sinks;
    la.n_uni = int(sp_.lim_unified());
    la.row_n = lim_row_n_, la.head_top = lim_head_top_, la.keys = lim_keys_;
    la.merged_top = lim_merged_, la.sel_off = sel_off_, la.sel_idx = sel_idx_;
    la.topk_scratch = topk_long_;
    if (ctx_.tp) {
      // Tensor parallelism: this rank's heads are the model's [tp_hq0, tp_hq0 + Hq); the merge
      // keys of every rank are gathered (an exact sum all-reduce of a zero-padded table, on
      // the model's stream, in the captured graph too) and their minimum is the one-rank key,
      // so every rank builds the one-rank list.
      la.hq0 = ctx_.tp_hq0, la.Hq_key = ctx_.tp_Hq_all;
      cudaStream_t ss = S_(fork_selection());  // the model's stream under tp
      const int R = ctx_.tp->size();
      cuda::lessismore_keys(la, ss);
      cuda::lessismore_keys_scatter(la, lim_gather_, ctx_.tp->rank(), R, ss);
      ctx_.tp->all_reduce_sum_on(lim_gather_, int64_t(R) * step_B_ * ld, ss);
      cuda::lessismore_keys_min(la, lim_gather_, R, ss);
      cuda::lessismore_lists(la, ss);
    } else {
      cuda::lessismore_select(la, S_(fork_selection()));
    }
    if (trace) trace_lists(l), trace_scores(l);
  }

  // lessismore_select's scratch.
  int32_t* lim_row_n_ = nullptr;
  int32_t* lim_head_top_ = nullptr;
  float* lim_keys_ = nullptr;
  int32_t* lim_merged_ = nullptr;
  float* lim_gather_ = nullptr;  // tensor parallelism: [ranks][max_batch][ld]
};

}  // namespace

const GpuMethodKind gpu_lessismore = SPADE_GPU_METHOD_KIND(GpuLessIsMore);

}  // namespace spade
#endif  // SPADE_HAVE_CUDA
