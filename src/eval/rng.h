// A small deterministic random generator for the evaluation tasks (src/eval/tasks.h).
// std::uniform_int_distribution and friends are implementation-defined, so a task drawn
// from a seed could differ between standard libraries; SplitMix64 with our own bounded
// draw and shuffle gives the same task on every platform.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace spade::eval {

class Rng {
 public:
  explicit Rng(uint64_t seed) : s_(seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull) {}
  uint64_t next() {
    uint64_t z = (s_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, n) (n > 0); the modulo bias is irrelevant at these sizes.
  uint64_t below(uint64_t n) { return next() % n; }
  // Uniform in [lo, hi].
  int64_t range(int64_t lo, int64_t hi) { return lo + int64_t(below(uint64_t(hi - lo + 1))); }
  double unit() { return double(next() >> 11) * (1.0 / 9007199254740992.0); }
  template <typename T>
  const T& pick(const std::vector<T>& v) { return v[size_t(below(v.size()))]; }
  template <typename T>
  void shuffle(std::vector<T>& v) {
    for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[size_t(below(i))]);
  }

 private:
  uint64_t s_;
};

// Mixes a base seed with a task name, a length and a sample index (FNV-1a over the parts),
// so every (task, length, sample) draws an independent stream.
inline uint64_t mix_seed(uint64_t seed, const std::string& task, int64_t length, int64_t sample) {
  uint64_t h = 1469598103934665603ull ^ seed;
  auto add = [&](uint64_t x) {
    for (int i = 0; i < 8; ++i) {
      h ^= (x >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  };
  for (char c : task) {
    h ^= uint8_t(c);
    h *= 1099511628211ull;
  }
  add(uint64_t(length));
  add(uint64_t(sample));
  return h;
}

}  // namespace spade::eval
