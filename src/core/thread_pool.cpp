#include "core/thread_pool.h"
#include "core/tuning.h"

#include <dirent.h>
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <mutex>

#include "core/error.h"

namespace spade {

namespace {
thread_local bool t_inside_pool = false;
int g_requested_threads = 0;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

// Serializes callers from different threads (the pool runs one job at a time).
std::mutex& call_mutex(const ThreadPool* p) {
  static std::mutex mu;
  (void)p;
  return mu;
}
}  // namespace

bool ThreadPool::inside() { return t_inside_pool; }

bool blas_single_threaded() {
  // Looked up at run time: the BLAS linked may be OpenBLAS (these exist) or another one.
  using SetFn = void (*)(int);
  using ShutdownFn = int (*)();
  auto set = reinterpret_cast<SetFn>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  if (!set) return false;
  set(1);
  // OpenBLAS starts its worker threads when it loads; with one thread they would only sleep,
  // but `--threads 1` means one thread, so they are ended (OpenBLAS's own fork handler).
  if (auto shutdown = reinterpret_cast<ShutdownFn>(dlsym(RTLD_DEFAULT, "blas_thread_shutdown_")))
    shutdown();
  return true;
}

int process_threads() {
  DIR* d = opendir("/proc/self/task");
  if (!d) return -1;
  int n = 0;
  while (const dirent* e = readdir(d))
    if (e->d_name[0] != '.') ++n;
  closedir(d);
  return n;
}

ThreadPool::ThreadPool(int n_threads) {
  if (n_threads <= 0) n_threads = int(std::max(1u, std::thread::hardware_concurrency()));
  for (int i = 1; i < n_threads; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  stop_.store(true, std::memory_order_seq_cst);
  generation_.fetch_add(1, std::memory_order_seq_cst);
  wake_sleepers();
  for (auto& t : workers_) t.join();
}

void ThreadPool::wake_sleepers() {
  // Taking the mutex orders this after a sleeper's check of the generation: it is either
  // waiting (and notified) or has not checked yet (and sees the new generation).
  { std::lock_guard<std::mutex> lk(sleep_mu_); }
  sleep_cv_.notify_all();
}

int ThreadPool::run_chunks(uint32_t gen) {
  int ran = 0;
  uint64_t t = ticket_.load(std::memory_order_acquire);
  for (;;) {
    // The ticket names the job it belongs to: a worker late for job `gen` claims nothing of
    // the next one.
    // The ticket also holds the chunk count, so nothing but the ticket is read before a claim
    // succeeds; after one, the job cannot finish (nor its fields change) until this chunk is
    // done.
    if (uint32_t(t >> 32) != gen) return ran;
    const int c = int(t & 0xFFFF), chunks = int((t >> 16) & 0xFFFF);
    if (c >= chunks) return ran;
    if (!ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel,
                                       std::memory_order_acquire))
      continue;
    const int64_t b = int64_t(c) * job_chunk_;
    const int64_t e = std::min(job_n_, b + job_chunk_);
    if (b < e) (*fn_)(b, e);
    done_.fetch_add(1, std::memory_order_acq_rel);
    ++ran;
    t = ticket_.load(std::memory_order_acquire);
  }
}

void ThreadPool::worker_loop() {
  using clock = std::chrono::steady_clock;
  const auto spin_for = std::chrono::microseconds(kSpinMicros);
  t_inside_pool = true;
  // Generation 0 is the pool's start: a job published before this thread ran is still seen
  // as new (and its ticket tells whether any chunk is left).
  uint32_t seen = 0;
  for (;;) {
    // Wait for the next generation: spin, then sleep.
    uint32_t g = generation_.load(std::memory_order_acquire);
    auto t0 = clock::now();
    for (uint32_t spins = 1; g == seen; ++spins) {
      cpu_relax();
      if (spins % 256 == 0) {
        if (clock::now() - t0 > spin_for) {
          std::unique_lock<std::mutex> lk(sleep_mu_);
          sleepers_.fetch_add(1, std::memory_order_seq_cst);
          sleep_cv_.wait(lk, [&] { return generation_.load(std::memory_order_seq_cst) != seen; });
          sleepers_.fetch_sub(1, std::memory_order_seq_cst);
          t0 = clock::now();
        } else if (spins % 8192 == 0) {
          std::this_thread::yield();
        }
      }
      g = generation_.load(std::memory_order_acquire);
    }
    seen = g;
    if (stop_.load(std::memory_order_acquire)) return;
    run_chunks(g);
  }
}

void ThreadPool::parallel_for(int64_t n, int64_t grain,
                              const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  const int64_t max_chunks = std::max<int64_t>(1, n / grain);
  const int chunks =
      int(std::min<int64_t>(int64_t(size()) * kChunksPerThread, max_chunks));
  if (chunks <= 1 || t_inside_pool || workers_.empty()) {
    fn(0, n);
    return;
  }
  std::lock_guard<std::mutex> lk(call_mutex(this));
  fn_ = &fn;
  job_n_ = n;
  job_chunk_ = (n + chunks - 1) / chunks;
  job_chunks_ = int((n + job_chunk_ - 1) / job_chunk_);
  done_.store(0, std::memory_order_relaxed);
  const uint32_t gen = generation_.load(std::memory_order_relaxed) + 1;
  ticket_.store(uint64_t(gen) << 32 | uint64_t(job_chunks_) << 16, std::memory_order_release);
  generation_.store(gen, std::memory_order_seq_cst);  // publishes the job (release)
  if (sleepers_.load(std::memory_order_seq_cst) > 0) wake_sleepers();
  t_inside_pool = true;
  run_chunks(gen);
  t_inside_pool = false;
  for (uint32_t spins = 1; done_.load(std::memory_order_acquire) != job_chunks_; ++spins) {
    cpu_relax();
    if (spins % 1024 == 0) std::this_thread::yield();
  }
}

void ThreadPool::set_global_threads(int64_t n) {
  SPADE_CHECK(n >= 1 && n <= kMaxThreads, "--threads must be in [1, ", kMaxThreads, "], got ", n);
  g_requested_threads = int(n);
  blas_single_threaded();
}

ThreadPool& ThreadPool::global() {
  static std::unique_ptr<ThreadPool> pool = [] {
    blas_single_threaded();
    int n = g_requested_threads;
    if (n <= 0 && tuning().threads > 0) n = tuning().threads;
    return std::make_unique<ThreadPool>(n);
  }();
  return *pool;
}

}  // namespace spade
