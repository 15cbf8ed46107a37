// Continuous batching over a StepModel (CpuModel or CudaModel): one engine thread runs steps; requests join the
// running batch and leave it between steps. Each step feeds every running sequence what it
// needs next -- one token for a decoding sequence, a chunk of its prompt for a prefilling
// one -- in a single forward call (decode first, prefill chunks fill the rest of the step's
// token budget), then samples a token for every sequence whose input is all in the cache.
//
// Admission: a submitted request waits in a bounded FIFO queue (full: rejected with 429)
// and is admitted when the batch has room and the KV pool has pages for its prompt plus a
// page of growth for each running sequence. If decode growth still runs the pool dry, the
// most recently admitted sequence is preempted: its pages are released and it goes back to
// the head of the queue, to be recomputed (prompt + tokens so far) when pages free up; its
// sampler and text state are kept, so its output is the same as without preemption. After
// a preemption nothing is admitted until a running request finishes (no thrashing).
//
// Cancellation (RequestChannel::cancel) is honoured at the next step: the request ends as
// Cancelled and its pages return to the pool.
//
// Failure isolation: a request's own sparse method that throws (while attending, or while
// taking its tokens' text) ends that request with FinishReason::Error and its message; its
// pages return to the pool and the step completes for every other sequence. Only an error
// of the shared forward pass itself fails the whole step.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "core/error.h"
#include "engine/request.h"
#include "engine/request_metrics.h"
#include "engine/step_model.h"

namespace spade {

struct SchedulerOptions {
  int max_batch = 16;              // sequences in one step
  int max_queue = 64;              // waiting requests beyond which submit() rejects (429)
  int64_t max_step_tokens = 512;   // tokens in one forward call (>= max_batch)
  // Logit rows one forward call may return (the runner's limit; CudaModel's max_logit_rows):
  // prompt-scoring prefill chunks (all logits) are cut to fit. 0: no limit (CpuModel).
  int64_t max_logit_rows = 0;
  // Longest sequence (prompt + completion) a request may have (--ctx-size); 0: the model's
  // context. max_context() is the least of this, the model's and what the KV pool holds.
  int64_t max_context = 0;
  // A step is either decode tokens only or one request's prefill chunk, never a mix (taking
  // turns while both wait), and a prompt's chunks start at multiples of max_step_tokens: what
  // a request computes then does not depend on the other requests (with a batch-invariant
  // runner, CudaModelOptions::deterministic). Costs prefill throughput.
  bool isolate_prefill = false;
};

// Why submit() refused a request: HTTP-like status (400, 429, 503) and a message.
class SubmitError : public Error {
 public:
  SubmitError(int status, std::string code, const std::string& msg)
      : Error(msg), status(status), code(std::move(code)) {}
  int status;
  std::string code;
};

class Scheduler {
 public:
  // `model` (and its KV pool) and `text` must outlive the scheduler, and the model must be
  // used by nobody else while the scheduler runs. Starts the engine thread.
  Scheduler(StepModel& model, const TokenText& text, const SchedulerOptions& opt);
  Scheduler(CpuModel& model, const TokenText& text, const SchedulerOptions& opt);
  ~Scheduler();
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Longest sequence (prompt + completion) a request may have: the model's context, or
  // what the whole KV pool holds if that is less.
  int64_t max_context() const { return max_context_; }
  const SchedulerOptions& options() const { return opt_; }

  // Queues a request. Throws SubmitError: 400 when prompt + max_tokens exceed
  // max_context() (or the request is malformed), 429 when the queue is full, 503 when
  // shutting down.
  std::shared_ptr<RequestChannel> submit(EngineRequest req);

  // Stop accepting requests (submit() answers 503); running and queued ones continue.
  void stop_accepting();
  // Waits until no request is queued or running, at most `timeout`; true if idle.
  bool wait_idle(std::chrono::milliseconds timeout);
  // Cancels every queued and running request and stops the engine thread.
  void shutdown();

  EngineMetrics metrics() const;

 private:
  struct Seq;
  Scheduler(std::unique_ptr<StepModel> owned, StepModel* model, const TokenText& text,
            const SchedulerOptions& opt);
  void loop();
  void step(std::vector<std::unique_ptr<Seq>>& running);
  void finish(Seq& s, FinishReason r, const std::string& error = {});
  bool admit_one(std::vector<std::unique_ptr<Seq>>& running);
  void preempt(std::vector<std::unique_ptr<Seq>>& running, size_t index);
  // A request's new token: accept() records it (engine thread; returns Stop for a stop id,
  // Length at max_tokens, else None); emit_token() hands its text to the consumer (stop
  // strings, logprobs) and returns how the request ends with it. on_token does both (steps
  // with host logits). Each is safe to run for different requests at once.
  FinishReason accept(Seq& s, int32_t tok);
  FinishReason emit_token(Seq& s, int32_t tok, FinishReason end, const TokenLogprob* lp);
  FinishReason on_token(Seq& s, int32_t tok, const float* logits);
  void count_rows(Seq& s);  // adds what its method read to attended_rows (finish, preemption)
  // Steps with at least this many new tokens deliver them on the thread pool.
  static constexpr int64_t kParallelDeliverRows = 32;
  std::vector<size_t> deliver_;        // this step's rows that sample a token
  std::vector<FinishReason> finish_;   // ... and how each request ends
  // Overlapped output: tokens a device-sampled step returned are accepted at once (the next
  // step feeds them) and delivered while the next step runs on the device. A request whose
  // stop string shows up then ends after that step, its in-flight token dropped.
  struct Pending {
    Seq* s;
    int32_t tok;
  };
  std::vector<Pending> pending_;
  // Delivers pending_ (thread pool for large batches); finishes the requests that ended,
  // except those in the step in flight (Seq::stop_hit: finished once it returns).
  void deliver_pending();
  // deliver_pending with no step in flight, then drops finished requests from `running`.
  // in_step: called inside step() (whose time the metrics count already).
  void flush_pending(std::vector<std::unique_ptr<Seq>>& running, bool in_step);
  void publish_gauges(const std::vector<std::unique_ptr<Seq>>& running);

  std::unique_ptr<StepModel> owned_;  // the CpuModel adapter of the CpuModel constructor
  StepModel& model_;
  const TokenText& text_;
  SchedulerOptions opt_;
  int64_t max_context_ = 0;
  int page_size_ = 16;

  mutable std::mutex mu_;           // guards waiting_, accepting_, stop_, metrics_
  std::condition_variable cv_;      // engine wake-up
  std::condition_variable idle_cv_;
  std::deque<std::unique_ptr<Seq>> waiting_;
  int64_t n_running_ = 0;           // mirror of the engine's running set (under mu_)
  bool accepting_ = true;
  bool stop_ = false;
  uint64_t next_order_ = 0;
  bool hold_admission_ = false;     // engine thread only: set by a preemption
  bool last_step_decoded_ = false;  // engine thread only: isolate_prefill's turn taking
  EngineMetrics metrics_;

  // Engine-thread workspaces (grow-only).
  std::vector<SeqInput> batch_;
  std::vector<Seq*> batch_seqs_;
  std::vector<int64_t> row_of_;
  std::vector<StepModel::RowSampling> rows_;
  std::thread thread_;
};

}  // namespace spade
