// Next-token sampling from a row of logits: repetition penalty, temperature, top-k, top-p,
// min-p, seeded RNG. temperature == 0 is greedy (argmax, lowest id on ties).
#pragma once
#include <cstdint>
#include <random>
#include <vector>

namespace spade {

struct SamplingParams {
  float temperature = 0.f;
  int top_k = 0;            // 0: off
  float top_p = 1.f;        // 1: off
  float min_p = 0.f;        // 0: off
  float repetition_penalty = 1.f;  // 1: off (HF semantics: divide positive, multiply negative)
  uint64_t seed = 0;
};

class Sampler {
 public:
  explicit Sampler(const SamplingParams& p) : p_(p), rng_(p.seed) {}
  // `history`: tokens seen so far (for the repetition penalty). Logits are not modified.
  int32_t sample(const float* logits, int32_t vocab, const std::vector<int32_t>& history);
  const SamplingParams& params() const { return p_; }

 private:
  SamplingParams p_;
  std::mt19937_64 rng_;
  std::vector<float> work_;
  std::vector<int32_t> idx_;
  std::vector<uint8_t> seen_;
  std::vector<double> probs_;
};

int32_t argmax(const float* logits, int32_t vocab);

}  // namespace spade
