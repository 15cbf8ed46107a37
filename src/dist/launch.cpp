// Local tensor-parallel ranks as child processes (launch.h).
#include "dist/launch.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "core/error.h"

namespace spade::dist {

namespace {

std::string describe_status(int status) {
  if (WIFSIGNALED(status)) return cat("was killed by signal ", WTERMSIG(status), " (", strsignal(WTERMSIG(status)), ")");
  return cat("exited with status ", WEXITSTATUS(status));
}

}  // namespace

LocalRanks::LocalRanks(const std::vector<std::string>& args, int n_ranks,
                       const std::string& address) {
  SPADE_CHECK(n_ranks >= 2, "LocalRanks: nothing to start for ", n_ranks, " rank(s)");
  const pid_t parent = getpid();
  const int devnull = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  SPADE_CHECK(devnull >= 0, "--tp: cannot open /dev/null: ", std::strerror(errno));
  for (int r = 1; r < n_ranks; ++r) {
    // Everything the child needs is built before fork: after it, only async-signal-safe calls.
    std::vector<std::string> a = args;
    a.insert(a.end(), {"--tp-rank", std::to_string(r), "--dist-init", address});
    std::vector<char*> argv;
    std::string exe = "/proc/self/exe";
    argv.push_back(exe.data());
    for (std::string& s : a) argv.push_back(s.data());
    argv.push_back(nullptr);
    std::fflush(nullptr);
    const pid_t pid = ::fork();
    if (pid < 0) {
      const int e = errno;
      ::close(devnull);
      for (pid_t p : pids_) ::kill(p, SIGKILL), ::waitpid(p, nullptr, 0);
      fail("--tp: cannot start rank ", r, ": ", std::strerror(e));
    }
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(127);  // rank 0 is already gone
      ::dup2(devnull, 0);
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
    pids_.push_back(pid);
  }
  ::close(devnull);
  done_.assign(pids_.size(), 0);
  watcher_ = std::thread([this] { watch(); });
}

void LocalRanks::watch() {
  using namespace std::chrono_literals;
  while (!stopping_.load()) {
    for (size_t i = 0; i < pids_.size(); ++i) {
      if (done_[i]) continue;
      int status = 0;
      if (::waitpid(pids_[i], &status, WNOHANG) != pids_[i]) continue;
      done_[i] = 1;
      if (WIFEXITED(status) && WEXITSTATUS(status) == 0) continue;  // after rank 0's shutdown
      if (stopping_.load()) return;  // rank 0 is exiting anyway
      std::fflush(stdout);
      std::fprintf(stderr, "spade: error: tensor-parallel rank %zu (pid %d) %s; stopping\n", i + 1,
                   int(pids_[i]), describe_status(status).c_str());
      std::fflush(stderr);
      for (size_t j = 0; j < pids_.size(); ++j)
        if (!done_[j]) ::kill(pids_[j], SIGKILL);
      std::_Exit(1);
    }
    std::this_thread::sleep_for(20ms);
  }
}

LocalRanks::~LocalRanks() {
  using namespace std::chrono_literals;
  stopping_.store(true);
  if (watcher_.joinable()) watcher_.join();
  // The ranks exit on rank 0's shutdown message or its closed connection; a rank that never
  // joined (rank 0 failed first) is still waiting to connect: it gets a few seconds, then is killed.
  const auto deadline = std::chrono::steady_clock::now() + 3s;
  for (size_t i = 0; i < pids_.size(); ++i) {
    while (!done_[i]) {
      if (::waitpid(pids_[i], nullptr, WNOHANG) == pids_[i]) {
        done_[i] = 1;
      } else if (std::chrono::steady_clock::now() >= deadline) {
        ::kill(pids_[i], SIGKILL);
        ::waitpid(pids_[i], nullptr, 0);
        done_[i] = 1;
      } else {
        std::this_thread::sleep_for(10ms);
      }
    }
  }
}

}  // namespace spade::dist
