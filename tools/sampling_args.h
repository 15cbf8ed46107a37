// The sampling flags shared by `spade generate` and `spade chat`:
// --temperature --top-k --top-p --min-p --repeat-penalty --seed.
#pragma once
#include <cstdint>

#include "args.h"
#include "engine/sampler.h"

namespace spade::cli {

inline SamplingParams sampling_from_args(const Args& a, double default_temperature) {
  SamplingParams s;
  s.temperature = float(a.number("--temperature", default_temperature));
  s.top_k = int(a.integer("--top-k", 0));
  s.top_p = float(a.number("--top-p", 1));
  s.min_p = float(a.number("--min-p", 0));
  s.repetition_penalty = float(a.number("--repeat-penalty", 1));
  s.seed = uint64_t(a.integer("--seed", 0));
  return s;
}

}  // namespace spade::cli
