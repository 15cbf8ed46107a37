// Counters of the serving engine (what `GET /metrics` shows): request and token counts,
// latency histograms (time to first token, time per output token, end to end, queueing),
// batch sizes, KV pages, and per sparse method the attended / dense-equivalent rows that
// give its density. Plain data: the scheduler updates it under its lock and hands out copies.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace spade {

// Prometheus-style histogram: counts[i] = observations <= bounds[i] (not cumulative here;
// the exporter accumulates), counts.back() = above the last bound.
struct Histogram {
  std::vector<double> bounds;
  std::vector<uint64_t> counts;
  double sum = 0;
  uint64_t count = 0;

  Histogram() = default;
  explicit Histogram(std::vector<double> b) : bounds(std::move(b)), counts(bounds.size() + 1, 0) {}
  void observe(double v) {
    size_t i = 0;
    while (i < bounds.size() && v > bounds[i]) ++i;
    ++counts[i];
    sum += v;
    ++count;
  }
};

struct MethodCounters {
  uint64_t requests = 0;       // requests finished with this method
  int64_t attended_rows = 0;   // (token, kv head) rows read by attention
  int64_t dense_rows = 0;      // rows full attention would have read
  double density() const { return dense_rows > 0 ? double(attended_rows) / double(dense_rows) : 1.0; }
};

struct EngineMetrics {
  // Requests by how they ended: stop, length, cancelled, error.
  uint64_t finished_stop = 0, finished_length = 0, finished_cancelled = 0, finished_error = 0;
  uint64_t submitted = 0;
  uint64_t rejected_queue_full = 0, rejected_shutdown = 0;
  uint64_t prompt_tokens = 0;       // prompt tokens prefilled (first admission only)
  uint64_t generation_tokens = 0;   // tokens sampled
  uint64_t recomputed_tokens = 0;   // tokens prefilled again after a preemption
  uint64_t steps = 0;               // forward calls
  uint64_t preemptions = 0;
  double busy_seconds = 0;          // time spent in steps: planning, forward, sampling, output
  double forward_seconds = 0;       // ... of which waiting on the runner's forward (device sampling
                                    //     included; not the delivery overlapped with it)
  double sample_seconds = 0;        // ... of which sampling on the host, logprobs, text and stop
                                    //     strings (the overlapped delivery too)
  uint64_t device_sampled_steps = 0;  // steps whose tokens were sampled by the runner (GPU)
  // The runner's steps by how they ran (StepModel::step_counters; 0 for the CPU runner).
  uint64_t graph_replays = 0, graph_captures = 0, graph_updates = 0, graph_instantiations = 0,
           eager_steps = 0;
  // ... and their time (StepModel::StepCounters): host launching by path, device by path.
  double eager_host_seconds = 0, capture_host_seconds = 0, replay_host_seconds = 0;
  double eager_device_seconds = 0, graph_device_seconds = 0;
  uint64_t overlapped_steps = 0;
  uint64_t cache_corrections = 0;  // correction chunks run (EngineRequest::correction_every)  // device steps that delivered the previous step's tokens meanwhile

  int64_t running = 0, waiting = 0;
  int64_t kv_pages_used = 0, kv_pages_total = 0;
  int64_t max_batch = 0;

  Histogram ttft{{0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}};
  Histogram tpot{{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5}};
  Histogram e2e{{0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300}};
  Histogram queue_time{{0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30}};
  Histogram batch_size{{1, 2, 4, 8, 16, 32, 64, 128, 256}};
  Histogram step_tokens{{1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096}};

  std::map<std::string, MethodCounters> methods;
};

}  // namespace spade
