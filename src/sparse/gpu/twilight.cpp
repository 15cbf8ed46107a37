// Twilight on the GPU (`twilight:base=quest` / `quest+twilight`): Quest's page selection
// (GpuQuest), then top-p pruning of its tokens on an INT4 estimate of the keys (the model's
// GpuPageHooks::k_int4, written by every KV append), then attention over the kept tokens.
// Twilight prunes even when Quest keeps every page (as the CPU method does).
//
// Layout / bytes (after GpuQuest's): the TwilightPruner (TwilightPruner::arena_bytes for
// max_batch lists of at most budget / 16 * 16 base tokens: estimated logits, kept lists at a
// fixed stride with their counts) + a second SparseAttention over the kept Token lists
// (SparseAttention::arena_bytes with its default splits) + 4 MiB. Reads the INT4 codes
// [L][pages][Hkv][P][D/2] and their u32 scale/zero [L][pages][Hkv][P].
#if defined(SPADE_HAVE_CUDA)
#include <memory>

#include "backend/cuda/twilight.h"
#include "core/error.h"
#include "sparse/gpu/quest.h"
#include "sparse/gpu/registry.h"

namespace spade {

namespace {

cudaStream_t S_(void* p) { return static_cast<cudaStream_t>(p); }

class GpuTwilight final : public GpuQuest {
 public:
  GpuTwilight(const GpuMethodContext& ctx, const CudaSparse& sp) : GpuQuest(ctx, sp) {}
  ~GpuTwilight() override {
    quiesce();
    sparse_kept_.reset();
    twilight_.reset();
  }

  static size_t arena_bytes_of(const GpuMethodContext& ctx, const CudaSparse& sp) {
    const ModelConfig& c = ctx.cfg;
    const int64_t kp = sp.budget / 16;
    return GpuQuest::arena_bytes_of(ctx, sp) +
           cuda::TwilightPruner::arena_bytes(ctx.max_batch, c.n_heads, c.n_kv_heads,
                                             int(kp * 16)) +
           cuda::SparseAttention::arena_bytes(ctx.max_batch, ctx.n_pages, c.n_heads,
                                              c.n_kv_heads, c.head_dim) +
           (4u << 20);  // attention over the kept lists
  }

  static std::string describe_spec(const CudaSparse& sp) {
    return cat("twilight p=", sp.twilight_p, " eps=", sp.twilight_eps,
               " head_combine=union keys=int4 (GPU: INT4 copy written by the KV append)"
               " dense_layers=", sp.dense_layers, " over [quest budget=", sp.budget,
               " page_size=16 pages=", sp.budget / 16, " group=max scores=",
               sp.quest_fast ? "fast" : "exact", "]");
  }

  void append_graph_key(std::vector<int>& k) const override {
    GpuQuest::append_graph_key(k);
    if (!sparse_step_) return;
    for (int n : sparse_kept_->pattern_items()) k.push_back(n);
  }

 private:
  void check() const override {
    GpuQuest::check();
    SPADE_CHECK(ctx_.hooks.k_int4, "--device cuda: this model keeps no INT4 key copy, so '",
                sp_.describe(), "' cannot run on it (build the model with the method, or with "
                "CudaModelOptions::any_method)");
  }

  void alloc_state(cuda::DeviceArena& A) override {
    GpuQuest::alloc_state(A);
    const ModelConfig& c = ctx_.cfg;
    twilight_ = std::make_unique<cuda::TwilightPruner>(A, ctx_.max_batch, c.n_heads,
                                                       c.n_kv_heads, c.head_dim, ctx_.page_size,
                                                       int(sp_.budget / 16 * 16), sp_.twilight_p,
                                                       sp_.twilight_eps);
    sparse_kept_ = std::make_unique<cuda::SparseAttention>(A, ctx_.max_batch, ctx_.n_pages,
                                                           c.n_heads, c.n_kv_heads, c.head_dim,
                                                           ctx_.page_size);
    sparse_kept_->set_deterministic(ctx_.deterministic);
  }

  bool always_sparse() const override { return true; }

  void plan_kernels(void* stream) override {
    GpuQuest::plan_kernels(stream);
    // Kept lists: upper bounds only (the real lengths are read on the GPU).
    sparse_kept_->plan(plan_seqs_, cuda::SelGran::Token, ctx_.cfg.n_kv_heads, plan_kept_max_,
                       nullptr, S_(stream));
  }

  void attend_lists(int l, const void* q_, const void* kc, const void* vc, void* att,
                    float scale) override {
    using cuda::bf16;
    select_pages(l, q_);
    const int Hkv = ctx_.cfg.n_kv_heads, D = ctx_.cfg.head_dim, P = ctx_.page_size;
    const size_t layer_rows = size_t(ctx_.n_pages) * size_t(Hkv) * P;
    const bf16* q = static_cast<const bf16*>(q_);
    cudaStream_t st = S_(run_);
    cuda::TwilightStep ts;
    ts.q = q;
    ts.codes = ctx_.hooks.k_int4 + size_t(l) * layer_rows * size_t(D / 2);
    ts.sz = ctx_.hooks.k_int4_sz + size_t(l) * layer_rows;
    ts.page_table = sparse_->dev_page_table(), ts.page_off = sparse_->dev_page_off();
    ts.kv_len = sparse_->dev_kv_len();
    ts.base_off = sel_off_, ts.base_idx = sel_idx_, ts.gran = cuda::SelGran::Chunk16;
    ts.B = step_B_, ts.scale = scale;
    twilight_->run(ts, st);
    if (trace) trace_twilight(l);
    sparse_kept_->run(q, static_cast<const bf16*>(kc), static_cast<const bf16*>(vc),
                      twilight_->kept_strided_off(), twilight_->kept_strided_idx(),
                      static_cast<bf16*>(att), scale, st, 0, nullptr, 0, sel_skip(l),
                      twilight_->kept_count());
  }

  void trace_twilight(int layer) {
    const int lists = step_B_ * ctx_.cfg.n_kv_heads, G = ctx_.cfg.n_heads / ctx_.cfg.n_kv_heads;
    const size_t ms = size_t(twilight_->max_slots());
    std::vector<int32_t> cnt(static_cast<size_t>(lists)), kept(size_t(lists) * ms);
    std::vector<float> lg(size_t(lists) * G * ms);
    SPADE_CUDA(cudaStreamSynchronize(S_(run_)));
    SPADE_CUDA(cudaMemcpy(cnt.data(), twilight_->kept_count(), 4 * cnt.size(), cudaMemcpyDeviceToHost));
    SPADE_CUDA(cudaMemcpy(kept.data(), twilight_->kept_strided_idx(), 4 * kept.size(), cudaMemcpyDeviceToHost));
    SPADE_CUDA(cudaMemcpy(lg.data(), twilight_->logits(), 4 * lg.size(), cudaMemcpyDeviceToHost));
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

  // The pruner and the attention over its kept Token lists.
  std::unique_ptr<cuda::TwilightPruner> twilight_;
  std::unique_ptr<cuda::SparseAttention> sparse_kept_;
};

}  // namespace

const GpuMethodKind gpu_twilight = SPADE_GPU_METHOD_KIND(GpuTwilight);

}  // namespace spade
#endif  // SPADE_HAVE_CUDA
