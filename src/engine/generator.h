// Single-sequence generation on the CPU model: chunked prefill, then decode one token per
// step with the sampler, streaming each token to a callback. Used by `spade generate` and
// `spade chat`; batched serving uses CpuModel directly.
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <vector>

#include "engine/sampler.h"
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
};

struct GenerateStats {
  int64_t prompt_tokens = 0, generated_tokens = 0;
  double prefill_seconds = 0, decode_seconds = 0;
  bool stopped_by_stop_id = false;
  int64_t corrections = 0;  // cache corrections run (GenerateOptions::correction_every)
  // generate_cuda: wall time of each decode step (ms, in order), so a one-off step (an index
  // build, a graph capture) can be told from the steady state.
  std::vector<float> step_ms;
};

// Runs prefill of `prompt` into `pt` (which may already hold a prefix) and decodes.
// `on_token(id)` is called for every generated token; returning false stops generation.
GenerateStats generate(CpuModel& model, PageTable& pt, const std::vector<int32_t>& prompt,
                       const GenerateOptions& opt,
                       const std::function<bool(int32_t)>& on_token);

}  // namespace spade
