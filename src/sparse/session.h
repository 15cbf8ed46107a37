// One request's sparse attention: the method's per-request state, the step context, the
// selection buffer and the counters, behind the AttentionFn the CPU model calls per layer
// (model/cpu_model.h). Prefill chunks (T > 1) attend densely; a one-token step runs
// select -> prune -> attend over the selection -> (scores to the method) and updates the
// counters. After warm-up a decode step allocates nothing.
//
// Counters per decode step (StepStats): tokens attended per (layer, KV head), density =
// attended / L, and with measure_recall the attention recall per (layer, query head) =
// the true full-attention weight mass on the selected tokens (1 for dense layers).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "backend/cpu/attention.h"
#include "model/config.h"
#include "model/cpu_model.h"
#include "sparse/method.h"
#include "sparse/selection.h"

namespace spade::sparse {

struct StepStats {
  int64_t step = -1;    // decode step index within the request
  int64_t length = 0;   // context length L of the step (the new token included)
  int n_layers = 0, n_kv_heads = 0, n_heads = 0;
  std::vector<int64_t> attended;  // [layer][kv_head] tokens read
  std::vector<uint8_t> sparse;    // [layer] 1 when the layer's selection was not dense
  std::vector<float> recall;      // [layer][q_head]; empty unless recall is measured

  // Mean over (layer, KV head) of attended / L.
  double density() const;
  // The same over sparse layers only (1 when every layer was dense).
  double sparse_density() const;
  double tokens_per_head() const;  // mean attended per (layer, KV head)
  bool has_recall() const { return !recall.empty(); }
  double mean_recall() const;    // over every (layer, query head)
  double sparse_recall() const;  // over sparse layers only (1 when none)
  double min_recall() const;
};

struct SessionTotals {
  int64_t steps = 0, recall_steps = 0;
  double density_sum = 0, sparse_density_sum = 0, tokens_sum = 0;
  double recall_sum = 0, sparse_recall_sum = 0, min_recall = 1;
  // Seconds spent computing full-attention weights only to measure recall (excluded from
  // decode speeds; an oracle's own use of the weights is part of its selection cost).
  double measure_seconds = 0;
  double mean_density() const { return steps ? density_sum / double(steps) : 1.0; }
  double mean_sparse_density() const { return steps ? sparse_density_sum / double(steps) : 1.0; }
  double mean_tokens_per_head() const { return steps ? tokens_sum / double(steps) : 0.0; }
  double mean_recall() const { return recall_steps ? recall_sum / double(recall_steps) : 1.0; }
  double mean_sparse_recall() const {
    return recall_steps ? sparse_recall_sum / double(recall_steps) : 1.0;
  }
};

struct SessionOptions {
  bool measure_recall = false;  // compute full attention weights as a measurement
  bool validate = false;        // check every selection's invariants (tests)
};

class SparseSession {
 public:
  // Tensor parallelism (dist/tp_runner.h): `cfg` and `kv` are one rank's (its head counts, its
  // KV heads) and `shard` says which of the model's heads they are and how the ranks gather
  // (sparse/method.h). Default: one rank.
  SparseSession(std::shared_ptr<const SparseMethod> method, const ModelConfig& cfg, KVPool& kv,
                SessionOptions opt = {}, HeadShard shard = {});
  SparseSession(const SparseSession&) = delete;
  SparseSession& operator=(const SparseSession&) = delete;

  // The per-layer attention callback for SeqInput::attention / GenerateOptions::attention.
  const AttentionFn& attention() const { return fn_; }
  void attend(int layer, const PageTable& pt, const float* q, int64_t p0, int64_t T, float* out);

  // Pre-sizes every buffer of the decode path for contexts up to max_len tokens, so that no
  // decode step allocates (otherwise buffers grow geometrically with the context).
  void reserve(int64_t max_len);
  // Forgets the method state and counters (a new request).
  void reset();
  // Token text for methods that read it (see MethodState::append_token_text): the decoded
  // bytes of each token, in position order, before the forward pass that writes it.
  void append_token_text(std::string_view piece) {
    if (state_) state_->append_token_text(piece);
  }
  bool wants_token_text() const { return state_ && state_->wants_token_text(); }
  const SparseMethod& method() const { return *method_; }
  // The method's per-request state (nullptr for stateless methods), e.g. for its counters.
  MethodState* state() { return state_.get(); }
  const StepStats& last_step() const { return step_; }
  const SessionTotals& totals() const { return totals_; }
  // Called after the last layer of every decode step.
  std::function<void(const StepStats&)> on_step;
  // Called with every decode layer's final selection (tests, tracing).
  std::function<void(int layer, const Selection&)> on_select;

 private:
  void record(int layer, const Selection& sel);
  void finish_step();

  std::shared_ptr<const SparseMethod> method_;
  ModelConfig cfg_;
  KVPool& kv_;
  SessionOptions opt_;
  std::unique_ptr<MethodState> state_;
  StepContext ctx_;
  Selection sel_;
  cpu::AttentionScratch scratch_;
  std::vector<float> scores_;
  StepStats step_;
  SessionTotals totals_;
  int64_t steps_ = 0;
  AttentionFn fn_;
};

}  // namespace spade::sparse
