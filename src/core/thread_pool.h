// A small fixed thread pool with a blocking parallel_for. Workers are created once; a
// parallel_for hands out contiguous index ranges and waits for them, so hot loops allocate
// nothing. Nested parallel_for calls run inline on the calling thread.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace spade {

class ThreadPool {
 public:
  explicit ThreadPool(int n_threads);  // n_threads <= 0: hardware concurrency
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return int(workers_.size()) + 1; }

  // Calls fn(begin, end) over [0, n) split into at most size() chunks of at least `grain`.
  void parallel_for(int64_t n, int64_t grain,
                    const std::function<void(int64_t, int64_t)>& fn);

  static ThreadPool& global();          // sized by SPADE_THREADS or hardware concurrency
  // Before first use of global(). Throws spade::Error unless 1 <= n <= kMaxThreads (the
  // same range SPADE_THREADS is checked against).
  static void set_global_threads(int64_t n);
  static constexpr int kMaxThreads = 1024;

 private:
  void worker_loop(int index);

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_start_, cv_done_;
  const std::function<void(int64_t, int64_t)>* job_ = nullptr;
  int64_t job_n_ = 0, job_chunk_ = 0;
  int job_chunks_ = 0;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
};

}  // namespace spade
