// RULER-style long-context tasks for `spade eval tasks`, drawn deterministically from a seed
// (src/eval/rng.h): needle-in-a-haystack with number / word / UUID needles, multi-key,
// multi-value and multi-query needles, variable tracking, frequent-words extraction, and
// key lookups inside a long JSON array or a code listing (structured data, the setting
// LycheeCluster argues about). Haystack tasks fill with lines of a real long text (Debian's
// bible-kjv-text); the others generate their own filler (coded words, records, code).
//
// A task is sized to a target prompt length in tokens: the generator draws its content
// (keys, values, needle depths) from the seed first, then finds the largest amount of
// filler whose rendered prompt (chat template + answer prefix) fits the target, through the
// caller's token counter. The same (task, length, seed, haystack, tokenizer) always gives
// the same prompt. Templates follow RULER (Hsieh et al., 2024), including its answer
// prefixes, which start the assistant's reply.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace spade {
class ChatTemplate;
}

namespace spade::eval {

enum class ScoreRule {
  All,  // fraction of the expected answers found in the output (RULER string_match_all)
  Any,  // 1 if any expected answer is found (RULER string_match_part)
};

struct TaskSample {
  std::string task;
  int64_t length = 0;   // target prompt tokens
  uint64_t seed = 0;    // the seed the content was drawn from
  std::string user;     // user message: instructions, context, question
  std::string answer_prefix;  // the assistant's reply starts with this (may be empty)
  std::vector<std::string> answers;
  ScoreRule rule = ScoreRule::All;
  int max_new_tokens = 32;
  int64_t filler = 0;   // filler units used (haystack lines, words, records)
};

// Tokens of the prompt rendered from (user message, answer prefix).
using PromptTokens = std::function<int64_t(const std::string& user, const std::string& prefix)>;

struct TaskInfo {
  std::string name, summary;
  bool uses_haystack = true;
};
const std::vector<TaskInfo>& all_tasks();
// "all" or a comma-separated list of task names; unknown names throw listing the valid ones.
std::vector<std::string> parse_task_list(const std::string& list);

// Draws `task` of `length` tokens from `seed`. `haystack`: lines of long real text (only the
// haystack tasks read it; it may be empty for the others). Throws when even the task without
// filler exceeds `length`.
TaskSample make_task(const std::string& task, int64_t length, uint64_t seed,
                     const std::vector<std::string>& haystack, const PromptTokens& count);

// The prompt text: the user message through the chat template with the generation prompt,
// then the answer prefix.
std::string render_prompt(const ChatTemplate& tmpl, const std::string& user,
                          const std::string& answer_prefix);

}  // namespace spade::eval
