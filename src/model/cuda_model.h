// The layer loop of CpuModel on the GPU (CUDA backend): bf16 weights, fp32 residual stream,
// cuBLASLt GEMMs (QKV and gate|up fused into one GEMM each; o- and down-projections add
// into the residual in the GEMM epilogue), fused bias/qk-norm/RoPE/KV-append, paged bf16 KV
// cache, split-KV decode and tensor-core prefill attention, GPU sampling, and CUDA graphs for
// decode steps, sparse ones included (one graph per launch shape: batch size, split counts,
// sparse work items; captured on first use). Attention is the methods' (sparse/gpu/
// method.h: one class per method, from the GPU registry): the model's own, and any added per
// request; a step groups its sequences by method and each method attends over its own rows,
// the rest of the layer runs once.
//
// Memory: everything lives in one DeviceArena sized up front from the config and options
// (weights + KV pool + workspaces + the model's own method); the constructor throws a clear
// error when it does not fit, and forward() never allocates device memory. A method added
// per request (add_method) takes one arena of its own when it is added.
#pragma once
#if defined(SPADE_HAVE_CUDA)
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <map>
#include <set>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "backend/cuda/sampling.h"
#include "engine/generator.h"
#include "kv/kv_pool.h"
#include "model/cpu_model.h"
#include "model/weights.h"
#include "sparse/gpu/cuda_sparse.h"
#include "sparse/gpu/method.h"

namespace spade {

namespace cuda {
class DeviceArena;
class Gemm;
}  // namespace cuda
namespace dist {
class DeviceCollectives;
}  // namespace dist

struct CudaModelOptions {
  int64_t kv_pages = 0;          // pages in the KV pool (0: enough for max_tokens)
  int64_t max_tokens = 4096;     // context tokens to provision when kv_pages == 0
  int page_size = 16;
  int max_batch = 32;            // sequences per step
  int64_t max_step_tokens = 2048;  // new tokens per forward() (prefill chunk cap)
  int64_t max_logit_rows = 0;    // 0: max(max_batch, 64)
  bool cuda_graphs = true;       // decode steps (all q_len == 1) replay a captured graph
  // Captured graphs kept at once; a new launch shape past it evicts the least recently
  // replayed one.
  int max_graphs = 128;
  // A decode launch shape is captured the graph_min_uses-th time a step has it; until then
  // its steps run eagerly. A capture stops the device for a few ms while the host records the
  // step (a nine-method step: ~8 ms against a ~2.6 ms step), and a server's batch compositions
  // often occur once (requests joining one by one after their prefill): an eager step costs
  // its launches' host time only, overlapped with the device. 1: capture at first sight.
  int graph_min_uses = 2;
  // Tests, diagnostics: when set, each capture appends its launch shape (graph_key) to this
  // list (what changed between graphs of a load).
  std::vector<std::vector<int>>* graph_log = nullptr;
  // Steps that take the decode GEMV (<= Gemm::small_m() tokens) fuse the next op into it
  // (gemm.h; the same values as the separate launches), a bit mask: kFuseSwiglu (gate|up +
  // SwiGLU, gemv_swiglu), kFuseQkvPost (qkv + qkv_post, gemv_qkv_post; not with q/k norms or
  // Twilight's INT4 keys). SPADE_FUSED_GEMV=<mask> in the environment overrides it (0: off).
  static constexpr int kFuseSwiglu = 1, kFuseQkvPost = 2;
  int fused_gemv = kFuseSwiglu | kFuseQkvPost;
  CudaSparse sparse;             // the model's own method (method id 0; default: full)
  // Keep every method's per-page data (Quest's page min/max, Twilight's INT4 keys) on every
  // KV append, so add_method() can add any method later (a server with per-request methods).
  // Off, only the data `sparse` reads is kept.
  bool any_method = false;
  int max_methods = 16;          // methods add_method() keeps at once (unused ones are evicted)
  // Deterministic and batch-invariant: the same inputs give the same bits on every run, and a
  // sequence's bits do not depend on the other sequences of its steps: decode attention with the
  // static chunk schedule, one kernel variant and fixed split counts (AttentionWorkspace::
  // set_deterministic, SparseAttention::set_deterministic), every projection through the decode
  // GEMV in groups of rows (Gemm::set_batch_invariant). Decode and prefill must not share a step
  // (a step's attention kernel depends on whether every row decodes; SchedulerOptions::
  // isolate_prefill). Slower: weights stream once per 8 rows, prefill chunks most of all.
  // Off, long decode steps with splits let warps draw their chunks (faster, last bits vary;
  // env SPADE_DETERMINISTIC=1 keeps the static schedule only).
  bool deterministic = false;
  // KV cache element type (--kv-dtype): bf16 (the default) or fp8 (E4M3, issue 40: half the
  // bytes per token, so kv_pages / max_tokens buy twice the context at the same memory; the
  // arena holds 1 byte per element plus a bf16 scratch of one layer's K and V that prefill
  // steps widen their pages into, AttentionWorkspace::run_fp8). Scales per (layer, KV head), K
  // and V apart, powers of two, as the CPU pool's (kv/kv_pool.h): kv_scale > 0 fixes every
  // scale (a power of two in [2^-40, 2^40]: parse_kv_scale rounds up to one); 0 = auto: the
  // model's first forward step sets each layer's from the largest finite |K| / |V| of that
  // step's rows per head (fp8_e4m3_scale_for_amax, the CPU's rule on the GPU's values), then
  // they stay (reset_kv_scales forgets them). The append quantizes as the CPU pool's write().
  // With fp8 only full attention runs (dense decode reads the codes directly); every other
  // GPU method is refused with an error naming it (its kernels read bf16 caches).
  KvDtype kv_dtype = KvDtype::BF16;
  float kv_scale = 0.f;
  // Tensor parallelism (issue 39, dist/tp_runner.h): this model is one rank's shard
  // (dist::shard_weights: its heads, its ffn slice; o-proj and down-proj columns) and `tp` its
  // collectives on this GPU (an NcclCommunicator). The o- and down-projections then add the
  // rank's partial into the residual (rank 0) or write it alone (ranks > 0), and an in-place
  // all-reduce of the residual on the model's stream follows each (inside captured graphs
  // too): every rank ends each layer with the full residual. Host syncs poll the collectives'
  // errors (a dead rank throws instead of hanging). Null (or one rank): no change at all.
  // Untested until a multi-GPU run (tests/gpu/test_cuda_tp.cpp).
  dist::DeviceCollectives* tp = nullptr;
  // With tp: the whole model's config and this rank's first KV head (its KV heads are
  // [tp_kv0, tp_kv0 + the shard's n_kv_heads)). Methods are parsed for the whole model (their
  // defaults, LycheeDecode's roles: method_spec) and run on the rank's heads; LessIsMore
  // gathers its per-head top lists over `tp` on the model's stream (sparse/gpu/lessismore.cpp).
  // Under tp every method attends on the model's stream (no lanes or side streams: NCCL's
  // collectives of one communicator must not run concurrently). `sparse` is then parsed for
  // the whole model too (the model slices it: shard_spec). n_layers 0: the shard's own.
  ModelConfig tp_model;
  int tp_kv0 = 0;
  // false: no final norm, LM head nor sampling (tensor-parallel followers: rank 0 alone
  // samples); forward() returns no rows, forward_sample*() throw.
  bool logits = true;
};

// Configs for synthetic-weight runs: "llama3-8b" (Llama-3.1-8B: 128K context, llama3 RoPE
// scaling), "llama3-70b" (Llama-3.1-70B, for tensor-parallel runs), "qwen3-8b" (Qwen3-8B),
// "smollm2-135m", or the path of any config.json / model directory.
ModelConfig synthetic_config(const std::string& name_or_path);

class CudaModel {
 public:
  // Real weights: fp32 host tensors are converted to bf16 and uploaded.
  CudaModel(const ModelWeights& w, const CudaModelOptions& opt);
  // Synthetic weights: random values with the config's shapes, generated on the GPU
  // (speed measurements of models whose weights we do not have).
  CudaModel(const ModelConfig& c, const CudaModelOptions& opt, uint64_t seed);
  ~CudaModel();
  CudaModel(const CudaModel&) = delete;
  CudaModel& operator=(const CudaModel&) = delete;

  const ModelConfig& config() const { return cfg_; }
  // KV pool (page ids only; the pages live on the device).
  void reserve(PageTable& pt, int64_t new_length);
  // Per-request state of the GPU method, or nullptr when it keeps none (every method but
  // lycheecluster). LycheeCluster: the request's token text (append_token_text in position
  // order, prompt first, each token before the step that feeds it: the CPU method's contract),
  // its chunk boundaries and its index slots. Pass it as SeqInput::device_state on every
  // forward of that request; destroy it once the request is released. At most max_batch
  // states exist at once (a clear error past that).
  // The model's own method's per-request state where it keeps one (LycheeCluster), else
  // nullptr (CLI and tests; a scheduler takes new_request_state(0), which also counts rows).
  std::unique_ptr<sparse::MethodState> new_request_state() {
    return methods_[0]->keeps_request_state() ? new_request_state(0) : nullptr;
  }
  // Per-request methods: the id of a method for SeqInput::device_state's requests (0: the
  // model's own; the same `key` gives the same id while the method is kept). Sequences of
  // different methods share one step: the dense layers run once over the batch, each method
  // attends over its own rows. Methods that no live request state uses are evicted when
  // max_methods are kept (a clear error when none can be). Throws for a method this model
  // cannot run (e.g. Quest without its page metadata: CudaModelOptions::any_method).
  int add_method(const std::string& key, const CudaSparse& sp);
  // The GPU form of `cfg` for this model (cuda_sparse_config): under tensor parallelism parsed
  // for the whole model (CudaModelOptions::tp_model) and LycheeDecode's roles sliced to this
  // rank's KV heads.
  CudaSparse method_spec(const sparse::SparseConfig& cfg) const;
  // `sp` (parsed for the whole model) on KV heads [kv0, kv0 + n_kv): LycheeDecode's roles
  // sliced to them; every other field is per KV head already.
  static CudaSparse shard_spec(CudaSparse sp, int kv0, int n_kv);
  // The state of a request of method `method`: pass it as SeqInput::device_state on every
  // forward of that request and destroy it once the request is released. It also counts the
  // request's decode rows (MethodState::attended_rows).
  std::unique_ptr<sparse::MethodState> new_request_state(int method);
  int methods_kept() const;
  void release(PageTable& pt);
  int64_t free_pages() const { return int64_t(free_.size()); }
  int64_t total_pages() const { return n_pages_; }
  int page_size() const { return opt_.page_size; }
  // The KV cache's element type (bf16 or fp8) and, for fp8, its scales.
  KvDtype kv_dtype() const { return opt_.kv_dtype; }
  bool kv_fp8() const { return fp8_; }
  // Whether every fp8 scale is set (fixed, or auto after the first step); true for bf16.
  bool kv_scales_set() const { return scales_set_; }
  // The fp8 scales, [n_layers][Hkv] each (K, V) as KVPool::k_scales() / v_scales() (a device
  // copy; 0 while auto scales are unset). Empty for bf16.
  void kv_scales(std::vector<float>& k, std::vector<float>& v) const;
  // Sets every fp8 scale ([n_layers][Hkv] each; powers of two in [2^-40, 2^40]), e.g. a CPU
  // pool's, before any page holds data (tests, shared calibrations).
  void set_kv_scales(const std::vector<float>& k, const std::vector<float>& v);
  // Auto scales: forgets them (the next step sets them again); only while no page is in use.
  // Fixed scales and bf16: nothing changes.
  void reset_kv_scales();

  // Same contract as CpuModel::forward (SeqInput::attention must be null): logits rows on
  // the host, row_of[i] = first row of sequence i.
  const std::vector<float>& forward(const std::vector<SeqInput>& batch,
                                    std::vector<int64_t>& row_of);
  // One step that samples on the GPU: returns one token per sequence (its last position).
  std::vector<int32_t> forward_sample(const std::vector<SeqInput>& batch,
                                      const cuda::GpuSampling& sp, uint64_t step);
  // One step that samples each sequence on the GPU with its own parameters (rows[i] for
  // batch[i]; no SeqInput may ask for all_logits): what a server batch of requests with
  // different sampling settings needs, with no logits copied to the host. Decode steps replay
  // the same graphs whatever the parameters. Returns one token per sequence.
  const std::vector<int32_t>& forward_sample_rows(const std::vector<SeqInput>& batch,
                                                  const std::vector<cuda::GpuSamplingRow>& rows);
  // forward_sample_rows in two halves, so that the host works while the GPU runs the step:
  // launch returns once the step is enqueued (page tables advanced, inputs consumed); wait
  // blocks until its tokens are on the host and returns them. No other call on the model in
  // between.
  void forward_sample_rows_launch(const std::vector<SeqInput>& batch,
                                  const std::vector<cuda::GpuSamplingRow>& rows);
  const std::vector<int32_t>& forward_sample_rows_wait();

  // Benchmarks: gives `pt` pages for `length` tokens whose K/V hold random bf16 values (as
  // if a prompt of that length had been prefilled), without running the prefill. fp8: random
  // codes of N(0, 1) values (auto scales unset: every scale becomes 1).
  void fill_kv_random(PageTable& pt, int64_t length, uint64_t seed);

  // Bytes of weights and of one layer's KV per token (for byte-floor estimates).
  size_t weight_bytes() const { return weight_bytes_; }
  size_t arena_bytes() const;
  // Time of the last forward*() on the device (ms, CUDA events around the step).
  float last_step_ms() const { return last_ms_; }
  int graphs_captured() const { return int(graphs_.size()); }
  // Steps by how they ran since construction (any thread may read them).
  struct GraphCounters {
    std::atomic<uint64_t> replays{0}, captures{0}, updates{0}, instantiations{0}, eager{0};
    // Nanoseconds: host time in launch() by path, device time (events) of eager / graph steps.
    std::atomic<uint64_t> eager_host_ns{0}, capture_host_ns{0}, replay_host_ns{0},
        eager_device_ns{0}, graph_device_ns{0};
  };
  const GraphCounters& graph_counters() const { return graph_counters_; }
  // Whether the last step's decode attention drew its chunks (the DYN schedule: fastest for
  // long steps with splits, not bit-reproducible; never with CudaModelOptions::deterministic).
  bool decode_draws_chunks() const;
  const CudaSparse& sparse() const { return methods_[0]->spec(); }
  // Tests: selections of the model's own method (method 0; sparse/gpu/method.h GpuSelectionTrace).
  using QuestTrace = GpuSelectionTrace;
  QuestTrace* quest_trace = nullptr;
  // BLASST (the model's own method) tile counters since the last reset, per layer and KV
  // head: {tiles, skipped} pairs, [n_layers][Hkv][2] (decode or prefill launches).
  std::vector<uint64_t> blasst_counts(bool prefill) const;
  void reset_blasst_counts();
  // Whether prefill chunks skip tiles (BLASST with prefill on and the wgmma prefill kernel).
  bool blasst_prefill_active() const;
  // Replaces the BLASST parameters (blasst_* fields of `s`; the model must have been built
  // with Method::Blasst). Captured decode graphs are dropped: their launches hold the
  // threshold. For calibration sweeps (one model, many lambdas).
  void set_blasst(const CudaSparse& s);

 private:
  struct Layer;
  void init(const ModelWeights* w, uint64_t seed);
  // Runs the whole step on stream_; logits end in d_logits_ (rows R_).
  void prepare(const std::vector<SeqInput>& batch, std::vector<int64_t>& row_of, bool sample);
  void enqueue(bool sample, const cuda::GpuSampling* sp, uint64_t step);
  void launch(bool sample, const cuda::GpuSampling* sp, uint64_t step);
  void sync_stream();  // cudaStreamSynchronize, or with opt_.tp its polling wait
  void drop_graphs();
  int method_of(const SeqInput& s) const;  // its device_state's method id (0 without one)
  // Rows that prefill (or correct the cache) densely, of a method that also decodes rows in
  // this step, to the model's full-attention method (method_of_seq_), so that the method's
  // decode rows stay sparse: a group is sparse only when all its rows decode (GpuMethod::plan),
  // and the CPU decides per request.
  void route_prefill_rows(const std::vector<SeqInput>& batch);
  int dense_method_ = -1;                    // full attention's method id, once added
  GpuMethodContext method_context() const;
  // Elements of one layer's K (or V) cache: [pages][Hkv][page_size][D], bf16 or fp8 (1 byte).
  size_t kv_elem_bytes() const { return opt_.kv_dtype == KvDtype::FP8 ? 1 : 2; }
  size_t kv_layer_elems() const {
    return size_t(n_pages_) * size_t(cfg_.n_kv_heads) * size_t(opt_.page_size) * size_t(cfg_.head_dim);
  }
  // Per-request methods (add_method): [0] = the model's own (buffers in the model's arena);
  // null entries are evicted ids, reused.
  std::vector<std::unique_ptr<GpuMethod>> methods_;
  std::vector<std::string> method_keys_;
  // This step's layout: sequences grouped by method (stable), each group's rows contiguous.
  struct Group {
    GpuMethod* m = nullptr;
    int id = 0;
    int b0 = 0, n = 0;    // sequences [b0, b0 + n) of the step's order
    int64_t t0 = 0;       // first token row
  };
  std::vector<Group> groups_;
  std::vector<int> order_, method_of_seq_;   // step order -> batch index; batch index -> method
  std::vector<int64_t> tok_start_;           // batch index -> first token row
  std::vector<int> method_count_;            // the counting sort's buckets
  std::vector<uint8_t> method_decodes_;      // route_prefill_rows: methods with a decode row
  std::vector<size_t> pages_before_;         // reserve(): each sequence's pages before the step
  std::vector<SeqInput> group_inputs_;       // the step's SeqInputs in step order
  std::vector<cuda::AttnSeq> aseq_;
  GpuPageHooks hooks_;                       // per-page data kept on every append
  int32_t* upd_ = nullptr;       // device [2 * upd_cap_]: pages whose Quest metadata is recomputed
  int32_t* upd_host_ = nullptr;  // pinned mirror
  int64_t upd_cap_ = 0;
  int upd_n_ = 0;
  // Quest metadata of the step's pages updated inside qkv_post (one token per sequence: no two
  // tokens share a page-head) instead of a quest_update_meta launch per layer. Needs each
  // page's metadata current for its earlier rows: pages get rows only through this model's
  // steps or fill_kv_random (which computes it); the GPU pool has no page copy (no fork).
  bool meta_in_append_ = false;
  int64_t seq_pages_cap_ = 0;  // most pages of one sequence
  ModelConfig cfg_;
  CudaModelOptions opt_;
  int fused_gemv_ = 0;  // opt_.fused_gemv, or SPADE_FUSED_GEMV
  std::unique_ptr<cuda::DeviceArena> arena_;
  std::unique_ptr<cuda::Gemm> gemm_;
  void* stream_ = nullptr;  // cudaStream_t
  void* ev0_ = nullptr;
  void* ev1_ = nullptr;
  void* ev_lanes_ = nullptr;  // this layer's q and K/V are ready: the methods' streams start
  std::vector<Layer> layers_;
  void* embed_ = nullptr;    // bf16 [V, H]
  void* lm_head_ = nullptr;  // bf16 [V, H] (aliases embed_ when tied)
  float* final_norm_ = nullptr;
  float* inv_freq_ = nullptr;
  void* k_cache_ = nullptr;  // bf16 (fp8: uint8 codes) [L][pages][Hkv][P][D]
  void* v_cache_ = nullptr;
  // FP8 cache (opt_.kv_dtype): scales [L][2][Hkv] (K then V per layer), the calibration
  // pass's maxima [L][2][Hkv] (auto), and one layer's bf16 K and V scratch (prefill steps).
  bool fp8_ = false;
  bool scales_set_ = true;
  float* kv_scales_dev_ = nullptr;
  unsigned int* kv_amax_ = nullptr;
  void* k_wide_ = nullptr;
  void* v_wide_ = nullptr;
  size_t weight_bytes_ = 0;
  // Workspaces.
  float* x_ = nullptr;       // [T, H] residual
  void* xn_ = nullptr;       // bf16 [T, max(H, ...)]
  float* qkv_ = nullptr;     // [T, (Hq + 2Hkv) D]
  void* q_ = nullptr;        // bf16 [T, Hq D]
  void* att_ = nullptr;      // bf16 [T, Hq D]
  float* gu_ = nullptr;      // [T, 2F]
  void* h_ = nullptr;        // bf16 [T, F]
  float* logits_ = nullptr;  // [R, V]
  int32_t* tok_in_ = nullptr;  // device: ids | pos | page | rows  (4 arrays of max_step_tokens)
  int32_t* tok_host_ = nullptr;  // pinned mirror
  int32_t* sampled_ = nullptr;   // device [max_batch]
  int32_t* sampled_host_ = nullptr;
  cuda::GpuSamplingRow* rows_dev_ = nullptr;   // forward_sample_rows: per-row parameters
  cuda::GpuSamplingRow* rows_host_ = nullptr;  // pinned mirror
  bool rows_mode_ = false;                     // this step samples with rows_dev_
  std::vector<int32_t> sampled_rows_;
  std::vector<int64_t> row_of_scratch_;           // forward_sample_rows: row of each sequence (unused)
  int64_t max_rows_ = 0;
  std::vector<int32_t> free_;
  int64_t n_pages_ = 0;
  // Current step.
  int T_ = 0, R_ = 0;
  std::vector<float> logits_host_;
  float last_ms_ = 0.f;
  bool last_eager_ = false;  // how the last launch() ran (GraphCounters' device time)
  void step_done();          // after the step's sync: last_ms_ and the device-time counters
  GraphCounters graph_counters_;
  // Captured steps by launch shape (graph_key) -> cudaGraphExec_t and the launch() that last
  // replayed it. At most opt_.max_graphs: a new shape then evicts the least recently used
  // graph (a server's batch sizes and method mixes drift; dropping every graph at once would
  // make the next shapes instantiate instead of updating a graph of their class).
  struct CachedGraph {
    void* exec = nullptr;
    uint64_t used = 0;
  };
  std::map<std::vector<int>, CachedGraph> graphs_;
  // Launch shapes seen but not captured yet (graph_min_uses) -> steps that had them; cleared
  // when it passes 4 * max_graphs entries.
  std::map<std::vector<int>, int> graph_seen_;
  // Diagnostics: with SPADE_GRAPH_LOG=<file> in the environment (read at construction), each
  // capture appends a line with its launch shape (graph_key) to that file.
  std::FILE* graph_log_file_ = nullptr;
  void log_capture(const std::vector<int>& key);
  uint64_t graph_clock_ = 0;
  void evict_lru_graph();
  std::vector<int> graph_key_;  // scratch
  void graph_key(bool sample);  // this step's launch shape into graph_key_
  // Graphs that cudaGraphExecUpdate may turn into one another: batch size, sampling, methods.
  std::vector<int> graph_class_;
  void graph_class(bool sample);
  std::map<std::vector<int>, std::vector<int>> graph_class_last_;  // class -> its latest key
  std::set<int> eager_T_;  // batch token counts that ran eagerly (GEMMs planned)
  cuda::GpuSampling graph_sampling_;             // parameters baked into sampling graphs
  int64_t step_off_ = 0;                         // int32 offset of the uint64 step counter
};

}  // namespace spade
#endif  // SPADE_HAVE_CUDA
