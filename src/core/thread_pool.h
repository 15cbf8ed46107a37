// A small fixed thread pool with a blocking parallel_for. Workers are created once; a
// parallel_for hands out contiguous index ranges and waits for them, so hot loops allocate
// nothing. Nested parallel_for calls run inline on the calling thread.
//
// Hand-off: decode runs ~200 small products per token, each a parallel_for of a few
// microseconds, so waking workers through a condition variable per op (tens of microseconds)
// would cost more than the work. Workers instead spin on an atomic generation counter for
// kSpinMicros after each job (pausing, yielding now and then so a busy machine keeps moving)
// and only then sleep (a condition variable the caller notifies only when someone sleeps). A job is cut into up to
// kChunksPerThread chunks per thread that the caller and the workers claim from one atomic
// ticket, so a worker the OS has not scheduled yet delays nothing: the caller takes its
// chunks. The caller returns once every chunk is done.
#pragma once
#include <atomic>
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

  // Calls fn(begin, end) over [0, n) split into at most size() * kChunksPerThread chunks of at
  // least `grain` (any thread may run any chunk; chunks never overlap).
  void parallel_for(int64_t n, int64_t grain,
                    const std::function<void(int64_t, int64_t)>& fn);

  static ThreadPool& global();          // sized by SPADE_THREADS or hardware concurrency
  // Before first use of global(). Throws spade::Error unless 1 <= n <= kMaxThreads (the
  // same range SPADE_THREADS is checked against). Also sets the BLAS library's own thread
  // count to 1 (OpenBLAS, when that is the BLAS linked): spade splits BLAS calls over this
  // pool itself, so `--threads N` is every thread the process computes on.
  static void set_global_threads(int64_t n);
  static constexpr int kMaxThreads = 1024;  // kMaxThreads * kChunksPerThread < 2^16
  // How long an idle worker spins before it sleeps.
  static constexpr int kSpinMicros = 2000;
  static constexpr int kChunksPerThread = 4;

  // Whether the calling thread is inside a parallel_for / run_team (nested calls run inline).
  static bool inside();

 private:
  void worker_loop();
  // Claims and runs chunks of job `gen` until none is left; returns how many it ran.
  int run_chunks(uint32_t gen);
  void wake_sleepers();

  std::vector<std::thread> workers_;
  // The current job: fn_ over [0, job_n_) in job_chunks_ chunks of job_chunk_ elements.
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t job_n_ = 0, job_chunk_ = 0;
  int job_chunks_ = 0;
  std::atomic<uint32_t> generation_{0};  // bumped to publish a job (and to stop)
  std::atomic<uint64_t> ticket_{0};      // generation << 32 | chunks << 16 | next chunk
  std::atomic<int> done_{0};             // chunks of the current job finished
  std::atomic<int> sleepers_{0};         // workers asleep on sleep_cv_
  std::mutex sleep_mu_;
  std::condition_variable sleep_cv_;
  std::atomic<bool> stop_{false};
};

// Makes the linked BLAS (OpenBLAS) compute on the calling thread only and stops its own
// worker threads, when it offers the calls to do so; a no-op for other BLAS libraries.
// Returns whether OpenBLAS was found.
bool blas_single_threaded();

// Threads of this process right now (Linux: /proc/self/task), -1 where that is unknown.
int process_threads();

}  // namespace spade
