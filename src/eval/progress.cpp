// Progress of src/eval/progress.h.
#include "eval/progress.h"

#include <unistd.h>

#include <cstdio>

namespace spade::eval {

Progress::Progress(std::string label, int64_t total)
    : label_(std::move(label)), total_(total), tty_(isatty(2)), t0_(std::chrono::steady_clock::now()) {}

std::string Progress::format_seconds(double s) {
  char b[32];
  const long long t = (long long)(s + 0.5);
  if (t >= 3600) std::snprintf(b, sizeof b, "%lldh%02lldm", t / 3600, (t / 60) % 60);
  else if (t >= 60) std::snprintf(b, sizeof b, "%lldm%02llds", t / 60, t % 60);
  else std::snprintf(b, sizeof b, "%llds", t);
  return b;
}

void Progress::skip(int64_t n) {
  skipped_ += n;
  done_ += n;
}

void Progress::done(int64_t n, const std::string& note) {
  done_ += n;
  print(note);
}

void Progress::print(const std::string& note) {
  const double el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  const int64_t ran = done_ - skipped_;
  std::string eta = "?";
  if (ran > 0) eta = format_seconds(el / double(ran) * double(total_ - done_));
  std::fprintf(stderr, "%s[%s] %lld/%lld (%3.0f%%) elapsed %s ETA %s  %s%s",
               tty_ ? "\r\033[K" : "", label_.c_str(), (long long)done_, (long long)total_,
               total_ ? 100.0 * double(done_) / double(total_) : 100.0,
               format_seconds(el).c_str(), eta.c_str(), note.c_str(), tty_ ? "" : "\n");
  std::fflush(stderr);
}

void Progress::finish() {
  if (tty_) std::fputs("\n", stderr);
}

}  // namespace spade::eval
