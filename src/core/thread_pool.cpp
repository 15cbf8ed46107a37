#include "core/thread_pool.h"
#include "core/tuning.h"

#include <algorithm>
#include <cstdlib>
#include <memory>

#include "core/error.h"

namespace spade {

namespace {
thread_local bool t_inside_pool = false;
int g_requested_threads = 0;
}  // namespace

ThreadPool::ThreadPool(int n_threads) {
  if (n_threads <= 0) n_threads = int(std::max(1u, std::thread::hardware_concurrency()));
  for (int i = 1; i < n_threads; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_start_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::worker_loop(int index) {
  t_inside_pool = true;
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int64_t, int64_t)>* job;
    int64_t b, e;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_start_.wait(lk, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      job = job_;
      b = std::min(job_n_, int64_t(index) * job_chunk_);
      e = std::min(job_n_, b + job_chunk_);
      if (index >= job_chunks_) b = e;
    }
    if (b < e) (*job)(b, e);
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (--pending_ == 0) cv_done_.notify_one();
    }
  }
}

void ThreadPool::parallel_for(int64_t n, int64_t grain,
                              const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  int64_t max_chunks = std::max<int64_t>(1, n / grain);
  int chunks = int(std::min<int64_t>(size(), max_chunks));
  if (chunks <= 1 || t_inside_pool || workers_.empty()) {
    fn(0, n);
    return;
  }
  int64_t chunk = (n + chunks - 1) / chunks;
  {
    std::lock_guard<std::mutex> lk(mu_);
    job_ = &fn;
    job_n_ = n;
    job_chunk_ = chunk;
    job_chunks_ = chunks;
    pending_ = int(workers_.size());
    ++generation_;
  }
  cv_start_.notify_all();
  t_inside_pool = true;
  fn(0, std::min(n, chunk));  // caller does chunk 0
  t_inside_pool = false;
  std::unique_lock<std::mutex> lk(mu_);
  cv_done_.wait(lk, [&] { return pending_ == 0; });
}

void ThreadPool::set_global_threads(int64_t n) {
  SPADE_CHECK(n >= 1 && n <= kMaxThreads, "--threads must be in [1, ", kMaxThreads, "], got ", n);
  g_requested_threads = int(n);
}

ThreadPool& ThreadPool::global() {
  static std::unique_ptr<ThreadPool> pool = [] {
    int n = g_requested_threads;
    if (n <= 0 && tuning().threads > 0) n = tuning().threads;
    return std::make_unique<ThreadPool>(n);
  }();
  return *pool;
}

}  // namespace spade
