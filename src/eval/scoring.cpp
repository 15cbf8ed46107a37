// Scoring rules of src/eval/scoring.h.
#include "eval/scoring.h"

#include <cctype>

namespace spade::eval {

namespace {
std::string lower(std::string s) {
  for (auto& c : s) c = char(std::tolower((unsigned char)c));
  return s;
}
}  // namespace

double score_answer(const std::vector<std::string>& answers, ScoreRule rule,
                    const std::string& output) {
  if (answers.empty()) return 0;
  const std::string out = lower(output);
  int found = 0;
  for (const auto& a : answers) found += !a.empty() && out.find(lower(a)) != std::string::npos;
  if (rule == ScoreRule::Any) return found > 0 ? 1.0 : 0.0;
  return double(found) / double(answers.size());
}

}  // namespace spade::eval
