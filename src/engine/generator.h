// Single-sequence generation on any runner (engine/step_model.h: CpuModel or CudaModel, made by
// engine/runner.h's factory): chunked prefill, then one token per step -- sampled by the
// runner when it can (the server's per-request stream: seed and draw index), else by the host
// sampler -- streamed to a callback, with the method's cache correction. Used by `spade
// generate` and `spade chat`; batched serving goes through the Scheduler.
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <vector>

#include "engine/sampler.h"
#include "engine/step_model.h"
#include "model/cpu_model.h"

namespace spade {

struct GenerateOptions {
  int64_t max_new_tokens = 128;
  int64_t prefill_chunk = 1024;      // prompt tokens per forward call
  SamplingParams sampling;
  std::vector<int32_t> stop_ids;     // generation ends after emitting one of these
  const AttentionFn* attention = nullptr;  // null: dense
  // Cache correction every N decoded tokens (the method's SparseMethod::correction_every;
  // sparse/cache_correction.h); 0: none.
  int64_t correction_every = 0;
  // Longest sequence (cache + prompt + generated; --ctx-size); 0: the model's context.
  int64_t max_context = 0;
  // Called after each prefill chunk with (prompt tokens fed so far, prompt tokens): progress
  // lines, and a way to stop a long prefill (Ctrl-C in `spade chat`). Returning false stops
  // it: generate() returns at once, stop_reason kInterrupted, no token generated, the chunks
  // already fed left in the cache (pt.length says how many).
  std::function<bool(int64_t done, int64_t total)> on_prefill_chunk;
};

// Why generation ended.
enum class StopReason {
  kMaxTokens,    // max_new_tokens generated
  kStopToken,    // emitted one of stop_ids (end of sequence)
  kContext,      // the sequence reached the context (max_context or the model's)
  kInterrupted,  // on_token or on_prefill_chunk returned false
};
// "max-tokens", "eos", "context", "interrupted".
const char* stop_reason_name(StopReason r);

struct GenerateStats {
  int64_t prompt_tokens = 0, generated_tokens = 0;
  double prefill_seconds = 0, decode_seconds = 0;
  bool stopped_by_stop_id = false;  // stop_reason == kStopToken
  StopReason stop_reason = StopReason::kMaxTokens;
  int64_t corrections = 0;  // cache corrections run (GenerateOptions::correction_every)
  // Wall time of each decode step (ms, in order), so a one-off step (an index build, a graph
  // capture) can be told from the steady state.
  std::vector<float> step_ms;
};

// Runs prefill of `prompt` into `pt` (which may already hold a prefix) and decodes.
// `on_token(id)` is called for every generated token; returning false stops generation.
// `device_state`: the request state of the runner's own method (StepModel::new_request_state),
// passed on every step; GenerateOptions::attention is for runners that take callbacks (CPU).
GenerateStats generate(StepModel& model, PageTable& pt, const std::vector<int32_t>& prompt,
                       const GenerateOptions& opt, const std::function<bool(int32_t)>& on_token,
                       sparse::MethodState* device_state = nullptr);
// The CPU model as a runner (CpuStepModel).
GenerateStats generate(CpuModel& model, PageTable& pt, const std::vector<int32_t>& prompt,
                       const GenerateOptions& opt,
                       const std::function<bool(int32_t)>& on_token);

}  // namespace spade
