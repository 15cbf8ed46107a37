#include "server/metrics_text.h"

#include <cstdio>

namespace spade::server {

namespace {

std::string num(double v) {
  char b[64];
  std::snprintf(b, sizeof b, "%.10g", v);
  return b;
}

// Label values: escape backslash, quote and newline.
std::string esc(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '\\' || c == '"') o += '\\';
    if (c == '\n') {
      o += "\\n";
      continue;
    }
    o += c;
  }
  return o;
}

struct Out {
  std::string s;
  void head(const char* name, const char* type, const char* help) {
    s += "# HELP ";
    s += name;
    s += ' ';
    s += help;
    s += "\n# TYPE ";
    s += name;
    s += ' ';
    s += type;
    s += '\n';
  }
  void sample(const std::string& name, const std::string& labels, double v) {
    s += name;
    if (!labels.empty()) s += "{" + labels + "}";
    s += ' ';
    s += num(v);
    s += '\n';
  }
  void metric(const char* name, const char* type, const char* help, double v) {
    head(name, type, help);
    sample(name, "", v);
  }
  void histogram(const char* name, const char* help, const Histogram& h) {
    head(name, "histogram", help);
    uint64_t cum = 0;
    for (size_t i = 0; i < h.bounds.size(); ++i) {
      cum += h.counts[i];
      sample(std::string(name) + "_bucket", "le=\"" + num(h.bounds[i]) + "\"", double(cum));
    }
    cum += h.counts.empty() ? 0 : h.counts.back();
    sample(std::string(name) + "_bucket", "le=\"+Inf\"", double(cum));
    sample(std::string(name) + "_sum", "", h.sum);
    sample(std::string(name) + "_count", "", double(h.count));
  }
};

}  // namespace

std::string prometheus_text(const EngineMetrics& m, const HttpCounts& http,
                            const std::string& model_id) {
  Out o;
  o.head("spade_model_info", "gauge", "The served model.");
  o.sample("spade_model_info", "model=\"" + esc(model_id) + "\"", 1);

  o.head("spade_http_requests_total", "counter", "HTTP requests answered, by route and status code.");
  for (const auto& [key, n] : http)
    o.sample("spade_http_requests_total",
             "route=\"" + esc(key.first) + "\",code=\"" + std::to_string(key.second) + "\"", double(n));

  o.metric("spade_requests_submitted_total", "counter", "Generation requests accepted into the queue.", double(m.submitted));
  o.head("spade_requests_finished_total", "counter", "Generation requests finished, by reason.");
  o.sample("spade_requests_finished_total", "reason=\"stop\"", double(m.finished_stop));
  o.sample("spade_requests_finished_total", "reason=\"length\"", double(m.finished_length));
  o.sample("spade_requests_finished_total", "reason=\"cancelled\"", double(m.finished_cancelled));
  o.sample("spade_requests_finished_total", "reason=\"error\"", double(m.finished_error));
  o.head("spade_requests_rejected_total", "counter", "Generation requests refused at admission, by reason.");
  o.sample("spade_requests_rejected_total", "reason=\"queue_full\"", double(m.rejected_queue_full));
  o.sample("spade_requests_rejected_total", "reason=\"shutdown\"", double(m.rejected_shutdown));

  o.metric("spade_prompt_tokens_total", "counter", "Prompt tokens prefilled.", double(m.prompt_tokens));
  o.metric("spade_generation_tokens_total", "counter", "Tokens generated.", double(m.generation_tokens));
  o.metric("spade_recomputed_tokens_total", "counter", "Tokens prefilled again after a preemption.", double(m.recomputed_tokens));
  o.metric("spade_engine_steps_total", "counter", "Forward passes of the engine loop.", double(m.steps));
  o.metric("spade_preemptions_total", "counter", "Sequences preempted (pages released, recomputed later).", double(m.preemptions));
  o.metric("spade_engine_busy_seconds_total", "counter", "Seconds the engine spent in steps.", m.busy_seconds);
  o.metric("spade_engine_forward_seconds_total", "counter",
           "Seconds of those in the model runner's forward pass.", m.forward_seconds);
  o.metric("spade_engine_sample_seconds_total", "counter",
           "Seconds of those in host sampling, logprobs, detokenization and stop strings.",
           m.sample_seconds);
  o.metric("spade_engine_device_sampled_steps_total", "counter",
           "Steps whose tokens the runner sampled on the device.", double(m.device_sampled_steps));
  o.metric("spade_engine_overlapped_steps_total", "counter",
           "Device steps during which the previous step's tokens were delivered.",
           double(m.overlapped_steps));
  o.metric("spade_engine_cache_corrections_total", "counter",
           "Cache corrections run: decoded tokens fed again with dense attention (the method's "
           "correction option).", double(m.cache_corrections));
  o.head("spade_engine_runner_steps_total", "counter",
         "The runner's steps by how they ran: CUDA graph replays, captures (then updated in place or "
         "instantiated), and eager launches.");
  o.sample("spade_engine_runner_steps_total", "how=\"graph_replay\"", double(m.graph_replays));
  o.sample("spade_engine_runner_steps_total", "how=\"eager\"", double(m.eager_steps));
  o.metric("spade_engine_graph_captures_total", "counter",
           "CUDA graphs captured for a new step shape.", double(m.graph_captures));
  o.metric("spade_engine_graph_updates_total", "counter",
           "Captured graphs applied to an instantiated graph of the same topology.", double(m.graph_updates));
  o.head("spade_engine_runner_host_seconds_total", "counter",
         "Host seconds the runner spent launching steps: eager launches, captures (with a first "
         "use's eager warm-up, the update or instantiation, and the replay), and replays alone.");
  o.sample("spade_engine_runner_host_seconds_total", "how=\"eager\"", m.eager_host_seconds);
  o.sample("spade_engine_runner_host_seconds_total", "how=\"capture\"", m.capture_host_seconds);
  o.sample("spade_engine_runner_host_seconds_total", "how=\"graph_replay\"", m.replay_host_seconds);
  o.head("spade_engine_runner_device_seconds_total", "counter",
         "Device seconds of the runner's steps (CUDA events around each), eager and graph; a graph "
         "step that captured includes the host's capture time, which the device waits for.");
  o.sample("spade_engine_runner_device_seconds_total", "how=\"eager\"", m.eager_device_seconds);
  o.sample("spade_engine_runner_device_seconds_total", "how=\"graph\"", m.graph_device_seconds);

  o.metric("spade_requests_running", "gauge", "Sequences in the running batch.", double(m.running));
  o.metric("spade_requests_waiting", "gauge", "Requests waiting for admission.", double(m.waiting));
  o.metric("spade_max_batch", "gauge", "Largest running batch allowed.", double(m.max_batch));
  o.metric("spade_kv_pages_used", "gauge", "KV cache pages in use.", double(m.kv_pages_used));
  o.metric("spade_kv_pages_total", "gauge", "KV cache pages in the pool.", double(m.kv_pages_total));
  o.metric("spade_kv_usage_ratio", "gauge", "Fraction of KV pages in use.",
           m.kv_pages_total ? double(m.kv_pages_used) / double(m.kv_pages_total) : 0.0);

  o.histogram("spade_time_to_first_token_seconds", "Seconds from request arrival to its first token.", m.ttft);
  o.histogram("spade_time_per_output_token_seconds", "Mean seconds between output tokens, per request.", m.tpot);
  o.histogram("spade_request_latency_seconds", "Seconds from arrival to the last token, per finished request.", m.e2e);
  o.histogram("spade_queue_time_seconds", "Seconds from arrival to admission into the batch.", m.queue_time);
  o.histogram("spade_batch_size", "Sequences per engine step.", m.batch_size);
  o.histogram("spade_step_tokens", "Tokens (prefill + decode) per engine step.", m.step_tokens);

  o.head("spade_sparse_requests_total", "counter", "Finished requests by sparse method.");
  for (const auto& [name, c] : m.methods)
    o.sample("spade_sparse_requests_total", "method=\"" + esc(name) + "\"", double(c.requests));
  o.head("spade_sparse_attended_rows_total", "counter",
         "Decode K/V rows (layer x KV head x token) read by attention, by sparse method.");
  for (const auto& [name, c] : m.methods)
    o.sample("spade_sparse_attended_rows_total", "method=\"" + esc(name) + "\"", double(c.attended_rows));
  o.head("spade_sparse_dense_rows_total", "counter",
         "Decode K/V rows full attention would have read, by sparse method.");
  for (const auto& [name, c] : m.methods)
    o.sample("spade_sparse_dense_rows_total", "method=\"" + esc(name) + "\"", double(c.dense_rows));
  o.head("spade_sparse_density", "gauge", "Attended / dense decode rows, by sparse method.");
  for (const auto& [name, c] : m.methods)
    o.sample("spade_sparse_density", "method=\"" + esc(name) + "\"", c.density());
  return o.s;
}

}  // namespace spade::server
