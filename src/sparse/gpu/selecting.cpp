// SelectingMethod and TokenTopKMethod (selecting.h). Layout / bytes: lists_bytes() = i32 CSR
// offsets [max_batch * Hkv + 1] + entries [sel_cap] + 2 x 256 B alignment, + the SparseAttention
// workspace (SparseAttention::arena_bytes with kSparseMaxSplit splits and n_patterns plans)
// + 4 MiB; TokenTopKMethod's long-row top-k scratch: cuda::topk_long_scratch_bytes(max_batch *
// score_rows rows of seq_pages_cap * page_size, k) + 256 B where the one-pass top-k does not
// cover the longest row; Twilight's stage over the selector: twilight_bytes() (selecting.h,
// twilight_stage.h). Here: the decode step's list plan (the dense kernel when every list
// covers its context, the CPU's set_dense), the rows each request reads, the attention over
// the lists, the token top-k and the test traces.
#if defined(SPADE_HAVE_CUDA)
#include "sparse/gpu/selecting.h"

#include <algorithm>

#include "backend/cuda/attention.h"
#include "core/error.h"

namespace spade {

namespace {
cudaStream_t S_(void* p) { return static_cast<cudaStream_t>(p); }
}  // namespace

size_t SelectingMethod::lists_bytes(const GpuMethodContext& ctx, int64_t sel_cap,
                                    int n_patterns) {
  const ModelConfig& c = ctx.cfg;
  const int64_t Hq = c.n_heads, Hkv = c.n_kv_heads, D = c.head_dim, mb = ctx.max_batch;
  size_t b = size_t(sel_cap + mb * Hkv + 1) * 4 + 2 * 256;
  b += cuda::SparseAttention::arena_bytes(int(mb), ctx.n_pages, int(Hq), int(Hkv), int(D),
                                          kSparseMaxSplit, std::max(1, n_patterns)) +
       (4u << 20);
  return b;
}

namespace {
// Twilight over a selector: the most base tokens of one list, whether the lists are shared
// by a request's KV heads, whether it also prunes whole contexts (the selector's dense layers
// at or above twilight_dense_layers).
struct TwlShape {
  int64_t slots = 0;
  bool shared = false, full = false;
};
TwlShape twl_shape(const GpuMethodContext& ctx, const CudaSparse& sp, int64_t sel_cap,
                   int lists_per_req, cuda::SelGran gran) {
  TwlShape t;
  const int64_t lists = int64_t(ctx.max_batch) * std::max(1, lists_per_req);
  t.slots = std::max<int64_t>(1, sel_cap / lists) * (gran == cuda::SelGran::Chunk16 ? 16 : 1);
  t.shared = lists_per_req == 1 && ctx.cfg.n_kv_heads > 1;
  t.full = sp.twilight_dense() < std::min(sp.dense_layers, ctx.cfg.n_layers);
  return t;
}
}  // namespace

size_t SelectingMethod::twilight_bytes(const GpuMethodContext& ctx, const CudaSparse& sp,
                                       int64_t sel_cap, int lists_per_req, cuda::SelGran gran) {
  if (!sp.twilight_any()) return 0;
  const TwlShape t = twl_shape(ctx, sp, sel_cap, lists_per_req, gran);
  return TwilightStage::arena_bytes(ctx, t.slots, t.shared, t.full);
}

SelectingMethod::~SelectingMethod() {
  quiesce();
  twl_.reset();
  sparse_.reset();
}

void SelectingMethod::check() const {
  const ModelConfig& c = ctx_.cfg;
  SPADE_CHECK(c.n_kv_heads > 0 && c.n_heads % c.n_kv_heads == 0 &&
                  c.n_heads / c.n_kv_heads <= 16,
              "--device cuda sparse decode: GQA group ", c.n_heads / std::max(1, c.n_kv_heads),
              " > 16 is not supported");
  SPADE_CHECK(sp_.dense_layers >= 0 && sp_.dense_layers <= c.n_layers,
              "sparse dense_layers outside [0, ", c.n_layers, "]");
  if (sp_.twilight_any()) {
    SPADE_CHECK(ctx_.hooks.k_int4, "--device cuda: this model keeps no INT4 key copy, so '",
                sp_.describe(), "' cannot run on it (build the model with the method, or with "
                "CudaModelOptions::any_method)");
    SPADE_CHECK(sp_.twilight_dense() >= 0 && sp_.twilight_dense() <= c.n_layers,
                "twilight dense_layers outside [0, ", c.n_layers, "]");
  }
}

void SelectingMethod::alloc(cuda::DeviceArena& A) {
  const ModelConfig& c = ctx_.cfg;
  const int64_t Hkv = c.n_kv_heads, mb = ctx_.max_batch;
  sparse_ = std::make_unique<cuda::SparseAttention>(A, int(mb), ctx_.n_pages, c.n_heads,
                                                    c.n_kv_heads, c.head_dim, ctx_.page_size,
                                                    kSparseMaxSplit, std::max(1, n_patterns()));
  sparse_->set_deterministic(ctx_.deterministic);  // split counts from each list alone
  alloc_state(A);
  sel_off_ = A.alloc_n<int32_t>(size_t(mb * Hkv + 1), "selection offsets");
  sel_idx_ = A.alloc_n<int32_t>(size_t(std::max<int64_t>(1, sel_cap())), "selection entries");
  if (sp_.twilight_any()) {
    const TwlShape t = twl_shape(ctx_, sp_, sel_cap(), lists_per_req(), gran());
    twl_full_ = t.full;
    twl_ = std::make_unique<TwilightStage>(A, ctx_, sp_, t.slots, t.shared, t.full);
  }
}

void SelectingMethod::plan_lists(const SeqInput* seqs, int n, bool decode) {
  const ModelConfig& c = ctx_.cfg;
  if (!decode || (sp_.dense_layers >= c.n_layers && !twl_full_)) return;
  const int P = ctx_.page_size;
  std::vector<cuda::SparseSeq>& sseq = plan_seqs_;
  sseq.resize(size_t(n));
  plan_max_entries_.clear();
  // Deterministic (batch-invariant): the sparse kernel for every decode row, also when its
  // lists cover the context, so that no row's kernel depends on the others' lengths.
  bool any_sparse = sp_.force_lists || always_sparse() || ctx_.deterministic;
  int max_np = 0;
  for (int i = 0; i < n; ++i) {
    const PageTable& pt = *seqs[i].pages;
    const int64_t L = pt.length + 1;
    const int np = int((L + P - 1) / P);
    sseq[size_t(i)] = {pt.pages.data(), np, int(L)};
    max_np = std::max(max_np, np);
  }
  list_entries(seqs, n, any_sparse);
  // Every list covering the whole context: the dense kernel (the CPU's set_dense).
  if (!any_sparse) return;
  plan_kernels(ctx_.stream);
  if (twl_) {
    // Kept lists: bounded by each (request, KV head)'s base tokens (the whole context where
    // Twilight also prunes the selector's dense layers).
    const int lpr = lists_per_req(), Hkv = c.n_kv_heads;
    const bool chunk = gran() == cuda::SelGran::Chunk16;
    plan_kept_max_.clear();
    for (int i = 0; i < n; ++i) {
      const int64_t L = sseq[size_t(i)].kv_len;
      for (int h = 0; h < Hkv; ++h) {
        const int64_t e = plan_max_entries_[size_t(i) * size_t(lpr) + size_t(lpr == 1 ? 0 : h)];
        const int64_t tokens = twl_full_ ? L : std::min<int64_t>(chunk ? e * 16 : e, L);
        plan_kept_max_.push_back(int(std::max<int64_t>(1, tokens)));
      }
    }
    twl_->plan(plan_seqs_, plan_kept_max_, ctx_.stream);
  }
  sparse_step_ = true;
  step_B_ = n;
  // Rounded up (within the score buffer's stride) so that the Quest launches, and a graph
  // keyed by them, change only every 1024 tokens.
  step_max_pages_ = int(std::min<int64_t>(ctx_.seq_pages_cap, (max_np + 63) / 64 * 64));
}

void SelectingMethod::list_entries(const SeqInput* seqs, int n, bool& any_sparse) {
  for (int i = 0; i < n; ++i) {
    const int64_t L = seqs[i].pages->length + 1;
    any_sparse |= sp_.budget < L;
    for (int h = 0; h < lists_per_req(); ++h)
      plan_max_entries_.push_back(int(std::min<int64_t>(sp_.budget, L)));
  }
}

void SelectingMethod::plan_kernels(void* stream) {
  sparse_->plan(plan_seqs_, gran(), lists_per_req(), plan_max_entries_, nullptr, S_(stream));
}

int64_t SelectingMethod::sparse_layer_rows(int l, int64_t L) const {
  if (l < sp_.dense_layers) return int64_t(ctx_.cfg.n_kv_heads) * L;
  return list_rows(l, L);
}

int64_t SelectingMethod::list_rows(int, int64_t L) const {
  return int64_t(ctx_.cfg.n_kv_heads) * std::min<int64_t>(sp_.budget, L);
}

void SelectingMethod::attend(int l, const void* q, const void* kc, const void* vc, void* att,
                             float scale) {
  if (sparse_step_ && twl_ && l >= sp_.twilight_dense() &&
      (l >= sp_.dense_layers || twl_full_))
    attend_pruned(l, q, kc, vc, att, scale);
  else if (sparse_step_ && l >= sp_.dense_layers) attend_lists(l, q, kc, vc, att, scale);
  else attend_dense(l, q, kc, vc, att, scale);
}

TwilightBaseLists SelectingMethod::twilight_base(int, const void*, const void*) {
  TwilightBaseLists b;
  b.off = sel_off_, b.idx = sel_idx_, b.gran = gran();
  b.shared = lists_per_req() == 1 && ctx_.cfg.n_kv_heads > 1;
  return b;
}

void SelectingMethod::attend_pruned(int l, const void* q, const void* kc, const void* vc,
                                    void* att, float scale) {
  // The selector's dense layers: every chunk of the context (the CPU prunes the base's dense
  // selection too); else the selector's lists of this layer.
  TwilightBaseLists b = l < sp_.dense_layers ? twl_->full_lists(step_B_, sparse_->dev_kv_len(), run_)
                                             : twilight_base(l, q, kc);
  b.page_table = sparse_->dev_page_table();
  b.page_off = sparse_->dev_page_off();
  b.kv_len = sparse_->dev_kv_len();
  twl_->attend(b, step_B_, l, q, kc, vc, att, scale, run_, sel_skip(l), trace);
}

void SelectingMethod::attend_lists(int l, const void* q, const void* kc, const void* vc,
                                   void* att, float scale) {
  using cuda::bf16;
  sparse_->run(static_cast<const bf16*>(q), static_cast<const bf16*>(kc),
               static_cast<const bf16*>(vc), sel_off_, sel_idx_, static_cast<bf16*>(att), scale,
               S_(run_), 0, nullptr, 0, sel_skip(l));
}

void SelectingMethod::append_graph_key(std::vector<int>& k) const {
  // The dense plan's shape; for a sparse step its batch, Quest stride and every plan's work
  // items.
  GpuMethod::append_graph_key(k);
  if (!sparse_step_) return;
  k.push_back(step_B_);
  k.push_back(step_max_pages_);
  for (int n : sparse_->pattern_items()) k.push_back(n);
  if (twl_) twl_->append_graph_key(k);
}

void SelectingMethod::trace_lists(int layer) {
  const int rows = step_B_ * lists_per_req();
  std::vector<int32_t> off(size_t(rows) + 1);
  SPADE_CUDA(cudaMemcpyAsync(off.data(), sel_off_, sizeof(int32_t) * off.size(),
                             cudaMemcpyDeviceToHost, S_(run_)));
  SPADE_CUDA(cudaStreamSynchronize(S_(run_)));
  std::vector<int32_t> idx(size_t(off.back()));
  SPADE_CUDA(cudaMemcpyAsync(idx.data(), sel_idx_, sizeof(int32_t) * idx.size(),
                             cudaMemcpyDeviceToHost, S_(run_)));
  SPADE_CUDA(cudaStreamSynchronize(S_(run_)));
  auto& t = trace->sel;
  if (t.size() <= size_t(layer)) t.resize(size_t(layer) + 1);
  t[size_t(layer)].assign(size_t(rows), {});
  for (int r = 0; r < rows; ++r)
    t[size_t(layer)][size_t(r)].assign(idx.begin() + off[size_t(r)], idx.begin() + off[size_t(r) + 1]);
}

// --- TokenTopKMethod.

size_t TokenTopKMethod::topk_bytes(const GpuMethodContext& ctx, int k, int score_rows) {
  const int64_t ld = ctx.seq_pages_cap * ctx.page_size;
  if (!cuda::topk_long_applies(ld, k)) return 0;
  return cuda::topk_long_scratch_bytes(ctx.max_batch * score_rows, ld, k) + 256;
}

void TokenTopKMethod::alloc_state(cuda::DeviceArena& A) {
  alloc_scores(A);
  const int64_t ld = score_ld();
  if (cuda::topk_long_applies(ld, k_))
    topk_long_ = A.alloc_n<unsigned char>(
        cuda::topk_long_scratch_bytes(ctx_.max_batch * score_rows_, ld, k_),
        "long-row top-k scratch");
}

void TokenTopKMethod::select_topk(const float* scores, const int32_t* n, int rows, int k,
                                  int32_t* out, void* stream) {
  const int64_t ld = score_ld();
  if (topk_long_) cuda::topk_rows_long(scores, ld, n, rows, k, out, topk_long_, S_(stream));
  else cuda::topk_rows(scores, ld, n, rows, k, out, S_(stream));
}

void TokenTopKMethod::trace_scores(int layer) {
  // Rows per request: Tidal's KV heads (group means), LessIsMore's query heads.
  const int Hkv = score_rows_;
  const int rows = step_B_ * Hkv;
  const int64_t ld = score_ld();
  std::vector<int32_t> len(static_cast<size_t>(step_B_));
  SPADE_CUDA(cudaMemcpyAsync(len.data(), sparse_->dev_kv_len(), sizeof(int32_t) * len.size(),
                             cudaMemcpyDeviceToHost, S_(run_)));
  SPADE_CUDA(cudaStreamSynchronize(S_(run_)));
  auto& t = trace->scores;
  if (t.size() <= size_t(layer)) t.resize(size_t(layer) + 1);
  t[size_t(layer)].assign(size_t(rows), {});
  for (int r = 0; r < rows; ++r) {
    auto& v = t[size_t(layer)][size_t(r)];
    v.resize(size_t(len[size_t(r / Hkv)]));
    const float* src = traced_scores();
    SPADE_CUDA(cudaMemcpy(v.data(), src + int64_t(r) * ld, sizeof(float) * v.size(),
                          cudaMemcpyDeviceToHost));
  }
}

}  // namespace spade
#endif  // SPADE_HAVE_CUDA
