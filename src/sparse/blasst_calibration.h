// BLASST calibration (Algorithm 2 of the BLASST paper) and the real-model measurements
// behind it and behind docs/twilight_blasst.md: sparsity of BLASST runs at a given lambda
// and length, and teacher-forced decode comparisons of a method against full attention
// (perplexity, top-1 agreement, KL).
//
// Algorithm 2: for each calibration length L_k sweep lambda over a set, keep the lambda whose
// measured sparsity is closest to the target S, keep the length only if that gap is < delta,
// then fit lambda = a * (1/L) by least squares (through the origin). We sweep a log grid and
// then, optionally, bisect (in log lambda) between the two grid points that bracket S,
// which only adds points to the set the algorithm picks from.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kv/kv_pool.h"
#include "model/cpu_model.h"
#include "sparse/method.h"
#include "sparse/methods/blasst.h"
#include "sparse/methods/twilight.h"

namespace spade::sparse {

// ---- Algorithm 2 ----

struct LambdaSample {
  double lambda = 0, sparsity = 0;
};

struct CalibrationLength {
  int64_t length = 0;
  double lambda_best = 0, sparsity = 0, gap = 0;
  bool kept = false;                // gap < delta: used in the fit
  std::vector<LambdaSample> sweep;  // every lambda measured, ascending
};

struct BlasstCalibration {
  double target = 0, delta = 0;
  double a = 0;       // lambda = a / L
  double r2 = 0;      // fit quality (1 - SS_res / SS_tot of lambda_best; NaN with < 2 points)
  int used = 0;       // lengths in the fit
  std::vector<CalibrationLength> lengths;
};

// measure(lambda, L): achieved sparsity (skipped tiles / tiles) at that lambda and length.
using SparsityFn = std::function<double(double lambda, int64_t L)>;

BlasstCalibration calibrate_blasst(const SparsityFn& measure, double target,
                                   const std::vector<int64_t>& lengths,
                                   const std::vector<double>& lambdas, double delta,
                                   int refine_steps);

// Least squares through the origin y = a x over (x, y) points; r2 = 1 - SS_res / SS_tot
// (NaN when fewer than 2 points or constant y).
double fit_through_origin(const std::vector<double>& x, const std::vector<double>& y,
                          double* r2);
// lo, ..., hi with `per_decade` points per factor 10 (both ends included).
std::vector<double> log_grid(double lo, double hi, int per_decade);
// Fraction of gaps below ln(lambda): the sparsity a lambda would reach given per-tile gaps
// (BlasstTrace::gaps) of an unskipped run; `sorted_gaps` ascending.
double sparsity_from_gaps(const std::vector<float>& sorted_gaps, double lambda);

// ---- A per-request session that exposes the method state ----
//
// SparseSession's data flow (sparse/session.h: prefill chunks attend densely or through
// attend_prefill, then on_prefill; a decode step runs on_append -> select -> prune ->
// attend_decode or exact attention -> on_scores), plus access to the method state (Twilight
// kept budgets, BLASST skip counts, LycheeCluster token text) and per-layer counters:
// attended tokens per (layer, KV head) and, with measure_recall, the true full-attention
// mass on the attended tokens per (layer, query head).
class ProbeSession {
 public:
  ProbeSession(std::shared_ptr<const SparseMethod> method, const ModelConfig& cfg, KVPool& kv,
               bool measure_recall = false);
  ProbeSession(const ProbeSession&) = delete;
  ProbeSession& operator=(const ProbeSession&) = delete;

  const AttentionFn& attention() const { return fn_; }
  void attend(int layer, const PageTable& pt, const float* q, int64_t p0, int64_t T, float* out);
  void reset();  // new request: fresh method state and counters

  const SparseMethod& method() const { return *method_; }
  MethodState* state() { return state_.get(); }
  const BlasstStats* blasst() const;
  const TwilightStats* twilight() const { return twilight_stats(state_.get()); }

  // Decode counters summed over steps.
  int64_t steps() const { return steps_; }
  double mean_attended(int first_layer = 0) const;  // per (layer >= first_layer, KV head, step)
  double mean_length() const { return steps_ ? double(length_sum_) / double(steps_) : 0; }
  double mean_recall(int first_layer = 0) const;    // NaN unless measured
  double min_recall(int first_layer = 0) const;

 private:
  std::shared_ptr<const SparseMethod> method_;
  ModelConfig cfg_;
  KVPool& kv_;
  bool recall_;
  std::unique_ptr<MethodState> state_;
  StepContext ctx_;
  Selection sel_;
  cpu::AttentionScratch scratch_;
  std::vector<float> scores_;
  int64_t steps_ = 0, length_sum_ = 0;
  std::vector<double> attended_sum_;  // [layer][kv_head]
  std::vector<double> recall_sum_;    // [layer][q_head]
  std::vector<float> recall_min_;     // [layer][q_head]
  AttentionFn fn_;
};

// ---- Running the CPU model on real text ----

// One sequence on the CPU model with its own KV pool, for measurements.
class ModelRunner {
 public:
  ModelRunner(const ModelWeights& w, int64_t max_tokens, int page_size = 16);
  const ModelConfig& config() const { return model_.config(); }
  KVPool& kv() { return kv_; }
  PageTable& pages() { return pt_; }
  // Empties the sequence (pages return to the pool).
  void reset();
  // Rewinds to `length` tokens (keeps the pages; later tokens are rewritten).
  void rewind(int64_t length);
  // Runs tokens[0..n) in chunks of `chunk` through `attn` (nullptr: dense); returns the
  // logits of the last token (vocab floats, valid until the next call).
  const float* prefill(const int32_t* tokens, int64_t n, const AttentionFn* attn,
                       int64_t chunk = 4096);
  // One decode step.
  const float* step(int32_t token, const AttentionFn* attn);
  // A copy of the current sequence that shares its full pages (KVPool::fork); resume() makes
  // the runner continue from it (the current sequence is released), so several methods can
  // decode from one dense prefill. release() returns a kept copy's pages.
  PageTable keep() { return kv_.fork(pt_); }
  void resume(const PageTable& kept);
  void release(PageTable& kept) { kv_.release(kept); }

 private:
  KVPool kv_;
  CpuModel model_;
  PageTable pt_;
  std::vector<int64_t> row_of_;
};

// Sparsity of a BLASST run over tokens[0..L): prefill (one chunk, lambda = a/L semantics of
// the method) or decode (dense prefill of L tokens, then `decode_steps` teacher-forced decode
// steps). `method` must be a blasst stack.
// `stats` (optional) receives the run's per-(layer, head) tile counts.
double measure_blasst_prefill(ModelRunner& r, std::shared_ptr<const SparseMethod> method,
                              const std::vector<int32_t>& tokens, int64_t L,
                              BlasstStats* stats = nullptr);
// With `prefilled`, the runner already holds tokens[0..L) (or more, from a dense prefill):
// it is rewound to L instead of prefilled again.
double measure_blasst_decode(ModelRunner& r, std::shared_ptr<const SparseMethod> method,
                             const std::vector<int32_t>& tokens, int64_t L, int64_t decode_steps,
                             bool prefilled = false, BlasstStats* stats = nullptr);
// Per-tile gaps (BlasstTrace::gaps, sorted) of an unskipped (lambda = 0) BLASST prefill over
// tokens[0..L): sparsity_from_gaps() then gives the teacher-forced sparsity of any lambda.
std::vector<float> prefill_tile_gaps(ModelRunner& r, const std::vector<int32_t>& tokens,
                                     int64_t L, int64_t tile, int64_t q_block,
                                     cpu::TileOrder order = cpu::TileOrder::Sequential);
// The same for decode: dense prefill of tokens[0..L) (skipped when `prefilled`, see
// measure_blasst_decode), then `decode_steps` unskipped teacher-forced BLASST decode steps.
std::vector<float> decode_tile_gaps(ModelRunner& r, const std::vector<int32_t>& tokens,
                                    int64_t L, int64_t decode_steps, int64_t tile,
                                    bool prefilled = false,
                                    cpu::TileOrder order = cpu::TileOrder::Sequential);

// ---- Teacher-forced decode against full attention ----

struct DecodeEval {
  std::vector<double> nll;     // -log p(true next token), per step
  std::vector<int32_t> top1;   // argmax, per step
  std::vector<float> logp;     // [steps][vocab] log-softmax (when kept)
};

// Prefills tokens[0..prefix) and decodes `steps` tokens teacher-forced (the input of step i
// is tokens[prefix + i - 1]; step i predicts tokens[prefix + i]); attention through `attn`
// (nullptr: dense).
DecodeEval eval_decode(ModelRunner& r, const std::vector<int32_t>& tokens, int64_t prefix,
                       int64_t steps, const AttentionFn* attn, bool keep_logp);
// The same from a kept dense prefill of tokens[0..prefix) (ModelRunner::keep) whose last
// logits are `prefix_logits`: only the decode steps run through `attn`. `on_step` (optional)
// is called after every decode step.
DecodeEval eval_decode_from(ModelRunner& r, const PageTable& kept, const float* prefix_logits,
                            const std::vector<int32_t>& tokens, int64_t prefix, int64_t steps,
                            const AttentionFn* attn, bool keep_logp,
                            const std::function<void()>& on_step = {});

struct Agreement {
  double ppl_ref = 0, ppl = 0;  // exp(mean nll)
  double top1 = 0;              // share of steps whose argmax equals the reference's
  double kl = 0;                // mean KL(ref || method) in nats (needs ref.logp, m.logp)
};
Agreement compare_decode(const DecodeEval& ref, const DecodeEval& m);

}  // namespace spade::sparse
