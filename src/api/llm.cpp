// spade::api::LLM (llm.h): the same pieces `spade serve` assembles (tools/cmd_serve.cpp):
// weights, tokenizer, runner (make_runner), per-request sparse methods, the scheduler.
#include "api/llm.h"

#include <algorithm>
#include <chrono>
#include <optional>

#include "core/error.h"
#include "core/thread_pool.h"
#include "engine/runner.h"
#include "engine/scheduler.h"
#include "model/loader.h"
#include "server/sparse_adapter.h"
#include "server/tokenizer_text.h"
#include "sparse/options.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace spade::api {

struct LLM::Impl {
  std::unique_ptr<ModelWeights> weights;
  std::unique_ptr<Tokenizer> tok;
  Runner runner;
  std::unique_ptr<server::SparseMethods> methods;
  std::unique_ptr<server::TokenizerText> text;
  std::unique_ptr<Scheduler> sched;  // destroyed first (its thread runs the runner)
  ~Impl() { sched.reset(); }
};

LLM::LLM(const std::string& model, const LLMOptions& o) : impl_(std::make_unique<Impl>()) {
  SPADE_CHECK(o.device == "cpu" || o.device == "cuda", "device must be \"cpu\" or \"cuda\", got '",
              o.device, "'");
  SPADE_CHECK(o.threads >= 0, "threads must be >= 0");
  SPADE_CHECK(o.max_batch >= 1 && o.max_batch <= 4096, "max_batch must be in [1, 4096]");
  SPADE_CHECK(o.max_step_tokens >= 1 && o.max_step_tokens <= (1 << 20),
              "max_step_tokens must be in [1, 1048576]");
  SPADE_CHECK(o.page_size >= 1 && o.page_size <= 4096, "page_size must be in [1, 4096]");
  SPADE_CHECK(o.kv_pages >= 0 && o.max_context >= 0, "kv_pages and max_context must be >= 0");
  if (o.threads > 0) ThreadPool::set_global_threads(o.threads);
  Impl& m = *impl_;
  const bool cpu = o.device == "cpu";
  SPADE_CHECK(cpu || o.cpu_weights == "auto", "cpu_weights is for device \"cpu\"");
  const KvDtype kv_dtype = parse_kv_dtype(o.kv_dtype, "kv_dtype");
  SPADE_CHECK(cpu || kv_dtype == KvDtype::BF16 || kv_dtype == KvDtype::FP8, "kv_dtype ", o.kv_dtype,
              ": the GPU KV cache is bf16 or fp8 (other types are for device \"cpu\")");
  SPADE_CHECK(kv_dtype == KvDtype::FP8 || o.kv_scale == "auto", "kv_scale is for kv_dtype \"fp8\"");
  const float kv_scale = kv_dtype == KvDtype::FP8 ? parse_kv_scale(o.kv_scale, "kv_scale") : 0.f;
  m.weights = load_model(model, cpu ? parse_cpu_weights(o.cpu_weights, "cpu_weights") : CpuWeights::F32);
  m.tok = Tokenizer::load(o.tokenizer.empty() ? model : o.tokenizer);
  const ModelConfig& cfg = m.weights->config;
  const int64_t ctx = o.max_context ? o.max_context : cfg.max_context;
  SPADE_CHECK(ctx >= 1 && ctx <= cfg.max_context, "max_context must be in [1, ", cfg.max_context,
              "] (the model's context), got ", ctx);
  SchedulerOptions so;
  so.max_batch = o.max_batch;
  so.max_queue = 100000;
  so.max_step_tokens = o.max_step_tokens;
  so.max_context = ctx;
  RunnerOptions ro;
  ro.device = o.device;
  SPADE_CHECK(!(o.kv_pages && o.kv_mem != 0), "kv_pages and kv_mem both size the KV cache: give one");
  ro.kv_pages = o.kv_mem != 0 ? kv_pages_for_memory(cfg, o.page_size, kv_dtype, o.kv_mem)
                : o.kv_pages  ? o.kv_pages
                              : default_kv_pages(ctx, o.max_batch, o.page_size);
  ro.page_size = o.page_size;
  ro.kv_dtype = kv_dtype;
  ro.kv_scale = kv_scale;
  ro.max_batch = o.max_batch;
  ro.max_step_tokens = o.max_step_tokens;
  ro.deterministic = o.deterministic;
  so.isolate_prefill = o.deterministic;
  m.runner = make_runner(*m.weights, ro);
  so.max_step_tokens = m.runner.max_step_tokens;
  so.max_logit_rows = m.runner.max_logit_rows;
  server::SparseSpec full;
  full.method = "full";
  m.methods = std::make_unique<server::SparseMethods>(
      cfg, m.runner.host_pool, full, m.runner.host_pool ? std::string() : m.runner.model->device(),
      m.runner.check_method);
  m.text = std::make_unique<server::TokenizerText>(*m.tok);
  m.sched = std::make_unique<Scheduler>(*m.runner.model, *m.text, so);
}

LLM::~LLM() = default;

std::vector<Completion> LLM::generate(const std::vector<std::string>& prompts,
                                      const std::vector<GenerateParams>& params) {
  std::vector<std::vector<int32_t>> ids;
  ids.reserve(prompts.size());
  for (const auto& p : prompts) ids.push_back(encode(p, true));
  return generate_ids(ids, params);
}

std::vector<Completion> LLM::generate_ids(const std::vector<std::vector<int32_t>>& prompts,
                                          const std::vector<GenerateParams>& params) {
  Impl& m = *impl_;
  SPADE_CHECK(params.size() == 1 || params.size() == prompts.size(), "generate: ", params.size(),
              " sampling parameter sets for ", prompts.size(), " prompts (give one, or one per prompt)");
  const int vocab = m.weights->config.vocab;
  std::vector<EngineRequest> reqs(prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    const GenerateParams& g = params.size() == 1 ? params[0] : params[i];
    EngineRequest& r = reqs[i];
    auto where = [&] { return cat("prompt ", i, ": "); };
    SPADE_CHECK(!prompts[i].empty(), where(), "the prompt is empty (no tokens)");
    for (int32_t id : prompts[i])
      SPADE_CHECK(id >= 0 && id < vocab, where(), "token id ", id, " is outside the vocabulary [0, ", vocab, ")");
    SPADE_CHECK(g.max_tokens >= 1, where(), "max_tokens must be >= 1, got ", g.max_tokens);
    SPADE_CHECK(g.temperature >= 0 && g.temperature <= 100, where(), "temperature must be in [0, 100]");
    SPADE_CHECK(g.top_p > 0 && g.top_p <= 1, where(), "top_p must be in (0, 1]");
    SPADE_CHECK(g.min_p >= 0 && g.min_p <= 1, where(), "min_p must be in [0, 1]");
    SPADE_CHECK(g.top_k >= 0, where(), "top_k must be >= 0");
    SPADE_CHECK(g.repetition_penalty > 0, where(), "repetition_penalty must be > 0");
    SPADE_CHECK(g.logprobs <= 20, where(), "logprobs must be at most 20");
    r.prompt = prompts[i];
    r.max_tokens = g.max_tokens;
    r.sampling.temperature = g.temperature;
    r.sampling.top_k = std::min(g.top_k, vocab);
    r.sampling.top_p = g.top_p;
    r.sampling.min_p = g.min_p;
    r.sampling.repetition_penalty = g.repetition_penalty;
    r.sampling.seed = g.seed;
    r.stop = g.stop;
    if (!g.ignore_eos) r.stop_ids = m.tok->eos_ids();
    for (int32_t id : g.stop_token_ids) {
      SPADE_CHECK(id >= 0 && id < vocab, where(), "stop token id ", id, " is outside the vocabulary");
      r.stop_ids.push_back(id);
    }
    r.logprobs = g.logprobs;
    std::optional<server::SparseSpec> spec;
    if (!g.sparse.empty()) {
      const sparse::SparseConfig sc = sparse::SparseConfig::parse_spec(g.sparse);
      server::SparseSpec s;
      s.method = sc.method;
      for (const auto& [k, v] : sc.options) s.options.emplace_back(k, v);
      spec = s;
    }
    try {
      server::ResolvedSparse sp = m.methods->resolve(spec);
      r.method = sp.method;
      r.attention = std::move(sp.maker);
      r.device_method = std::move(sp.device_method);
      r.correction_every = sp.correction_every;
    } catch (const std::exception& e) {
      fail(where(), e.what());
    }
  }
  std::vector<std::shared_ptr<RequestChannel>> chans;
  auto cancel_all = [&] {
    for (auto& c : chans) c->cancel();
  };
  for (size_t i = 0; i < reqs.size(); ++i) {
    try {
      chans.push_back(m.sched->submit(std::move(reqs[i])));
    } catch (const std::exception& e) {
      cancel_all();
      fail("prompt ", i, ": ", e.what());
    }
  }
  std::vector<Completion> out(chans.size());
  RequestDelta d;
  for (size_t i = 0; i < chans.size(); ++i) {
    Completion& c = out[i];
    c.prompt_token_ids = prompts[i];
    for (;;) {
      if (!chans[i]->wait_take(d, std::chrono::milliseconds(1000))) continue;
      c.text += d.text;
      c.token_ids.insert(c.token_ids.end(), d.tokens.begin(), d.tokens.end());
      for (const TokenLogprob& lp : d.logprobs) {
        c.logprobs.push_back(lp.logprob);
        c.top_logprobs.push_back(lp.top);
      }
      if (!d.finished) continue;
      if (d.reason == FinishReason::Error || d.reason == FinishReason::Cancelled) {
        cancel_all();
        fail("prompt ", i, ": ", d.reason == FinishReason::Error ? d.error : std::string("cancelled"));
      }
      c.finish_reason = finish_reason_name(d.reason);
      c.density = d.density;
      break;
    }
  }
  return out;
}

std::vector<int32_t> LLM::encode(const std::string& text, bool add_special) const {
  return impl_->tok->encode(text, add_special, true);
}

std::string LLM::decode(const std::vector<int32_t>& ids) const {
  return impl_->tok->decode(ids, true);
}

std::string LLM::apply_chat_template(
    const std::vector<std::pair<std::string, std::string>>& messages) const {
  const ChatTemplate* t = impl_->tok->chat_template();
  SPADE_CHECK(t, "the model has no chat template");
  std::vector<ChatMessage> msgs;
  for (const auto& [role, content] : messages) msgs.push_back({role, content});
  return t->render(msgs, true);
}

const ModelConfig& LLM::config() const { return impl_->weights->config; }
std::string LLM::device() const { return impl_->runner.model->device(); }
int64_t LLM::max_context() const { return impl_->sched->max_context(); }

}  // namespace spade::api
