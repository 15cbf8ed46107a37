// Ranks as threads for the tensor-parallel tests (tests/test_tp_*.cpp, tests/gpu/test_cuda_tp*.cpp):
// each rank is a thread of the test process with its own TcpCommunicator on 127.0.0.1 and an
// ephemeral port; what a rank throws comes back to the test instead of ending the process.
#pragma once
#include <gtest/gtest.h>

#include <chrono>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "dist/tcp_communicator.h"
#include "test_util.h"

namespace spade::test {

// Rendezvous and per-message timeouts of the tests' ranks, scaled for slow (sanitized) builds.
inline dist::TcpOptions tp_quick(std::chrono::milliseconds connect = std::chrono::seconds(10),
                                 std::chrono::milliseconds io = std::chrono::seconds(10)) {
  dist::TcpOptions o;
  o.connect_timeout = std::chrono::duration_cast<std::chrono::milliseconds>(scaled(connect));
  o.io_timeout = std::chrono::duration_cast<std::chrono::milliseconds>(io * time_scale());
  return o;
}

// Runs fn(comm) on `n` ranks, each a thread with its own TcpCommunicator; returns what each
// rank threw (null: nothing).
inline std::vector<std::exception_ptr> run_ranks(int n,
                                                 const std::function<void(dist::Communicator&)>& fn,
                                                 dist::TcpOptions o = tp_quick()) {
  dist::TcpListener l("127.0.0.1:0");
  const std::string addr = "127.0.0.1:" + std::to_string(l.port());
  std::vector<std::exception_ptr> err(static_cast<size_t>(n));
  std::vector<std::thread> th;
  for (int r = 1; r < n; ++r)
    th.emplace_back([&, r] {
      try {
        dist::TcpCommunicator c(addr, r, n, o);
        fn(c);
      } catch (...) {
        err[size_t(r)] = std::current_exception();
      }
    });
  try {
    dist::TcpCommunicator c(std::move(l), n, o);
    fn(c);
  } catch (...) {
    err[0] = std::current_exception();
  }
  for (auto& t : th) t.join();
  return err;
}

// A test failure for every rank that threw, with its message.
inline void expect_ok(const std::vector<std::exception_ptr>& err) {
  for (size_t r = 0; r < err.size(); ++r)
    if (err[r]) {
      try {
        std::rethrow_exception(err[r]);
      } catch (const std::exception& e) {
        ADD_FAILURE() << "rank " << r << ": " << e.what();
      }
    }
}

}  // namespace spade::test
