// A sparse method on the GPU as an object (the GPU twin of sparse/method.h): the base class
// every GPU method derives from. CudaModel keeps the dense layer loop and, per layer, hands
// each method the attention of its own rows; it never names a method.
//
// Layout / bytes: one object per distinct configuration (CudaModel::add_method), created from
// its row of the GPU registry (sparse/gpu/registry.h, keyed by the CPU registry's names). Its
// buffers live in one DeviceArena (the model's, for the model's own method, else one of its
// own) of exactly registry row.arena_bytes(ctx, spec) bytes, computed before construction:
// the dense attention workspace (dense layers, the dense fallback, prefill, BLASST skipping),
// BLASST's tile counters (u64 [2 (decode, prefill)][NL][Hkv][2]) when it skips, then the
// subclass's selection state (selecting.h, the method files). Streams: the model's step
// stream, a lane of its own (steps shared with other methods) and, for methods whose
// selections later layers read, a side stream. A step runs requests of several methods:
// CudaModel lays the batch out so that each method's sequences are contiguous rows, then
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

namespace dist {
class DeviceCollectives;
}  // namespace dist

namespace cuda {
class AttentionWorkspace;
struct SelSkip;
struct BlasstSkip;
struct AttnSeq;
}  // namespace cuda

// Tests: when set, each sparse decode step copies every sparse layer's selection to the host:
// sel[layer][b * lists + h] = the ascending page indices (Quest) or token positions read
// (LessIsMore: sel[layer][b], the one shared list; LycheeDecode's block / chunk lists expanded
// to their tokens; layers that ran dense keep an empty list).
// Forces a sync per layer.
struct GpuSelectionTrace {
  std::vector<std::vector<std::vector<int32_t>>> sel;
  // Tidal: each selection layer's group-mean scores [layer][b * Hkv + h][kv_len of b];
  // LessIsMore: per query head [layer][b * Hq + hq][kv_len of b]; oracle-topk and
  // oracle-topp group=mean: the group weights W [layer][b * Hkv + h][kv_len of b];
  // oracle-topp group=union: each query head's true weights [layer][b * Hq + hq][kv_len of b].
  std::vector<std::vector<std::vector<float>>> scores;
  // Twilight: the pruner's kept token positions [layer][b * Hkv + h] (selection order) and
  // its estimated logits [layer][(b * Hkv + h) * G + g][slot] (slot = 16 * entry + row of
  // the layer's Chunk16 list (Quest's in sel; full: chunk u = tokens [16u, 16u + 16)), or the
  // entry of a Token list (tidal, lessismore, lycheecluster: the base list of KV head h);
  // slots past the context or the list are -inf or stale: read the first list-length ones).
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
  int64_t kv_layer_elems = 0;   // one layer's K (or V) cache: layer l at cache + l * this
  int64_t seq_pages_cap = 0;    // most pages of one sequence
  int64_t max_step_tokens = 0;  // query rows per step
  const void* k_cache = nullptr;  // bf16 [L][pages][Hkv][P][D]: layer l at + l * kv_layer_elems
  bool deterministic = false;
  void* stream = nullptr;       // cudaStream_t: the model's step stream
  GpuPageHooks hooks;
  // FP8 cache (CudaModelOptions::kv_dtype, issue 40): k_cache / the attend() caches hold E4M3
  // codes; kv_scales: device [L][2][Hkv] (layer l's K scales at l * 2 Hkv, V's Hkv after);
  // k_wide / v_wide: one layer of bf16 scratch (AttentionWorkspace::run_fp8). Only full
  // attention reads it so far: create() refuses every other method with an error naming it.
  bool kv_fp8 = false;
  const float* kv_scales = nullptr;
  void* k_wide = nullptr;
  void* v_wide = nullptr;
  // Tensor parallelism (CudaModelOptions::tp): cfg is the rank's shard, its query heads the
  // model's [tp_hq0, tp_hq0 + cfg.n_heads) of tp_Hq_all; methods whose selection spans heads
  // (LessIsMore) gather over `tp` on the model's stream; no method forks a side stream.
  dist::DeviceCollectives* tp = nullptr;
  int tp_hq0 = 0, tp_Hq_all = 0;
};

// Throws spade::Error naming the method when `sp` cannot run over an fp8 KV cache on the GPU
// (kv_fp8; every method but plain full attention so far, issue 40). create() checks it.
void check_gpu_kv_dtype(bool kv_fp8, const CudaSparse& sp);

class GpuMethod {
 public:
  // The method of `sp` from its GPU registry row. arena: where the buffers go (the model's,
  // for its own method), or null: a DeviceArena of arena_bytes() of its own (methods added per
  // request). Throws spade::Error for a method this model cannot run.
  static std::unique_ptr<GpuMethod> create(const GpuMethodContext& ctx, const CudaSparse& sp,
                                           cuda::DeviceArena* arena);
  // Device bytes create() takes (the registry row's sizing, before any object exists).
  static size_t arena_bytes(const GpuMethodContext& ctx, const CudaSparse& sp);

  virtual ~GpuMethod();
  GpuMethod(const GpuMethod&) = delete;
  GpuMethod& operator=(const GpuMethod&) = delete;

  const CudaSparse& spec() const { return sp_; }
  virtual std::string describe() const { return sp_.describe(); }
  // Its own per-request state (LycheeCluster), or nullptr; keeps_request_state() says which.
  virtual std::unique_ptr<sparse::MethodState> new_request_state() { return nullptr; }
  virtual bool keeps_request_state() const { return false; }

  // One step over its n sequences (contiguous rows of the step; seqs[i].device_state: the
  // GpuRequestState of each). Host work and async uploads on the model's stream; the caller
  // synchronizes once after every method planned. Before the page tables' lengths advance.
  void plan(const SeqInput* seqs, const cuda::AttnSeq* aseq, int n);
  virtual void begin_step() {}
  // Attention of layer `layer` over its rows: q, att point at its first row (bf16 [rows, Hq,
  // D]); kc, vc at the layer's cache. Dense here (with BLASST's skipping when it has it).
  virtual void attend(int layer, const void* q, const void* kc, const void* vc, void* att,
                      float scale);
  // attend() on the method's own stream, after `ready` (an event recorded on the model's
  // stream), so that the methods of one step run side by side; the model's stream then waits
  // for it with join_lane(). Inside a captured graph they are parallel branches.
  void attend_on_lane(void* ready, int layer, const void* q, const void* kc, const void* vc,
                      void* att, float scale);
  void join_lane();
  // Before the next layer: waits for a selection made on the side stream.
  void join();
  // Whether this step's launches may be captured (decode, no host-driven index sync).
  bool decode() const;
  virtual bool graphable() const { return decode(); }
  virtual void append_graph_key(std::vector<int>& k) const;
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
  // Rows of one skipped decode tile: the dense decode kernel's 16-token warp chunks (its last
  // chunk, the only partial one, is the seed and never skipped), the selection kernel's chunks
  // of 16 list rows (a list's partial last chunk counts 16 too: an upper bound there).
  static constexpr int64_t kBlasstTileRows = 16;
  // Hands the decode tiles skipped since the last call to the requests of the decode steps
  // that skipped them (GpuRequestState::skipped, kBlasstTileRows rows per tile; several
  // requests of one step share the step's count in proportion to their rows: the counters are
  // per (layer, KV head), not per request). Reads the counters (a stream sync); plan() and
  // GpuRequestState::attended_rows() call it, so density counts a skipped tile's rows as not
  // attended.
  void settle_blasst();
  // settle_blasst without waiting (plan(), every step): hands out the tiles of a counter copy
  // that has landed, then starts the next copy (pinned, on the model's stream, behind the
  // steps it covers), so the host never waits for the device to count a step's skips.
  void settle_blasst_async();
  bool blasst_prefill_active() const;
  virtual void set_blasst(const CudaSparse& s);  // BLASST only: new parameters

  // Live request states of this method (CudaModel evicts methods nobody uses).
  std::shared_ptr<std::atomic<int>> live = std::make_shared<std::atomic<int>>(0);

 protected:
  GpuMethod(const GpuMethodContext& ctx, const CudaSparse& sp);
  // Bytes of the base's part: the dense attention workspace, BLASST's counters, slack.
  static size_t base_bytes(const GpuMethodContext& ctx, const CudaSparse& sp);
  // After construction (create()): checks, streams, buffers from `arena` (or an own one of
  // `bytes`).
  void init(cuda::DeviceArena* arena, size_t bytes);
  // Throws for a model this method cannot run on (before anything is allocated).
  virtual void check() const {}
  // Whether selections run on a side stream that later layers join (fork_selection).
  virtual bool uses_side_stream() const { return false; }
  // The subclass's buffers, after the base's.
  virtual void alloc(cuda::DeviceArena&) {}
  // Sparse lists of a step (selecting.h); `decode`: every sequence adds one token. Sets
  // sparse_step_ when the step's lists are used.
  virtual void plan_lists(const SeqInput*, int, bool /*decode*/) {}
  // Rows one decode request of context L reads in layer l of a sparse step.
  virtual int64_t sparse_layer_rows(int l, int64_t L) const;
  // Synchronizes every stream the method launches on (subclass destructors, before they
  // free what those launches read).
  void quiesce();

  cuda::BlasstSkip blasst_skip(int layer) const;
  cuda::SelSkip sel_skip(int layer) const;
  // The stream a selection that only later layers read runs on (the side stream, forked from
  // run_); join() waits for it. Traced steps stay on run_.
  void* fork_selection();
  // The dense attention of the method's rows (the dense workspace, BLASST's skip).
  void attend_dense(int layer, const void* q, const void* kc, const void* vc, void* att,
                    float scale);

  GpuMethodContext ctx_;
  CudaSparse sp_;
  std::unique_ptr<cuda::DeviceArena> own_arena_;
  std::unique_ptr<cuda::AttentionWorkspace> attn_;
  unsigned long long* blasst_counts_ = nullptr;
  void* run_ = nullptr;   // cudaStream_t its launches go to: the model's, or lane_ (attend_on_lane)
  void* lane_ = nullptr;  // its own stream, for steps shared with other methods
  void* ev_lane_ = nullptr;
  void* side_ = nullptr;  // cudaStream_t: selections only later layers read
  void* ev_fork_ = nullptr;
  void* ev_join_ = nullptr;
  bool sel_pending_ = false;
  // This step.
  std::vector<cuda::AttnSeq> plan_aseq_;
  bool sparse_step_ = false;
  int step_B_ = 0;
  int step_max_pages_ = 0;

 private:
  // Each decoding request's rows of this step (dense attention when the step's lists are off);
  // `decode`: every row of the step decodes (BLASST's decode counters count its tiles).
  void count_rows(const SeqInput* seqs, int n, bool decode);
  // Whether decode launches skip tiles (and count them).
  bool blasst_decode_skips() const;
  // settle_blasst(): the requests of the decode steps since the last settle, with their rows.
  struct BlasstPending {
    std::shared_ptr<int64_t> skipped;
    int64_t rows = 0;
  };
  std::vector<BlasstPending> blasst_pending_;
  // The counter copy in flight (settle_blasst_async) and the requests it settles.
  std::vector<BlasstPending> blasst_inflight_;
  unsigned long long* blasst_host_ = nullptr;  // pinned: the decode counters
  void* blasst_ev_ = nullptr;                  // cudaEvent_t: the copy landed
  bool blasst_copying_ = false;
  void blasst_hand_out(const uint64_t* counts, std::vector<BlasstPending>& pending);
  uint64_t blasst_settled_ = 0;    // decode tiles skipped, summed, at the last settle
  bool blasst_unsettled_ = false;  // a skipping decode step ran since
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
  // lists (streaming, tidal, lessismore, lycheedecode topk / ratio, oracle-topk, dense layers;
  // quest counts whole 16-token pages), an upper bound where the device sizes or prunes
  // further (lycheedecode topp / threshold, oracle-topp, twilight, lycheecluster); less the
  // rows of the tiles BLASST skipped in its decode steps (GpuMethod::settle_blasst).
  int64_t attended_rows() const override {
    if (blasst) blasst->settle_blasst();
    return attended - *skipped;
  }
  int64_t attended = 0;
  // BLASST: rows of its decode steps' skipped tiles, and the method that settles them (set by
  // its plan; the method outlives its request states: `live`).
  std::shared_ptr<int64_t> skipped = std::make_shared<int64_t>(0);
  GpuMethod* blasst = nullptr;

  const int method;
  const std::unique_ptr<sparse::MethodState> own;

 private:
  std::shared_ptr<std::atomic<int>> live_;
};

}  // namespace spade
#endif  // SPADE_HAVE_CUDA
