// The prefill progress line of `spade generate` and `spade chat` (stderr only; stdout keeps
// the generated text alone). Nothing is shown for a prefill that ends within `after_s`
// seconds (--progress-after, default 2; negative: never). Past that, each update says
//   [spade] prefill 3072/6800 tokens (45%), 1234 tok/s, ETA 3.1 s
// On a terminal it is one line rewritten in place with '\r', at most 4 updates a second, and
// erased when the prefill ends (the answer then starts on a clean line). Anywhere else (a
// file, a pipe, a CI log) each update is a line of its own, at most one every 5 s, and a last
// line gives the total: "[spade] prefill done: 6800 tokens in 5.5 s (1236 tok/s)".
// Updates come after each prefill chunk (GenerateOptions::on_prefill_chunk), so a single
// chunk longer than the threshold shows only its end.
#pragma once
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>

namespace spade::cli {

class PrefillProgress {
 public:
  using Clock = std::function<double()>;  // seconds, monotonic

  // `tty`: rewrite one line in place; else plain lines. `clock`: for tests.
  PrefillProgress(double after_s, std::FILE* out, bool tty, Clock clock = steady_seconds)
      : after_s_(after_s), out_(out), tty_(tty), clock_(std::move(clock)), t0_(clock_()) {}
  // stderr, in its own mode.
  explicit PrefillProgress(double after_s)
      : PrefillProgress(after_s, stderr, isatty(fileno(stderr)) != 0) {}

  // Restarts the clock (a new prefill with the same settings: chat's next turn).
  void start() {
    t0_ = clock_();
    shown_ = false;
    last_ = -1e300;
  }

  // After a chunk: `done` of `total` prompt tokens fed.
  void update(int64_t done, int64_t total) {
    if (after_s_ < 0 || total <= 0) return;
    const double now = clock_(), elapsed = now - t0_;
    if (elapsed < after_s_) return;
    if (done >= total) return finish(done, elapsed);
    const double min_gap = tty_ ? 0.25 : 5.0;
    if (shown_ && now - last_ < min_gap) return;
    last_ = now;
    shown_ = true;
    const double rate = double(done) / std::max(elapsed, 1e-9);
    const double eta = rate > 0 ? double(total - done) / rate : 0;
    std::fprintf(out_, "%s[spade] prefill %lld/%lld tokens (%d%%), %.0f tok/s, ETA %.1f s%s",
                 tty_ ? "\r" : "", (long long)done, (long long)total, int(100 * done / total), rate,
                 eta, tty_ ? "\x1b[K" : "\n");
    std::fflush(out_);
  }

  bool shown() const { return shown_; }

 private:
  static double steady_seconds() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  void finish(int64_t done, double elapsed) {
    if (tty_) {
      if (shown_) std::fputs("\r\x1b[K", out_);  // erase the line: the answer starts clean
    } else {
      std::fprintf(out_, "[spade] prefill done: %lld tokens in %.1f s (%.0f tok/s)\n",
                   (long long)done, elapsed, double(done) / std::max(elapsed, 1e-9));
    }
    std::fflush(out_);
    shown_ = false;
    last_ = -1e300;
    t0_ = 1e300;  // nothing more until start()
  }

  double after_s_;
  std::FILE* out_;
  bool tty_;
  Clock clock_;
  double t0_;
  bool shown_ = false;
  double last_ = -1e300;
};

}  // namespace spade::cli
