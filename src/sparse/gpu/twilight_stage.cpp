// TwilightStage (twilight_stage.h). Layout / bytes: TwilightPruner::arena_bytes(max_batch, Hq,
// Hkv, max_slots) + SparseAttention::arena_bytes(max_batch, n_pages, Hq, Hkv, D) (default
// splits) + 4 MiB, + for shared base lists i32 [max_batch * Hkv + 1] offsets and
// [max_batch * Hkv * max_slots] entries + 512 B, + where it prunes whole contexts i32
// [max_batch * Hkv + 1] offsets and [max_batch * Hkv * seq_pages_cap * page_size / 16] chunk
// entries + 512 B (max_slots then at least seq_pages_cap * page_size). Launches per pruned layer, on the method's
// stream: (shared bases) the per-head copy, the pruner's estimate and top-p, the attention
// over the kept lists (read in place at their fixed stride with their counts).
#if defined(SPADE_HAVE_CUDA)
#include "sparse/gpu/twilight_stage.h"

#include <algorithm>

#include "backend/cuda/twilight.h"
#include "backend/cuda/twilight_base.h"
#include "core/error.h"

namespace spade {

namespace {
cudaStream_t S_(void* p) { return static_cast<cudaStream_t>(p); }
}  // namespace

int64_t TwilightStage::slots(const GpuMethodContext& ctx, int64_t max_slots, bool full) {
  int64_t ms = std::max<int64_t>(1, max_slots);
  if (full) ms = std::max<int64_t>(ms, (ctx.seq_pages_cap * ctx.page_size + 15) / 16 * 16);
  return ms;
}

size_t TwilightStage::arena_bytes(const GpuMethodContext& ctx, int64_t max_slots, bool shared,
                                  bool full) {
  const ModelConfig& c = ctx.cfg;
  const int64_t ms = slots(ctx, max_slots, false), lists = int64_t(ctx.max_batch) * c.n_kv_heads;
  const int64_t pruner_ms = slots(ctx, max_slots, full);
  size_t b = cuda::TwilightPruner::arena_bytes(ctx.max_batch, c.n_heads, c.n_kv_heads,
                                               int(pruner_ms)) +
             cuda::SparseAttention::arena_bytes(ctx.max_batch, ctx.n_pages, c.n_heads,
                                                c.n_kv_heads, c.head_dim) +
             (4u << 20);
  if (shared) b += size_t(lists + 1) * 4 + size_t(lists * ms) * 4 + 512;
  if (full) b += size_t(lists + 1) * 4 + size_t(lists * (pruner_ms / 16)) * 4 + 512;
  return b;
}

TwilightStage::TwilightStage(cuda::DeviceArena& A, const GpuMethodContext& ctx,
                             const CudaSparse& sp, int64_t max_slots, bool shared, bool full)
    : ctx_(ctx), max_slots_(slots(ctx, max_slots, full)) {
  const ModelConfig& c = ctx_.cfg;
  SPADE_CHECK(max_slots_ <= (int64_t(1) << 30), "twilight: base lists of ", max_slots_,
              " tokens");
  pruner_ = std::make_unique<cuda::TwilightPruner>(A, ctx_.max_batch, c.n_heads, c.n_kv_heads,
                                                   c.head_dim, ctx_.page_size, int(max_slots_),
                                                   sp.twilight_p, sp.twilight_eps);
  kept_ = std::make_unique<cuda::SparseAttention>(A, ctx_.max_batch, ctx_.n_pages, c.n_heads,
                                                  c.n_kv_heads, c.head_dim, ctx_.page_size);
  kept_->set_deterministic(ctx_.deterministic);
  const size_t lists = size_t(ctx_.max_batch) * size_t(c.n_kv_heads);
  if (shared) {
    exp_off_ = A.alloc_n<int32_t>(lists + 1, "twilight base offsets (per KV head)");
    exp_idx_ = A.alloc_n<int32_t>(lists * size_t(slots(ctx, max_slots, false)),
                                  "twilight base lists (per KV head)");
  }
  if (full) {
    SPADE_CHECK(ctx_.page_size % 16 == 0, "twilight: pruning whole contexts needs KV pages of "
                "a multiple of 16 tokens (got ", ctx_.page_size, ")");
    full_off_ = A.alloc_n<int32_t>(lists + 1, "twilight context offsets");
    full_idx_ = A.alloc_n<int32_t>(lists * size_t(max_slots_ / 16), "twilight context chunks");
  }
}

TwilightStage::~TwilightStage() = default;

void TwilightStage::plan(const std::vector<cuda::SparseSeq>& seqs, const std::vector<int>& kept_max,
                         void* stream) {
  // Kept lists: upper bounds only (the real lengths are read on the GPU).
  kept_->plan(seqs, cuda::SelGran::Token, ctx_.cfg.n_kv_heads, kept_max, nullptr, S_(stream));
}

void TwilightStage::attend(const TwilightBaseLists& base, int B, int layer, const void* q_,
                           const void* kc, const void* vc, void* att, float scale, void* stream,
                           const cuda::SelSkip& skip, GpuSelectionTrace* trace) {
  using cuda::bf16;
  const int Hkv = ctx_.cfg.n_kv_heads, D = ctx_.cfg.head_dim, P = ctx_.page_size;
  const size_t layer_rows = size_t(ctx_.n_pages) * size_t(Hkv) * P;
  const bf16* q = static_cast<const bf16*>(q_);
  cudaStream_t st = S_(stream);
  cuda::TwilightStep ts;
  ts.q = q;
  ts.codes = ctx_.hooks.k_int4 + size_t(layer) * layer_rows * size_t(D / 2);
  ts.sz = ctx_.hooks.k_int4_sz + size_t(layer) * layer_rows;
  ts.page_table = base.page_table, ts.page_off = base.page_off, ts.kv_len = base.kv_len;
  ts.base_off = base.off, ts.base_idx = base.idx, ts.gran = base.gran;
  if (base.shared) {
    SPADE_CHECK(exp_off_, "twilight: shared base lists without their per-head buffer");
    cuda::twilight_expand_lists(base.off, base.idx, B, Hkv, exp_off_, exp_idx_, st);
    ts.base_off = exp_off_, ts.base_idx = exp_idx_;
  }
  ts.B = B, ts.scale = scale;
  pruner_->run(ts, st);
  if (trace) trace_kept(B, layer, stream, trace);
  kept_->run(q, static_cast<const bf16*>(kc), static_cast<const bf16*>(vc),
             pruner_->kept_strided_off(), pruner_->kept_strided_idx(), static_cast<bf16*>(att),
             scale, st, 0, nullptr, 0, skip, pruner_->kept_count());
}

TwilightBaseLists TwilightStage::full_lists(int B, const int32_t* kv_len, void* stream) {
  SPADE_CHECK(full_off_, "twilight: no context lists (the stage was built without full)");
  cuda::twilight_full_lists(kv_len, B, ctx_.cfg.n_kv_heads, full_off_, full_idx_, S_(stream));
  TwilightBaseLists b;
  b.off = full_off_, b.idx = full_idx_, b.gran = cuda::SelGran::Chunk16, b.shared = false;
  return b;
}

void TwilightStage::append_graph_key(std::vector<int>& k) const {
  for (int n : kept_->pattern_items()) k.push_back(n);
}

void TwilightStage::trace_kept(int B, int layer, void* stream, GpuSelectionTrace* trace) {
  const int lists = B * ctx_.cfg.n_kv_heads, G = ctx_.cfg.n_heads / ctx_.cfg.n_kv_heads;
  const size_t ms = size_t(pruner_->max_slots());
  std::vector<int32_t> cnt(static_cast<size_t>(lists)), kept(size_t(lists) * ms);
  std::vector<float> lg(size_t(lists) * G * ms);
  SPADE_CUDA(cudaStreamSynchronize(S_(stream)));
  SPADE_CUDA(cudaMemcpy(cnt.data(), pruner_->kept_count(), 4 * cnt.size(), cudaMemcpyDeviceToHost));
  SPADE_CUDA(cudaMemcpy(kept.data(), pruner_->kept_strided_idx(), 4 * kept.size(), cudaMemcpyDeviceToHost));
  SPADE_CUDA(cudaMemcpy(lg.data(), pruner_->logits(), 4 * lg.size(), cudaMemcpyDeviceToHost));
  auto& tk = trace->kept;
  auto& tl = trace->logits;
  if (tk.size() <= size_t(layer)) tk.resize(size_t(layer) + 1), tl.resize(size_t(layer) + 1);
  tk[size_t(layer)].assign(size_t(lists), {});
  tl[size_t(layer)].assign(size_t(lists) * G, {});
  for (int i = 0; i < lists; ++i) {
    tk[size_t(layer)][size_t(i)].assign(kept.begin() + int64_t(i) * int64_t(ms),
                                        kept.begin() + int64_t(i) * int64_t(ms) + cnt[size_t(i)]);
    for (int g = 0; g < G; ++g) {
      const auto b = lg.begin() + (int64_t(i) * G + g) * int64_t(ms);
      tl[size_t(layer)][size_t(i) * G + g].assign(b, b + int64_t(ms));
    }
  }
}

std::string twilight_stage_describe(const CudaSparse& sp, const std::string& base) {
  return cat("twilight p=", sp.twilight_p, " eps=", sp.twilight_eps,
             " head_combine=union keys=int4 (GPU: INT4 copy written by the KV append)"
             " dense_layers=", sp.twilight_dense_layers, " over [", base, "]");
}

}  // namespace spade
#endif  // SPADE_HAVE_CUDA
