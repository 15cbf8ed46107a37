// LycheeDecode on the GPU (hybrid heads; the CPU's LycheeDecodeMethod, mode topk with token
// units). Per decode layer l:
//   - every KV head a retrieval head (layer 0): the dense decode kernel, emitting the
//     group-mean scores when a later layer needs sets;
//   - otherwise one launch of the sparse kernel with the layer's retrieval heads flagged
//     dense (they read their whole context, pooled with the sparse heads into equal work
//     items: LycheeDecode appendix C) and emitting their group-mean scores; the sparse heads
//     read the sets they inherited.
// Then the retrieval heads' top-`budget` tokens by group-mean score (= by the CPU's softmax
// weight of the group-averaged query, a monotone map) replace their heads' rows of the set
// table, and the table is compacted into the CSR lists the next layer reads, on a side stream
// that overlaps the layer's GEMMs (fork_selection). The sets never leave the GPU.
//
// Layout / bytes (after SelectingMethod's lists, selecting.h, whose SparseAttention holds one
// plan per distinct retrieval-head pattern): f32 group-mean scores [max_batch * Hkv]
// [seq_pages_cap * page_size], i32 row lengths [max_batch * Hkv], i32 strided top-k
// [max_batch * Hkv][k] (k = min(budget, max_context)), + 3 x 256 B; the lists hold
// max_batch * Hkv * k entries; the long-row top-k scratch where it applies.
#if defined(SPADE_HAVE_CUDA)
#include <algorithm>

#include "backend/cuda/attention.h"
#include "core/error.h"
#include "sparse/gpu/registry.h"
#include "sparse/gpu/selecting.h"

namespace spade {

namespace {

cudaStream_t S_(void* p) { return static_cast<cudaStream_t>(p); }

// The distinct retrieval-head patterns of the layers that are not all retrieval heads (one
// SparseAttention plan each); pattern_of[layer] = its index or -1.
void ld_patterns(const CudaSparse& sp, const ModelConfig& c,
                 std::vector<std::vector<uint8_t>>& patterns, std::vector<int>& pattern_of) {
  patterns.clear();
  pattern_of.assign(size_t(c.n_layers), -1);
  SPADE_CHECK(int64_t(sp.retrieval.size()) == c.n_layers, "lycheedecode: roles for ",
              sp.retrieval.size(), " layers, the model has ", c.n_layers);
  for (int l = 0; l < c.n_layers; ++l) {
    const auto& r = sp.retrieval[size_t(l)];
    SPADE_CHECK(int64_t(r.size()) == c.n_kv_heads, "lycheedecode: roles for ", r.size(),
                " KV heads");
    if (std::all_of(r.begin(), r.end(), [](uint8_t x) { return x != 0; })) continue;
    auto it = std::find(patterns.begin(), patterns.end(), r);
    pattern_of[size_t(l)] = int(it - patterns.begin());
    if (it == patterns.end()) patterns.push_back(r);
  }
  if (patterns.empty()) patterns.push_back(std::vector<uint8_t>(size_t(c.n_kv_heads), 0));
}

class GpuLycheeDecode final : public TokenTopKMethod {
 public:
  GpuLycheeDecode(const GpuMethodContext& ctx, const CudaSparse& sp)
      : TokenTopKMethod(ctx, sp, k_of(ctx, sp), ctx.cfg.n_kv_heads) {
    ld_patterns(sp_, ctx_.cfg, ld_patterns_, ld_pattern_of_);
  }

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
    std::vector<std::vector<uint8_t>> pats;
    std::vector<int> pattern_of;
    ld_patterns(sp, ctx.cfg, pats, pattern_of);
    return base_bytes(ctx, sp) + lists_bytes(ctx, cap(ctx, sp), int(pats.size())) + own +
           topk_bytes(ctx, k_of(ctx, sp), ctx.cfg.n_kv_heads);
  }
  static std::string describe_spec(const CudaSparse& sp) {
    int n = 0, tot = 0;
    for (const auto& l : sp.retrieval)
      for (uint8_t r : l) n += r, ++tot;
    return cat("lycheedecode mode=topk budget=", sp.budget, " block=1 roles=", sp.roles_source,
               " retrieval heads ", n, "/", tot, " (retrieval heads in the sparse kernel's "
               "launch with their group-mean scores, token top-k on the GPU; hybrid heads "
               "pooled into equal work items)");
  }

  void attend(int l, const void* q, const void* kc, const void* vc, void* att,
              float scale) override {
    if (sparse_step_) ld_layer(l, q, kc, vc, att, scale);
    else attend_dense(l, q, kc, vc, att, scale);
  }

 private:
  bool uses_side_stream() const override { return true; }
  int64_t sel_cap() const override { return cap(ctx_, sp_); }
  int n_patterns() const override { return int(ld_patterns_.size()); }
  void plan_kernels(void* stream) override {
    sparse_->plan_patterns(plan_seqs_, cuda::SelGran::Token, ctx_.cfg.n_kv_heads,
                           plan_max_entries_, ld_patterns_, S_(stream));
  }
  int64_t list_rows(int l, int64_t L) const override {
    const int64_t b = std::min<int64_t>(sp_.budget, L);
    int64_t rows = 0;
    for (int h = 0; h < ctx_.cfg.n_kv_heads; ++h) rows += sp_.retrieval[size_t(l)][size_t(h)] ? L : b;
    return rows;
  }
  void alloc_scores(cuda::DeviceArena& A) override {
    const int64_t rows = int64_t(ctx_.max_batch) * ctx_.cfg.n_kv_heads;
    sel_scores_ = A.alloc_n<float>(size_t(rows) * size_t(score_ld()), "tidal scores");
    tidal_rown_ = A.alloc_n<int32_t>(size_t(rows), "tidal row lengths");
    tidal_strided_ = A.alloc_n<int32_t>(
        size_t(rows) * size_t(std::min<int64_t>(sp_.budget, ctx_.cfg.max_context)), "tidal top-k");
  }

  void ld_layer(int layer, const void* q_, const void* kc_, const void* vc_, void* att_,
                float scale) {
    using cuda::bf16;
    const bf16* q = static_cast<const bf16*>(q_);
    const bf16* kc = static_cast<const bf16*>(kc_);
    const bf16* vc = static_cast<const bf16*>(vc_);
    bf16* att = static_cast<bf16*>(att_);
    cudaStream_t st = S_(run_);
    const int Hkv = ctx_.cfg.n_kv_heads;
    const int k = int(std::min<int64_t>(sp_.budget, ctx_.cfg.max_context));
    const int64_t ld = score_ld();
    const std::vector<uint8_t>& roles = sp_.retrieval[size_t(layer)];
    const bool selects = layer + 1 < ctx_.cfg.n_layers &&
                         std::any_of(roles.begin(), roles.end(), [](uint8_t r) { return r != 0; });
    const int pattern = ld_pattern_of_[size_t(layer)];
    // BLASST over LycheeDecode skips only in launches that emit no scores.
    if (pattern < 0) {  // all retrieval heads: dense attention
      const cuda::DecodeScores ds{sel_scores_, ld};
      attn_->run(q, kc, vc, att, scale, st, selects ? cuda::BlasstSkip{} : blasst_skip(layer),
                 selects ? &ds : nullptr);
    } else {
      sparse_->run(q, kc, vc, sel_off_, sel_idx_, att, scale, st, pattern,
                   selects ? sel_scores_ : nullptr, ld, selects ? cuda::SelSkip{} : sel_skip(layer));
    }
    if (!selects) return;
    uint32_t heads = 0;
    for (int h = 0; h < Hkv; ++h)
      if (roles[size_t(h)]) heads |= 1u << h;
    // The next layer's sets: off the critical path until its attention (join).
    cudaStream_t ss = S_(fork_selection());
    cuda::row_lengths(sparse_->dev_kv_len(), step_B_, Hkv, tidal_rown_, ss, heads);
    select_topk(sel_scores_, tidal_rown_, step_B_ * Hkv, k, tidal_strided_, ss);
    cuda::token_compact_lists(tidal_strided_, sparse_->dev_kv_len(), step_B_, Hkv, k, sel_off_,
                              sel_idx_, ss);
    if (trace) trace_lists(layer), trace_scores(layer);
  }

  // Per layer, the index of its retrieval-head pattern in ld_patterns_ (the SparseAttention
  // plan's dense heads), or -1 when every head is a retrieval head.
  std::vector<int> ld_pattern_of_;
  std::vector<std::vector<uint8_t>> ld_patterns_;
};

}  // namespace

const GpuMethodKind gpu_lycheedecode = SPADE_GPU_METHOD_KIND(GpuLycheeDecode);

}  // namespace spade
#endif  // SPADE_HAVE_CUDA
