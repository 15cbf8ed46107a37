// LycheeDecode on the GPU (hybrid heads; the CPU's LycheeDecodeMethod, every selection mode
// and block size). Per decode layer l:
//   - every KV head a retrieval head (layer 0): the dense decode kernel, emitting the
//     group-mean scores when a later layer needs sets;
//   - otherwise one launch of the sparse kernel with the layer's retrieval heads flagged
//     dense (they read their whole context, pooled with the sparse heads into equal work
//     items: LycheeDecode appendix C) and emitting their group-mean scores; the sparse heads
//     read the sets they inherited.
// Then the retrieval heads' next-layer sets replace their heads' rows of the set table, and
// the table is compacted into the CSR lists the next layer reads, on a side stream that
// overlaps the layer's GEMMs (fork_selection). The sets never leave the GPU. The sets:
//   mode=topk block=1  the top-`budget` tokens by group-mean score (= by the CPU's softmax
//                      weight of the group-averaged query, a monotone map), topk_rows;
//   any other rule     the CPU's ld_select on the softmax of those scores (rule_select.h):
//                      unit weights of `block` tokens, then topk / ratio / topp / threshold's
//                      exact cut (weight descending, ties by the lower unit). Lists hold
//                      64-token blocks (SelGran::Block64) at block 64, 16-token chunks
//                      (Chunk16) at block 16, else token positions (the units expanded);
//                      Block64 / Chunk16 need KV pages of a multiple of 16 tokens, else
//                      tokens.
//
// Layout / bytes (after SelectingMethod's lists, selecting.h, whose SparseAttention holds one
// plan per distinct retrieval-head pattern): f32 group-mean scores [max_batch * Hkv][ld]
// (ld = seq_pages_cap * page_size), i32 row lengths [max_batch * Hkv], i32 strided sets
// [max_batch * Hkv][k] (topk block 1: k = min(budget, max_context); rules: k = ld), + 3 x
// 256 B; rules add f32 unit weights [max_batch * Hkv][ld], RuleCrit [max_batch * Hkv] and
// i32 set sizes [max_batch * Hkv] (+ 3 x 256 B); the lists hold max_batch * Hkv * k
// entries; the long-row top-k scratch where it applies (k = 1 for rules).
#if defined(SPADE_HAVE_CUDA)
#include <algorithm>
#include <cmath>

#include "backend/cuda/attention.h"
#include "backend/cuda/rule_select.h"
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

  // Token top-k: its k; rules: 1 (no top-k runs).
  static int k_of(const GpuMethodContext& ctx, const CudaSparse& sp) {
    return sp.ld_rule() ? 1 : int(std::min<int64_t>(sp.budget, ctx.cfg.max_context));
  }
  // Entries of one row of the set table: k tokens, or (rules) up to the longest context.
  static int64_t row_cap(const GpuMethodContext& ctx, const CudaSparse& sp) {
    return sp.ld_rule() ? ctx.seq_pages_cap * ctx.page_size
                        : std::min<int64_t>(sp.budget, ctx.cfg.max_context);
  }
  static int64_t cap(const GpuMethodContext& ctx, const CudaSparse& sp) {
    return int64_t(ctx.max_batch) * ctx.cfg.n_kv_heads * row_cap(ctx, sp);
  }
  static size_t arena_bytes_of(const GpuMethodContext& ctx, const CudaSparse& sp) {
    const int64_t mb = ctx.max_batch, Hkv = ctx.cfg.n_kv_heads, P = ctx.page_size;
    const int64_t k = row_cap(ctx, sp);
    size_t own = size_t(mb * Hkv) * size_t(ctx.seq_pages_cap * P) * 4 +
                 size_t(mb * Hkv) * 4 + size_t(mb * Hkv * k) * 4 + 3 * 256;
    if (sp.ld_rule())
      own += size_t(mb * Hkv) * size_t(ctx.seq_pages_cap * P) * 4 +
             size_t(mb * Hkv) * sizeof(cuda::RuleCrit) + size_t(mb * Hkv) * 4 + 3 * 256;
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
    static const char* kModes[] = {"topk", "ratio", "topp", "threshold"};
    const int m = std::clamp(sp.ld_mode, 0, 3);
    const std::string rule =
        m == 0 ? cat("budget=", sp.budget)
        : m == 1 ? cat("ratio=", sp.ld_ratio)
        : m == 2 ? cat("p=", sp.ld_p)
                 : cat("tau=", sp.ld_tau);
    return cat("lycheedecode mode=", kModes[m], " ", rule, " block=", sp.ld_block, " roles=",
               sp.roles_source, " retrieval heads ", n, "/", tot, " (retrieval heads in the "
               "sparse kernel's launch with their group-mean scores, ",
               sp.ld_rule() ? cat("the CPU's selection rule on their softmax weights, ",
                                  sp.ld_block == 1 ? std::string("token") : cat(sp.ld_block, "-token"),
                                  " units")
                            : std::string("token top-k"),
               " on the GPU; hybrid heads pooled into equal work items)");
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
  // Rules: 64-token blocks or 16-token chunks as list entries where the KV pages allow.
  cuda::SelGran gran() const override {
    if (!sp_.ld_rule() || ctx_.page_size % 16 != 0) return cuda::SelGran::Token;
    if (sp_.ld_block == 64) return cuda::SelGran::Block64;
    if (sp_.ld_block == 16) return cuda::SelGran::Chunk16;
    return cuda::SelGran::Token;
  }
  bool expands() const { return gran() == cuda::SelGran::Token && sp_.ld_block > 1; }
  void plan_kernels(void* stream) override {
    sparse_->plan_patterns(plan_seqs_, gran(), ctx_.cfg.n_kv_heads, plan_max_entries_,
                           ld_patterns_, S_(stream));
  }
  // Units a sparse head's set keeps at context L (the CPU's ld_select k; topp and
  // threshold: every unit, a bound), and whether that is fewer than all of them.
  int64_t rule_units(int64_t L) const {
    const int64_t B = sp_.ld_block, U = (L + B - 1) / B;
    int64_t k = U;
    if (sp_.ld_mode == 0) k = (std::max<int64_t>(1, sp_.budget) + B - 1) / B;
    else if (sp_.ld_mode == 1)
      k = (std::max<int64_t>(1, int64_t(std::ceil(sp_.ld_ratio * double(L)))) + B - 1) / B;
    return std::clamp<int64_t>(k, 1, U);
  }
  // Tokens of a set of k units (at most L).
  int64_t rule_tokens(int64_t L) const { return std::min<int64_t>(rule_units(L) * sp_.ld_block, L); }
  void list_entries(const SeqInput* seqs, int n, bool& any_sparse) override {
    if (!sp_.ld_rule()) return SelectingMethod::list_entries(seqs, n, any_sparse);
    const bool units = gran() != cuda::SelGran::Token;
    for (int i = 0; i < n; ++i) {
      const int64_t L = seqs[i].pages->length + 1, U = (L + sp_.ld_block - 1) / sp_.ld_block;
      const int64_t k = rule_units(L);
      // topp / threshold sets depend on the weights: the lists are always read.
      any_sparse |= sp_.ld_mode >= 2 || k < U;
      for (int h = 0; h < ctx_.cfg.n_kv_heads; ++h)
        plan_max_entries_.push_back(int(units ? k : rule_tokens(L)));
    }
  }
  // Exact for topk and ratio; an upper bound for topp and threshold (every token).
  int64_t list_rows(int l, int64_t L) const override {
    const int64_t b = sp_.ld_rule() ? (sp_.ld_mode >= 2 ? L : rule_tokens(L))
                                    : std::min<int64_t>(sp_.budget, L);
    int64_t rows = 0;
    for (int h = 0; h < ctx_.cfg.n_kv_heads; ++h) rows += sp_.retrieval[size_t(l)][size_t(h)] ? L : b;
    return rows;
  }
  void alloc_scores(cuda::DeviceArena& A) override {
    const int64_t rows = int64_t(ctx_.max_batch) * ctx_.cfg.n_kv_heads;
    sel_scores_ = A.alloc_n<float>(size_t(rows) * size_t(score_ld()), "tidal scores");
    tidal_rown_ = A.alloc_n<int32_t>(size_t(rows), "tidal row lengths");
    tidal_strided_ = A.alloc_n<int32_t>(size_t(rows) * size_t(row_cap(ctx_, sp_)), "tidal top-k");
    if (!sp_.ld_rule()) return;
    unit_w_ = A.alloc_n<float>(size_t(rows) * size_t(score_ld()), "lycheedecode unit weights");
    crit_ = A.alloc_n<cuda::RuleCrit>(size_t(rows), "lycheedecode criteria");
    set_n_ = A.alloc_n<int32_t>(size_t(rows), "lycheedecode set sizes");
  }
  // Tests: the traced lists as token positions (blocks / chunks expanded).
  void trace_tokens(int layer) {
    trace_lists(layer);
    if (gran() == cuda::SelGran::Token) return;
    const int64_t B = sp_.ld_block;
    auto& rows = trace->sel[size_t(layer)];
    for (size_t r = 0; r < rows.size(); ++r) {
      const int64_t L = plan_seqs_[r / size_t(ctx_.cfg.n_kv_heads)].kv_len;
      std::vector<int32_t> t;
      for (int32_t u : rows[r])
        for (int64_t j = u * B; j < std::min<int64_t>(L, (u + 1) * B); ++j) t.push_back(int32_t(j));
      rows[r] = std::move(t);
    }
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
    const int32_t* kv_len = sparse_->dev_kv_len();
    if (sp_.ld_rule()) {
      // The CPU's ld_select: softmax, unit weights, the rule's cut, the kept units.
      cuda::RuleParams rp;
      rp.mode = sp_.ld_mode == 0   ? cuda::RuleMode::TopK
                : sp_.ld_mode == 1 ? cuda::RuleMode::Ratio
                : sp_.ld_mode == 2 ? cuda::RuleMode::TopP
                                   : cuda::RuleMode::Threshold;
      rp.block = sp_.ld_block;
      rp.k_units = (std::max<int64_t>(1, sp_.budget) + sp_.ld_block - 1) / sp_.ld_block;
      rp.ratio = sp_.ld_ratio;
      rp.mass = sp_.ld_p;
      rp.tau = sp_.ld_tau;
      cuda::rule_unit_weights(sel_scores_, ld, kv_len, step_B_ * Hkv, Hkv, heads, sp_.ld_block,
                              unit_w_, ss);
      cuda::rule_criteria(unit_w_, ld, kv_len, step_B_ * Hkv, Hkv, heads, rp, crit_, ss);
      cuda::rule_lists(unit_w_, ld, crit_, kv_len, step_B_, Hkv, 1, heads, sp_.ld_block,
                       expands(), tidal_strided_, row_cap(ctx_, sp_), set_n_, ss);
      cuda::counted_compact_lists(tidal_strided_, row_cap(ctx_, sp_), set_n_, step_B_ * Hkv,
                                  sel_off_, sel_idx_, ss);
    } else {
      cuda::row_lengths(kv_len, step_B_, Hkv, tidal_rown_, ss, heads);
      select_topk(sel_scores_, tidal_rown_, step_B_ * Hkv, k, tidal_strided_, ss);
      cuda::token_compact_lists(tidal_strided_, kv_len, step_B_, Hkv, k, sel_off_, sel_idx_, ss);
    }
    if (trace) trace_tokens(layer), trace_scores(layer);
  }

  // Per layer, the index of its retrieval-head pattern in ld_patterns_ (the SparseAttention
  // plan's dense heads), or -1 when every head is a retrieval head.
  std::vector<int> ld_pattern_of_;
  std::vector<std::vector<uint8_t>> ld_patterns_;
  // Rules: the unit weights of the retrieval heads' rows, their cuts, the set sizes.
  float* unit_w_ = nullptr;
  cuda::RuleCrit* crit_ = nullptr;
  int32_t* set_n_ = nullptr;
};

}  // namespace

const GpuMethodKind gpu_lycheedecode = SPADE_GPU_METHOD_KIND(GpuLycheeDecode);

}  // namespace spade
#endif  // SPADE_HAVE_CUDA
