// LycheeCluster on the GPU (a GpuMethod, method.h; the CPU method: sparse/methods/lycheecluster.h;
// the index kernels: backend/cuda/cluster_index.h, docs/cuda_lycheecluster.md).
//
// Per request: a host state (LcRequestState) with the token text, the streaming chunk
// boundaries (sparse::StreamingChunks, the CPU's chunker) and one request slot; the request's
// index of sparse layer j lives in LcIndexGpu slot `request slot * n_sparse + j`.
// Per decode step (every sequence q_len == 1), the CPU method's rules per request:
//   dense while L <= sink + budget (budget_mode=total: L <= budget): its slot holds no chunks,
//     so the search lists every token [0, L) (the CPU's set_dense, over the same kernel);
//   sync: the first step past that builds the index over every chunk closed by the tokens
//     before the current one (the CPU's rule: their K is in every layer's cache when the step
//     begins); later, once >= buffer tokens wait behind the index, the chunks closed since
//     are inserted (lazy update). Chunking runs on the host (token text). In the step's
//     plan, one build_batch covers every sparse layer of every request that builds (a few
//     launch sequences instead of one per request and layer) and one insert_batch every
//     insert, on the model's stream ahead of the step's launches: their shapes are the host's
//     (chunk counts), so they run eagerly, while the step itself still replays its CUDA graph
//     (every launch reads fixed device addresses; an index sync used to make the whole step,
//     every method of a mixed batch included, run eagerly);
//   search per (request, KV head) -> sink + chosen chunks + un-indexed tail (Token lists at a
//     fixed stride, with their lengths), which SparseAttention reads in place (compacted to
//     CSR only for a trace).
//
// Layout / bytes (after SelectingMethod's lists, selecting.h, which hold max(1, max_batch *
// Hkv * cap) entries, cap = min(context, sink + budget + buffer + 2 * open chunk + 16)): the
// LcIndexGpu (LcIndexGpu::arena_bytes for max_batch * n_sparse slots of up to max_chunks
// chunks: chunk bounds, coarse / fine centers), i32 lists [max_batch * Hkv][cap] and their
// lengths and offsets [max_batch * Hkv], i32 slot table [n_sparse][max_batch], + 3 x 256 B;
// a pinned host mirror of the slot table; Twilight's stage when stacked
// (`lycheecluster+twilight`: SelectingMethod::twilight_bytes; the search's lists are compacted
// to CSR, then pruned).
#if defined(SPADE_HAVE_CUDA)
#include <algorithm>
#include <cmath>
#include <mutex>
#include <vector>

#include "backend/cuda/cluster_index.h"
#include "backend/cuda/sparse_attention.h"
#include "core/error.h"
#include "sparse/gpu/registry.h"
#include "sparse/gpu/selecting.h"

namespace spade {

namespace {

cudaStream_t S_(void* p) { return static_cast<cudaStream_t>(p); }

// The request slots of one method (shared with its request states, which return theirs).
struct CudaLcSlots {
  std::mutex mu;
  std::vector<int> free;
  int total = 0;
};

class LcRequestState final : public sparse::MethodState {
 public:
  LcRequestState(std::shared_ptr<CudaLcSlots> slots, int slot)
      : slots_(std::move(slots)), slot(slot) {}
  ~LcRequestState() override {
    std::lock_guard<std::mutex> g(slots_->mu);
    slots_->free.push_back(slot);
  }
  void append_token_text(std::string_view piece) override { text.emplace_back(piece); }
  bool wants_token_text() const override { return true; }

  std::shared_ptr<CudaLcSlots> slots_;
  const int slot;
  bool fresh = true;          // its index slots still need a reset
  int32_t indexed = 0;        // chunks in the GPU index (every sparse layer alike)
  std::vector<std::string> text;
  sparse::StreamingChunks chunks;
};

// Sparse layers and index capacity of `sp` for a model of `c` whose sequences hold at most
// `seq_tokens` tokens.
struct LcShape {
  int n_sparse = 0;
  cuda::LcIndexConfig index;
  int cap = 0;  // list entries per (request, KV head)
};

LcShape lc_shape(const CudaSparse& sp, const ModelConfig& c, int64_t seq_tokens, int max_batch,
                 int P) {
  const sparse::LycheeClusterParams& p = sp.lc;
  LcShape s;
  s.n_sparse = std::max(0, c.n_layers - p.dense_layers);
  const int64_t ctx = std::min<int64_t>(c.max_context, seq_tokens);
  const int min_len = p.chunker.fixed ? p.chunker.fixed_tokens : p.chunker.min_tokens;
  const int64_t chunks = (std::max<int64_t>(0, ctx - p.sink) + min_len - 1) / min_len + 1;
  SPADE_CHECK(chunks <= 16384, "--device cuda: lycheecluster indexes at most 16384 chunks per "
              "request; a context of ", ctx, " tokens in chunks of >= ", min_len, " tokens needs ",
              chunks, " (lower the context or --max-tokens, or raise min_chunk)");
  s.index.slots = std::max(1, max_batch * s.n_sparse);
  s.index.search_batch = std::max(1, max_batch);  // a layer's search: one slot per request
  s.index.Hkv = c.n_kv_heads;
  s.index.D = c.head_dim;
  s.index.P = P;
  s.index.max_chunks = int(std::max<int64_t>(1, chunks));
  s.index.chunks_per_fine = p.index.chunks_per_fine;
  s.index.max_coarse = p.index.max_coarse;
  s.index.iterations = p.index.kmeans.iterations;
  // Sink + chosen chunk tokens (<= budget) + the un-indexed tail (< buffer before an insert,
  // the open chunk after one); a request still dense lists L <= sink + budget tokens.
  const int64_t open = std::max(p.chunker.max_tokens, p.chunker.fixed_tokens);
  s.cap = int(std::min<int64_t>(ctx, p.sink + p.budget + p.buffer + 2 * open + 16));
  // Build scratch for as many (request, layer) slots per launch sequence as fit 128 MiB (at
  // least one; a request's first sparse step builds all its sparse layers).
  s.index.build_heads = cuda::LcIndexGpu::build_heads_within(s.index, size_t(128) << 20);
  return s;
}

LcShape lc_shape(const GpuMethodContext& ctx, const CudaSparse& sp) {
  return lc_shape(sp, ctx.cfg, ctx.seq_pages_cap * ctx.page_size, ctx.max_batch, ctx.page_size);
}

// The LycheeCluster state inside a request's GpuRequestState (null when it has none).
LcRequestState* lc_state(sparse::MethodState* s) {
  auto* g = dynamic_cast<GpuRequestState*>(s);
  return g ? dynamic_cast<LcRequestState*>(g->own.get()) : nullptr;
}

class GpuLycheeCluster final : public SelectingMethod {
 public:
  GpuLycheeCluster(const GpuMethodContext& ctx, const CudaSparse& sp) : SelectingMethod(ctx, sp) {}
  ~GpuLycheeCluster() override {
    quiesce();
    if (lc_slot_host_) cudaFreeHost(lc_slot_host_);
    lc_.reset();
  }

  static size_t lc_arena_bytes(const GpuMethodContext& ctx, const CudaSparse& sp) {
    const LcShape s = lc_shape(ctx, sp);
    if (s.n_sparse == 0) return 0;
    const size_t mb = size_t(ctx.max_batch), Hkv = size_t(ctx.cfg.n_kv_heads);
    return cuda::LcIndexGpu::arena_bytes(s.index) + mb * Hkv * size_t(s.cap) * 4 + mb * Hkv * 4 +
           size_t(s.n_sparse) * mb * 4 + 3 * 256;
  }
  static int64_t cap(const GpuMethodContext& ctx, const CudaSparse& sp) {
    const LcShape s = lc_shape(ctx, sp);
    return std::max<int64_t>(1, int64_t(ctx.max_batch) * ctx.cfg.n_kv_heads * s.cap);
  }
  static size_t arena_bytes_of(const GpuMethodContext& ctx, const CudaSparse& sp) {
    return base_bytes(ctx, sp) + lists_bytes(ctx, cap(ctx, sp), 1) + lc_arena_bytes(ctx, sp) +
           twilight_bytes(ctx, sp, cap(ctx, sp), ctx.cfg.n_kv_heads, cuda::SelGran::Token);
  }
  static std::string describe_spec(const CudaSparse& sp) {
    const auto& p = sp.lc;
    return cat("lycheecluster budget=", p.budget, " budget_mode=",
               p.budget_total ? "total" : "clusters", " sink=", p.sink, " buffer=", p.buffer,
               " dense_layers=", p.dense_layers, " chunking=", p.chunker.fixed ? "fixed" : "structure",
               " chunks_per_fine=", p.index.chunks_per_fine, " max_coarse=", p.index.max_coarse,
               " kmeans_iters=", p.index.kmeans.iterations, " coarse_topk=",
               p.search.coarse_topk ? std::to_string(p.search.coarse_topk) : std::string("auto"),
               " (GPU: index build, lazy update and search kernels; chunking on the host from "
               "the token text)");
  }

  std::unique_ptr<sparse::MethodState> new_request_state() override {
    std::lock_guard<std::mutex> g(lc_slots_->mu);
    SPADE_CHECK(!lc_slots_->free.empty(), "lycheecluster on the GPU: all ", lc_slots_->total,
                " request slots (max_batch) are in use; destroy the state of a finished request "
                "first");
    const int slot = lc_slots_->free.back();
    lc_slots_->free.pop_back();
    return std::make_unique<LcRequestState>(lc_slots_, slot);
  }
  bool keeps_request_state() const override { return true; }

 private:
  int64_t sel_cap() const override { return cap(ctx_, sp_); }

  void alloc_state(cuda::DeviceArena& A) override {
    const LcShape s = lc_shape(ctx_, sp_);
    lc_slots_ = std::make_shared<CudaLcSlots>();
    lc_slots_->total = ctx_.max_batch;
    for (int i = ctx_.max_batch - 1; i >= 0; --i) lc_slots_->free.push_back(i);
    if (s.n_sparse == 0) return;
    const size_t mb = size_t(ctx_.max_batch), Hkv = size_t(ctx_.cfg.n_kv_heads);
    lc_cap_ = s.cap;
    lc_ = std::make_unique<cuda::LcIndexGpu>(A, s.index);
    lc_lists_ = A.alloc_n<int32_t>(mb * Hkv * size_t(s.cap), "lycheecluster lists");
    lc_counts_ = A.alloc_n<int32_t>(mb * Hkv, "lycheecluster list lengths");
    // The attention reads the strided lists in place (list i at i * cap, lc_counts_[i] long).
    lc_off_ = A.alloc_n<int32_t>(mb * Hkv, "lycheecluster list offsets");
    std::vector<int32_t> off(mb * Hkv);
    for (size_t i = 0; i < off.size(); ++i) off[i] = int32_t(i * size_t(s.cap));
    SPADE_CUDA(cudaMemcpy(lc_off_, off.data(), off.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
    lc_slot_dev_ = A.alloc_n<int32_t>(size_t(s.n_sparse) * mb, "lycheecluster slot table");
    SPADE_CUDA(cudaMallocHost(&lc_slot_host_, sizeof(int32_t) * size_t(s.n_sparse) * mb));
  }

  void plan_lists(const SeqInput* seqs, int n, bool decode) override {
    lc_sync_.clear();
    SelectingMethod::plan_lists(seqs, n, decode);  // the step's page table is on its way
    sync_indexes();
  }

  // Every sparse layer's builds and inserts of this step, eagerly on the model's stream (the
  // step's launches, graph or not, follow in stream order). They read chunks of tokens before
  // the current one, whose K every layer's cache holds.
  void sync_indexes() {
    if (lc_sync_.empty()) return;
    const int n_sparse = ctx_.cfg.n_layers - sp_.lc.dense_layers;
    SPADE_CHECK(ctx_.k_cache, "lycheecluster: no KV cache in the method context");
    const cuda::bf16* k0 = static_cast<const cuda::bf16*>(ctx_.k_cache) +
                           int64_t(sp_.lc.dense_layers) * ctx_.kv_layer_elems;
    lc_builds_.clear();
    lc_ins_.clear();
    for (const LcSync& s : lc_sync_) {
      const int32_t* pt = sparse_->dev_page_table() + s.page_off;
      for (int jj = 0; jj < n_sparse; ++jj) {
        const int slot = s.req_slot * n_sparse + jj;
        const cuda::bf16* kl = k0 + jj * ctx_.kv_layer_elems;
        if (s.n_old == 0) lc_builds_.push_back({slot, kl, pt, s.starts, s.n_new});
        else lc_ins_.push_back({slot, pt, s.n_old, s.starts + s.n_old + 1, s.n_new, kl});
      }
    }
    cudaStream_t st = S_(ctx_.stream);
    if (!lc_builds_.empty()) lc_->build_batch(lc_builds_, st);
    if (!lc_ins_.empty()) lc_->insert_batch(lc_ins_, nullptr, st);
  }

  int64_t list_rows(int, int64_t L) const override {
    return int64_t(ctx_.cfg.n_kv_heads) * std::min<int64_t>(lc_cap_, L);
  }

  void list_entries(const SeqInput* batch, int n, bool& any_sparse) override {
    const sparse::LycheeClusterParams& p = sp_.lc;
    const int P = ctx_.page_size, Hkv = ctx_.cfg.n_kv_heads, mb = ctx_.max_batch;
    const int n_sparse = ctx_.cfg.n_layers - p.dense_layers;
    std::vector<int>& max_entries = plan_max_entries_;
    cudaStream_t st = S_(ctx_.stream);
    // Checks and chunking first (a repeated extend with the same L does nothing), so a bad
    // batch throws before any request's state records a build or update that would not run.
    // Chunks close over the tokens before the current one (L - 1), as on the CPU.
    for (int i = 0; i < n; ++i) {
      auto* rs = lc_state(batch[i].device_state);
      SPADE_CHECK(rs && rs->slots_ == lc_slots_, "lycheecluster on the GPU: every sequence needs "
                  "its request state from this model's new_request_state() in SeqInput::device_state");
      const int64_t L = batch[i].pages->length + 1;
      const int32_t have = rs->fresh ? 0 : rs->indexed;
      const bool over = p.budget_total ? L > p.budget : L > int64_t(p.sink) + p.budget;
      const int64_t indexed_end = have > 0 ? rs->chunks.starts()[size_t(have)] : p.sink;
      if (over && !(have > 0 && L - indexed_end < p.buffer)) {
        rs->chunks.extend(rs->text, L - 1, p.sink, p.chunker);
        SPADE_CHECK(rs->chunks.n_chunks() <= lc_->config().max_chunks, "lycheecluster: ",
                    rs->chunks.n_chunks(), " chunks exceed the index capacity of ",
                    lc_->config().max_chunks);
      }
    }
    int64_t page_off = 0;
    for (int i = 0; i < n; ++i) {
      auto* rs = lc_state(batch[i].device_state);
      if (rs->fresh) {
        for (int j = 0; j < n_sparse; ++j) lc_->reset(rs->slot * n_sparse + j, st);
        rs->fresh = false;
        rs->indexed = 0;
      }
      const int64_t L = batch[i].pages->length + 1;
      const bool over = p.budget_total ? L > p.budget : L > int64_t(p.sink) + p.budget;
      if (over) {
        any_sparse = true;
        // The CPU's sync rule (LycheeClusterMethod::sync), once for every sparse layer; the
        // chunks were extended above when it fires.
        const int32_t have = rs->indexed;
        const int64_t indexed_end = have > 0 ? rs->chunks.starts()[size_t(have)] : p.sink;
        if (!(have > 0 && L - indexed_end < p.buffer)) {
          const int32_t avail = rs->chunks.n_chunks();
          if (avail > have) {
            lc_sync_.push_back({rs->slot, have, avail - have, rs->chunks.starts().data(), page_off});
            rs->indexed = avail;
          }
        }
      }
      for (int h = 0; h < Hkv; ++h) max_entries.push_back(int(std::min<int64_t>(lc_cap_, L)));
      for (int j = 0; j < n_sparse; ++j) lc_slot_host_[j * mb + int(i)] = rs->slot * n_sparse + j;
      page_off += (L + P - 1) / P;
    }
    SPADE_CUDA(cudaMemcpyAsync(lc_slot_dev_, lc_slot_host_, sizeof(int32_t) * size_t(n_sparse) * mb,
                               cudaMemcpyHostToDevice, st));
  }

  // The layer's search into the strided lists lc_lists_ / lc_counts_ (the indexes were
  // synced in the plan).
  void search_layer(int l, const void* q) {
    const sparse::LycheeClusterParams& p = sp_.lc;
    const int j = l - p.dense_layers;
    cudaStream_t st = S_(run_);
    cuda::LcSearchArgs a;
    a.q = static_cast<const cuda::bf16*>(q);
    a.slot = lc_slot_dev_ + int64_t(j) * ctx_.max_batch;
    a.kv_len = sparse_->dev_kv_len();
    a.B = step_B_, a.Hq = ctx_.cfg.n_heads;
    a.budget = p.budget, a.budget_total = p.budget_total;
    a.coarse_topk = p.search.coarse_topk, a.coarse_cover = p.search.coarse_cover;
    a.sink = p.sink, a.cap = lc_cap_;
    a.lists = lc_lists_, a.counts = lc_counts_;
    lc_->search(a, st);
  }

  TwilightBaseLists twilight_base(int l, const void* q, const void* kc) override {
    search_layer(l, q);
    // The pruner reads CSR lists.
    cuda::LcIndexGpu::compact(lc_lists_, lc_counts_, step_B_ * ctx_.cfg.n_kv_heads, lc_cap_,
                              sel_off_, sel_idx_, S_(run_));
    if (trace) trace_lists(l);
    return SelectingMethod::twilight_base(l, q, kc);
  }

  void attend_lists(int l, const void* q, const void* kc_, const void* vc_, void* att,
                    float scale) override {
    const int Hkv = ctx_.cfg.n_kv_heads;
    cudaStream_t st = S_(run_);
    search_layer(l, q);
    const cuda::bf16* kc = static_cast<const cuda::bf16*>(kc_);
    if (trace) {  // the trace reads CSR lists
      cuda::LcIndexGpu::compact(lc_lists_, lc_counts_, step_B_ * Hkv, lc_cap_, sel_off_, sel_idx_, st);
      trace_lists(l);
    }
    sparse_->run(static_cast<const cuda::bf16*>(q), kc, static_cast<const cuda::bf16*>(vc_), lc_off_,
                 lc_lists_, static_cast<cuda::bf16*>(att), scale, st, 0, nullptr, 0, sel_skip(l),
                 lc_counts_);
  }

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
  std::vector<cuda::LcBuild> lc_builds_;
  std::vector<cuda::LcInsert> lc_ins_;
};

}  // namespace

const GpuMethodKind gpu_lycheecluster = SPADE_GPU_METHOD_KIND(GpuLycheeCluster);

}  // namespace spade
#endif  // SPADE_HAVE_CUDA
