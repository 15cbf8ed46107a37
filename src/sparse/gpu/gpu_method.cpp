// See gpu_method.h: sizing, buffers, the per-step plan and the per-layer attention of a GPU
// method. Method-specific layers: gpu_method_scored.cpp (Tidal / LessIsMore selection layers,
// oracle-topk), gpu_method_lycheedecode.cpp, gpu_method_lycheecluster.cpp, and BLASST's skip
// parameters in gpu_method_blasst.cpp.
#if defined(SPADE_HAVE_CUDA)
#include "sparse/gpu/gpu_method.h"

#include <algorithm>
#include <cmath>

#include "backend/cuda/attention.h"
#include "backend/cuda/cluster_index.h"
#include "backend/cuda/sparse_attention.h"
#include "backend/cuda/twilight.h"
#include "core/error.h"

namespace spade {

namespace {
// The most splits of one (request, KV head) in sparse decode launches (dense retrieval heads at
// batch 1 take ~128 at 128K; bench/results/sparse_max_split_ab_h100_20261127.json).
constexpr int kSparseMaxSplit = 256;

cudaStream_t S_(void* p) { return static_cast<cudaStream_t>(p); }

cuda::AttnLimits attn_limits(const GpuMethodContext& ctx) {
  cuda::AttnLimits lim;
  lim.max_batch = ctx.max_batch;
  lim.max_q_tokens = ctx.max_step_tokens;
  lim.max_pages = ctx.n_pages;
  lim.max_split = 64;
  return lim;
}

// LycheeDecode: the distinct retrieval-head patterns of the layers that are not all retrieval
// heads (one SparseAttention plan each); pattern_of[layer] = its index or -1.
void ld_patterns(const CudaSparse& sp, const ModelConfig& c,
                 std::vector<std::vector<uint8_t>>& patterns, std::vector<int>& pattern_of) {
  patterns.clear();
  pattern_of.assign(size_t(c.n_layers), -1);
  if (sp.method != CudaSparse::Method::LycheeDecode) return;
  SPADE_CHECK(int64_t(sp.retrieval.size()) == c.n_layers, "lycheedecode: roles for ",
              sp.retrieval.size(), " layers, the model has ", c.n_layers);
  for (int l = 0; l < c.n_layers; ++l) {
    const auto& r = sp.retrieval[size_t(l)];
    SPADE_CHECK(int64_t(r.size()) == c.n_kv_heads, "lycheedecode: roles for ", r.size(),
                " KV heads");
    if (std::all_of(r.begin(), r.end(), [](uint8_t x) { return x != 0; })) continue;
    auto it = std::find(patterns.begin(), patterns.end(), r);
    pattern_of[size_t(l)] = int(it - patterns.begin());
    if (it == patterns.end()) patterns.push_back(r);
  }
  if (patterns.empty()) patterns.push_back(std::vector<uint8_t>(size_t(c.n_kv_heads), 0));
}

bool token_topk(const CudaSparse& sp) {
  return sp.method == CudaSparse::Method::Tidal || sp.method == CudaSparse::Method::LycheeDecode ||
         sp.method == CudaSparse::Method::OracleTopK || sp.method == CudaSparse::Method::LessIsMore;
}
int topk_k(const CudaSparse& sp, const ModelConfig& c) {
  return sp.method == CudaSparse::Method::LessIsMore
             ? int(std::max<int64_t>(1, sp.lim_unified()))
             : int(std::min<int64_t>(sp.budget, c.max_context));
}
int topk_rows_n(const GpuMethodContext& ctx, const CudaSparse& sp) {
  return ctx.max_batch *
         (sp.method == CudaSparse::Method::LessIsMore ? ctx.cfg.n_heads : ctx.cfg.n_kv_heads);
}
bool long_topk(const GpuMethodContext& ctx, const CudaSparse& sp) {
  return token_topk(sp) &&
         cuda::topk_long_applies(ctx.seq_pages_cap * ctx.page_size, topk_k(sp, ctx.cfg));
}

}  // namespace

size_t GpuMethod::state_bytes(const GpuMethodContext& ctx, const CudaSparse& sp,
                              std::vector<std::vector<uint8_t>>* patterns, int64_t* sel_cap_out) {
  const ModelConfig& c = ctx.cfg;
  const int64_t Hq = c.n_heads, Hkv = c.n_kv_heads, D = c.head_dim, NL = c.n_layers;
  const int64_t mb = ctx.max_batch, P = ctx.page_size, cap = ctx.seq_pages_cap;
  size_t b = 0;
  int64_t sel_cap = 0;
  if (sp.blasst_any()) b += size_t(4) * NL * Hkv * 8 + 1024;
  if (!sp.selects()) {
    if (sel_cap_out) *sel_cap_out = 0;
    return b;
  }
  const int64_t kp = sp.budget / 16;
  if (sp.quest_base()) {
    sel_cap = mb * Hkv * std::max<int64_t>(1, std::min(kp, cap));
    b += size_t(mb * Hkv * cap) * 4 + 256;  // page scores
    if (sp.method == CudaSparse::Method::Twilight) {
      b += cuda::TwilightPruner::arena_bytes(int(mb), int(Hq), int(Hkv), int(kp * 16));
      b += cuda::SparseAttention::arena_bytes(int(mb), ctx.n_pages, int(Hq), int(Hkv), int(D)) +
           (4u << 20);  // attention over the kept lists
    }
  } else if (sp.method == CudaSparse::Method::Tidal ||
             sp.method == CudaSparse::Method::LycheeDecode) {
    const int64_t k = std::min<int64_t>(sp.budget, c.max_context);
    sel_cap = mb * Hkv * k;
    b += size_t(mb * Hkv) * size_t(cap * P) * 4 + size_t(mb * Hkv) * 4 + size_t(mb * Hkv * k) * 4 +
         3 * 256;
  } else if (sp.method == CudaSparse::Method::OracleTopK) {
    const int64_t k = std::min<int64_t>(sp.budget, c.max_context);
    sel_cap = mb * Hkv * k;
    b += size_t(mb * (Hq + Hkv)) * size_t(cap * P) * 4 + size_t(mb * Hkv) * 4 +
         size_t(mb * Hkv * k) * 4 + 4 * 256;
  } else if (sp.method == CudaSparse::Method::LycheeCluster) {
    sel_cap = std::max<int64_t>(1, lc_list_entries(ctx, sp));
    b += lc_arena_bytes(ctx, sp);
  } else if (sp.method == CudaSparse::Method::LessIsMore) {
    const int64_t k = std::min<int64_t>(sp.budget, c.max_context), nu = sp.lim_unified();
    sel_cap = mb * k;
    b += size_t(mb * Hq) * size_t(cap * P) * 4 + size_t(mb * Hq + mb) * 4 +
         size_t(mb * Hq * nu) * 4 + size_t(mb) * size_t(cap * P) * 4 + size_t(mb * nu) * 4 +
         5 * 256;
  } else {
    sel_cap = mb * std::min<int64_t>(sp.budget, c.max_context);
  }
  b += size_t(sel_cap + mb * Hkv + 1) * 4 + 2 * 256;
  std::vector<std::vector<uint8_t>> pats;
  std::vector<int> pattern_of;
  ld_patterns(sp, c, pats, pattern_of);
  b += cuda::SparseAttention::arena_bytes(int(mb), ctx.n_pages, int(Hq), int(Hkv), int(D),
                                          kSparseMaxSplit,
                                          int(std::max<size_t>(1, pats.size()))) +
       (4u << 20);
  if (long_topk(ctx, sp))
    b += cuda::topk_long_scratch_bytes(topk_rows_n(ctx, sp), cap * P, topk_k(sp, c)) + 256;
  if (patterns) *patterns = std::move(pats);
  if (sel_cap_out) *sel_cap_out = sel_cap;
  return b;
}

size_t GpuMethod::arena_bytes(const GpuMethodContext& ctx, const CudaSparse& sp) {
  return cuda::AttentionWorkspace::arena_bytes(attn_limits(ctx), ctx.cfg.n_heads,
                                               ctx.cfg.n_kv_heads, ctx.cfg.head_dim) +
         state_bytes(ctx, sp, nullptr, nullptr) + (1u << 20);
}

GpuMethod::GpuMethod(const GpuMethodContext& ctx, const CudaSparse& sp, cuda::DeviceArena* arena)
    : ctx_(ctx), sp_(sp) {
  const ModelConfig& c = ctx_.cfg;
  if (sp_.selects()) {
    SPADE_CHECK(c.n_kv_heads > 0 && c.n_heads % c.n_kv_heads == 0 &&
                    c.n_heads / c.n_kv_heads <= 16,
                "--device cuda sparse decode: GQA group ", c.n_heads / std::max(1, c.n_kv_heads),
                " > 16 is not supported");
    SPADE_CHECK(sp_.dense_layers >= 0 && sp_.dense_layers <= c.n_layers,
                "sparse dense_layers outside [0, ", c.n_layers, "]");
  }
  if (sp_.needs_quest_meta()) {
    SPADE_CHECK(ctx_.page_size == 16, "--device cuda: ", sp_.describe(),
                " needs KV pages of 16 tokens (got ", ctx_.page_size, ")");
    SPADE_CHECK(ctx_.hooks.quest_meta, "--device cuda: this model keeps no Quest page metadata, "
                "so '", sp_.describe(), "' cannot run on it (build the model with the method, "
                "or with CudaModelOptions::any_method)");
  }
  if (sp_.needs_int4_keys())
    SPADE_CHECK(ctx_.hooks.k_int4, "--device cuda: this model keeps no INT4 key copy, so '",
                sp_.describe(), "' cannot run on it (build the model with the method, or with "
                "CudaModelOptions::any_method)");
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
    own_arena_ = std::make_unique<cuda::DeviceArena>(arena_bytes(ctx_, sp_));
    arena = own_arena_.get();
  }
  alloc(*arena);
}

GpuMethod::~GpuMethod() {
  if (ctx_.stream) cudaStreamSynchronize(S_(ctx_.stream));
  if (side_) cudaStreamSynchronize(S_(side_));
  if (lane_) cudaStreamSynchronize(S_(lane_));
  if (ev_lane_) cudaEventDestroy(static_cast<cudaEvent_t>(ev_lane_));
  if (lane_) cudaStreamDestroy(S_(lane_));
  if (lc_slot_host_) cudaFreeHost(lc_slot_host_);
  if (ev_fork_) cudaEventDestroy(static_cast<cudaEvent_t>(ev_fork_));
  if (ev_join_) cudaEventDestroy(static_cast<cudaEvent_t>(ev_join_));
  if (side_) cudaStreamDestroy(S_(side_));
  sparse_kept_.reset();
  twilight_.reset();
  lc_.reset();
  sparse_.reset();
  attn_.reset();
  own_arena_.reset();
}

void GpuMethod::alloc(cuda::DeviceArena& A) {
  const ModelConfig& c = ctx_.cfg;
  const int64_t Hq = c.n_heads, Hkv = c.n_kv_heads, D = c.head_dim, NL = c.n_layers;
  const int64_t mb = ctx_.max_batch, P = ctx_.page_size, ld = ctx_.seq_pages_cap * P;
  const CudaSparse& sp = sp_;
  int64_t sel_cap = 0;
  state_bytes(ctx_, sp, nullptr, &sel_cap);
  ld_patterns(sp, c, ld_patterns_, ld_pattern_of_);
  attn_ = std::make_unique<cuda::AttentionWorkspace>(A, attn_limits(ctx_), int(Hq), int(Hkv),
                                                     int(D), int(P));
  // BLASST decode: the skip kernel keeps the static schedule, so plan its split counts.
  attn_->set_blasst_decode(sp.blasst_any() && sp.blasst_decode);
  if (ctx_.deterministic) attn_->set_deterministic(true);
  if (sp.blasst_any()) {
    const size_t n = size_t(4) * NL * Hkv;
    blasst_counts_ = A.alloc_n<unsigned long long>(n, "blasst tile counters");
    SPADE_CUDA(cudaMemset(blasst_counts_, 0, n * 8));
  }
  if (sp.scheduled() || sp.method == CudaSparse::Method::LycheeDecode) {
    cudaStream_t side;
    SPADE_CUDA(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
    side_ = side;
    cudaEvent_t ef, ej;
    SPADE_CUDA(cudaEventCreateWithFlags(&ef, cudaEventDisableTiming));
    SPADE_CUDA(cudaEventCreateWithFlags(&ej, cudaEventDisableTiming));
    ev_fork_ = ef;
    ev_join_ = ej;
  }
  if (!sp.selects()) return;
  sparse_ = std::make_unique<cuda::SparseAttention>(
      A, int(mb), ctx_.n_pages, int(Hq), int(Hkv), int(D), int(P), kSparseMaxSplit,
      int(std::max<size_t>(1, ld_patterns_.size())));
  if (sp.quest_base())
    quest_scores_ = A.alloc_n<float>(size_t(mb * Hkv * ctx_.seq_pages_cap), "quest scores");
  if (sp.method == CudaSparse::Method::Twilight) {
    twilight_ = std::make_unique<cuda::TwilightPruner>(A, int(mb), int(Hq), int(Hkv), int(D),
                                                       int(P), int(sp.budget / 16 * 16),
                                                       sp.twilight_p, sp.twilight_eps);
    sparse_kept_ = std::make_unique<cuda::SparseAttention>(A, int(mb), ctx_.n_pages, int(Hq),
                                                           int(Hkv), int(D), int(P));
  }
  if (sp.method == CudaSparse::Method::LessIsMore) {
    const int64_t nu = sp.lim_unified();
    sel_scores_ = A.alloc_n<float>(size_t(mb * Hq) * size_t(ld), "lessismore scores");
    lim_row_n_ = A.alloc_n<int32_t>(size_t(mb * Hq + mb), "lessismore row counts");
    lim_head_top_ = A.alloc_n<int32_t>(size_t(mb * Hq * nu), "lessismore head top-k");
    lim_keys_ = A.alloc_n<float>(size_t(mb) * size_t(ld), "lessismore merge keys");
    lim_merged_ = A.alloc_n<int32_t>(size_t(mb * nu), "lessismore merged top-k");
  }
  if (sp.method == CudaSparse::Method::OracleTopK) {
    const int64_t k = std::min<int64_t>(sp.budget, c.max_context);
    sel_scores_ = A.alloc_n<float>(size_t(mb * Hq) * size_t(ld), "oracle per-head scores");
    oracle_w_ = A.alloc_n<float>(size_t(mb * Hkv) * size_t(ld), "oracle group weights");
    tidal_rown_ = A.alloc_n<int32_t>(size_t(mb * Hkv), "oracle row lengths");
    tidal_strided_ = A.alloc_n<int32_t>(size_t(mb * Hkv * k), "oracle top-k");
  }
  if (sp.method == CudaSparse::Method::Tidal || sp.method == CudaSparse::Method::LycheeDecode) {
    const int64_t rows = mb * Hkv;
    sel_scores_ = A.alloc_n<float>(size_t(rows) * size_t(ld), "tidal scores");
    tidal_rown_ = A.alloc_n<int32_t>(size_t(rows), "tidal row lengths");
    tidal_strided_ = A.alloc_n<int32_t>(
        size_t(rows) * size_t(std::min<int64_t>(sp.budget, c.max_context)), "tidal top-k");
  }
  if (sp.method == CudaSparse::Method::LycheeCluster) lc_alloc(A);
  if (long_topk(ctx_, sp))
    topk_long_ = A.alloc_n<unsigned char>(
        cuda::topk_long_scratch_bytes(topk_rows_n(ctx_, sp), ld, topk_k(sp, c)),
        "long-row top-k scratch");
  sel_off_ = A.alloc_n<int32_t>(size_t(mb * Hkv + 1), "selection offsets");
  sel_idx_ = A.alloc_n<int32_t>(size_t(std::max<int64_t>(1, sel_cap)), "selection entries");
}

void GpuMethod::plan(const SeqInput* seqs, const cuda::AttnSeq* aseq, int n) {
  const ModelConfig& c = ctx_.cfg;
  const int P = ctx_.page_size;
  cudaStream_t st = S_(ctx_.stream);
  plan_aseq_.assign(aseq, aseq + n);  // kept: no allocation once warm
  attn_->plan(plan_aseq_, st, 0, /*wait=*/false);
  const CudaSparse& sp = sp_;
  sparse_step_ = false;
  lc_sync_.clear();
  bool decode = true;
  for (int i = 0; i < n; ++i) decode = decode && seqs[i].n_tokens == 1;
  if (!sp.selects() || !decode || sp.dense_layers >= c.n_layers) {
    count_rows(seqs, n);
    return;
  }
  const bool quest = sp.quest_base();
  const bool twilight = sp.method == CudaSparse::Method::Twilight;
  const bool per_head = lists_per_req() > 1;  // lists per KV head
  const int Hkv = c.n_kv_heads;
  const int64_t kp = sp.budget / 16;
  // Host planning vectors are members: cleared, never reallocated once warm.
  std::vector<cuda::SparseSeq>& sseq = plan_seqs_;
  std::vector<int>& max_entries = plan_max_entries_;
  std::vector<int>& kept_max = plan_kept_max_;
  sseq.resize(size_t(n));
  max_entries.clear();
  kept_max.clear();
  // Twilight prunes even when Quest keeps every page (as the CPU method does).
  bool any_sparse = sp.force_lists || twilight;
  const bool lc = sp.method == CudaSparse::Method::LycheeCluster;
  int max_np = 0;
  for (int i = 0; i < n; ++i) {
    const PageTable& pt = *seqs[i].pages;
    const int64_t L = pt.length + 1;
    const int np = int((L + P - 1) / P);
    sseq[size_t(i)] = {pt.pages.data(), np, int(L)};
    max_np = std::max(max_np, np);
    if (lc) {
      // lc_prepare, below
    } else if (quest) {
      any_sparse |= kp < np;
      for (int h = 0; h < Hkv; ++h) max_entries.push_back(int(std::min<int64_t>(kp, np)));
      for (int h = 0; h < Hkv; ++h) kept_max.push_back(int(std::min<int64_t>(kp * 16, L)));
    } else {
      any_sparse |= sp.budget < L;
      for (int h = 0; h < (per_head ? Hkv : 1); ++h)
        max_entries.push_back(int(std::min<int64_t>(sp.budget, L)));
    }
  }
  if (lc) lc_prepare(seqs, n, any_sparse, max_entries);
  // Every list covering the whole context: the dense kernel (the CPU's set_dense).
  if (!any_sparse) {
    count_rows(seqs, n);
    return;
  }
  if (sp.method == CudaSparse::Method::LycheeDecode)
    sparse_->plan_patterns(sseq, cuda::SelGran::Token, Hkv, max_entries, ld_patterns_, st);
  else
    sparse_->plan(sseq, quest ? cuda::SelGran::Chunk16 : cuda::SelGran::Token, per_head ? Hkv : 1,
                  max_entries, nullptr, st);
  // Kept lists: upper bounds only (the real lengths are read on the GPU).
  if (twilight) sparse_kept_->plan(sseq, cuda::SelGran::Token, Hkv, kept_max, nullptr, st);
  sparse_step_ = true;
  step_B_ = n;
  // Rounded up (within the score buffer's stride) so that the Quest launches, and a graph
  // keyed by them, change only every 1024 tokens.
  step_max_pages_ = int(std::min<int64_t>(ctx_.seq_pages_cap, (max_np + 63) / 64 * 64));
  count_rows(seqs, n);
}

void GpuMethod::count_rows(const SeqInput* seqs, int n) {
  const ModelConfig& c = ctx_.cfg;
  const int NL = c.n_layers, Hkv = c.n_kv_heads;
  const CudaSparse& sp = sp_;
  using Role = sparse::LayerSchedule::Role;
  for (int i = 0; i < n; ++i) {
    auto* g = dynamic_cast<GpuRequestState*>(seqs[i].device_state);
    if (!g || seqs[i].n_tokens != 1) continue;  // decode rows only (a prefill chunk is dense)
    const int64_t L = seqs[i].pages->length + 1;
    if (!sparse_step_) {
      g->attended += int64_t(NL) * Hkv * L;
      continue;
    }
    const int64_t b = std::min<int64_t>(sp.budget, L);
    const int64_t quest_tokens = std::min<int64_t>(sp.budget / 16 * 16, L);
    int64_t rows = 0;
    for (int l = 0; l < NL; ++l) {
      if (l < sp.dense_layers) {
        rows += int64_t(Hkv) * L;
      } else if (sp.scheduled()) {
        rows += int64_t(Hkv) * (sp.schedule.role(l) == Role::Reuse ? b : L);
      } else if (sp.method == CudaSparse::Method::LycheeDecode) {
        for (int h = 0; h < Hkv; ++h) rows += sp.retrieval[size_t(l)][size_t(h)] ? L : b;
      } else if (sp.quest_base()) {
        rows += int64_t(Hkv) * quest_tokens;
      } else if (sp.method == CudaSparse::Method::LycheeCluster) {
        rows += int64_t(Hkv) * std::min<int64_t>(lc_cap_, L);
      } else {  // streaming, oracle-topk
        rows += int64_t(Hkv) * b;
      }
    }
    g->attended += rows;
  }
}

void GpuMethod::begin_step() {
  if (!sparse_step_) return;
  cudaStream_t st = S_(run_);
  if (sp_.method == CudaSparse::Method::Streaming)
    cuda::streaming_lists(sparse_->dev_kv_len(), step_B_, int(sp_.budget), sp_.sinks, sel_off_,
                          sel_idx_, st);
  if (sp_.method == CudaSparse::Method::Tidal || sp_.method == CudaSparse::Method::OracleTopK)
    cuda::row_lengths(sparse_->dev_kv_len(), step_B_, ctx_.cfg.n_kv_heads, tidal_rown_, st);
}

void GpuMethod::attend(int l, const void* q_, const void* kc_, const void* vc_, void* att_,
                       float scale) {
  using cuda::bf16;
  const bf16* q = static_cast<const bf16*>(q_);
  const bf16* kc = static_cast<const bf16*>(kc_);
  const bf16* vc = static_cast<const bf16*>(vc_);
  bf16* att = static_cast<bf16*>(att_);
  cudaStream_t st = S_(run_);
  const CudaSparse& spc = sp_;
  const int Hq = ctx_.cfg.n_heads, Hkv = ctx_.cfg.n_kv_heads, D = ctx_.cfg.head_dim;
  const bool quest = spc.quest_base();
  const bool twilight = spc.method == CudaSparse::Method::Twilight;
  if (sparse_step_ && spc.method == CudaSparse::Method::LycheeDecode) {
    ld_layer(l, q, kc, vc, att, scale);
  } else if (sparse_step_ && spc.method == CudaSparse::Method::LycheeCluster) {
    if (l >= spc.dense_layers) lc_layer(l, q, kc, vc, att, scale);
    else attn_->run(q, kc, vc, att, scale, st, blasst_skip(l));
  } else if (sparse_step_ && scored_layer(l, q, kc, vc, att, scale)) {
    // a Tidal / LessIsMore selection layer or an oracle-topk layer (gpu_method_scored.cpp)
  } else if (sparse_step_ && l >= spc.dense_layers) {
    const int P = ctx_.page_size;
    const size_t layer_meta = size_t(ctx_.n_pages) * size_t(Hkv) * 2 * D;
    const size_t layer_rows = size_t(ctx_.n_pages) * size_t(Hkv) * P;
    if (quest) {
      // The top-k writes the CSR lists itself (QuestArgs::csr_off): no compaction launch.
      const bf16* meta = static_cast<const bf16*>(ctx_.hooks.quest_meta) + size_t(l) * layer_meta;
      cuda::QuestArgs qa{q, meta, sparse_->dev_page_table(), sparse_->dev_page_off(),
                         sparse_->dev_kv_len(), quest_scores_, sel_idx_, step_B_, Hq, Hkv,
                         D, step_max_pages_, int(spc.budget / 16)};
      qa.fast = spc.quest_fast;
      qa.csr_off = sel_off_;
      cuda::quest_select(qa, st);
      if (trace) trace_quest(l);
    }
    if (twilight) {
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
      sparse_kept_->run(q, kc, vc, twilight_->kept_strided_off(), twilight_->kept_strided_idx(),
                        att, scale, st, 0, nullptr, 0, sel_skip(l), twilight_->kept_count());
    } else {
      sparse_->run(q, kc, vc, sel_off_, sel_idx_, att, scale, st, 0, nullptr, 0, sel_skip(l));
    }
  } else {
    attn_->run(q, kc, vc, att, scale, st, blasst_skip(l));
  }
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

bool GpuMethod::decode() const { return attn_->decode(); }

bool GpuMethod::draws_chunks() const { return attn_->draws_chunks(); }

void GpuMethod::append_graph_key(std::vector<int>& k) const {
  // The dense plan's split and item counts; for a sparse step its flag, Quest stride and
  // every plan's work items.
  k.push_back(attn_->n_split());
  k.push_back(attn_->n_items());
  k.push_back(attn_->decode_variant());  // auto's kernel depends on the context length too
  k.push_back(sparse_step_ ? 1 : 0);
  if (!sparse_step_) return;
  k.push_back(step_B_);
  k.push_back(step_max_pages_);
  for (int n : sparse_->pattern_items()) k.push_back(n);
  if (sparse_kept_)
    for (int n : sparse_kept_->pattern_items()) k.push_back(n);
}

}  // namespace spade
#endif  // SPADE_HAVE_CUDA
