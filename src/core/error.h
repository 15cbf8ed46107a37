// Errors a user can act on: every failure names what was being read (file, tensor,
// field) and what was expected versus found. Thrown as spade::Error; the CLI prints
// what() and exits non-zero.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace spade {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg) : std::runtime_error(msg) {}
};

// cat("a", 1, "b") -> "a1b": builds messages without <format> (not in g++ 12).
template <typename... Args>
std::string cat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}

template <typename... Args>
[[noreturn]] void fail(Args&&... args) {
  throw Error(cat(std::forward<Args>(args)...));
}

}  // namespace spade

// SPADE_CHECK(cond, parts...): throws spade::Error with the concatenated parts.
#define SPADE_CHECK(cond, ...)                     \
  do {                                             \
    if (!(cond)) ::spade::fail(__VA_ARGS__);       \
  } while (0)
