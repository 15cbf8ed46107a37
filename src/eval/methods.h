// The method list of a `spade eval` sweep: ';'-separated specs NAME[:k=v,...] (as in
// `spade needle --methods`) crossed with a budget list. A method that takes a budget and
// was given none runs once per budget; the others (full, oracle-topp, blasst, a spec that
// sets its budget, budget=auto included) run once. Each run has a label, its spec with the budget written in,
// that names it in the results.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "sparse/options.h"

namespace spade::eval {

struct MethodRun {
  std::string label;    // "quest:budget=256", "full", "twilight:p=0.9,budget=512"
  std::string name;     // registry name
  int64_t budget = -1;  // -1: the method takes no budget
  sparse::SparseConfig config;
};

std::vector<MethodRun> expand_methods(const std::string& list, const std::vector<int64_t>& budgets);

}  // namespace spade::eval
