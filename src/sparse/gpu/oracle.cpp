// oracle-topk on the GPU (a measurement, the CPU's OracleTopKMethod): in each layer >=
// dense_layers, full attention for its per-query-head scores (its output then overwritten),
// the true group weights W of each (request, KV head), their top-`budget` tokens, then
// attention over that set.
//
// Layout / bytes (after SelectingMethod's lists, selecting.h): f32 per-head scores
// [max_batch * Hq][seq_pages_cap * page_size], f32 group weights [max_batch * Hkv][same],
// i32 row lengths [max_batch * Hkv], i32 strided top-k [max_batch * Hkv][k] (k = min(budget,
// max_context)), + 4 x 256 B; the lists hold max_batch * Hkv * k entries; the long-row top-k
// scratch where it applies.
#if defined(SPADE_HAVE_CUDA)
#include <algorithm>

#include "backend/cuda/attention.h"
#include "core/error.h"
#include "sparse/gpu/registry.h"
#include "sparse/gpu/selecting.h"

namespace spade {

namespace {

cudaStream_t S_(void* p) { return static_cast<cudaStream_t>(p); }

class GpuOracleTopK final : public TokenTopKMethod {
 public:
  GpuOracleTopK(const GpuMethodContext& ctx, const CudaSparse& sp)
      : TokenTopKMethod(ctx, sp, k_of(ctx, sp), ctx.cfg.n_kv_heads) {}

  static int k_of(const GpuMethodContext& ctx, const CudaSparse& sp) {
    return int(std::min<int64_t>(sp.budget, ctx.cfg.max_context));
  }
  static int64_t cap(const GpuMethodContext& ctx, const CudaSparse& sp) {
    return int64_t(ctx.max_batch) * ctx.cfg.n_kv_heads * std::min<int64_t>(sp.budget, ctx.cfg.max_context);
  }
  static size_t arena_bytes_of(const GpuMethodContext& ctx, const CudaSparse& sp) {
    const int64_t mb = ctx.max_batch, Hq = ctx.cfg.n_heads, Hkv = ctx.cfg.n_kv_heads,
                  P = ctx.page_size;
    const int64_t k = std::min<int64_t>(sp.budget, ctx.cfg.max_context);
    const size_t own = size_t(mb * (Hq + Hkv)) * size_t(ctx.seq_pages_cap * P) * 4 +
                       size_t(mb * Hkv) * 4 + size_t(mb * Hkv * k) * 4 + 4 * 256;
    return base_bytes(ctx, sp) + lists_bytes(ctx, cap(ctx, sp), 1) + own +
           topk_bytes(ctx, k_of(ctx, sp), ctx.cfg.n_kv_heads);
  }
  static std::string describe_spec(const CudaSparse& sp) {
    return cat("oracle-topk budget=", sp.budget, " dense_layers=", sp.dense_layers,
               " (a measurement: full attention for the true weights, then attention over "
               "their top-k per KV head)");
  }

  void begin_step() override {
    if (!sparse_step_) return;
    cuda::row_lengths(sparse_->dev_kv_len(), step_B_, ctx_.cfg.n_kv_heads, tidal_rown_,
                      S_(run_));
  }

 private:
  int64_t sel_cap() const override { return cap(ctx_, sp_); }
  const float* traced_scores() const override { return oracle_w_; }
  void alloc_scores(cuda::DeviceArena& A) override {
    const int64_t mb = ctx_.max_batch, Hq = ctx_.cfg.n_heads, Hkv = ctx_.cfg.n_kv_heads;
    const int64_t ld = score_ld();
    const int64_t k = std::min<int64_t>(sp_.budget, ctx_.cfg.max_context);
    sel_scores_ = A.alloc_n<float>(size_t(mb * Hq) * size_t(ld), "oracle per-head scores");
    oracle_w_ = A.alloc_n<float>(size_t(mb * Hkv) * size_t(ld), "oracle group weights");
    tidal_rown_ = A.alloc_n<int32_t>(size_t(mb * Hkv), "oracle row lengths");
    tidal_strided_ = A.alloc_n<int32_t>(size_t(mb * Hkv * k), "oracle top-k");
  }

  // The measurement first: full attention for its per-head scores (its output is then
  // overwritten), the true group weights, their top-k; then attention over that set.
  void attend_lists(int l, const void* q_, const void* kc_, const void* vc_, void* att_,
                    float scale) override {
    using cuda::bf16;
    const bf16* q = static_cast<const bf16*>(q_);
    const bf16* kc = static_cast<const bf16*>(kc_);
    const bf16* vc = static_cast<const bf16*>(vc_);
    bf16* att = static_cast<bf16*>(att_);
    cudaStream_t st = S_(run_);
    const int Hq = ctx_.cfg.n_heads, Hkv = ctx_.cfg.n_kv_heads;
    const int tidal_k = int(std::min<int64_t>(sp_.budget, ctx_.cfg.max_context));
    const int64_t ld = score_ld();
    const cuda::DecodeScores ds{sel_scores_, ld, true};
    attn_->run(q, kc, vc, att, scale, st, {}, &ds);
    cuda::oracle_group_weights(sel_scores_, ld, sparse_->dev_kv_len(), step_B_, Hq, Hkv,
                               oracle_w_, st);
    select_topk(oracle_w_, tidal_rown_, step_B_ * Hkv, tidal_k, tidal_strided_, st);
    cuda::token_compact_lists(tidal_strided_, sparse_->dev_kv_len(), step_B_, Hkv, tidal_k,
                              sel_off_, sel_idx_, st);
    if (trace) trace_lists(l), trace_scores(l);
    sparse_->run(q, kc, vc, sel_off_, sel_idx_, att, scale, st, 0, nullptr, 0, sel_skip(l));
  }

  float* oracle_w_ = nullptr;  // the true group weights
};

}  // namespace

const GpuMethodKind gpu_oracle_topk = SPADE_GPU_METHOD_KIND(GpuOracleTopK);

}  // namespace spade
#endif  // SPADE_HAVE_CUDA
