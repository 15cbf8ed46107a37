// A sparse method on the GPU as one object (the GPU twin of sparse/method.h): CudaModel keeps
// the dense layer loop and, per layer, hands each method the attention of its own rows.
//
// One GpuMethod per distinct configuration (CudaModel::add_method): its buffers (its own
// DeviceArena, sized up front by arena_bytes), its dense attention workspace (dense layers,
// the dense fallback, prefill, BLASST skipping), its selection state, its side stream. A step
// runs requests of several methods: CudaModel lays the batch out so that each method's
// sequences are contiguous rows, then per step
//   plan(seqs)          host: page tables, lengths, work items of its rows (no sync)
//   begin_step()        device: per-step lists (streaming windows, row lengths)
//   attend(layer, ...)  device: the attention of its rows in that layer (q, out offset to them)
//   join()              before the next layer reads a selection made on the side stream
// and append_graph_key() adds its launch shapes to the step's CUDA graph key.
// Per-request state (LycheeCluster's chunk text and index slots) comes from
// new_request_state() and travels as SeqInput::device_state inside a GpuRequestState.
//
// Per-page data that must be current for every page a request may read (Quest's key min/max,
// Twilight's INT4 keys) is the model's (GpuPageHooks): it is written by the KV append of every
// request, whatever its method, so a page is readable by any method.
#pragma once
#if defined(SPADE_HAVE_CUDA)
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/cuda/cuda_common.h"
#include "model/cpu_model.h"
#include "sparse/gpu/cuda_sparse.h"
#include "sparse/method.h"

namespace spade {

namespace cuda {
class AttentionWorkspace;
class SparseAttention;
class TwilightPruner;
class LcIndexGpu;
struct LcInsert;
struct SelSkip;
struct SparseSeq;
struct BlasstSkip;
struct AttnSeq;
}  // namespace cuda

struct CudaLcSlots;  // gpu_method_lycheecluster.cpp

// Tests: when set, each sparse decode step copies every sparse layer's selection to the host:
// sel[layer][b * lists + h] = the ascending page indices (Quest) or token positions read
// (LessIsMore: sel[layer][b], the one shared list; layers that ran dense keep an empty list).
// Forces a sync per layer.
struct GpuSelectionTrace {
  std::vector<std::vector<std::vector<int32_t>>> sel;
  // Tidal: each selection layer's group-mean scores [layer][b * Hkv + h][kv_len of b];
  // LessIsMore: per query head [layer][b * Hq + hq][kv_len of b]; oracle-topk: the group
  // weights W [layer][b * Hkv + h][kv_len of b].
  std::vector<std::vector<std::vector<float>>> scores;
  // Twilight: the pruner's kept token positions [layer][b * Hkv + h] (selection order) and
  // its estimated logits [layer][(b * Hkv + h) * G + g][slot] (slot = 16 * entry + row of
  // the layer's Quest list in sel; slots past the context are -inf).
  std::vector<std::vector<std::vector<int32_t>>> kept;
  std::vector<std::vector<std::vector<float>>> logits;
};

// The model's per-page data (null when no method of the model reads it).
struct GpuPageHooks {
  void* quest_meta = nullptr;         // bf16 [L][pages][Hkv][2][D]: per-page key min / max
  uint8_t* k_int4 = nullptr;          // [L][pages][Hkv][P][D/2]: INT4 key codes
  uint32_t* k_int4_sz = nullptr;      // [L][pages][Hkv][P]: their scale / zero
};

// What a method needs from the model, fixed when the model is built.
struct GpuMethodContext {
  ModelConfig cfg;
  int page_size = 16;
  int max_batch = 32;
  int64_t n_pages = 0;          // KV pool pages
  int64_t seq_pages_cap = 0;    // most pages of one sequence
  int64_t max_step_tokens = 0;  // query rows per step
  bool deterministic = false;
  void* stream = nullptr;       // cudaStream_t: the model's step stream
  GpuPageHooks hooks;
};

class GpuMethod {
 public:
  // arena: where the buffers go (the model's, for its own method), or null: a DeviceArena of
  // arena_bytes() of its own (methods added per request).
  GpuMethod(const GpuMethodContext& ctx, const CudaSparse& sp, cuda::DeviceArena* arena);
  ~GpuMethod();
  GpuMethod(const GpuMethod&) = delete;
  GpuMethod& operator=(const GpuMethod&) = delete;
  // Device bytes the constructor takes (dense attention workspace + the method's state).
  static size_t arena_bytes(const GpuMethodContext& ctx, const CudaSparse& sp);

  const CudaSparse& spec() const { return sp_; }
  std::string describe() const { return sp_.describe(); }
  // Its own per-request state (LycheeCluster), or nullptr.
  std::unique_ptr<sparse::MethodState> new_request_state();

  // One step over its n sequences (contiguous rows of the step; seqs[i].device_state: the
  // GpuRequestState of each). Host work and async uploads on the model's stream; the caller
  // synchronizes once after every method planned. Before the page tables' lengths advance.
  void plan(const SeqInput* seqs, const cuda::AttnSeq* aseq, int n);
  void begin_step();
  // Attention of layer `layer` over its rows: q, att point at its first row (bf16 [rows, Hq,
  // D]); kc, vc at the layer's cache.
  void attend(int layer, const void* q, const void* kc, const void* vc, void* att, float scale);
  // attend() on the method's own stream, after `ready` (an event recorded on the model's
  // stream), so that the methods of one step run side by side; the model's stream then waits
  // for it with join_lane(). Inside a captured graph they are parallel branches.
  void attend_on_lane(void* ready, int layer, const void* q, const void* kc, const void* vc,
                      void* att, float scale);
  void join_lane();
  void join();
  // Whether this step's launches may be captured (decode, no host-driven index sync).
  bool decode() const;
  bool graphable() const { return decode() && lc_sync_.empty(); }
  void append_graph_key(std::vector<int>& k) const;
  bool draws_chunks() const;
  // Whether a step of this method ran outside a graph capture (first-use host work done).
  bool warm = false;

  // Tests: selections of this method's steps, in its own row order.
  GpuSelectionTrace* trace = nullptr;
  // BLASST tile counters ([2 (decode, prefill)][NL][Hkv][2]) count only while set (the eager
  // run before a graph capture does not count).
  bool count_blasst = true;
  std::vector<uint64_t> blasst_counts(bool prefill) const;
  void reset_blasst_counts();
  bool blasst_prefill_active() const;
  void set_blasst(const CudaSparse& s);  // same method, new BLASST parameters

  // Live request states of this method (CudaModel evicts methods nobody uses).
  std::shared_ptr<std::atomic<int>> live = std::make_shared<std::atomic<int>>(0);

 private:
  void alloc(cuda::DeviceArena& A);
  static size_t state_bytes(const GpuMethodContext& ctx, const CudaSparse& sp,
                            std::vector<std::vector<uint8_t>>* patterns, int64_t* sel_cap);
  void select_topk(const float* scores, const int32_t* n, int rows, int k, int32_t* out,
                   void* stream);
  void* fork_selection();
  int lists_per_req() const;
  // A Tidal / LessIsMore selection layer or an oracle-topk layer: runs it, returns true.
  bool scored_layer(int layer, const void* q, const void* kc, const void* vc, void* att,
                    float scale);
  void ld_layer(int layer, const void* q, const void* kc, const void* vc, void* att, float scale);
  void lc_prepare(const SeqInput* seqs, int n, bool& any_sparse, std::vector<int>& max_entries);
  // Each decoding request's rows of this step (dense attention when the step's lists are off).
  void count_rows(const SeqInput* seqs, int n);
  void lc_layer(int layer, const void* q, const void* kc, const void* vc, void* att, float scale);
  static size_t lc_arena_bytes(const GpuMethodContext& ctx, const CudaSparse& sp);
  static int64_t lc_list_entries(const GpuMethodContext& ctx, const CudaSparse& sp);
  void lc_alloc(cuda::DeviceArena& A);
  cuda::BlasstSkip blasst_skip(int layer) const;
  cuda::SelSkip sel_skip(int layer) const;
  void trace_quest(int layer);
  void trace_scores(int layer);
  void trace_twilight(int layer);

  GpuMethodContext ctx_;
  CudaSparse sp_;
  std::unique_ptr<cuda::DeviceArena> own_arena_;
  std::unique_ptr<cuda::AttentionWorkspace> attn_;
  std::unique_ptr<cuda::SparseAttention> sparse_;
  // Twilight: the pruner and the attention over its kept Token lists.
  std::unique_ptr<cuda::TwilightPruner> twilight_;
  std::unique_ptr<cuda::SparseAttention> sparse_kept_;
  float* quest_scores_ = nullptr;
  int32_t* sel_off_ = nullptr;
  int32_t* sel_idx_ = nullptr;
  // Selection layers' scores [rows][seq_pages_cap * P]: Tidal's group means (rows
  // max_batch * Hkv), LessIsMore's per query head (rows max_batch * Hq).
  float* sel_scores_ = nullptr;
  // Tidal: the per-row context lengths and the strided top-k [max_batch * Hkv][budget].
  int32_t* tidal_rown_ = nullptr;
  int32_t* tidal_strided_ = nullptr;
  // LycheeDecode: per layer, the index of its retrieval-head pattern in ld_patterns_ (the
  // SparseAttention plan's dense heads), or -1 when every head is a retrieval head.
  std::vector<int> ld_pattern_of_;
  std::vector<std::vector<uint8_t>> ld_patterns_;
  // LessIsMore: lessismore_select's scratch.
  int32_t* lim_row_n_ = nullptr;
  int32_t* lim_head_top_ = nullptr;
  float* lim_keys_ = nullptr;
  int32_t* lim_merged_ = nullptr;
  float* oracle_w_ = nullptr;  // oracle-topk: true group weights
  void* topk_long_ = nullptr;  // two-stage top-k scratch, when rows outgrow topk_rows
  unsigned long long* blasst_counts_ = nullptr;
  void* run_ = nullptr;   // cudaStream_t its launches go to: the model's, or lane_ (attend_on_lane)
  void* lane_ = nullptr;  // its own stream, for steps shared with other methods
  void* ev_lane_ = nullptr;
  void* side_ = nullptr;  // cudaStream_t: selections only later layers read
  void* ev_fork_ = nullptr;
  void* ev_join_ = nullptr;
  bool sel_pending_ = false;
  // LycheeCluster (gpu_method_lycheecluster.cpp).
  std::shared_ptr<CudaLcSlots> lc_slots_;
  std::unique_ptr<cuda::LcIndexGpu> lc_;
  int32_t* lc_slot_dev_ = nullptr;
  int32_t* lc_slot_host_ = nullptr;
  int32_t* lc_lists_ = nullptr;
  int32_t* lc_counts_ = nullptr;
  int32_t* lc_off_ = nullptr;
  int lc_cap_ = 0;
  struct LcSync {
    int req_slot = 0, n_old = 0, n_new = 0;
    const int32_t* starts = nullptr;
    int64_t page_off = 0;
  };
  std::vector<LcSync> lc_sync_;
  std::vector<cuda::LcInsert> lc_ins_;
  // This step.
  std::vector<cuda::SparseSeq> plan_seqs_;
  std::vector<cuda::AttnSeq> plan_aseq_;
  std::vector<int> plan_max_entries_, plan_kept_max_;
  bool sparse_step_ = false;
  int step_B_ = 0;
  int step_max_pages_ = 0;
};

// A request's state on the GPU: which of the model's methods it runs (CudaModel::add_method
// id) and that method's own per-request state. Passed as SeqInput::device_state.
class GpuRequestState final : public sparse::MethodState {
 public:
  GpuRequestState(int method, std::shared_ptr<std::atomic<int>> live,
                  std::unique_ptr<sparse::MethodState> own)
      : method(method), own(std::move(own)), live_(std::move(live)) {
    ++*live_;
  }
  ~GpuRequestState() override { --*live_; }
  void append_token_text(std::string_view piece) override {
    if (own) own->append_token_text(piece);
  }
  bool wants_token_text() const override { return own && own->wants_token_text(); }
  // The method's live counter it holds (tells one model's methods from another's).
  const std::atomic<int>* counter() const { return live_.get(); }
  // Decode rows its method's lists held (GpuMethod::plan): exact where the host sizes the
  // lists (streaming, tidal, lessismore, lycheedecode, oracle-topk, dense layers; quest counts
  // whole 16-token pages), an upper bound where the device prunes or skips further
  // (twilight, lycheecluster, blasst).
  int64_t attended_rows() const override { return attended; }
  int64_t attended = 0;

  const int method;
  const std::unique_ptr<sparse::MethodState> own;

 private:
  std::shared_ptr<std::atomic<int>> live_;
};

}  // namespace spade
#endif  // SPADE_HAVE_CUDA
