// Starting tensor-parallel ranks on this host (`--tp N` without --dist-init, issue 39): rank 0
// runs the command; ranks 1..N-1 are the same binary (/proc/self/exe) with the same arguments
// and `--tp-rank r --dist-init 127.0.0.1:PORT` appended, their stdin /dev/null.
//
// Lifetimes: a rank that exits with a non-zero status or is killed while rank 0 runs makes
// rank 0 print which rank and how, stop the other ranks and exit with status 1 at once (from
// a watcher thread: rank 0 may be idle, e.g. a server between requests). Rank 0 exiting ends
// the others: their connection to rank 0 closes (they stop with an error), and a rank still
// loading its model is killed by the kernel (PR_SET_PDEATHSIG). The destructor gives the
// ranks a few seconds to exit after rank 0's shutdown message, then kills what is left.
#pragma once
#include <sys/types.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

namespace spade::dist {

class LocalRanks {
 public:
  // `args`: the command line without argv[0] (e.g. {"generate", "--model", ...}).
  LocalRanks(const std::vector<std::string>& args, int n_ranks, const std::string& address);
  ~LocalRanks();
  LocalRanks(const LocalRanks&) = delete;
  LocalRanks& operator=(const LocalRanks&) = delete;
  const std::vector<pid_t>& pids() const { return pids_; }

 private:
  void watch();
  std::vector<pid_t> pids_;
  std::vector<char> done_;  // per rank 1..N-1: reaped
  std::atomic<bool> stopping_{false};
  std::thread watcher_;
};

}  // namespace spade::dist
