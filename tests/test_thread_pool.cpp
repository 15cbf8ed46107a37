// The thread pool's hand-off (src/core/thread_pool.h): every index of every job runs exactly
// once whoever claims it, nested calls run inline, a sleeping pool wakes, callers on several
// threads serialize, and the BLAS library is made single-threaded.
#include <gtest/gtest.h>

#include <dlfcn.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "core/thread_pool.h"
#include "smollm2_model.h"

using spade::process_threads;
using spade::ThreadPool;

TEST(ThreadPool, EveryIndexOnceOverManyJobs) {
  ThreadPool pool(4);
  ASSERT_EQ(pool.size(), 4);
  std::vector<std::atomic<int>> hits(5000);
  int64_t expect_sum = 0;
  // Many small jobs back to back (the decode pattern), sizes and grains varied.
  for (int job = 0; job < 3000; ++job) {
    const int64_t n = 1 + (job * 37) % 5000, grain = 1 + job % 70;
    for (int64_t i = 0; i < n; ++i) hits[size_t(i)].store(0, std::memory_order_relaxed);
    std::atomic<int64_t> calls{0};
    pool.parallel_for(n, grain, [&](int64_t b, int64_t e) {
      ASSERT_LT(b, e);
      ASSERT_LE(e, n);
      calls.fetch_add(1);
      for (int64_t i = b; i < e; ++i) hits[size_t(i)].fetch_add(1, std::memory_order_relaxed);
    });
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[size_t(i)].load(), 1) << "job " << job << " i " << i;
    // At most size() * kChunksPerThread chunks, each at least `grain` long but the last.
    ASSERT_LE(calls.load(), int64_t(pool.size()) * ThreadPool::kChunksPerThread);
    ASSERT_LE(calls.load(), std::max<int64_t>(1, n / grain));
    expect_sum += n;
  }
  EXPECT_GT(expect_sum, 0);
}

TEST(ThreadPool, WorkersShareTheWork) {
  ThreadPool pool(2);
  // A job long enough that the worker, spinning after the previous job, claims some chunks.
  std::atomic<int> on_worker{0};
  const std::thread::id caller = std::this_thread::get_id();
  for (int rep = 0; rep < 50 && on_worker.load() == 0; ++rep)
    pool.parallel_for(64, 1, [&](int64_t, int64_t) {
      if (std::this_thread::get_id() != caller) on_worker.fetch_add(1);
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    });
  EXPECT_GT(on_worker.load(), 0);
}

TEST(ThreadPool, NestedCallsRunInline) {
  ThreadPool pool(3);
  std::atomic<int64_t> total{0};
  pool.parallel_for(12, 1, [&](int64_t b, int64_t e) {
    EXPECT_TRUE(ThreadPool::inside());
    for (int64_t i = b; i < e; ++i) {
      const std::thread::id me = std::this_thread::get_id();
      pool.parallel_for(100, 1, [&](int64_t b2, int64_t e2) {
        EXPECT_EQ(std::this_thread::get_id(), me);
        EXPECT_EQ(b2, 0);
        EXPECT_EQ(e2, 100);
        total.fetch_add(e2 - b2);
      });
    }
  });
  EXPECT_FALSE(ThreadPool::inside());
  EXPECT_EQ(total.load(), 1200);
}

TEST(ThreadPool, WakesAfterSleeping) {
  ThreadPool pool(2);
  for (int rep = 0; rep < 3; ++rep) {
    // Longer than the spin: the worker has gone to sleep on the generation counter.
    std::this_thread::sleep_for(std::chrono::microseconds(3 * ThreadPool::kSpinMicros));
    std::atomic<int64_t> sum{0};
    pool.parallel_for(1000, 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) sum.fetch_add(i);
    });
    EXPECT_EQ(sum.load(), 999 * 1000 / 2);
  }
}

TEST(ThreadPool, CallersOnSeveralThreadsSerialize) {
  ThreadPool pool(2);
  std::atomic<int64_t> sum{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < 3; ++c)
    callers.emplace_back([&] {
      for (int job = 0; job < 300; ++job)
        pool.parallel_for(257, 1, [&](int64_t b, int64_t e) { sum.fetch_add(e - b); });
    });
  for (auto& t : callers) t.join();
  EXPECT_EQ(sum.load(), 3 * 300 * 257);
}

TEST(ThreadPool, BlasComputesOnTheCallingThreadOnly) {
  using GetFn = int (*)();
  auto get = reinterpret_cast<GetFn>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  if (!get) GTEST_SKIP() << "the BLAS linked is not OpenBLAS";
  const int before = process_threads(), blas_before = get();
  ASSERT_TRUE(spade::blas_single_threaded());
  EXPECT_EQ(get(), 1);
  // OpenBLAS's own workers (blas_before - 1 of them, none if it was already single) are gone.
  if (before > 0) {
    EXPECT_EQ(process_threads(), before - (blas_before - 1));
  }
}

TEST(ThreadPool, StartsAndStopsBeforeItsWorkersRun) {
  // A job (or the destructor) can come before a worker thread has started: the worker must
  // still see the stop (a late start once made the destructor wait forever).
  for (int rep = 0; rep < 300; ++rep) {
    ThreadPool pool(3);
    std::atomic<int64_t> sum{0};
    if (rep % 2) pool.parallel_for(30, 1, [&](int64_t b, int64_t e) { sum.fetch_add(e - b); });
    EXPECT_EQ(sum.load(), rep % 2 ? 30 : 0);
  }
}

// `spade generate --threads N --stats` reports the threads the process has at the end of the
// run: N, OpenBLAS's own included (they are ended; spade splits BLAS calls over its pool).
TEST(ThreadPoolCli, ThreadsNIsEveryThread) {
  if (!std::ifstream(spade::test::smollm2_path()).good())
    GTEST_SKIP() << spade::test::kSmolLM2 << " not present; fetch it with `bash scripts/fetch_model.sh`";
  char self[4096] = {};
  const ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
  ASSERT_GT(len, 0);
  std::string dir(self, size_t(len));
  const std::string spade = dir.substr(0, dir.rfind('/')) + "/spade";
  if (!std::ifstream(spade).good()) GTEST_SKIP() << spade << " not built";
  for (int n : {1, 2, 3}) {
    const std::string cmd = spade + " generate --model " + spade::test::smollm2_path() +
                            " --prompt 'Count to ten:' -n 8 --stats --threads " +
                            std::to_string(n) + " 2>&1 >/dev/null";
    std::string err;
    FILE* p = popen(cmd.c_str(), "r");
    ASSERT_NE(p, nullptr);
    char buf[4096];
    size_t got;
    while ((got = std::fread(buf, 1, sizeof buf, p)) > 0) err.append(buf, got);
    ASSERT_EQ(pclose(p), 0) << cmd << "\n" << err;
    std::smatch m;
    ASSERT_TRUE(std::regex_search(err, m, std::regex(R"(\| threads (\d+) \(process (-?\d+)\))")))
        << err;
    EXPECT_EQ(std::stoi(m[1]), n);
    EXPECT_EQ(std::stoi(m[2]), n) << "threads in the process at the end of `--threads " << n << "`";
  }
}
