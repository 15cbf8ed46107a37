// A progress line with ETA for long `spade eval` sweeps, on stderr: units done / total,
// elapsed time, and the remaining time estimated from the units run so far in this process
// (units skipped because a resumed JSON already holds them count as done but not in the
// rate). On a terminal the line redraws in place; otherwise one line per update.
#pragma once
#include <chrono>
#include <cstdint>
#include <string>

namespace spade::eval {

class Progress {
 public:
  Progress(std::string label, int64_t total);
  void skip(int64_t n = 1);                      // units already done (resume)
  void done(int64_t n, const std::string& note);  // units just run
  void finish();
  static std::string format_seconds(double s);    // "1h02m", "3m05s", "12s"

 private:
  void print(const std::string& note);
  std::string label_;
  int64_t total_, done_ = 0, skipped_ = 0;
  bool tty_;
  std::chrono::steady_clock::time_point t0_;
};

}  // namespace spade::eval
