// The pieces of `spade eval` (tools/cmd_eval.cpp) that its sub-commands share: the sweep's
// setup from the options, the result file and its records, task prompts and the sweep frame.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "args.h"
#include "eval/decode.h"
#include "eval/methods.h"
#include "eval/progress.h"
#include "eval/results.h"
#include "eval/runner.h"
#include "eval/tasks.h"
#include "model/loader.h"
#include "sparse/registry.h"
#include "tokenizer/tokenizer.h"

namespace spade::cli::eval_cmd {

using json = nlohmann::json;
using namespace spade::eval;

std::string read_file(const std::string& path);
std::vector<std::string> lines_of(const std::string& text);
std::string md_path(const Args& a, const std::string& out);

struct Setup {
  std::unique_ptr<ModelWeights> w;
  std::unique_ptr<Tokenizer> tok;
  std::vector<MethodRun> runs;
  Device device = Device::CPU;
  std::vector<Placement> place;  // per run: GPU or CPU
  std::vector<std::shared_ptr<const sparse::SparseMethod>> methods;  // CPU runs (else null)
  RunnerOptions ro;  // page size and prefill chunk (each sub-command sets the lengths)
  std::vector<int64_t> lengths;
  int samples = 3;
  uint64_t seed = 1;
  std::string text;
  json meta;
};

Setup setup(const Args& a, const std::string& kind);

json method_fields(const Setup& s, const EvalRunner& run, size_t m);

// A fresh file, or a resumed one of the same backend (records of one table stay comparable).
ResultFile open_results(const std::string& out, const std::string& kind, const json& meta,
                        const std::string& cmd);

// The session's counters (CPU); the GPU keeps none but the request's density (attended /
// dense decode rows, BLASST's skipped tiles not attended): the other fields null.
json totals_fields(const DecodeResult& r, bool recall);

struct Prompt {
  TaskSample sample;
  std::vector<int32_t> tokens;
};

Prompt task_prompt(const Setup& s, const std::vector<std::string>& hay, const std::string& task,
                   int64_t L, int sample);

std::string key_of(const std::string& kind, const std::string& what, int64_t L, int sample,
                   const std::string& method);

// The frame of the task sweeps (tasks, agree): for every (length, task, sample) with runs not
// yet in the result file, the prompt (set on the runner) and those runs' indices; the file is
// saved after each prompt.
template <typename Body>
void sweep_task_prompts(Setup& s, EvalRunner& runner, ResultFile& file, const char* kind,
                        const std::vector<std::string>& tasks, const std::vector<std::string>& hay,
                        Progress& prog, Body&& body) {
  for (int64_t L : s.lengths)
    for (const auto& task : tasks)
      for (int k = 0; k < s.samples; ++k) {
        std::vector<size_t> todo;
        for (size_t m = 0; m < s.runs.size(); ++m)
          if (file.has(key_of(kind, task, L, k, s.runs[m].label))) prog.skip();
          else todo.push_back(m);
        if (todo.empty()) continue;
        Prompt p = task_prompt(s, hay, task, L, k);
        runner.set_prompt(p.tokens);
        body(task, L, k, p, todo);
        file.save();
      }
}

// The end of a sweep (tasks, agree, ppl, recall): progress line, final save, the Markdown report
// beside the JSON.
void finish_sweep(const Args& a, Progress& prog, ResultFile& file, const std::string& out,
                  const char* kind);

// The sub-commands (cmd is the command line, kept in the result file).
int run_tasks(const Args& a, const std::string& cmd);    // eval_tasks.cpp
int run_agree(const Args& a, const std::string& cmd);    // eval_tasks.cpp
int run_longgen(const Args& a, const std::string& cmd);  // eval_longgen.cpp
int run_text(const Args& a, const std::string& cmd, const std::string& kind);  // eval_text.cpp: ppl, recall

}  // namespace spade::cli::eval_cmd
