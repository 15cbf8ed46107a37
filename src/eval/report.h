// The Markdown report of a `spade eval` JSON file (src/eval/results.h): tables of the mean
// of each measurement per method (rows, in the order the run first met them) and length
// (columns), per task for `tasks`, and the tasks full attention does not solve, listed
// rather than hidden. `spade eval report` regenerates it from the JSON alone; the plots
// come from scripts/eval_plot.py.
#pragma once
#include <nlohmann/json.hpp>
#include <string>

namespace spade::eval {

std::string markdown_report(const nlohmann::json& doc);

}  // namespace spade::eval
