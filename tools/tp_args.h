// --tp N, and the hidden --tp-rank R / --dist-init HOST:PORT, shared by generate, chat and serve
// (issue 39; docs/cli.md "Tensor parallelism"). Each command declares the three options, then:
//   TpLaunch tp(a, argc, argv);                         // values checked before the model loads
//   auto weights = load_model(...);
//   if (tp.follower()) return tp.follow(*weights);      // ranks 1..N-1: mirror rank 0's steps
//   tp.start(*weights, ro);                             // rank 0: check, start ranks, set ro.tp
//   Runner runner = make_runner(*weights, ro);          // (tp must outlive the runner)
// --tp N alone starts ranks 1..N-1 on this host (dist/launch.h) on a free localhost port;
// --tp N --dist-init H:P makes this process rank 0 listening there (start the other ranks with
// --tp-rank R and the same --dist-init: several hosts).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "args.h"
#include "core/error.h"
#include "dist/launch.h"
#include "dist/shard.h"
#include "dist/tcp_communicator.h"
#include "dist/tp_runner.h"
#include "engine/runner.h"

namespace spade::cli {

class TpLaunch {
 public:
  TpLaunch(const Args& a, int argc, char** argv) {
    const long long n = a.integer("--tp", 1);
    SPADE_CHECK(n >= 1 && n <= 64, "--tp must be in [1, 64], got ", n);
    size_ = int(n);
    address_ = a.str("--dist-init");
    if (a.has("--tp-rank")) {
      const long long r = a.integer("--tp-rank", 0);
      SPADE_CHECK(size_ > 1, "--tp-rank needs --tp N with N > 1");
      SPADE_CHECK(r >= 0 && r < size_, "--tp-rank must be in [0, ", size_, "), got ", r);
      SPADE_CHECK(a.has("--dist-init"), "--tp-rank needs --dist-init HOST:PORT (rank 0's address)");
      rank_ = int(r);
    }
    if (a.has("--dist-init")) {
      SPADE_CHECK(size_ > 1, "--dist-init needs --tp N with N > 1");
      (void)dist::parse_host_port(address_);  // a bad address fails now
    }
    for (int i = 0; i < argc; ++i) args_.emplace_back(argv[i]);
  }
  int size() const { return size_; }
  bool follower() const { return rank_ > 0; }

  // Ranks 1..N-1: runs until rank 0 shuts the ranks down; the command's exit status.
  int follow(const ModelWeights& w) {
    dist::run_follower_rank(w, address_, rank_, size_);
    return 0;
  }

  // Rank 0: refuses a model that does not split over the ranks (before any rank starts),
  // starts ranks 1..N-1 here unless --dist-init was given, and sets ro's TP fields.
  void start(const ModelWeights& w, RunnerOptions& ro) {
    ro.tp = size_;
    if (size_ == 1) return;
    dist::check_shardable(w.config, size_);
    // GPU ranks: NCCL in the build and, with every rank on this host, a GPU per rank (rank r
    // takes GPU r), checked before any rank starts.
    if (ro.device == "cuda") dist::check_cuda_tp(size_, address_.empty());
    if (!address_.empty()) {
      ro.dist_init = address_;
      return;
    }
    auto l = std::make_shared<dist::TcpListener>("127.0.0.1:0");
    ro.dist_init = "127.0.0.1:" + std::to_string(l->port());
    ro.dist_listener = l;
    ranks_ = std::make_unique<dist::LocalRanks>(args_, size_, ro.dist_init);
  }

 private:
  int size_ = 1, rank_ = 0;
  std::string address_;
  std::vector<std::string> args_;
  std::unique_ptr<dist::LocalRanks> ranks_;
};

}  // namespace spade::cli
