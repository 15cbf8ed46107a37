// A generation request as the scheduler sees it (token ids in, text and token events out),
// and the channel through which the engine loop hands its results to whoever submitted it
// (an HTTP handler thread, a test). The HTTP layer (src/server/) turns OpenAI JSON into an
// EngineRequest and RequestChannel events back into JSON / SSE.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/sampler.h"
#include "model/cpu_model.h"
#include "sparse/options.h"

namespace spade {

// Incremental detokenizer of one request: push(id) returns the newly complete text (never a
// partial UTF-8 sequence; special tokens produce no text), flush() what is left at the end.
class TextStream {
 public:
  virtual ~TextStream() = default;
  virtual std::string push(int32_t id) = 0;
  virtual std::string flush() = 0;
};

// Text of tokens, shared by all requests; must be safe to call from several threads.
class TokenText {
 public:
  virtual ~TokenText() = default;
  // A stream continuing after `prev` (the prompt's last token): text is decoded as the
  // continuation of the prompt (no start-of-text stripping of a leading space).
  virtual std::unique_ptr<TextStream> stream(int32_t prev = -1) const = 0;
  // The text of one token on its own (for logprobs); may be a partial UTF-8 sequence.
  virtual std::string piece(int32_t id) const = 0;
};

// Per-sequence attention of a sparse method: fn() is the AttentionFn given to CpuModel
// (nullptr = dense causal). attended() reports how many (token, KV head, query) rows it
// read so far, for the density metric; -1 when it does not know (then dense is assumed).
class SeqAttention {
 public:
  virtual ~SeqAttention() = default;
  virtual const AttentionFn* fn() = 0;
  virtual int64_t attended() const { return -1; }
  // The tokens of the next forward pass, in position order (for methods that read token
  // text, e.g. LycheeCluster's chunking).
  virtual void on_tokens(const int32_t* ids, int64_t n, const TokenText& text) {
    (void)ids, (void)n, (void)text;
  }
};
// Makes a fresh SeqAttention for a request; called on the engine thread when the request
// is admitted (again after a preemption, since its cache is then recomputed).
using AttentionMaker = std::function<std::unique_ptr<SeqAttention>()>;

struct EngineRequest {
  std::vector<int32_t> prompt;       // at least one token
  int64_t max_tokens = 16;           // >= 1; 0: prefill only (finishes as Length, no token)
  SamplingParams sampling;
  std::vector<std::string> stop;     // stop strings (not part of the output)
  std::vector<int32_t> stop_ids;     // stop tokens (EOS); their text is never output
  int logprobs = -1;                 // < 0: off; k >= 0: sampled token's logprob + top k
  // < 0: off; k >= 0: score the prompt: for every prompt token i >= 1, its logprob given
  // tokens < i, its rank and the top k (RequestDelta::prompt_logprobs). Prefill chunks of
  // such a request ask for all logits (host logits: no device sampling in those steps).
  int prompt_logprobs = -1;
  std::string method = "full";       // sparse method name (metrics label)
  AttentionMaker attention;          // empty: dense
  // A method the runner itself runs for this request (StepModel::new_request_state; the GPU's
  // per-request methods); null: the runner's own method.
  std::shared_ptr<const sparse::SparseConfig> device_method;
  // Cache correction of its method (SparseMethod::correction_every): after every N decoded
  // tokens the scheduler feeds those N again as one dense chunk at their own positions,
  // rewriting their K/V, before the next decode step. 0: none.
  int64_t correction_every = 0;
};

enum class FinishReason { None, Stop, Length, Cancelled, Error };
const char* finish_reason_name(FinishReason r);  // "stop", "length", "cancelled", "error"

struct TokenLogprob {
  int32_t id = 0;
  float logprob = 0.f;
  std::vector<std::pair<int32_t, float>> top;  // best first
  int64_t rank = 0;  // prompt logprobs: 1 + tokens with a higher logit; else 0 (not computed)
};

// What the engine has produced since the consumer last looked.
struct RequestDelta {
  std::string text;
  std::vector<int32_t> tokens;
  std::vector<TokenLogprob> logprobs;  // one per token when logprobs were asked for
  // EngineRequest::prompt_logprobs: prompt tokens 1 .. P-1 in order, all in the one delta
  // that ends the prefill (before any generated token); none for a one-token prompt.
  std::vector<TokenLogprob> prompt_logprobs;
  bool finished = false;
  FinishReason reason = FinishReason::None;
  std::string error;                   // with FinishReason::Error
  int64_t prompt_tokens = 0, completion_tokens = 0;
  // With `finished`: the request's attention density over its decode steps (rows its method
  // read / rows full attention would read); < 0 when it had no decode step.
  double density = -1;
};

// Shared between the engine loop (producer) and the submitter (consumer).
class RequestChannel {
 public:
  using clock = std::chrono::steady_clock;

  // Consumer side. Waits until something new is there or `timeout` passes, then moves it
  // into `out` (whose buffers are reused). Returns true when `out` holds anything new.
  bool wait_take(RequestDelta& out, std::chrono::milliseconds timeout);
  // Asks the engine to stop this request (client gone); it finishes as Cancelled and its
  // KV pages are returned at the next step.
  void cancel() { cancelled_.store(true); }
  bool cancelled() const { return cancelled_.load(); }
  bool finished() const;

  // Producer side (engine thread).
  void emit(const std::string& text, int32_t token, const TokenLogprob* lp);
  void emit_prompt_logprobs(std::vector<TokenLogprob>&& lps);
  void finish(FinishReason r, int64_t prompt_tokens, int64_t completion_tokens,
              const std::string& error = {}, double density = -1);

  const clock::time_point created = clock::now();

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  RequestDelta pending_;
  bool taken_final_ = false;
  std::atomic<bool> cancelled_{false};
};

}  // namespace spade
