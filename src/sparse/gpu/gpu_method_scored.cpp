// GpuMethod's layers whose attention also scores tokens for a selection (Tidal and LessIsMore
// selection layers, oracle-topk), the token top-k over long rows, the side stream the
// selections run on, and the test traces. The rest of the method: gpu_method.cpp;
// LycheeDecode's layer: gpu_method_lycheedecode.cpp.
#if defined(SPADE_HAVE_CUDA)
#include <algorithm>
#include <cmath>

#include "backend/cuda/attention.h"
#include "backend/cuda/sparse_attention.h"
#include "backend/cuda/twilight.h"
#include "core/error.h"
#include "sparse/gpu/gpu_method.h"

namespace spade {

namespace {
cudaStream_t S_(void* p) { return static_cast<cudaStream_t>(p); }
}  // namespace

bool GpuMethod::scored_layer(int l, const void* q_, const void* kc_, const void* vc_, void* att_,
                             float scale) {
  using cuda::bf16;
  const bf16* q = static_cast<const bf16*>(q_);
  const bf16* kc = static_cast<const bf16*>(kc_);
  const bf16* vc = static_cast<const bf16*>(vc_);
  bf16* att = static_cast<bf16*>(att_);
  cudaStream_t st = S_(run_);
  const CudaSparse& spc = sp_;
  const int Hq = ctx_.cfg.n_heads, Hkv = ctx_.cfg.n_kv_heads;
  const bool tidal = spc.method == CudaSparse::Method::Tidal;
  const bool lim = spc.method == CudaSparse::Method::LessIsMore;
  const bool oracle = spc.method == CudaSparse::Method::OracleTopK;
  const int tidal_k = int(std::min<int64_t>(spc.budget, ctx_.cfg.max_context));
  const int64_t tidal_ld = ctx_.seq_pages_cap * ctx_.page_size;
  const sparse::LayerSchedule::Role role =
      spc.scheduled() ? spc.schedule.role(l) : sparse::LayerSchedule::Role::Reuse;
  if (tidal && role == sparse::LayerSchedule::Role::Select) {
    // Full attention that also emits the group-mean scores; the top-k of each (request, KV
    // head) becomes the token lists of the following layers.
    const cuda::DecodeScores ds{sel_scores_, tidal_ld};
    attn_->run(q, kc, vc, att, scale, st, {}, &ds);
    cudaStream_t ss = S_(fork_selection());
    select_topk(sel_scores_, tidal_rown_, step_B_ * Hkv, tidal_k, tidal_strided_, ss);
    cuda::token_compact_lists(tidal_strided_, sparse_->dev_kv_len(), step_B_, Hkv, tidal_k,
                              sel_off_, sel_idx_, ss);
    if (trace) trace_quest(l), trace_scores(l);
  } else if (oracle && l >= spc.dense_layers) {
    // The measurement first: full attention for its per-head scores (its output is then
    // overwritten), the true group weights, their top-k; then attention over that set.
    const cuda::DecodeScores ds{sel_scores_, tidal_ld, true};
    attn_->run(q, kc, vc, att, scale, st, {}, &ds);
    cuda::oracle_group_weights(sel_scores_, tidal_ld, sparse_->dev_kv_len(), step_B_, Hq, Hkv,
                               oracle_w_, st);
    select_topk(oracle_w_, tidal_rown_, step_B_ * Hkv, tidal_k, tidal_strided_, st);
    cuda::token_compact_lists(tidal_strided_, sparse_->dev_kv_len(), step_B_, Hkv, tidal_k,
                              sel_off_, sel_idx_, st);
    if (trace) trace_quest(l), trace_scores(l);
    sparse_->run(q, kc, vc, sel_off_, sel_idx_, att, scale, st, 0, nullptr, 0, sel_skip(l));
  } else if (lim && role == sparse::LayerSchedule::Role::Select) {
    // Full attention that also emits every query head's scores; their merged ranking, the
    // sinks and the recency window become the one list of each request.
    const cuda::DecodeScores ds{sel_scores_, tidal_ld, true};
    attn_->run(q, kc, vc, att, scale, st, {}, &ds);
    cuda::LessIsMoreArgs la;
    la.scores = sel_scores_, la.ld = tidal_ld, la.kv_len = sparse_->dev_kv_len();
    la.B = step_B_, la.Hq = Hq;
    la.budget = tidal_k, la.n_recent = int(spc.recent), la.sinks = spc.sinks;
    la.n_uni = int(spc.lim_unified());
    la.row_n = lim_row_n_, la.head_top = lim_head_top_, la.keys = lim_keys_;
    la.merged_top = lim_merged_, la.sel_off = sel_off_, la.sel_idx = sel_idx_;
    la.topk_scratch = topk_long_;
    cuda::lessismore_select(la, S_(fork_selection()));
    if (trace) trace_quest(l), trace_scores(l);
  } else {
    return false;
  }
  return true;
}

void GpuMethod::select_topk(const float* scores, const int32_t* n, int rows, int k, int32_t* out,
                            void* stream) {
  const int64_t ld = ctx_.seq_pages_cap * ctx_.page_size;
  if (topk_long_) cuda::topk_rows_long(scores, ld, n, rows, k, out, topk_long_, S_(stream));
  else cuda::topk_rows(scores, ld, n, rows, k, out, S_(stream));
}

void* GpuMethod::fork_selection() {
  if (!side_ || trace) return run_;  // traced steps stay in order on one stream
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

int GpuMethod::lists_per_req() const {
  const CudaSparse& sp = sp_;
  return sp.quest_base() || sp.method == CudaSparse::Method::Tidal ||
                 sp.method == CudaSparse::Method::LycheeDecode ||
                 sp.method == CudaSparse::Method::OracleTopK ||
                 sp.method == CudaSparse::Method::LycheeCluster
             ? ctx_.cfg.n_kv_heads
             : 1;
}

void GpuMethod::trace_quest(int layer) {
  const int rows = step_B_ * lists_per_req();
  std::vector<int32_t> off(size_t(rows) + 1);
  SPADE_CUDA(cudaMemcpyAsync(off.data(), sel_off_, sizeof(int32_t) * off.size(),
                             cudaMemcpyDeviceToHost, S_(run_)));
  SPADE_CUDA(cudaStreamSynchronize(S_(run_)));
  std::vector<int32_t> idx(size_t(off.back()));
  SPADE_CUDA(cudaMemcpyAsync(idx.data(), sel_idx_, sizeof(int32_t) * idx.size(),
                             cudaMemcpyDeviceToHost, S_(run_)));
  SPADE_CUDA(cudaStreamSynchronize(S_(run_)));
  auto& t = trace->sel;
  if (t.size() <= size_t(layer)) t.resize(size_t(layer) + 1);
  t[size_t(layer)].assign(size_t(rows), {});
  for (int r = 0; r < rows; ++r)
    t[size_t(layer)][size_t(r)].assign(idx.begin() + off[size_t(r)], idx.begin() + off[size_t(r) + 1]);
}

void GpuMethod::trace_scores(int layer) {
  // Rows per request: Tidal's KV heads (group means), LessIsMore's query heads.
  const int Hkv = sp_.method == CudaSparse::Method::LessIsMore ? ctx_.cfg.n_heads
                                                                        : ctx_.cfg.n_kv_heads;
  const int rows = step_B_ * Hkv;
  const int64_t ld = ctx_.seq_pages_cap * ctx_.page_size;
  std::vector<int32_t> len(static_cast<size_t>(step_B_));
  SPADE_CUDA(cudaMemcpyAsync(len.data(), sparse_->dev_kv_len(), sizeof(int32_t) * len.size(),
                             cudaMemcpyDeviceToHost, S_(run_)));
  SPADE_CUDA(cudaStreamSynchronize(S_(run_)));
  auto& t = trace->scores;
  if (t.size() <= size_t(layer)) t.resize(size_t(layer) + 1);
  t[size_t(layer)].assign(size_t(rows), {});
  for (int r = 0; r < rows; ++r) {
    auto& v = t[size_t(layer)][size_t(r)];
    v.resize(size_t(len[size_t(r / Hkv)]));
    const float* src = sp_.method == CudaSparse::Method::OracleTopK ? oracle_w_ : sel_scores_;
    SPADE_CUDA(cudaMemcpy(v.data(), src + int64_t(r) * ld, sizeof(float) * v.size(),
                          cudaMemcpyDeviceToHost));
  }
}

void GpuMethod::trace_twilight(int layer) {
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

}  // namespace spade
#endif  // SPADE_HAVE_CUDA
