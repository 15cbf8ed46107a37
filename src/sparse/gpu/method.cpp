// GpuMethod (method.h): what every GPU method shares. Layout / bytes: base_bytes() = the dense
// AttentionWorkspace for max_batch sequences of max_step_tokens query rows over the whole KV
// pool (split-KV decode with up to 64 splits, prefill), + u64 [4][NL][Hkv] BLASST tile counters
// (+1 KiB) when the method skips tiles, + 1 MiB slack; the subclass's own bytes follow. Here:
// the step plan of the dense workspace, per-request row counting, the dense attention (with
// BLASST's skip parameters: fixed lambda or a / L, decode vs prefill), the method's lane and
// side streams, the BLASST counters, their decode tiles handed to the requests that skipped
// them (settle_blasst: density counts skipped rows as not attended) and lambda changes
// (calibration).
#if defined(SPADE_HAVE_CUDA)
#include "sparse/gpu/method.h"

#include <algorithm>
#include <cmath>

#include "backend/cuda/attention.h"
#include "backend/cuda/sparse_attention.h"
#include "core/error.h"
#include "sparse/gpu/registry.h"

namespace spade {

namespace {

cudaStream_t S_(void* p) { return static_cast<cudaStream_t>(p); }

cuda::AttnLimits attn_limits(const GpuMethodContext& ctx) {
  cuda::AttnLimits lim;
  lim.max_batch = ctx.max_batch;
  lim.max_q_tokens = ctx.max_step_tokens;
  lim.max_pages = ctx.n_pages;
  lim.max_split = 64;
  return lim;
}

}  // namespace

// FP8 cache (issue 40): only full attention reads it so far (the dense decode kernel reads the
// codes; prefill widens them). Every other method's kernels (selections, scores, page bounds,
// INT4 keys, BLASST's skip kernels, LycheeCluster's index) read bf16 caches: refused, by name,
// instead of reading fp8 bytes as bf16.
void check_gpu_kv_dtype(bool kv_fp8, const CudaSparse& sp) {
  if (!kv_fp8) return;
  const bool plain_full = sp.method == CudaSparse::Method::None && !sp.twilight_sel && !sp.blasst_any();
  if (plain_full) return;
  std::string name = find_gpu_method(sp).name;
  if (sp.twilight_sel) name += "+twilight";
  if (sp.blasst_sel) name += "+blasst";
  SPADE_CHECK(plain_full, "sparse method '", name,
              "' does not read an fp8 KV cache on the GPU yet (issue 40): with --device cuda, "
              "--kv-dtype fp8 runs full attention only; use --kv-dtype bf16 for this method, or "
              "--device cpu");
}

namespace {
void check_kv_dtype(const GpuMethodContext& ctx, const CudaSparse& sp) { check_gpu_kv_dtype(ctx.kv_fp8, sp); }
}  // namespace

std::unique_ptr<GpuMethod> GpuMethod::create(const GpuMethodContext& ctx, const CudaSparse& sp,
                                             cuda::DeviceArena* arena) {
  check_kv_dtype(ctx, sp);
  const GpuMethodRow& row = find_gpu_method(sp);
  std::unique_ptr<GpuMethod> m = row.kind->make(ctx, sp);
  m->init(arena, arena ? 0 : row.kind->arena_bytes(ctx, sp));
  return m;
}

size_t GpuMethod::arena_bytes(const GpuMethodContext& ctx, const CudaSparse& sp) {
  check_kv_dtype(ctx, sp);
  return find_gpu_method(sp).kind->arena_bytes(ctx, sp);
}

size_t GpuMethod::base_bytes(const GpuMethodContext& ctx, const CudaSparse& sp) {
  const ModelConfig& c = ctx.cfg;
  size_t b = cuda::AttentionWorkspace::arena_bytes(attn_limits(ctx), c.n_heads, c.n_kv_heads,
                                                   c.head_dim) +
             (1u << 20);
  if (sp.blasst_any()) b += size_t(4) * c.n_layers * c.n_kv_heads * 8 + 1024;
  return b;
}

GpuMethod::GpuMethod(const GpuMethodContext& ctx, const CudaSparse& sp) : ctx_(ctx), sp_(sp) {}

void GpuMethod::init(cuda::DeviceArena* arena, size_t bytes) {
  check();
  run_ = ctx_.stream;
  {
    cudaStream_t lane;
    SPADE_CUDA(cudaStreamCreateWithFlags(&lane, cudaStreamNonBlocking));
    lane_ = lane;
    cudaEvent_t ev;
    SPADE_CUDA(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    ev_lane_ = ev;
  }
  if (!arena) {
    own_arena_ = std::make_unique<cuda::DeviceArena>(bytes);
    arena = own_arena_.get();
  }
  cuda::DeviceArena& A = *arena;
  const ModelConfig& c = ctx_.cfg;
  attn_ = std::make_unique<cuda::AttentionWorkspace>(A, attn_limits(ctx_), c.n_heads,
                                                     c.n_kv_heads, c.head_dim, ctx_.page_size);
  // BLASST decode: the skip kernel keeps the static schedule, so plan its split counts.
  attn_->set_blasst_decode(sp_.blasst_any() && sp_.blasst_decode);
  if (ctx_.deterministic) attn_->set_deterministic(true);
  attn_->set_fp8_cache(ctx_.kv_fp8);
  if (sp_.blasst_any()) {
    const size_t n = size_t(4) * c.n_layers * c.n_kv_heads;
    blasst_counts_ = A.alloc_n<unsigned long long>(n, "blasst tile counters");
    SPADE_CUDA(cudaMemset(blasst_counts_, 0, n * 8));
  }
  if (uses_side_stream()) {
    cudaStream_t side;
    SPADE_CUDA(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
    side_ = side;
    cudaEvent_t ef, ej;
    SPADE_CUDA(cudaEventCreateWithFlags(&ef, cudaEventDisableTiming));
    SPADE_CUDA(cudaEventCreateWithFlags(&ej, cudaEventDisableTiming));
    ev_fork_ = ef;
    ev_join_ = ej;
  }
  alloc(A);
}

void GpuMethod::quiesce() {
  if (ctx_.stream) cudaStreamSynchronize(S_(ctx_.stream));
  if (side_) cudaStreamSynchronize(S_(side_));
  if (lane_) cudaStreamSynchronize(S_(lane_));
}

GpuMethod::~GpuMethod() {
  quiesce();
  if (blasst_copying_) cudaEventSynchronize(static_cast<cudaEvent_t>(blasst_ev_));  // the copy's target
  if (blasst_ev_) cudaEventDestroy(static_cast<cudaEvent_t>(blasst_ev_));
  if (blasst_host_) cudaFreeHost(blasst_host_);
  if (ev_lane_) cudaEventDestroy(static_cast<cudaEvent_t>(ev_lane_));
  if (lane_) cudaStreamDestroy(S_(lane_));
  if (ev_fork_) cudaEventDestroy(static_cast<cudaEvent_t>(ev_fork_));
  if (ev_join_) cudaEventDestroy(static_cast<cudaEvent_t>(ev_join_));
  if (side_) cudaStreamDestroy(S_(side_));
  attn_.reset();
  own_arena_.reset();
}

void GpuMethod::plan(const SeqInput* seqs, const cuda::AttnSeq* aseq, int n) {
  cudaStream_t st = S_(ctx_.stream);
  settle_blasst_async();  // the previous steps' skipped tiles, without waiting for them
  plan_aseq_.assign(aseq, aseq + n);  // kept: no allocation once warm
  attn_->plan(plan_aseq_, st, 0, /*wait=*/false);
  sparse_step_ = false;
  bool decode = true;
  // A one-token cache-correction chunk (SeqInput::dense) is no decode row: it attends densely.
  for (int i = 0; i < n; ++i) decode = decode && seqs[i].n_tokens == 1 && !seqs[i].dense;
  plan_lists(seqs, n, decode);
  count_rows(seqs, n, decode);
}

int64_t GpuMethod::sparse_layer_rows(int, int64_t L) const {
  return int64_t(ctx_.cfg.n_kv_heads) * L;
}

void GpuMethod::count_rows(const SeqInput* seqs, int n, bool decode) {
  const ModelConfig& c = ctx_.cfg;
  const int NL = c.n_layers, Hkv = c.n_kv_heads;
  // A step of decode rows only runs the decode kernels, whose skipped tiles count in the decode
  // counters (a mixed step's decode rows attend with the prefill launch: not counted).
  const bool skips = decode && blasst_decode_skips();
  for (int i = 0; i < n; ++i) {
    auto* g = dynamic_cast<GpuRequestState*>(seqs[i].device_state);
    // Decode rows only (a prefill or correction chunk is dense).
    if (!g || seqs[i].n_tokens != 1 || seqs[i].dense) continue;
    const int64_t L = seqs[i].pages->length + 1;
    int64_t rows = int64_t(NL) * Hkv * L;
    if (sparse_step_) {
      rows = 0;
      for (int l = 0; l < NL; ++l) rows += sparse_layer_rows(l, L);
    }
    g->attended += rows;
    if (skips) {
      g->blasst = this;
      blasst_pending_.push_back({g->skipped, rows});
    }
  }
  blasst_unsettled_ = blasst_unsettled_ || skips;
}

bool GpuMethod::blasst_decode_skips() const {
  if (!sp_.blasst_any() || !sp_.blasst_decode || !blasst_counts_) return false;
  return sp_.blasst_lambda >= 0 ? sp_.blasst_lambda > 0 : sp_.blasst_a > 0;
}

void GpuMethod::blasst_hand_out(const uint64_t* c, std::vector<BlasstPending>& pending) {
  const size_t n = size_t(ctx_.cfg.n_layers) * ctx_.cfg.n_kv_heads * 2;
  uint64_t skipped = 0;
  for (size_t i = 1; i < n; i += 2) skipped += c[i];
  // The counters only grow, but for reset_blasst_counts (which settles first).
  const uint64_t d = skipped >= blasst_settled_ ? skipped - blasst_settled_ : skipped;
  blasst_settled_ = skipped;
  int64_t left = int64_t(d) * kBlasstTileRows, total_rows = 0;
  for (const BlasstPending& p : pending) total_rows += p.rows;
  const int64_t all = left;
  for (size_t i = 0; i < pending.size() && total_rows > 0 && left > 0; ++i) {
    const BlasstPending& p = pending[i];
    int64_t share = i + 1 == pending.size()
                        ? left
                        : int64_t(double(all) * double(p.rows) / double(total_rows));
    share = std::min({share, left, p.rows});
    *p.skipped += share;
    left -= share;
  }
  pending.clear();
}

void GpuMethod::settle_blasst() {
  if (blasst_copying_) {  // the copy in flight first: its requests' steps come first
    SPADE_CUDA(cudaEventSynchronize(static_cast<cudaEvent_t>(blasst_ev_)));
    blasst_copying_ = false;
    blasst_hand_out(reinterpret_cast<const uint64_t*>(blasst_host_), blasst_inflight_);
  }
  if (!blasst_unsettled_) return;
  blasst_unsettled_ = false;
  const std::vector<uint64_t> c = blasst_counts(false);  // waits for the steps
  blasst_hand_out(c.data(), blasst_pending_);
}

void GpuMethod::settle_blasst_async() {
  if (blasst_copying_) {
    const cudaError_t e = cudaEventQuery(static_cast<cudaEvent_t>(blasst_ev_));
    if (e == cudaErrorNotReady) return;  // next step's plan looks again
    SPADE_CUDA(e);
    blasst_copying_ = false;
    blasst_hand_out(reinterpret_cast<const uint64_t*>(blasst_host_), blasst_inflight_);
  }
  if (!blasst_unsettled_) return;
  blasst_unsettled_ = false;
  if (!blasst_host_) {
    SPADE_CUDA(cudaMallocHost(&blasst_host_, size_t(ctx_.cfg.n_layers) * ctx_.cfg.n_kv_heads * 2 * 8));
    cudaEvent_t ev;
    SPADE_CUDA(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    blasst_ev_ = ev;
  }
  cudaStream_t st = S_(ctx_.stream);
  SPADE_CUDA(cudaMemcpyAsync(blasst_host_, blasst_counts_,
                             size_t(ctx_.cfg.n_layers) * ctx_.cfg.n_kv_heads * 2 * 8,
                             cudaMemcpyDeviceToHost, st));
  SPADE_CUDA(cudaEventRecord(static_cast<cudaEvent_t>(blasst_ev_), st));
  blasst_inflight_.swap(blasst_pending_);  // pending is empty after the swap (was settled)
  blasst_pending_.clear();
  blasst_copying_ = true;
}

void GpuMethod::attend(int l, const void* q, const void* kc, const void* vc, void* att,
                       float scale) {
  attend_dense(l, q, kc, vc, att, scale);
}

void GpuMethod::attend_dense(int l, const void* q, const void* kc, const void* vc, void* att,
                             float scale) {
  using cuda::bf16;
  if (ctx_.kv_fp8) {  // full attention only (check_kv_dtype): no BLASST skip
    const int Hkv = ctx_.cfg.n_kv_heads;
    cuda::KvFp8 kv;
    kv.k = static_cast<const uint8_t*>(kc);
    kv.v = static_cast<const uint8_t*>(vc);
    kv.k_scale = ctx_.kv_scales + size_t(l) * 2 * size_t(Hkv);
    kv.v_scale = kv.k_scale + Hkv;
    kv.k_wide = static_cast<bf16*>(ctx_.k_wide);
    kv.v_wide = static_cast<bf16*>(ctx_.v_wide);
    attn_->run_fp8(static_cast<const bf16*>(q), kv, static_cast<bf16*>(att), scale, S_(run_));
    return;
  }
  attn_->run(static_cast<const bf16*>(q), static_cast<const bf16*>(kc),
             static_cast<const bf16*>(vc), static_cast<bf16*>(att), scale, S_(run_),
             blasst_skip(l));
}

void GpuMethod::attend_on_lane(void* ready, int layer, const void* q, const void* kc,
                               const void* vc, void* att, float scale) {
  SPADE_CUDA(cudaStreamWaitEvent(S_(lane_), static_cast<cudaEvent_t>(ready), 0));
  run_ = lane_;
  attend(layer, q, kc, vc, att, scale);
  run_ = ctx_.stream;
  SPADE_CUDA(cudaEventRecord(static_cast<cudaEvent_t>(ev_lane_), S_(lane_)));
}

void GpuMethod::join_lane() {
  SPADE_CUDA(cudaStreamWaitEvent(S_(ctx_.stream), static_cast<cudaEvent_t>(ev_lane_), 0));
}

void* GpuMethod::fork_selection() {
  // Traced steps stay in order on one stream; under tensor parallelism every collective stays
  // on the model's stream, in the same order on every rank.
  if (!side_ || trace || ctx_.tp) return run_;
  SPADE_CUDA(cudaEventRecord(static_cast<cudaEvent_t>(ev_fork_), S_(run_)));
  SPADE_CUDA(cudaStreamWaitEvent(S_(side_), static_cast<cudaEvent_t>(ev_fork_), 0));
  sel_pending_ = true;
  return side_;
}

void GpuMethod::join() {
  if (!sel_pending_) return;
  SPADE_CUDA(cudaEventRecord(static_cast<cudaEvent_t>(ev_join_), S_(side_)));
  SPADE_CUDA(cudaStreamWaitEvent(S_(run_), static_cast<cudaEvent_t>(ev_join_), 0));
  sel_pending_ = false;
}

bool GpuMethod::decode() const { return attn_->decode(); }

bool GpuMethod::draws_chunks() const { return attn_->draws_chunks(); }

void GpuMethod::append_graph_key(std::vector<int>& k) const {
  // The dense plan's split and item counts, and whether the step is sparse (selecting.h adds
  // its launch shapes).
  k.push_back(attn_->n_split());
  k.push_back(attn_->n_items());
  k.push_back(attn_->decode_variant());  // auto's kernel depends on the context length too
  k.push_back(sparse_step_ ? 1 : 0);
}

// --- BLASST: the skip parameters of each attention launch and the tile counters.

cuda::BlasstSkip GpuMethod::blasst_skip(int layer) const {
  const CudaSparse& sp = sp_;
  cuda::BlasstSkip k;
  const bool dec = attn_->decode();
  if (!sp.blasst_any() || !(dec ? sp.blasst_decode : blasst_prefill_active())) return k;
  if (sp.blasst_lambda >= 0) {
    if (sp.blasst_lambda > 0) k.log_lambda = float(std::log(sp.blasst_lambda));
  } else {
    const double a = dec ? sp.blasst_a : sp.blasst_prefill_a;
    if (a > 0) k.log_lambda = float(std::log(a)), k.per_length = true;
  }
  const int Hkv = ctx_.cfg.n_kv_heads;
  if (count_blasst)
    k.counts = blasst_counts_ + (size_t(dec ? 0 : 1) * ctx_.cfg.n_layers + size_t(layer)) * Hkv * 2;
  return k;
}

cuda::SelSkip GpuMethod::sel_skip(int layer) const {
  const CudaSparse& sp = sp_;
  cuda::SelSkip k;
  if (!sp.blasst_sel || !sp.blasst_decode) return k;
  const cuda::BlasstSkip b = blasst_skip(layer);
  k.log_lambda = b.log_lambda;
  k.per_length = b.per_length;
  k.length_selected = sp.blasst_len_selected;
  k.counts = b.counts;
  return k;
}

bool GpuMethod::blasst_prefill_active() const {
  return sp_.blasst_any() && sp_.blasst_prefill;
}

std::vector<uint64_t> GpuMethod::blasst_counts(bool prefill) const {
  const size_t n = size_t(ctx_.cfg.n_layers) * ctx_.cfg.n_kv_heads * 2;
  std::vector<uint64_t> h(n, 0);
  if (!blasst_counts_) return h;
  SPADE_CUDA(cudaStreamSynchronize(S_(ctx_.stream)));
  SPADE_CUDA(cudaMemcpy(h.data(), blasst_counts_ + (prefill ? n : 0), n * 8, cudaMemcpyDeviceToHost));
  return h;
}

void GpuMethod::set_blasst(const CudaSparse& s) {
  // BLASST inside this selector's lists (X+blasst): only the skip parameters change (the
  // calibration probe over a selector); the lists, their sizes and buffers stay.
  SPADE_CHECK(sp_.blasst_sel && s.blasst_sel && s.method == sp_.method,
              "set_blasst: the model was not built with BLASST");
  SPADE_CHECK(s.blasst_decode == sp_.blasst_decode && s.blasst_prefill == sp_.blasst_prefill,
              "set_blasst: the phases that skip are fixed when the model is built");
  settle_blasst();
  SPADE_CUDA(cudaStreamSynchronize(S_(ctx_.stream)));
  sp_.blasst_lambda = s.blasst_lambda;
  sp_.blasst_a = s.blasst_a;
  sp_.blasst_prefill_a = s.blasst_prefill_a;
  sp_.blasst_len_selected = s.blasst_len_selected;
}

void GpuMethod::reset_blasst_counts() {
  if (!blasst_counts_) return;
  settle_blasst();  // the requests keep what they skipped so far
  blasst_settled_ = 0;
  SPADE_CUDA(cudaStreamSynchronize(S_(ctx_.stream)));
  SPADE_CUDA(cudaMemset(blasst_counts_, 0, size_t(4) * ctx_.cfg.n_layers * ctx_.cfg.n_kv_heads * 8));
}

}  // namespace spade
#endif  // SPADE_HAVE_CUDA
