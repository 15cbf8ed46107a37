// GpuQuest (quest.h). Layout / bytes: f32 page scores [max_batch * Hkv][seq_pages_cap] (+256 B)
// after the lists; the lists hold max_batch * Hkv * max(1, min(budget / 16, seq_pages_cap))
// page entries. Kernels: backend/cuda/sparse_attention.h (quest_select: exact or tensor-core
// page scores, radix top-k writing the CSR lists; SparseAttention over Chunk16 entries).
#if defined(SPADE_HAVE_CUDA)
#include "sparse/gpu/quest.h"

#include <algorithm>

#include "core/error.h"
#include "sparse/gpu/registry.h"

namespace spade {

namespace {
cudaStream_t S_(void* p) { return static_cast<cudaStream_t>(p); }
}  // namespace

int64_t GpuQuest::quest_sel_cap(const GpuMethodContext& ctx, const CudaSparse& sp) {
  const int64_t kp = sp.budget / 16;
  return int64_t(ctx.max_batch) * ctx.cfg.n_kv_heads *
         std::max<int64_t>(1, std::min(kp, ctx.seq_pages_cap));
}

size_t GpuQuest::quest_bytes(const GpuMethodContext& ctx) {
  return size_t(int64_t(ctx.max_batch) * ctx.cfg.n_kv_heads * ctx.seq_pages_cap) * 4 + 256;
}

size_t GpuQuest::arena_bytes_of(const GpuMethodContext& ctx, const CudaSparse& sp) {
  return base_bytes(ctx, sp) + lists_bytes(ctx, quest_sel_cap(ctx, sp), 1) + quest_bytes(ctx) +
         twilight_bytes(ctx, sp, quest_sel_cap(ctx, sp), ctx.cfg.n_kv_heads,
                        cuda::SelGran::Chunk16);
}

std::string GpuQuest::describe_spec(const CudaSparse& sp) {
  return cat("quest budget=", sp.budget, " page_size=16 pages=", sp.budget / 16,
             " dense_layers=", sp.dense_layers, " group=max scores=",
             sp.quest_fast ? "fast" : "exact");
}

void GpuQuest::check() const {
  SelectingMethod::check();
  SPADE_CHECK(ctx_.page_size == 16, "--device cuda: ", sp_.describe(),
              " needs KV pages of 16 tokens (got ", ctx_.page_size, ")");
  SPADE_CHECK(ctx_.hooks.quest_meta, "--device cuda: this model keeps no Quest page metadata, "
              "so '", sp_.describe(), "' cannot run on it (build the model with the method, "
              "or with CudaModelOptions::any_method)");
}

void GpuQuest::alloc_state(cuda::DeviceArena& A) {
  quest_scores_ = A.alloc_n<float>(
      size_t(int64_t(ctx_.max_batch) * ctx_.cfg.n_kv_heads * ctx_.seq_pages_cap), "quest scores");
}

void GpuQuest::list_entries(const SeqInput* seqs, int n, bool& any_sparse) {
  const int P = ctx_.page_size, Hkv = ctx_.cfg.n_kv_heads;
  const int64_t kp = sp_.budget / 16;
  for (int i = 0; i < n; ++i) {
    const int64_t L = seqs[i].pages->length + 1;
    const int np = int((L + P - 1) / P);
    any_sparse |= kp < np;
    for (int h = 0; h < Hkv; ++h) plan_max_entries_.push_back(int(std::min<int64_t>(kp, np)));
  }
}

int64_t GpuQuest::list_rows(int, int64_t L) const {
  return int64_t(ctx_.cfg.n_kv_heads) * std::min<int64_t>(sp_.budget / 16 * 16, L);
}

void GpuQuest::select_pages(int l, const void* q) {
  using cuda::bf16;
  const int Hq = ctx_.cfg.n_heads, Hkv = ctx_.cfg.n_kv_heads, D = ctx_.cfg.head_dim;
  const size_t layer_meta = size_t(ctx_.n_pages) * size_t(Hkv) * 2 * D;
  // The top-k writes the CSR lists itself (QuestArgs::csr_off): no compaction launch.
  const bf16* meta = static_cast<const bf16*>(ctx_.hooks.quest_meta) + size_t(l) * layer_meta;
  cuda::QuestArgs qa{static_cast<const bf16*>(q), meta, sparse_->dev_page_table(),
                     sparse_->dev_page_off(), sparse_->dev_kv_len(), quest_scores_, sel_idx_,
                     step_B_, Hq, Hkv, D, step_max_pages_, int(sp_.budget / 16)};
  qa.fast = sp_.quest_fast;
  qa.csr_off = sel_off_;
  cuda::quest_select(qa, S_(run_));
  if (trace) trace_lists(l);
}

TwilightBaseLists GpuQuest::twilight_base(int l, const void* q, const void* kc) {
  select_pages(l, q);
  return SelectingMethod::twilight_base(l, q, kc);
}

void GpuQuest::attend_lists(int l, const void* q, const void* kc, const void* vc, void* att,
                            float scale) {
  select_pages(l, q);
  SelectingMethod::attend_lists(l, q, kc, vc, att, scale);
}

const GpuMethodKind gpu_quest = SPADE_GPU_METHOD_KIND(GpuQuest);

}  // namespace spade
#endif  // SPADE_HAVE_CUDA
