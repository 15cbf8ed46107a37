#include "sparse/session.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <utility>

#include "core/error.h"

namespace spade::sparse {

double StepStats::density() const {
  if (attended.empty() || length <= 0) return 1.0;
  double s = 0;
  for (int64_t a : attended) s += double(a);
  return s / (double(attended.size()) * double(length));
}

double StepStats::sparse_density() const {
  double s = 0;
  int64_t n = 0;
  for (int l = 0; l < n_layers; ++l) {
    if (!sparse[size_t(l)]) continue;
    for (int h = 0; h < n_kv_heads; ++h) s += double(attended[size_t(l * n_kv_heads + h)]);
    n += n_kv_heads;
  }
  return n ? s / (double(n) * double(length)) : 1.0;
}

double StepStats::tokens_per_head() const {
  if (attended.empty()) return 0;
  double s = 0;
  for (int64_t a : attended) s += double(a);
  return s / double(attended.size());
}

double StepStats::mean_recall() const {
  if (recall.empty()) return NAN;
  double s = 0;
  for (float r : recall) s += r;
  return s / double(recall.size());
}

double StepStats::sparse_recall() const {
  if (recall.empty()) return NAN;
  double s = 0;
  int64_t n = 0;
  for (int l = 0; l < n_layers; ++l) {
    if (!sparse[size_t(l)]) continue;
    for (int g = 0; g < n_heads; ++g) s += recall[size_t(l * n_heads + g)];
    n += n_heads;
  }
  return n ? s / double(n) : 1.0;
}

double StepStats::min_recall() const {
  if (recall.empty()) return NAN;
  return *std::min_element(recall.begin(), recall.end());
}

SparseSession::SparseSession(std::shared_ptr<const SparseMethod> method, const ModelConfig& cfg,
                             KVPool& kv, SessionOptions opt, HeadShard shard)
    : method_(std::move(method)), cfg_(cfg), kv_(kv), opt_(opt) {
  SPADE_CHECK(method_, "SparseSession: no method");
  method_->check_kv_layout(kv_.layout());
  ctx_.shard = std::move(shard);
  ctx_.bind(cfg, kv_, &scratch_, "SparseSession");
  step_.n_layers = cfg.n_layers;
  step_.n_kv_heads = cfg.n_kv_heads;
  step_.n_heads = cfg.n_heads;
  step_.attended.assign(size_t(cfg.n_layers) * size_t(cfg.n_kv_heads), 0);
  step_.sparse.assign(size_t(cfg.n_layers), 0);
  if (opt_.measure_recall) step_.recall.assign(size_t(cfg.n_layers) * size_t(cfg.n_heads), 1.f);
  reset();
  fn_ = [this](int layer, const PageTable& pt, const float* q, int64_t p0, int64_t T, float* out) {
    attend(layer, pt, q, p0, T, out);
  };
}

void SparseSession::reserve(int64_t max_len) {
  const size_t N = size_t(std::max<int64_t>(1, max_len));
  const size_t D = size_t(cfg_.head_dim), G = size_t(ctx_.G);
  ctx_.reserve(max_len);
  scratch_.k.reserve(N * D);
  scratch_.v.reserve(N * D);
  scratch_.s.reserve(G * N);
  scratch_.q.reserve(G * D);
  scratch_.o.reserve(G * D);
  scratch_.limit.reserve(G);
  scores_.reserve(size_t(cfg_.n_heads) * N);
  sel_.positions.reserve(size_t(cfg_.n_kv_heads) * N);
  sel_.offsets.reserve(size_t(cfg_.n_kv_heads) + 1);
}

void SparseSession::reset() {
  state_ = method_->new_state();
  ctx_.state = state_.get();
  ctx_.invalidate_weights();
  totals_ = SessionTotals{};
  steps_ = 0;
  step_.step = -1;
  step_.length = 0;
}

void SparseSession::attend(int layer, const PageTable& pt, const float* q, int64_t p0,
                           int64_t T, float* out) {
  if (T > 1) {  // prefill chunk: dense causal attention, then let the method index it
    ctx_.begin_layer(layer, pt, q, p0 + T);
    if (!method_->attend_prefill(ctx_, q, p0, T, out))
      cpu::attention_dense(kv_, layer, pt, q, p0, T, cfg_.n_heads, ctx_.scale, out, scratch_);
    method_->on_prefill(ctx_, p0, T);
    return;
  }
  if (layer == 0) {
    ctx_.step = steps_;
    step_.step = steps_;
    step_.length = p0 + 1;
    ctx_.invalidate_weights();
  }
  ctx_.begin_layer(layer, pt, q, p0 + 1);
  method_->on_append(ctx_);
  method_->select(ctx_, sel_);
  method_->prune(ctx_, sel_);
  if (opt_.validate) validate(sel_, cfg_.n_kv_heads, p0 + 1);
  float* scores = nullptr;
  if (ctx_.scores_requested()) {
    SPADE_CHECK(sel_.uniform(), method_->name(), ": scores need a uniform selection");
    scores = SelectScratch::ensure(scores_, size_t(cfg_.n_heads) * size_t(sel_.count(0)));
  }
  if (scores || !method_->attend_decode(ctx_, sel_, out))
    cpu::attention_selected(kv_, layer, pt, q, cfg_.n_heads, ctx_.scale, sel_, out, scratch_,
                            scores);
  if (scores) method_->on_scores(ctx_, sel_, scores);
  // Density and recall count the rows the attention read: the selection's, or fewer where the
  // method's own attention dropped some (BLASST's skipped tiles).
  const Selection* read = scores ? nullptr : method_->read_selection(ctx_);
  record(layer, read ? *read : sel_);
  if (on_select) on_select(layer, sel_);
  if (layer == cfg_.n_layers - 1) finish_step();
}

void SparseSession::record(int layer, const Selection& sel) {
  const int Hkv = cfg_.n_kv_heads, G = ctx_.G;
  for (int h = 0; h < Hkv; ++h) step_.attended[size_t(layer * Hkv + h)] = sel.count(h);
  step_.sparse[size_t(layer)] = !sel.dense();
  if (!opt_.measure_recall) return;
  float* rec = step_.recall.data() + size_t(layer) * size_t(cfg_.n_heads);
  if (sel.dense()) {
    std::fill_n(rec, cfg_.n_heads, 1.f);
    return;
  }
  const float* w;
  if (ctx_.has_full_weights()) {
    w = ctx_.full_weights();
  } else {
    const auto t0 = std::chrono::steady_clock::now();
    w = ctx_.full_weights();
    totals_.measure_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  const int64_t L = ctx_.L;
  for (int h = 0; h < Hkv; ++h) {
    const int32_t* pos = sel.head(h);
    const int64_t n = sel.count(h);
    for (int g = 0; g < G; ++g) {
      const float* wr = w + int64_t(h * G + g) * L;
      double s = 0;
      for (int64_t i = 0; i < n; ++i) s += wr[pos[i]];
      rec[h * G + g] = float(s);
    }
  }
}

void SparseSession::finish_step() {
  ++steps_;
  totals_.steps++;
  totals_.density_sum += step_.density();
  totals_.sparse_density_sum += step_.sparse_density();
  totals_.tokens_sum += step_.tokens_per_head();
  if (opt_.measure_recall) {
    totals_.recall_steps++;
    totals_.recall_sum += step_.mean_recall();
    totals_.sparse_recall_sum += step_.sparse_recall();
    totals_.min_recall = std::min(totals_.min_recall, step_.min_recall());
  }
  if (on_step) on_step(step_);
}

}  // namespace spade::sparse
