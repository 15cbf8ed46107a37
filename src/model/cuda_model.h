// The layer loop of CpuModel on the GPU (CUDA backend): bf16 weights, fp32 residual stream,
// cuBLASLt GEMMs (QKV and gate|up fused into one GEMM each; o- and down-projections add
// into the residual in the GEMM epilogue), fused bias/qk-norm/RoPE/KV-append, paged bf16 KV
// cache, split-KV decode and tensor-core prefill attention, GPU sampling, and CUDA graphs for
// decode steps, sparse ones included (one graph per launch shape: batch size, split counts,
// sparse work items; captured on first use).
//
// Memory: everything lives in one DeviceArena sized up front from the config and options
// (weights + KV pool + workspaces); the constructor throws a clear error when it does not
// fit, and forward() never allocates device memory.
#pragma once
#if defined(SPADE_HAVE_CUDA)
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "backend/cuda/sampling.h"
#include "engine/generator.h"
#include "kv/kv_pool.h"
#include "model/cpu_model.h"
#include "model/weights.h"
#include "sparse/layer_schedule.h"
#include "sparse/methods/lycheecluster.h"
#include "sparse/options.h"

namespace spade {

namespace cuda {
class DeviceArena;
class Gemm;
class AttentionWorkspace;
class SparseAttention;
class TwilightPruner;
class LcIndexGpu;
struct LcInsert;
struct SelSkip;
struct SparseSeq;
struct BlasstSkip;
}  // namespace cuda

struct CudaLcSlots;  // cuda_model_lycheecluster.cpp

// Sparse decode on the GPU (issue 9): the methods with a GPU selector, with the CPU method's
// parameters. Prefill stays dense; decode steps (every sequence q_len == 1) attend over the
// selection in layers >= dense_layers. Quest: per-page key min/max kept on every append for
// every layer, page scores + radix top-k + attention over the selected pages (the CPU's
// QuestMethod with group=max and page_size == KV page size == 16). Streaming: sinks + the
// recent window, one list shared by the KV heads (StreamingMethod). BLASST (over full
// attention): tile skipping inside the dense kernels (backend/cuda/attention.h BlasstSkip)
// with the CPU method's lambda (fixed, or a / L per sequence); decode tiles are each warp's
// 16-token chunks, prefill tiles 64 packed rows x 128 keys (wgmma prefill, head_dim 128) or
// 32 packed rows x 64 keys (the generic prefill kernel, head_dim 64; describe() says which).
// BLASST decode default a on the GPU (lambda = a / L): SmolLM2-135M-Instruct calibrated for
// 50% sparsity with the GPU kernels (configs/blasst_smollm2_gpu_decode_s50.json).
constexpr double kBlasstDefaultGpuDecodeA = 4.128;

struct CudaSparse {
  enum class Method {
    None, Streaming, Quest, Tidal, LessIsMore, LycheeDecode, OracleTopK, Blasst, Twilight,
    LycheeCluster
  };
  Method method = Method::None;
  int64_t budget = 0;
  int sinks = 0;         // streaming, lessismore
  int64_t recent = 0;    // lessismore: the recency window (round(budget * recent_ratio))
  int dense_layers = 0;  // leading full-attention layers
  int quest_fast = 0;    // 1: tensor-core page scores (fp32 rounding; near-tie selections)
  bool force_lists = false;  // tests: attend over lists even when they cover the whole context
  // blasst: lambda >= 0 fixed (0 = never skip), else a / L (decode a, prefill prefill_a)
  double blasst_lambda = -1, blasst_a = 0, blasst_prefill_a = 0;
  bool blasst_decode = true, blasst_prefill = true;
  // BLASST over a selection (`--sparse quest+blasst`, blasst:base=M): `method` is the base's,
  // and its attention launches also skip: over the lists (SparseAttention's SelSkip, lambda =
  // a / the selection's tokens when blasst_len_selected, else a / the context) and in its dense
  // launches (dense layers, the dense fallback, prefill when blasst_prefill). Launches that
  // emit scores (Tidal / LessIsMore selection layers, LycheeDecode retrieval heads) do not skip.
  bool blasst_sel = false, blasst_len_selected = true;
  bool blasst_any() const { return method == Method::Blasst || blasst_sel; }
  int head_dim = 0;  // set by cuda_sparse_config (describe: prefill skipping needs 128)
  // tidal, lessismore: layer roles (dense / select / reuse); dense_layers mirrors schedule's
  sparse::LayerSchedule schedule;
  bool scheduled() const { return method == Method::Tidal || method == Method::LessIsMore; }
  // lessismore: merged tokens besides the sinks and the recency window.
  int64_t lim_unified() const { return budget - recent - sinks; }
  // lycheedecode: retrieval[layer][h] = 1 for retrieval heads (the rest are sparse heads),
  // mode topk with block 1 (budget = tokens per sparse head), roles in identity order.
  std::vector<std::vector<uint8_t>> retrieval;
  std::string roles_source;
  std::string describe() const;
  // Attends over selection lists (streaming, quest); BLASST skips inside the dense kernels.
  bool selects() const {
    return method == Method::Streaming || quest_base() || scheduled() ||
           method == Method::LycheeDecode || method == Method::OracleTopK ||
           method == Method::LycheeCluster;
  }
  // lycheecluster: the CPU method's parameters (budget, budget_mode, sink, buffer,
  // dense_layers, chunking, index and search options; the GPU supports the defaults' bound
  // space, pooling, seeding, center dtype, grouping and ranking). budget and dense_layers
  // above mirror lc.budget and lc.dense_layers.
  sparse::LycheeClusterParams lc;
  // twilight (base quest, budget = the Quest budget): top-p mass and bisection resolution
  double twilight_p = 0.95, twilight_eps = 1e-6;
  // Quest selects (quest itself, or twilight's base).
  bool quest_base() const { return method == Method::Quest || method == Method::Twilight; }
};
// The GPU form of a sparse::SparseConfig, through the same option table and checks as the
// CPU method (sparse/registry.h). "full" -> Method::None; methods without a GPU path and
// unsupported options (quest group=sum, page_size != 16) throw spade::Error. Extra option
// "gpu_scores=exact|fast" is read by the GPU only (fast: tensor-core Quest scores).
CudaSparse cuda_sparse_config(const sparse::SparseConfig& cfg, const ModelConfig& model,
                              int kv_page_size);

struct CudaModelOptions {
  int64_t kv_pages = 0;          // pages in the KV pool (0: enough for max_tokens)
  int64_t max_tokens = 4096;     // context tokens to provision when kv_pages == 0
  int page_size = 16;
  int max_batch = 32;            // sequences per step
  int64_t max_step_tokens = 2048;  // new tokens per forward() (prefill chunk cap)
  int64_t max_logit_rows = 0;    // 0: max(max_batch, 64)
  bool cuda_graphs = true;       // decode steps (all q_len == 1) replay a captured graph
  // Steps that take the decode GEMV (<= Gemm::small_m() tokens) fuse the next op into it
  // (gemm.h; the same values as the separate launches), a bit mask: kFuseSwiglu (gate|up +
  // SwiGLU, gemv_swiglu), kFuseQkvPost (qkv + qkv_post, gemv_qkv_post; not with q/k norms or
  // Twilight's INT4 keys). SPADE_FUSED_GEMV=<mask> in the environment overrides it (0: off).
  static constexpr int kFuseSwiglu = 1, kFuseQkvPost = 2;
  int fused_gemv = kFuseSwiglu | kFuseQkvPost;
  CudaSparse sparse;             // sparse decode (default: none; dense attention)
  // Decode attention with the static chunk schedule only: the same inputs give the same bits on
  // every run (AttentionWorkspace::set_deterministic; env SPADE_DETERMINISTIC=1 does the same).
  // Off, long decode steps with splits let warps draw their chunks (faster, last bits vary).
  bool deterministic = false;
};

// Configs for synthetic-weight runs: "llama3-8b" (Llama-3.1-8B: 128K context, llama3 RoPE
// scaling), "qwen3-8b" (Qwen3-8B), or the path of any config.json / model directory.
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
  std::unique_ptr<sparse::MethodState> new_request_state();
  void release(PageTable& pt);
  int64_t free_pages() const { return int64_t(free_.size()); }
  int64_t total_pages() const { return n_pages_; }
  int page_size() const { return opt_.page_size; }

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

  // Benchmarks: gives `pt` pages for `length` tokens whose K/V hold random bf16 values (as
  // if a prompt of that length had been prefilled), without running the prefill.
  void fill_kv_random(PageTable& pt, int64_t length, uint64_t seed);

  // Bytes of weights and of one layer's KV per token (for byte-floor estimates).
  size_t weight_bytes() const { return weight_bytes_; }
  size_t arena_bytes() const;
  // Time of the last forward*() on the device (ms, CUDA events around the step).
  float last_step_ms() const { return last_ms_; }
  int graphs_captured() const { return int(graphs_.size()); }
  // Whether the last step's decode attention drew its chunks (the DYN schedule: fastest for
  // long steps with splits, not bit-reproducible; never with CudaModelOptions::deterministic).
  bool decode_draws_chunks() const;
  const CudaSparse& sparse() const { return opt_.sparse; }
  // Tests: when set, each sparse decode step copies every sparse layer's Quest selection (Tidal,
  // LessIsMore, LycheeDecode, oracle-topk: each selecting layer's token lists) to the host: sel[layer][b * Hkv + h] = the
  // ascending page indices (within the request) read (LessIsMore: sel[layer][b], the one
  // shared list; layers that ran dense keep an empty list). Forces a sync per layer.
  struct QuestTrace {
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
  QuestTrace* quest_trace = nullptr;
  // BLASST tile counters since the last reset, per layer and KV head: {tiles, skipped} pairs,
  // [n_layers][Hkv][2] (decode or prefill launches).
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
  void trace_quest(int layer);
  void trace_scores(int layer);  // Tidal / LessIsMore: a selection layer's scores into quest_trace
  void trace_twilight(int layer);  // the pruner's kept lists and logits into quest_trace
  int lists_per_req() const;     // selection lists per request: Hkv, or 1 (one shared list)
  // LycheeDecode: attention of decode layer `layer` (bf16 q [B, Hq, D], this layer's K/V
  // cache, out att) and its retrieval heads' selections for the next layer
  // (cuda_model_lycheedecode.cpp).
  void ld_layer(int layer, const void* q, const void* kc, const void* vc, void* att, float scale);
  // Decode layer `layer` when it is a Tidal / LessIsMore selection layer (full attention with
  // score emission, then the selection) or an oracle-topk layer: runs it and returns true;
  // else false (cuda_model_sparse.cpp).
  bool scored_layer(int layer, const void* q, const void* kc, const void* vc, void* att,
                    float scale);
  // A selection that only later layers read (Tidal, LessIsMore, LycheeDecode retrieval heads)
  // runs on side_, forked after its layer's attention and joined before the next layer's, so
  // its top-k overlaps the layer's GEMMs (also inside a captured graph). fork returns the
  // stream to enqueue it on (stream_ itself when tracing).
  // topk_rows over `rows` rows of selection scores (stride seq_pages_cap_ * P): the two-stage
  // topk_rows_long when the rows outgrow topk_rows' cache (128K contexts), else topk_rows.
  void select_topk(const float* scores, const int32_t* n, int rows, int k, int32_t* out,
                   void* stream);
  void* topk_long_ = nullptr;  // its scratch (arena), when it applies
  void* fork_selection();
  void join_selection();
  void* side_ = nullptr;  // cudaStream_t
  void* ev_fork_ = nullptr;
  void* ev_join_ = nullptr;
  bool sel_pending_ = false;
  void drop_graphs();
  cuda::BlasstSkip blasst_skip(int layer) const;  // this step's skipping in `layer` (or none)
  cuda::SelSkip sel_skip(int layer) const;  // the same inside a selection (blasst_sel)
  // LycheeCluster (cuda_model_lycheecluster.cpp). lc_prepare: per request of a decode step,
  // whether it is past the dense threshold (any_sparse), its list bound (max_entries), and
  // the index builds / lazy inserts this step runs (the CPU method's sync rule, host
  // chunking); uploads each layer's slot table. lc_layer: this step's syncs of `layer` (after
  // its K append), the search, the CSR compaction and the attention over the lists.
  void lc_prepare(const std::vector<SeqInput>& batch, bool& any_sparse,
                  std::vector<int>& max_entries);
  void lc_layer(int layer, const void* q, const void* kc, const void* vc, void* att, float scale);
  size_t lc_arena_bytes() const;    // init: the index, lists and slot table
  int64_t lc_list_entries() const;  // init: strided list entries (the CSR capacity)
  void lc_alloc();                  // init: takes them from the arena
  std::shared_ptr<CudaLcSlots> lc_slots_;  // free request slots, shared with the request states
  std::unique_ptr<cuda::LcIndexGpu> lc_;  // slot = request slot * sparse layers + (layer - dense)
  int32_t* lc_slot_dev_ = nullptr;    // [sparse layers][max_batch] index slot of each batch entry
  int32_t* lc_slot_host_ = nullptr;   // pinned mirror
  int32_t* lc_lists_ = nullptr;       // strided lists [max_batch * Hkv][lc_cap_]
  int32_t* lc_counts_ = nullptr;      // [max_batch * Hkv]
  int32_t* lc_off_ = nullptr;         // [max_batch * Hkv]: i * lc_cap_ (the lists' offsets)
  int lc_cap_ = 0;                    // list bound: sink + budget + the longest un-indexed tail
  struct LcSync {                     // one request's build (n_old == 0) or lazy insert
    int req_slot = 0, n_old = 0, n_new = 0;
    const int32_t* starts = nullptr;  // host chunk starts (the request state's)
    int64_t page_off = 0;             // its page table in the sparse plan's
  };
  std::vector<LcSync> lc_sync_;       // this step's (empty on most steps: those replay graphs)
  std::vector<cuda::LcInsert> lc_ins_;
  ModelConfig cfg_;
  CudaModelOptions opt_;
  int fused_gemv_ = 0;  // opt_.fused_gemv, or SPADE_FUSED_GEMV
  std::unique_ptr<cuda::DeviceArena> arena_;
  std::unique_ptr<cuda::Gemm> gemm_;
  std::unique_ptr<cuda::AttentionWorkspace> attn_;
  std::unique_ptr<cuda::SparseAttention> sparse_;
  // Twilight: the pruner, attention over its kept Token lists, INT4 keys written by qkv_post
  // ([L][pages][Hkv][P][D/2] codes, [L][pages][Hkv][P] scale/zero).
  std::unique_ptr<cuda::TwilightPruner> twilight_;
  std::unique_ptr<cuda::SparseAttention> sparse_kept_;
  uint8_t* k_int4_ = nullptr;
  uint32_t* k_int4_sz_ = nullptr;
  // Sparse decode state (arena): Quest metadata [L][pages][Hkv][2][D] bf16, page scores,
  // CSR lists (Quest's top-k writes them directly); metadata update list (page ids | slots
  // filled).
  void* quest_meta_ = nullptr;
  float* quest_scores_ = nullptr;
  int32_t* sel_off_ = nullptr;
  int32_t* sel_idx_ = nullptr;
  // Selection layers' scores [rows][seq_pages_cap_ * P]: Tidal's group means (rows
  // max_batch * Hkv), LessIsMore's per query head (rows max_batch * Hq).
  float* sel_scores_ = nullptr;
  // Tidal: the per-row context lengths and the strided top-k [max_batch * Hkv][budget].
  int32_t* tidal_rown_ = nullptr;
  int32_t* tidal_strided_ = nullptr;
  // LycheeDecode: per layer, the index of its retrieval-head pattern in ld_patterns_ (the
  // SparseAttention plan's dense heads), or -1 when every head is a retrieval head (the dense
  // kernel runs). The sets live in tidal_strided_ (a row per (request, KV head)); retrieval
  // heads overwrite their rows (tidal_rown_: their lengths, 0 for the sparse heads).
  std::vector<int> ld_pattern_of_;
  std::vector<std::vector<uint8_t>> ld_patterns_;
  // LessIsMore: lessismore_select's scratch (sparse_attention.h LessIsMoreArgs).
  int32_t* lim_row_n_ = nullptr;
  int32_t* lim_head_top_ = nullptr;
  float* lim_keys_ = nullptr;
  int32_t* lim_merged_ = nullptr;
  // oracle-topk: each layer's true group weights W [max_batch * Hkv][seq_pages_cap_ * P] from
  // the per-head scores in sel_scores_; top-k rows in tidal_strided_.
  float* oracle_w_ = nullptr;
  unsigned long long* blasst_counts_ = nullptr;  // [2 (decode, prefill)][NL][Hkv][2]
  bool count_blasst_ = true;  // false while a step runs eagerly before its graph capture
  // prepare()'s per-step planning vectors (kept, so steady-state decode allocates nothing).
  std::vector<cuda::SparseSeq> plan_seqs_;
  std::vector<int> plan_max_entries_, plan_kept_max_;
  int32_t* upd_ = nullptr;       // device [2 * upd_cap_]
  int32_t* upd_host_ = nullptr;  // pinned mirror
  int64_t upd_cap_ = 0;
  int upd_n_ = 0;
  // Quest metadata of the step's pages updated inside qkv_post (one token per sequence: no two
  // tokens share a page-head) instead of a quest_update_meta launch per layer. Needs each
  // page's metadata current for its earlier rows: pages get rows only through this model's
  // steps or fill_kv_random (which computes it); the GPU pool has no page copy (no fork).
  bool meta_in_append_ = false;
  int64_t seq_pages_cap_ = 0;  // most pages of one sequence
  bool sparse_step_ = false;   // this step attends over selections
  int step_B_ = 0;
  int step_max_pages_ = 0;  // Quest's page-score stride: the longest request's pages rounded up to 64
  void* stream_ = nullptr;  // cudaStream_t
  void* ev0_ = nullptr;
  void* ev1_ = nullptr;
  std::vector<Layer> layers_;
  void* embed_ = nullptr;    // bf16 [V, H]
  void* lm_head_ = nullptr;  // bf16 [V, H] (aliases embed_ when tied)
  float* final_norm_ = nullptr;
  float* inv_freq_ = nullptr;
  void* k_cache_ = nullptr;  // bf16 [L][pages][Hkv][P][D]
  void* v_cache_ = nullptr;
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
  int64_t max_rows_ = 0;
  std::vector<int32_t> free_;
  int64_t n_pages_ = 0;
  // Current step.
  int T_ = 0, R_ = 0;
  std::vector<float> logits_host_;
  float last_ms_ = 0.f;
  // Captured steps by launch shape (graph_key) -> cudaGraphExec_t.
  std::map<std::vector<int>, void*> graphs_;
  std::vector<int> graph_key_;  // scratch
  void graph_key(bool sample);  // this step's launch shape into graph_key_
  cuda::GpuSampling graph_sampling_;             // parameters baked into sampling graphs
  int64_t step_off_ = 0;                         // int32 offset of the uint64 step counter
};

// engine/generator.h's generate() on the GPU: chunked prefill, then one token per step,
// sampled on the GPU (the host sampler is used only for a repetition penalty). `state`: the
// request's CudaModel::new_request_state() where the method keeps one (its token text is the
// caller's: the prompt's before the call, each token's in on_token).
GenerateStats generate_cuda(CudaModel& model, PageTable& pt, const std::vector<int32_t>& prompt,
                            const GenerateOptions& opt,
                            const std::function<bool(int32_t)>& on_token,
                            sparse::MethodState* state = nullptr);

}  // namespace spade
#endif  // SPADE_HAVE_CUDA
