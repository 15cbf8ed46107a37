// oracle-topp on the GPU (a measurement, as the CPU's OracleTopPMethod): in every sparse
// layer the dense attention with per-query-head scores (its output then overwritten), the
// true softmax weights of each query head, and per (request, KV head):
//   group=union  each query head's smallest best-first set whose weight reaches p, the KV
//                head reading their union;
//   group=mean   the smallest best-first set of the group weights W (the sum over the G
//                heads, oracle_group_weights) reaching p * G;
// then attention over that set. Best-first = weight descending, ties by the lower position;
// the exact cut is the rule kernels' (backend/cuda/rule_select.h: a radix select on the
// weights' bits with masses in 64-bit fixed point), so the sets are the CPU's up to the
// rounding of the weights themselves.
//
// Layout / bytes (after SelectingMethod's lists, selecting.h; the lists hold max_batch * Hkv
// * ld entries, ld = seq_pages_cap * page_size, every list at most its context): f32
// per-head scores, then weights in place [max_batch * Hq][ld]; group=mean: f32 group
// weights [max_batch * Hkv][ld]; RuleCrit [max_batch * score rows] (score rows: Hq for
// union, Hkv for mean); i32 strided sets [max_batch * Hkv][ld]; i32 set sizes [max_batch *
// Hkv]; + 5 x 256 B; the long-row top-k scratch of TokenTopKMethod at k = 1 where it
// applies (unused: the sizing follows the base class's allocation).
#if defined(SPADE_HAVE_CUDA)
#include <algorithm>

#include "backend/cuda/attention.h"
#include "backend/cuda/rule_select.h"
#include "core/error.h"
#include "sparse/gpu/registry.h"
#include "sparse/gpu/selecting.h"

namespace spade {

namespace {

cudaStream_t S_(void* p) { return static_cast<cudaStream_t>(p); }

class GpuOracleTopP final : public TokenTopKMethod {
 public:
  GpuOracleTopP(const GpuMethodContext& ctx, const CudaSparse& sp)
      : TokenTopKMethod(ctx, sp, 1, rows_of(ctx, sp)) {}

  static int rows_of(const GpuMethodContext& ctx, const CudaSparse& sp) {
    return sp.oracle_union ? ctx.cfg.n_heads : ctx.cfg.n_kv_heads;
  }
  static int64_t ld_of(const GpuMethodContext& ctx) { return ctx.seq_pages_cap * ctx.page_size; }
  static int64_t cap(const GpuMethodContext& ctx) {
    return int64_t(ctx.max_batch) * ctx.cfg.n_kv_heads * ld_of(ctx);
  }
  static size_t arena_bytes_of(const GpuMethodContext& ctx, const CudaSparse& sp) {
    const int64_t mb = ctx.max_batch, Hq = ctx.cfg.n_heads, Hkv = ctx.cfg.n_kv_heads;
    const size_t ld = size_t(ld_of(ctx));
    const size_t own = size_t(mb * Hq) * ld * 4 + (sp.oracle_union ? 0 : size_t(mb * Hkv) * ld * 4) +
                       size_t(mb * rows_of(ctx, sp)) * sizeof(cuda::RuleCrit) +
                       size_t(mb * Hkv) * ld * 4 + size_t(mb * Hkv) * 4 + 5 * 256;
    return base_bytes(ctx, sp) + lists_bytes(ctx, cap(ctx), 1) + own +
           topk_bytes(ctx, 1, rows_of(ctx, sp));
  }
  static std::string describe_spec(const CudaSparse& sp) {
    return cat("oracle-topp p=", sp.oracle_p, " group=", sp.oracle_union ? "union" : "mean",
               " dense_layers=", sp.dense_layers,
               " (a measurement: full attention for the true weights, then attention over the "
               "smallest top set reaching p per ",
               sp.oracle_union ? "query head, unioned per KV head)" : "KV head's group weights)");
  }

 private:
  int64_t sel_cap() const override { return cap(ctx_); }
  const float* traced_scores() const override { return sp_.oracle_union ? sel_scores_ : oracle_w_; }
  // Every list may hold its whole context; the CPU never runs these layers dense.
  void list_entries(const SeqInput* seqs, int n, bool& any_sparse) override {
    any_sparse = true;
    for (int i = 0; i < n; ++i) {
      const int64_t L = seqs[i].pages->length + 1;
      for (int h = 0; h < lists_per_req(); ++h) plan_max_entries_.push_back(int(L));
    }
  }
  // An upper bound (the device sizes the sets).
  int64_t list_rows(int, int64_t L) const override { return int64_t(ctx_.cfg.n_kv_heads) * L; }
  void alloc_scores(cuda::DeviceArena& A) override {
    const int64_t mb = ctx_.max_batch, Hq = ctx_.cfg.n_heads, Hkv = ctx_.cfg.n_kv_heads;
    const size_t ld = size_t(score_ld());
    sel_scores_ = A.alloc_n<float>(size_t(mb * Hq) * ld, "oracle-topp per-head scores");
    if (!sp_.oracle_union)
      oracle_w_ = A.alloc_n<float>(size_t(mb * Hkv) * ld, "oracle-topp group weights");
    crit_ = A.alloc_n<cuda::RuleCrit>(size_t(mb * score_rows_), "oracle-topp criteria");
    sets_ = A.alloc_n<int32_t>(size_t(mb * Hkv) * ld, "oracle-topp sets");
    set_n_ = A.alloc_n<int32_t>(size_t(mb * Hkv), "oracle-topp set sizes");
  }

  void attend_lists(int l, const void* q_, const void* kc_, const void* vc_, void* att_,
                    float scale) override {
    using cuda::bf16;
    const bf16* q = static_cast<const bf16*>(q_);
    const bf16* kc = static_cast<const bf16*>(kc_);
    const bf16* vc = static_cast<const bf16*>(vc_);
    bf16* att = static_cast<bf16*>(att_);
    cudaStream_t st = S_(run_);
    const int Hq = ctx_.cfg.n_heads, Hkv = ctx_.cfg.n_kv_heads, G = Hq / Hkv;
    const int64_t ld = score_ld();
    const int32_t* kv_len = sparse_->dev_kv_len();
    const cuda::DecodeScores ds{sel_scores_, ld, true};
    attn_->run(q, kc, vc, att, scale, st, {}, &ds);
    cuda::RuleParams rp;
    rp.mode = cuda::RuleMode::TopP;
    rp.block = 1;
    if (sp_.oracle_union) {
      // Each query head's weights (in place), its cut at p, the union over the group.
      cuda::rule_unit_weights(sel_scores_, ld, kv_len, step_B_ * Hq, Hq, ~0u, 1, sel_scores_, st);
      rp.mass = sp_.oracle_p;
      cuda::rule_criteria(sel_scores_, ld, kv_len, step_B_ * Hq, Hq, ~0u, rp, crit_, st);
      cuda::rule_lists(sel_scores_, ld, crit_, kv_len, step_B_, Hkv, G, ~0u, 1, false, sets_, ld,
                       set_n_, st);
    } else {
      cuda::oracle_group_weights(sel_scores_, ld, kv_len, step_B_, Hq, Hkv, oracle_w_, st);
      rp.mass = sp_.oracle_p * G;
      cuda::rule_criteria(oracle_w_, ld, kv_len, step_B_ * Hkv, Hkv, ~0u, rp, crit_, st);
      cuda::rule_lists(oracle_w_, ld, crit_, kv_len, step_B_, Hkv, 1, ~0u, 1, false, sets_, ld,
                       set_n_, st);
    }
    cuda::counted_compact_lists(sets_, ld, set_n_, step_B_ * Hkv, sel_off_, sel_idx_, st);
    if (trace) trace_lists(l), trace_scores(l);
    sparse_->run(q, kc, vc, sel_off_, sel_idx_, att, scale, st, 0, nullptr, 0, sel_skip(l));
  }

  float* oracle_w_ = nullptr;           // group=mean: the group weights W
  cuda::RuleCrit* crit_ = nullptr;      // per score row: its cut
  int32_t* sets_ = nullptr;             // strided sets [max_batch * Hkv][ld]
  int32_t* set_n_ = nullptr;            // their sizes
};

}  // namespace

const GpuMethodKind gpu_oracle_topp = SPADE_GPU_METHOD_KIND(GpuOracleTopP);

}  // namespace spade
#endif  // SPADE_HAVE_CUDA
