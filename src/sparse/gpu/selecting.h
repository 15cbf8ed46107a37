// The GPU methods that attend over selection lists (every one but full and BLASST over full):
// SelectingMethod plans the lists of a decode step and attends over them with SparseAttention;
// TokenTopKMethod adds what the token selectors (TidalDecode, LessIsMore, LycheeDecode,
// oracle-topk, oracle-topp) share: score rows, the per-row top-k, the long-row scratch, the
// score traces (LycheeDecode's rules and oracle-topp select with backend/cuda/rule_select.h).
//
// Layout / bytes (after the base's, method.h): lists_bytes() = the CSR lists, i32 offsets
// [max_batch * Hkv + 1] and entries [sel_cap] (sel_cap: the subclass's bound on a step's
// entries), + a SparseAttention of kSparseMaxSplit splits over the KV pool for max_batch
// sequences (n_patterns dense-head patterns) + 4 MiB; then the subclass's own buffers, in
// the order alloc_state() takes them; then, for Twilight over the selector
// (CudaSparse::twilight_any), its pruning stage (twilight_stage.h; twilight_bytes(): lists of
// at most sel_cap / (max_batch * lists_per_req) entries, x 16 tokens for Chunk16, or the
// longest context where Twilight prunes the selector's dense layers). TokenTopKMethod's scores are f32 rows of
// seq_pages_cap * page_size (the longest context) each, score_rows rows per sequence; the
// long-row two-stage top-k scratch exists only where cuda::topk_long_applies.
#pragma once
#if defined(SPADE_HAVE_CUDA)
#include <memory>
#include <vector>

#include "backend/cuda/sparse_attention.h"
#include "sparse/gpu/method.h"
#include "sparse/gpu/twilight_stage.h"

namespace spade {

class SelectingMethod : public GpuMethod {
 public:
  ~SelectingMethod() override;
  void attend(int layer, const void* q, const void* kc, const void* vc, void* att,
              float scale) override;
  void append_graph_key(std::vector<int>& k) const override;

 protected:
  SelectingMethod(const GpuMethodContext& ctx, const CudaSparse& sp) : GpuMethod(ctx, sp) {}
  // The most splits of one (request, KV head) in sparse decode launches (dense retrieval heads
  // at batch 1 take ~128 at 128K; bench/results/sparse_max_split_ab_h100_20261127.json).
  static constexpr int kSparseMaxSplit = 256;
  // Bytes of the lists and the attention over them (see the top of this file).
  static size_t lists_bytes(const GpuMethodContext& ctx, int64_t sel_cap, int n_patterns);
  // Bytes of Twilight's stage over this selector (0 unless sp.twilight_any()): sel_cap,
  // lists_per_req and gran as the object's sel_cap(), lists_per_req(), gran().
  static size_t twilight_bytes(const GpuMethodContext& ctx, const CudaSparse& sp,
                               int64_t sel_cap, int lists_per_req, cuda::SelGran gran);

  void check() const override;
  void alloc(cuda::DeviceArena& A) final;
  void plan_lists(const SeqInput* seqs, int n, bool decode) override;
  int64_t sparse_layer_rows(int l, int64_t L) const final;

  // --- What a selector defines.
  // Most entries of one step's lists (sizes sel_idx_).
  virtual int64_t sel_cap() const = 0;
  // Dense-head patterns of the SparseAttention plan (LycheeDecode), else 1.
  virtual int n_patterns() const { return 1; }
  // Its buffers, after the SparseAttention and before the lists.
  virtual void alloc_state(cuda::DeviceArena&) {}
  // Lists per request: one per KV head, or one shared by the heads.
  virtual int lists_per_req() const { return ctx_.cfg.n_kv_heads; }
  virtual cuda::SelGran gran() const { return cuda::SelGran::Token; }
  // The step's list bounds (max_entries, one per list) and whether any list is shorter than
  // its context (any_sparse; else the step runs dense). Default: min(budget, L) tokens.
  virtual void list_entries(const SeqInput* seqs, int n, bool& any_sparse);
  // Whether a step's lists are used even when they cover every context (Twilight prunes).
  virtual bool always_sparse() const { return twl_ != nullptr; }
  // The SparseAttention plan(s) of the step.
  virtual void plan_kernels(void* stream);
  // Rows one request of context L reads in sparse layer l (>= dense_layers).
  virtual int64_t list_rows(int l, int64_t L) const;
  // Layer l >= dense_layers of a sparse step. Default: attention over the lists.
  virtual void attend_lists(int layer, const void* q, const void* kc, const void* vc, void* att,
                            float scale);
  // Tests: the step's CSR lists of this layer into trace->sel.
  void trace_lists(int layer);
  // Twilight over this selector: layer `layer`'s lists as the pruner reads them, after the
  // selector's work of the layer (Quest's page selection, LycheeCluster's search). Default:
  // the CSR lists (sel_off_, sel_idx_) at gran(), shared when lists_per_req() == 1, written
  // before the layer (begin_step or a selection layer).
  virtual TwilightBaseLists twilight_base(int layer, const void* q, const void* kc);
  // Layer l >= twilight_dense_layers of a sparse step: Twilight's pruning of the selector's
  // lists (the whole context in the selector's dense layers), then attention over the kept.
  void attend_pruned(int layer, const void* q, const void* kc, const void* vc, void* att,
                     float scale);

  std::unique_ptr<cuda::SparseAttention> sparse_;
  int32_t* sel_off_ = nullptr;
  int32_t* sel_idx_ = nullptr;
  // This step (host planning vectors: cleared, never reallocated once warm).
  std::vector<cuda::SparseSeq> plan_seqs_;
  std::vector<int> plan_max_entries_;
  // Twilight over this selector (null without it); twl_full_: it also prunes whole contexts
  // (the selector's dense layers at or above twilight_dense_layers).
  std::unique_ptr<TwilightStage> twl_;
  bool twl_full_ = false;
  std::vector<int> plan_kept_max_;  // per (request, KV head): its base tokens (kept bounds)
};

class TokenTopKMethod : public SelectingMethod {
 protected:
  // k: tokens each top-k row keeps; score_rows: score rows per sequence (KV heads, or query
  // heads for LessIsMore).
  TokenTopKMethod(const GpuMethodContext& ctx, const CudaSparse& sp, int k, int score_rows)
      : SelectingMethod(ctx, sp), k_(k), score_rows_(score_rows) {}
  // The long-row top-k scratch's bytes (0 where the one-pass top-k covers every row).
  static size_t topk_bytes(const GpuMethodContext& ctx, int k, int score_rows);

  void alloc_state(cuda::DeviceArena& A) final;
  // Its score buffers (before the long-row scratch).
  virtual void alloc_scores(cuda::DeviceArena& A) = 0;
  // The top-k_ of `rows` score rows (length n[row]) into out [rows][k], on `stream`.
  void select_topk(const float* scores, const int32_t* n, int rows, int k, int32_t* out,
                   void* stream);
  // Tests: this layer's score rows into trace->scores.
  void trace_scores(int layer);
  virtual const float* traced_scores() const { return sel_scores_; }
  int64_t score_ld() const { return ctx_.seq_pages_cap * ctx_.page_size; }

  const int k_;
  const int score_rows_;
  float* sel_scores_ = nullptr;
  int32_t* tidal_rown_ = nullptr;     // per-row context lengths [max_batch * Hkv]
  int32_t* tidal_strided_ = nullptr;  // strided top-k [max_batch * Hkv][k]
  void* topk_long_ = nullptr;         // two-stage top-k scratch, when rows outgrow topk_rows
};

}  // namespace spade
#endif  // SPADE_HAVE_CUDA
