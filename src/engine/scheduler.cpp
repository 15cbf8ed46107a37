#include "engine/scheduler.h"

#include <algorithm>
#include <cmath>

#include "core/thread_pool.h"

namespace spade {

using clock_type = std::chrono::steady_clock;

static double seconds(clock_type::duration d) { return std::chrono::duration<double>(d).count(); }

struct Scheduler::Seq {
  Seq(EngineRequest&& r, std::shared_ptr<RequestChannel> c, std::unique_ptr<TextStream> t)
      : ch(std::move(c)), req(std::move(r)), sampler(req.sampling), text(std::move(t)) {}

  std::shared_ptr<RequestChannel> ch;
  EngineRequest req;
  Sampler sampler;
  std::unique_ptr<TextStream> text;
  std::vector<int32_t> tokens;  // prompt + generated; the cache holds tokens[0, pt.length)
  int64_t n_prompt = 0;
  int64_t generated = 0;
  PageTable pt;
  std::unique_ptr<SeqAttention> attn;
  // attn's function behind a guard: a method that throws fails this request only (error),
  // and its remaining layers of the step write zeros that nobody samples from.
  AttentionFn guarded;
  std::string error;
  std::unique_ptr<sparse::MethodState> dev_state;  // the runner's method state (GPU methods)
  std::string held;             // text not yet emitted: might be the start of a stop string
  uint64_t order = 0;           // admission priority (submission order)
  bool admitted_once = false;
  bool prompt_counted = false;
  int64_t dense_rows = 0;       // decode rows full attention would read
  int64_t attended_rows = 0;    // ... and what the method read (finished attention objects)
  bool rows_counted = false;    // attended_rows counted by a method (CPU session or runner state)
  int64_t emitted = 0;          // tokens handed to the consumer (generated, once delivered)
  int64_t since_correction = 0; // decode tokens fed since the last cache correction
  int64_t correcting = 0;       // tokens of a cache-correction chunk still to feed (dense)
  FinishReason ending = FinishReason::None;  // its last accepted token ends it: no more steps
  bool in_flight = false;       // in the device step now running (overlapped output)
  bool stop_hit = false;        // ... and a stop string ended it meanwhile: finish after the step
  clock_type::time_point t_first{}, t_last{};
  int64_t plp_next = 1;                // prompt logprobs: next prompt position to score
  std::vector<TokenLogprob> plp;       // ... scored so far (emitted when the prompt is done)
};

// Log-softmax of `logits` at `tok`, the rank of `tok` (1 + ids with a larger logit) and the
// `k` best ids, best first (ties: lower id first).
static void score_token(const float* logits, int32_t V, int32_t tok, int k, TokenLogprob& lp) {
  float mx = logits[0];
  for (int32_t i = 1; i < V; ++i) mx = std::max(mx, logits[i]);
  double sum = 0;
  for (int32_t i = 0; i < V; ++i) sum += std::exp(double(logits[i] - mx));
  const float lse = mx + float(std::log(sum));
  lp.id = tok;
  lp.logprob = logits[tok] - lse;
  lp.rank = 1;
  for (int32_t i = 0; i < V; ++i) lp.rank += logits[i] > logits[tok];
  lp.top.clear();
  const size_t n = size_t(std::min(k, V));
  if (n == 0) return;
  thread_local std::vector<std::pair<float, int32_t>> top;  // requests score in parallel
  top.clear();
  auto worse = [](const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  for (int32_t i = 0; i < V; ++i) {
    if (top.size() < n) {
      top.push_back({logits[i], i});
      std::push_heap(top.begin(), top.end(), worse);
    } else if (logits[i] > top.front().first) {
      std::pop_heap(top.begin(), top.end(), worse);
      top.back() = {logits[i], i};
      std::push_heap(top.begin(), top.end(), worse);
    }
  }
  std::sort_heap(top.begin(), top.end(), worse);
  for (const auto& [l, id] : top) lp.top.push_back({id, l - lse});
}

Scheduler::Scheduler(CpuModel& model, const TokenText& text, const SchedulerOptions& opt)
    : Scheduler(std::make_unique<CpuStepModel>(model), nullptr, text, opt) {}

Scheduler::Scheduler(StepModel& model, const TokenText& text, const SchedulerOptions& opt)
    : Scheduler(nullptr, &model, text, opt) {}

Scheduler::Scheduler(std::unique_ptr<StepModel> owned, StepModel* model, const TokenText& text,
                     const SchedulerOptions& opt)
    : owned_(std::move(owned)), model_(model ? *model : *owned_), text_(text), opt_(opt) {
  SPADE_CHECK(opt_.max_batch >= 1, "max batch must be >= 1");
  SPADE_CHECK(opt_.max_queue >= 1, "max queue must be >= 1");
  opt_.max_step_tokens = std::max<int64_t>(opt_.max_step_tokens, opt_.max_batch);
  page_size_ = model_.page_size();
  max_context_ = std::min<int64_t>(model_.config().max_context, model_.total_pages() * page_size_);
  if (opt_.max_context > 0) max_context_ = std::min(max_context_, opt_.max_context);
  metrics_.kv_pages_total = model_.total_pages();
  metrics_.max_batch = opt_.max_batch;
  thread_ = std::thread([this] { loop(); });
}

Scheduler::~Scheduler() { shutdown(); }

std::shared_ptr<RequestChannel> Scheduler::submit(EngineRequest req) {
  const int64_t P = int64_t(req.prompt.size());
  if (P == 0) throw SubmitError(400, "invalid_prompt", "the prompt is empty (no tokens)");
  if (req.attention && !model_.supports_attention_callbacks())
    throw SubmitError(400, "unsupported_sparse_method",
                      cat("sparse methods run on the CPU backend; this server runs on ", model_.device(),
                          " with full attention"));
  if (req.device_method && !model_.runs_methods())
    throw SubmitError(400, "unsupported_sparse_method",
                      cat("this server's runner (", model_.device(), ") runs no per-request methods itself"));
  if (req.max_tokens < 0)
    throw SubmitError(400, "invalid_value", cat("max_tokens must be at least 0, got ", req.max_tokens));
  const int32_t vocab = model_.config().vocab;
  for (int32_t t : req.prompt)
    if (t < 0 || t >= vocab)
      throw SubmitError(400, "invalid_prompt",
                        cat("token id ", t, " is outside the vocabulary [0, ", vocab, ")"));
  if (P + req.max_tokens > max_context_) {
    if (P >= max_context_)
      throw SubmitError(400, "context_length_exceeded",
                        cat("This model's maximum context length is ", max_context_,
                            " tokens. However, your prompt has ", P,
                            " tokens, leaving no room for a completion. Please reduce the "
                            "length of the prompt."));
    throw SubmitError(400, "context_length_exceeded",
                      cat("This model's maximum context length is ", max_context_,
                          " tokens. However, you requested ", P + req.max_tokens, " tokens (",
                          P, " in the prompt, ", req.max_tokens,
                          " for the completion). Please reduce the length of the prompt or "
                          "completion."));
  }
  auto ch = std::make_shared<RequestChannel>();
  const int32_t last = req.prompt.back();
  auto s = std::make_unique<Seq>(std::move(req), ch, text_.stream(last));
  s->n_prompt = P;
  s->tokens.reserve(size_t(P + s->req.max_tokens));
  s->tokens.assign(s->req.prompt.begin(), s->req.prompt.end());
  s->req.prompt.clear();
  s->req.prompt.shrink_to_fit();
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!accepting_ || stop_) {
      ++metrics_.rejected_shutdown;
      throw SubmitError(503, "server_shutting_down", "the server is shutting down");
    }
    if (int64_t(waiting_.size()) >= opt_.max_queue) {
      ++metrics_.rejected_queue_full;
      throw SubmitError(429, "queue_full",
                        cat("the server is busy: ", n_running_, " requests running and ",
                            waiting_.size(), " queued (the limit); retry later"));
    }
    s->order = next_order_++;
    ++metrics_.submitted;
    waiting_.push_back(std::move(s));
    metrics_.waiting = int64_t(waiting_.size());
  }
  cv_.notify_all();
  return ch;
}

void Scheduler::stop_accepting() {
  std::lock_guard<std::mutex> lk(mu_);
  accepting_ = false;
}

bool Scheduler::wait_idle(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lk(mu_);
  return idle_cv_.wait_for(lk, timeout, [&] { return waiting_.empty() && n_running_ == 0; });
}

void Scheduler::shutdown() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    accepting_ = false;
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

EngineMetrics Scheduler::metrics() const {
  const StepModel::StepCounters c = model_.step_counters();
  std::lock_guard<std::mutex> lk(mu_);
  EngineMetrics m = metrics_;
  m.graph_replays = c.replays;
  m.graph_captures = c.captures;
  m.graph_updates = c.updates;
  m.graph_instantiations = c.instantiations;
  m.eager_steps = c.eager;
  m.eager_host_seconds = c.eager_host_s, m.capture_host_seconds = c.capture_host_s;
  m.replay_host_seconds = c.replay_host_s;
  m.eager_device_seconds = c.eager_device_s, m.graph_device_seconds = c.graph_device_s;
  return m;
}

void Scheduler::finish(Seq& s, FinishReason r, const std::string& error) {
  if (!s.pt.pages.empty() || s.pt.length) {
    model_.release(s.pt);
    hold_admission_ = false;  // pages came back: admission may resume after a preemption
  }
  count_rows(s);
  s.dev_state.reset();
  s.attn.reset();
  const auto now = clock_type::now();
  const int64_t attended = s.rows_counted ? s.attended_rows : s.dense_rows;  // dense: all rows
  {
    // Metrics first, so that whoever sees the request end also sees it counted.
    std::lock_guard<std::mutex> lk(mu_);
    switch (r) {
      case FinishReason::Stop: ++metrics_.finished_stop; break;
      case FinishReason::Length: ++metrics_.finished_length; break;
      case FinishReason::Cancelled: ++metrics_.finished_cancelled; break;
      default: ++metrics_.finished_error; break;
    }
    if (r == FinishReason::Stop || r == FinishReason::Length) {
      metrics_.e2e.observe(seconds(now - s.ch->created));
      if (s.generated > 1) metrics_.tpot.observe(seconds(s.t_last - s.t_first) / double(s.generated - 1));
      MethodCounters& m = metrics_.methods[s.req.method];
      ++m.requests;
      m.dense_rows += s.dense_rows;
      m.attended_rows += attended;
    }
    metrics_.kv_pages_used = model_.used_pages();
  }
  s.ch->finish(r, s.n_prompt, s.generated, error,
               s.dense_rows > 0 ? double(attended) / double(s.dense_rows) : -1.0);
}

void Scheduler::count_rows(Seq& s) {
  // What the request's method read, before its state goes (finish, preemption).
  const int64_t a = s.attn ? s.attn->attended() : s.dev_state ? s.dev_state->attended_rows() : -1;
  if (a >= 0) {
    s.attended_rows += a;
    s.rows_counted = true;
  }
}

void Scheduler::preempt(std::vector<std::unique_ptr<Seq>>& running, size_t index) {
  std::unique_ptr<Seq> s = std::move(running[index]);
  running.erase(running.begin() + long(index));
  const int64_t lost = s->pt.length;
  // Admit nothing until a running request finishes: readmitting now would only recompute
  // this sequence and preempt it again at the next page boundary.
  hold_admission_ = true;
  model_.release(s->pt);
  count_rows(*s);
  s->dev_state.reset();  // recomputed from scratch on readmission, like the cache
  s->correcting = 0;     // ... with dense attention: nothing left to correct
  s->since_correction = 0;
  s->attn.reset();
  std::lock_guard<std::mutex> lk(mu_);
  ++metrics_.preemptions;
  metrics_.recomputed_tokens += uint64_t(lost);
  --n_running_;
  // Back to the head of the queue, ahead of requests submitted after it.
  auto it = std::find_if(waiting_.begin(), waiting_.end(),
                         [&](const std::unique_ptr<Seq>& w) { return w->order > s->order; });
  waiting_.insert(it, std::move(s));
}

static int64_t pages_for(int64_t tokens, int page) { return (tokens + page - 1) / page; }

bool Scheduler::admit_one(std::vector<std::unique_ptr<Seq>>& running) {
  // Pages the running sequences still need for their current input plus one decode token.
  int64_t committed = 0;
  for (const auto& r : running)
    committed += std::max<int64_t>(
        0, pages_for(int64_t(r->tokens.size()) + 1, page_size_) - int64_t(r->pt.pages.size()));
  std::unique_ptr<Seq> s;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (waiting_.empty()) return false;
    const Seq& w = *waiting_.front();
    const int64_t need = pages_for(int64_t(w.tokens.size()) + 1, page_size_);
    if (!running.empty() && (hold_admission_ || committed + need > model_.free_pages())) return false;
    s = std::move(waiting_.front());
    waiting_.pop_front();
    ++n_running_;
    if (!s->admitted_once) metrics_.queue_time.observe(seconds(clock_type::now() - s->ch->created));
  }
  s->admitted_once = true;
  s->error.clear();
  try {
    if (s->req.attention) {
      s->attn = s->req.attention();
      Seq* sp = s.get();
      const int64_t width = int64_t(model_.config().n_heads) * model_.config().head_dim;
      s->guarded = [sp, width](int layer, const PageTable& pt, const float* q, int64_t p0,
                               int64_t T, float* out) {
        if (sp->error.empty()) {
          try {
            (*sp->attn->fn())(layer, pt, q, p0, T, out);
            return;
          } catch (const std::exception& e) {
            sp->error = e.what();
          }
        }
        std::fill(out, out + T * width, 0.f);
      };
    }
    s->dev_state = model_.new_request_state(s->req.device_method.get());
  } catch (const std::exception& e) {
    finish(*s, FinishReason::Error, cat("sparse method: ", e.what()));
    std::lock_guard<std::mutex> lk(mu_);
    --n_running_;
    return true;
  }
  // Keep `running` in priority (submission) order: preemption takes from the back.
  auto it = std::find_if(running.begin(), running.end(),
                         [&](const std::unique_ptr<Seq>& r) { return r->order > s->order; });
  running.insert(it, std::move(s));
  return true;
}

void Scheduler::loop() {
  std::vector<std::unique_ptr<Seq>> running;
  std::vector<std::unique_ptr<Seq>> dropped;
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !waiting_.empty() || !running.empty(); });
      if (stop_) break;
      for (auto it = waiting_.begin(); it != waiting_.end();) {
        if ((*it)->ch->cancelled()) {
          dropped.push_back(std::move(*it));
          it = waiting_.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (auto& s : dropped) finish(*s, FinishReason::Cancelled);
    dropped.clear();
    if (!pending_.empty() &&
        std::any_of(running.begin(), running.end(),
                    [](const std::unique_ptr<Seq>& r) { return r->ch->cancelled(); }))
      flush_pending(running, false);  // what was sampled before the cancel reaches the client
    for (size_t i = 0; i < running.size();) {
      if (running[i]->ch->cancelled()) {
        finish(*running[i], FinishReason::Cancelled);
        running.erase(running.begin() + long(i));
        std::lock_guard<std::mutex> lk(mu_);
        --n_running_;
      } else {
        ++i;
      }
    }
    while (int64_t(running.size()) < opt_.max_batch && admit_one(running)) {
    }
    if (!running.empty()) step(running);
    publish_gauges(running);
  }
  // Shutdown: deliver what was sampled, cancel whatever is left.
  flush_pending(running, false);
  for (auto& s : running) finish(*s, FinishReason::Cancelled, "the server is shutting down");
  running.clear();
  std::deque<std::unique_ptr<Seq>> rest;
  {
    std::lock_guard<std::mutex> lk(mu_);
    rest.swap(waiting_);
  }
  for (auto& s : rest) finish(*s, FinishReason::Cancelled, "the server is shutting down");
  publish_gauges(running);
}

void Scheduler::publish_gauges(const std::vector<std::unique_ptr<Seq>>& running) {
  bool idle;
  {
    std::lock_guard<std::mutex> lk(mu_);
    n_running_ = int64_t(running.size());
    metrics_.running = n_running_;
    metrics_.waiting = int64_t(waiting_.size());
    metrics_.kv_pages_used = model_.used_pages();
    idle = running.empty() && waiting_.empty();
  }
  if (idle) idle_cv_.notify_all();
}

// Whether a request's next step may sample on the device: no host logits needed.
static bool device_samplable(const EngineRequest& q, bool scoring) {
  return q.logprobs < 0 && q.sampling.repetition_penalty == 1.f && !scoring;
}

void Scheduler::step(std::vector<std::unique_ptr<Seq>>& running) {
  const auto t0 = clock_type::now();
  const ModelConfig& cfg = model_.config();
  // A step with host logits delivers in order and at once: deliver what is pending first.
  if (!pending_.empty()) {
    bool overlap = model_.samples_on_device();
    for (const auto& r : running)
      overlap = overlap && (r->ending != FinishReason::None ||
                            device_samplable(r->req, r->req.prompt_logprobs >= 0 && r->plp_next < r->n_prompt));
    if (!overlap) flush_pending(running, true);
  }
  // Cache correction: a request whose method asks for it, after every N decode tokens, goes
  // back N positions and feeds those tokens again as one chunk with dense attention (its
  // pages hold them; their K/V are overwritten), then decodes on.
  for (auto& r : running) {
    const int64_t N = r->req.correction_every;
    if (N <= 0 || r->correcting > 0 || r->since_correction < N || r->ending != FinishReason::None)
      continue;
    if (int64_t(r->tokens.size()) - r->pt.length != 1 || r->pt.length - N < r->n_prompt) continue;
    r->pt.length -= N;
    r->correcting = N;
    r->since_correction = 0;
  }
  // Plan: decode tokens first (one per sequence whose input is all cached but its last
  // sampled token), then prefill chunks in priority order with the rest of the budget.
  // If the pool cannot hold the plan, preempt the lowest-priority sequence and re-plan.
  int only_pass = -1;  // isolate_prefill: pass 0 = decode rows only, 1 = one prefill chunk
  for (;;) {
    batch_.clear();
    batch_seqs_.clear();
    int64_t budget = opt_.max_step_tokens, pages_needed = 0;
    if (opt_.isolate_prefill) {
      bool any_decode = false, any_prefill = false;
      for (const auto& r : running) {
        if (r->ending != FinishReason::None) continue;
        const int64_t feed = int64_t(r->tokens.size()) - r->pt.length;
        const bool decoding = feed == 1 && r->pt.length >= r->n_prompt;
        any_decode = any_decode || decoding;
        any_prefill = any_prefill || (feed > 0 && !decoding);
      }
      only_pass = any_decode && (!any_prefill || !last_step_decoded_) ? 0 : 1;
    }
    bool prefill_taken = false;
    // Rows beyond one per sequence that prompt-scoring chunks may take.
    int64_t spare_rows = opt_.max_logit_rows > 0 ? opt_.max_logit_rows - int64_t(running.size()) : budget;
    for (int pass = 0; pass < 2; ++pass) {
      for (auto& r : running) {
        if (r->ending != FinishReason::None) continue;  // its last token ends it
        const int64_t feed = int64_t(r->tokens.size()) - r->pt.length;
        const bool decoding = feed == 1 && r->pt.length >= r->n_prompt;
        if ((pass == 0) != decoding || budget <= 0 || feed <= 0) continue;
        if (only_pass >= 0 && (pass != only_pass || (pass == 1 && prefill_taken))) continue;
        prefill_taken = pass == 1;
        const bool scoring = r->req.prompt_logprobs >= 0 && r->plp_next < r->n_prompt;
        const int64_t n = std::min({feed, budget, scoring ? 1 + std::max<int64_t>(0, spare_rows) : feed,
                                    r->correcting > 0 ? r->correcting : feed});
        if (scoring) spare_rows -= n - 1;
        budget -= n;
        SeqInput in;
        in.pages = &r->pt;
        in.tokens = r->tokens.data() + r->pt.length;
        in.n_tokens = n;
        in.attention = r->attn && r->correcting == 0 ? &r->guarded : nullptr;  // correction: dense
        in.dense = r->correcting > 0;  // also on the GPU, where a one-token piece looks like a decode row
        in.device_state = r->dev_state.get();
        in.all_logits = scoring;
        batch_.push_back(in);
        batch_seqs_.push_back(r.get());
        pages_needed += std::max<int64_t>(
            0, pages_for(r->pt.length + n, page_size_) - int64_t(r->pt.pages.size()));
      }
    }
    if (pages_needed <= model_.free_pages() || running.size() <= 1) break;
    if (!pending_.empty()) {  // requests that end with their pending token give pages back
      flush_pending(running, true);
      continue;
    }
    preempt(running, running.size() - 1);
  }
  if (!batch_.empty()) last_step_decoded_ = only_pass == 0;
  if (batch_.empty()) {  // every running request ends with its pending token
    flush_pending(running, true);
    std::lock_guard<std::mutex> lk(mu_);
    metrics_.busy_seconds += seconds(clock_type::now() - t0);  // holds the flush's sample time
    return;
  }
  for (size_t i = 0; i < batch_.size(); ++i) {
    Seq* s = batch_seqs_[i];
    if (s->correcting > 0) continue;  // tokens its method has seen already
    try {
      if (s->attn) s->attn->on_tokens(batch_[i].tokens, batch_[i].n_tokens, text_);
      if (s->dev_state && s->dev_state->wants_token_text())
        for (int64_t j = 0; j < batch_[i].n_tokens; ++j)
          s->dev_state->append_token_text(text_.piece(batch_[i].tokens[j]));
    } catch (const std::exception& e) {
      if (s->error.empty()) s->error = e.what();
    }
  }

  // Device sampling when the runner has it and no request of the step needs host logits.
  bool on_device = model_.samples_on_device();
  for (size_t i = 0; i < batch_.size() && on_device; ++i)
    on_device = device_samplable(batch_seqs_[i]->req, batch_[i].all_logits);
  const std::vector<float>* logits = nullptr;
  const std::vector<int32_t>* tokens = nullptr;
  const auto t_fwd = clock_type::now();
  double deliver_s = 0;
  bool overlapped = false;
  try {
    if (on_device) {
      rows_.resize(batch_.size());
      for (size_t i = 0; i < batch_.size(); ++i) {
        Seq& s = *batch_seqs_[i];
        const SamplingParams& p = s.req.sampling;
        rows_[i] = {p.temperature, p.top_k, p.top_p, p.min_p, p.seed, uint64_t(s.generated)};
        s.in_flight = true;
      }
      model_.forward_sample_launch(batch_, rows_);
      // The previous step's tokens reach their consumers while this step runs.
      if (!pending_.empty()) {
        const auto td = clock_type::now();
        overlapped = true;
        deliver_pending();
        deliver_s = seconds(clock_type::now() - td);
      }
      tokens = &model_.forward_sample_wait();
    } else {
      logits = &model_.forward(batch_, row_of_);
    }
  } catch (const std::exception& e) {
    if (!pending_.empty()) deliver_pending();
    const std::string msg = cat("engine error: ", e.what());
    for (Seq* s : batch_seqs_) {
      s->in_flight = false;
      if (!s->ch->finished()) finish(*s, s->stop_hit ? FinishReason::Stop : FinishReason::Error, msg);
    }
    running.erase(std::remove_if(running.begin(), running.end(),
                                 [](const std::unique_ptr<Seq>& r) { return r->ch->finished(); }),
                  running.end());
    std::lock_guard<std::mutex> lk(mu_);
    metrics_.busy_seconds += seconds(clock_type::now() - t0);
    return;
  }
  const auto t_sample = clock_type::now();
  int64_t step_tokens = 0, sampled = 0, n_corrections = 0;
  const int64_t rows_per_pos = int64_t(cfg.n_layers) * cfg.n_kv_heads;
  for (size_t i = 0; i < batch_seqs_.size(); ++i) {
    Seq& s = *batch_seqs_[i];
    s.in_flight = false;
    step_tokens += batch_[i].n_tokens;
    if (s.correcting > 0) {  // a cache-correction chunk: nothing to sample
      s.correcting -= batch_[i].n_tokens;
      if (s.correcting == 0) ++n_corrections;
    } else if (batch_[i].n_tokens == 1 && s.pt.length > s.n_prompt) {
      ++s.since_correction;
    }
    if (s.ch->finished()) continue;  // ended while the step ran (defensive: none do today)
    if (s.stop_hit) {  // a stop string ended it during the step: this token is dropped
      finish(s, FinishReason::Stop);
      continue;
    }
    if (!s.error.empty()) {
      // Its own method failed: this request ends with that error (its pages go back); the
      // other sequences of the step are unaffected.
      finish(s, FinishReason::Error, cat("sparse method '", s.req.method, "': ", s.error));
      continue;
    }
    if (!s.prompt_counted && s.pt.length >= s.n_prompt) {
      s.prompt_counted = true;
      std::lock_guard<std::mutex> lk(mu_);
      metrics_.prompt_tokens += uint64_t(s.n_prompt);
    }
    if (batch_[i].n_tokens == 1) s.dense_rows += rows_per_pos * s.pt.length;
    if (batch_[i].all_logits && logits) {
      // Prompt logprobs: row j of the chunk at p0 scores the token at p0 + j + 1.
      const int64_t p0 = batch_[i].tokens - s.tokens.data();
      const int64_t q0 = std::max(s.plp_next, p0 + 1);
      const int64_t end = std::min(s.n_prompt, p0 + batch_[i].n_tokens + 1);
      if (q0 < end) {
        const size_t at = s.plp.size();
        s.plp.resize(at + size_t(end - q0));
        ThreadPool::global().parallel_for(end - q0, 16, [&](int64_t a, int64_t b) {
          for (int64_t j = a; j < b; ++j)
            score_token(logits->data() + (row_of_[i] + q0 + j - p0 - 1) * cfg.vocab, cfg.vocab,
                        s.tokens[size_t(q0 + j)], s.req.prompt_logprobs, s.plp[at + size_t(j)]);
        });
        s.plp_next = end;
      }
      if (s.plp_next >= s.n_prompt && !s.plp.empty()) {
        s.ch->emit_prompt_logprobs(std::move(s.plp));
        s.plp.clear();
      }
    }
    if (s.pt.length < int64_t(s.tokens.size())) continue;  // prefill continues next step
    if (s.req.max_tokens == 0) {  // prefill only (prompt scoring): nothing to sample
      finish(s, FinishReason::Length);
      continue;
    }
    if (tokens) {  // accepted now (the next step feeds it), delivered during the next step
      const int32_t tok = (*tokens)[i];
      s.ending = accept(s, tok);
      pending_.push_back({&s, tok});
      ++sampled;
    } else {
      deliver_.push_back(i);
    }
  }
  // Host logits: each request's token (host sampling, detokenization, stop strings, logprobs,
  // the hand-off to its consumer) is independent per request, so a large batch spreads them
  // over the thread pool; finishing (pages back to the pool) stays on this thread.
  if (!deliver_.empty()) {
    sampled = int64_t(deliver_.size());
    finish_.assign(deliver_.size(), FinishReason::None);
    auto deliver = [&](int64_t a, int64_t b) {
      for (int64_t k = a; k < b; ++k) {
        const size_t i = deliver_[size_t(k)];
        Seq& s = *batch_seqs_[i];
        const int64_t last = batch_[i].all_logits ? batch_[i].n_tokens - 1 : 0;  // prompt logprobs
        const float* row = logits->data() + (row_of_[i] + last) * cfg.vocab;
        const int32_t tok = s.sampler.sample(row, cfg.vocab, s.tokens);
        finish_[size_t(k)] = on_token(s, tok, row);
      }
    };
    const auto td = clock_type::now();
    if (sampled >= kParallelDeliverRows)
      ThreadPool::global().parallel_for(sampled, kParallelDeliverRows / 2, deliver);
    else
      deliver(0, sampled);
    for (size_t k = 0; k < deliver_.size(); ++k)
      if (finish_[k] != FinishReason::None) finish(*batch_seqs_[deliver_[k]], finish_[k]);
    deliver_.clear();
    deliver_s += seconds(clock_type::now() - td);
  }
  // Finished sequences leave the batch (their pages were released in finish()).
  running.erase(std::remove_if(running.begin(), running.end(),
                               [](const std::unique_ptr<Seq>& r) { return r->ch->finished(); }),
                running.end());
  const auto t_end = clock_type::now();
  std::lock_guard<std::mutex> lk(mu_);
  ++metrics_.steps;
  metrics_.forward_seconds += seconds(t_sample - t_fwd) - (overlapped ? deliver_s : 0.0);
  metrics_.sample_seconds += deliver_s;
  if (overlapped) ++metrics_.overlapped_steps;
  metrics_.cache_corrections += uint64_t(n_corrections);
  if (tokens) ++metrics_.device_sampled_steps;
  metrics_.generation_tokens += uint64_t(sampled);
  metrics_.batch_size.observe(double(batch_.size()));
  metrics_.step_tokens.observe(double(step_tokens));
  metrics_.busy_seconds += seconds(t_end - t0);
}

void Scheduler::deliver_pending() {
  const int64_t n = int64_t(pending_.size());
  finish_.assign(pending_.size(), FinishReason::None);
  auto deliver = [&](int64_t a, int64_t b) {
    for (int64_t k = a; k < b; ++k) {
      const Pending& p = pending_[size_t(k)];
      finish_[size_t(k)] = emit_token(*p.s, p.tok, p.s->ending, nullptr);
    }
  };
  if (n >= kParallelDeliverRows)
    ThreadPool::global().parallel_for(n, kParallelDeliverRows / 2, deliver);
  else
    deliver(0, n);
  for (size_t k = 0; k < pending_.size(); ++k) {
    if (finish_[k] == FinishReason::None) continue;
    Seq& s = *pending_[k].s;
    if (s.in_flight) s.stop_hit = true;  // the step now running computes its next token
    else finish(s, finish_[k]);
  }
  pending_.clear();
}

void Scheduler::flush_pending(std::vector<std::unique_ptr<Seq>>& running, bool in_step) {
  if (pending_.empty()) return;
  {
    const auto td = clock_type::now();
    deliver_pending();
    const double dt = seconds(clock_type::now() - td);
    std::lock_guard<std::mutex> lk(mu_);
    metrics_.sample_seconds += dt;
    if (!in_step) metrics_.busy_seconds += dt;  // step() counts its own time
  }
  running.erase(std::remove_if(running.begin(), running.end(),
                               [](const std::unique_ptr<Seq>& r) { return r->ch->finished(); }),
                running.end());
}

// Longest suffix of `text` that is a proper prefix of one of `stops`.
static size_t held_suffix(const std::string& text, const std::vector<std::string>& stops) {
  size_t best = 0;
  for (const std::string& st : stops) {
    for (size_t k = std::min(text.size(), st.size() - 1); k > best; --k)
      if (text.compare(text.size() - k, k, st, 0, k) == 0) {
        best = k;
        break;
      }
  }
  return best;
}

FinishReason Scheduler::accept(Seq& s, int32_t tok) {
  s.tokens.push_back(tok);
  ++s.generated;
  if (std::find(s.req.stop_ids.begin(), s.req.stop_ids.end(), tok) != s.req.stop_ids.end())
    return FinishReason::Stop;
  return s.generated >= s.req.max_tokens ? FinishReason::Length : FinishReason::None;
}

FinishReason Scheduler::on_token(Seq& s, int32_t tok, const float* logits) {
  const FinishReason end = accept(s, tok);
  TokenLogprob lp;
  if (s.req.logprobs >= 0) {
    score_token(logits, model_.config().vocab, tok, s.req.logprobs, lp);
    lp.rank = 0;  // sampled tokens report no rank
  }
  return emit_token(s, tok, end, s.req.logprobs >= 0 ? &lp : nullptr);
}

FinishReason Scheduler::emit_token(Seq& s, int32_t tok, FinishReason end, const TokenLogprob* lp) {
  const auto now = clock_type::now();
  const bool first = s.emitted++ == 0;
  s.t_last = now;
  if (first) {
    s.t_first = now;
    std::lock_guard<std::mutex> lk(mu_);
    metrics_.ttft.observe(seconds(now - s.ch->created));
  }
  const bool stop_tok = end == FinishReason::Stop;  // accept(): a stop id, not part of the text
  FinishReason fr = end;
  if (!stop_tok) s.held += s.text->push(tok);
  if (fr != FinishReason::None) s.held += s.text->flush();

  // Stop strings: emit everything that cannot be the start of one.
  std::string out;
  if (!s.req.stop.empty()) {
    size_t at = std::string::npos;
    for (const std::string& st : s.req.stop) at = std::min(at, s.held.find(st));
    if (at != std::string::npos) {
      out.assign(s.held, 0, at);
      s.held.clear();
      fr = FinishReason::Stop;
    } else {
      const size_t keep = fr != FinishReason::None ? 0 : held_suffix(s.held, s.req.stop);
      out.assign(s.held, 0, s.held.size() - keep);
      s.held.erase(0, s.held.size() - keep);
    }
  } else {
    out.swap(s.held);
    s.held.clear();
  }
  s.ch->emit(out, tok, lp);
  return fr;  // the caller finishes it (pages go back on the engine thread)
}

}  // namespace spade
