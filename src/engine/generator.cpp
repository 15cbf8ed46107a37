#include "engine/generator.h"

#include <algorithm>
#include <memory>

#include "core/error.h"
#include "sparse/cache_correction.h"

namespace spade {

const char* stop_reason_name(StopReason r) {
  switch (r) {
    case StopReason::kMaxTokens: return "max-tokens";
    case StopReason::kStopToken: return "eos";
    case StopReason::kContext: return "context";
    case StopReason::kInterrupted: return "interrupted";
  }
  return "?";
}

GenerateStats generate(StepModel& model, PageTable& pt, const std::vector<int32_t>& prompt,
                       const GenerateOptions& opt, const std::function<bool(int32_t)>& on_token,
                       sparse::MethodState* device_state) {
  using clock = std::chrono::steady_clock;
  const ModelConfig& c = model.config();
  GenerateStats st;
  SPADE_CHECK(!prompt.empty(), "the prompt is empty (no tokens)");
  const int64_t total = pt.length + int64_t(prompt.size());
  const int64_t ctx = opt.max_context > 0 ? std::min<int64_t>(opt.max_context, c.max_context) : c.max_context;
  SPADE_CHECK(total <= ctx, "the prompt has ", prompt.size(), " tokens",
              pt.length ? cat(" after ", pt.length, " cached") : std::string(), ", more than the ",
              ctx < c.max_context ? "context (--ctx-size) of " : "model's context of ", ctx, " tokens");
  SPADE_CHECK(!opt.attention || model.supports_attention_callbacks(), "this runner (",
              model.device(), ") runs its methods itself: no attention function");
  st.prompt_tokens = int64_t(prompt.size());
  // The runner samples when it can (no host logits needed): the token of draw i is a function
  // of (seed, i), as in the server; else the host sampler, on the logits.
  const bool on_device = model.samples_on_device() && opt.sampling.repetition_penalty == 1.f;
  Sampler sampler(opt.sampling);
  std::vector<int32_t> history(prompt);
  history.reserve(prompt.size() + size_t(std::max<int64_t>(0, opt.max_new_tokens)));
  std::vector<int64_t> row_of;
  std::vector<SeqInput> batch(1);
  batch[0].pages = &pt;
  batch[0].attention = opt.attention;
  batch[0].device_state = device_state;
  std::vector<StepModel::RowSampling> rows(1);
  const SamplingParams& sp = opt.sampling;
  rows[0] = {sp.temperature, sp.top_k, sp.top_p, sp.min_p, sp.seed, 0};
  std::vector<float> kept;  // host logits that must outlive a cache correction's forward pass
  // Feeds tokens [toks, toks + n) and returns the next token (sampled) when `sample`.
  auto feed = [&](const int32_t* toks, int64_t n, bool sample) -> int32_t {
    batch[0].tokens = toks;
    batch[0].n_tokens = n;
    if (on_device) {
      rows[0].draw = uint64_t(st.generated_tokens);
      return model.forward_sample(batch, rows)[0];
    }
    const auto& lg = model.forward(batch, row_of);
    if (!sample) return 0;
    kept.assign(lg.begin() + row_of[0] * c.vocab, lg.begin() + (row_of[0] + 1) * c.vocab);
    return -1;  // sampled by the caller, after a possible correction
  };
  auto host_sample = [&] { return sampler.sample(kept.data(), c.vocab, history); };

  std::unique_ptr<sparse::CacheCorrection> cc;
  if (opt.correction_every > 0) cc = std::make_unique<sparse::CacheCorrection>(opt.correction_every);
  std::vector<int64_t> corr_rows;
  auto dense = [&](const SeqInput& in) { (void)model.forward({in}, corr_rows); };

  auto t0 = clock::now();
  const int64_t chunk = std::max<int64_t>(1, opt.prefill_chunk);
  int32_t tok = 0;
  for (size_t off = 0; off < prompt.size(); off += size_t(chunk)) {
    const int64_t n = std::min<int64_t>(chunk, int64_t(prompt.size() - off));
    tok = feed(prompt.data() + off, n, off + size_t(n) >= prompt.size());
    if (opt.on_prefill_chunk && !opt.on_prefill_chunk(int64_t(off) + n, int64_t(prompt.size()))) {
      st.prefill_seconds = std::chrono::duration<double>(clock::now() - t0).count();
      st.stop_reason = StopReason::kInterrupted;
      return st;
    }
  }
  if (!on_device) tok = host_sample();
  auto t1 = clock::now();
  st.prefill_seconds = std::chrono::duration<double>(t1 - t0).count();
  st.step_ms.reserve(size_t(std::max<int64_t>(0, opt.max_new_tokens)));
  for (int64_t i = 0; i < opt.max_new_tokens; ++i) {
    history.push_back(tok);
    ++st.generated_tokens;
    const bool is_stop = std::find(opt.stop_ids.begin(), opt.stop_ids.end(), tok) != opt.stop_ids.end();
    if (!on_token(tok)) {
      st.stop_reason = StopReason::kInterrupted;
      break;
    }
    if (is_stop) {
      st.stopped_by_stop_id = true;
      st.stop_reason = StopReason::kStopToken;
      break;
    }
    if (i + 1 == opt.max_new_tokens) break;
    if (pt.length + 1 > ctx) {
      st.stop_reason = StopReason::kContext;
      break;
    }
    const auto ts = clock::now();
    tok = feed(&history.back(), 1, true);
    // The step's token (or logits) is kept: a correction may run the model again.
    if (cc && cc->after_decode(dense, pt, history.back(), device_state)) ++st.corrections;
    if (!on_device) tok = host_sample();
    st.step_ms.push_back(float(1e3 * std::chrono::duration<double>(clock::now() - ts).count()));
  }
  st.decode_seconds = std::chrono::duration<double>(clock::now() - t1).count();
  return st;
}

GenerateStats generate(CpuModel& model, PageTable& pt, const std::vector<int32_t>& prompt,
                       const GenerateOptions& opt, const std::function<bool(int32_t)>& on_token) {
  CpuStepModel runner(model);
  return generate(runner, pt, prompt, opt, on_token, nullptr);
}

}  // namespace spade
