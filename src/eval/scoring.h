// Exact-match scoring of a generated answer against a task's expected answers (RULER's
// string_match_all / string_match_part): case-insensitive containment of each expected
// answer in the output. ScoreRule::All gives the fraction of answers found (1 only when
// every one is present), ScoreRule::Any gives 1 when at least one is.
#pragma once
#include <string>
#include <vector>

#include "eval/tasks.h"

namespace spade::eval {

double score_answer(const std::vector<std::string>& answers, ScoreRule rule,
                    const std::string& output);
inline double score_answer(const TaskSample& s, const std::string& output) {
  return score_answer(s.answers, s.rule, output);
}

}  // namespace spade::eval
