// The sampling flags shared by `spade generate` and `spade chat`:
// --temperature --top-k --top-p --min-p --repeat-penalty --seed.
#pragma once
#include <cmath>
#include <cstdint>

#include "args.h"
#include "engine/sampler.h"

namespace spade::cli {

// The one default temperature of every command-line front end (generate, chat; eval and
// needle decode greedily): 0, greedy decoding, so that two runs without --temperature give the
// same text and outputs compare across methods and devices. Sampling is opt-in
// (--temperature 0.7 --top-p 0.9 --seed S). `spade serve` follows the OpenAI API instead: a
// request without "temperature" samples at 1.0 (docs/cli.md).
inline constexpr double kDefaultTemperature = 0;

inline SamplingParams sampling_from_args(const Args& a, double default_temperature = kDefaultTemperature) {
  SamplingParams s;
  s.temperature = float(a.number("--temperature", default_temperature));
  s.top_k = int(a.integer("--top-k", 0));
  s.top_p = float(a.number("--top-p", 1));
  s.min_p = float(a.number("--min-p", 0));
  s.repetition_penalty = float(a.number("--repeat-penalty", 1));
  s.seed = uint64_t(a.integer("--seed", 0));
  // Ranges, as the server checks them: a value outside is an error, never clamped.
  SPADE_CHECK(std::isfinite(s.temperature) && s.temperature >= 0.f && s.temperature <= 100.f,
              "--temperature must be in [0, 100], got ", a.str("--temperature"));
  SPADE_CHECK(s.top_k >= 0, "--top-k must be >= 0 (0: off), got ", a.str("--top-k"));
  SPADE_CHECK(std::isfinite(s.top_p) && s.top_p > 0.f && s.top_p <= 1.f,
              "--top-p must be in (0, 1], got ", a.str("--top-p"));
  SPADE_CHECK(std::isfinite(s.min_p) && s.min_p >= 0.f && s.min_p <= 1.f,
              "--min-p must be in [0, 1], got ", a.str("--min-p"));
  SPADE_CHECK(std::isfinite(s.repetition_penalty) && s.repetition_penalty > 0.f,
              "--repeat-penalty must be > 0, got ", a.str("--repeat-penalty"));
  return s;
}

}  // namespace spade::cli
