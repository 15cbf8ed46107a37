// Next-token sampling on the GPU, one CTA per logits row: greedy (argmax, lowest id on
// ties), or temperature + top-k + min-p + top-p, matching engine/sampler.h's order of
// operations (the random stream differs from the CPU sampler's mt19937). Repetition penalty
// is not done here (the model runner falls back to the host sampler for it).
// Cost: greedy reads V floats once; top-k / top-p find their thresholds by bisection on the
// order-preserving integer image of the logits (<= 32 passes each over a row that stays in
// L1/L2: ~V*4*64 bytes of cache traffic, ~20-40 us at V = 128K).
#pragma once
#include <cstdint>

#include "backend/cuda/cuda_common.h"

namespace spade::cuda {

struct GpuSampling {
  float temperature = 0.f;
  int top_k = 0;
  float top_p = 1.f;
  float min_p = 0.f;
  uint64_t seed = 0;
};

// One row's parameters for sample_rows(): a batch whose requests sample differently. `draw`
// is the index of the token being drawn within its request (0 for the first), so a request's
// random stream depends on its seed and position only, not on its row or batch.
struct GpuSamplingRow {
  GpuSampling p;
  uint64_t draw = 0;
};

// out[r] = sampled id of logits row r ([R, V] fp32); `step` varies the random stream. When
// `step_dev` is given the step is read from device memory instead (CUDA graph replays).
void sample(const float* logits, int R, int V, const GpuSampling& p, uint64_t step,
            int32_t* out, cudaStream_t s, const uint64_t* step_dev = nullptr);
// out[r] = sampled id of row r with rows[r]'s parameters (a device array of R entries, read
// at launch time: a captured graph replays with whatever the array holds).
void sample_rows(const float* logits, int R, int V, const GpuSamplingRow* rows, int32_t* out,
                 cudaStream_t s);

}  // namespace spade::cuda
