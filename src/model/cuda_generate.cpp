// generate_cuda (cuda_model.h): engine/generator.h's generate() on the GPU: chunked prefill,
// then one token per step sampled on the GPU (the host sampler only for a repetition penalty).
#if defined(SPADE_HAVE_CUDA)
#include <algorithm>
#include <memory>
#include <chrono>

#include "backend/cuda/sampling.h"
#include "core/error.h"
#include "engine/sampler.h"
#include "model/cuda_model.h"
#include "sparse/cache_correction.h"

namespace spade {

GenerateStats generate_cuda(CudaModel& model, PageTable& pt, const std::vector<int32_t>& prompt,
                            const GenerateOptions& opt,
                            const std::function<bool(int32_t)>& on_token,
                            sparse::MethodState* state) {
  using clock = std::chrono::steady_clock;
  const ModelConfig& c = model.config();
  GenerateStats st;
  SPADE_CHECK(!prompt.empty(), "the prompt is empty (no tokens)");
  SPADE_CHECK(!opt.attention, "--device cuda: sparse attention functions are CPU-only");
  SPADE_CHECK(pt.length + int64_t(prompt.size()) <= c.max_context, "the prompt has ",
              prompt.size(), " tokens, more than the model's context of ", c.max_context,
              " tokens");
  st.prompt_tokens = int64_t(prompt.size());
  const bool host_sampling = opt.sampling.repetition_penalty != 1.f;
  Sampler sampler(opt.sampling);
  cuda::GpuSampling gs;
  gs.temperature = opt.sampling.temperature;
  gs.top_k = opt.sampling.top_k;
  gs.top_p = opt.sampling.top_p;
  gs.min_p = opt.sampling.min_p;
  gs.seed = opt.sampling.seed;
  std::vector<int32_t> history(prompt);
  std::vector<int64_t> row_of;
  uint64_t step = 0;
  auto run = [&](const int32_t* toks, int64_t n) -> int32_t {
    std::vector<SeqInput> b(1);
    b[0].pages = &pt;
    b[0].tokens = toks;
    b[0].n_tokens = n;
    b[0].device_state = state;
    if (host_sampling) {
      const auto& lg = model.forward(b, row_of);
      return sampler.sample(lg.data() + row_of[0] * c.vocab, c.vocab, history);
    }
    return model.forward_sample(b, gs, step++)[0];
  };
  std::unique_ptr<sparse::CacheCorrection> cc;
  if (opt.correction_every > 0) cc = std::make_unique<sparse::CacheCorrection>(opt.correction_every);
  std::vector<int64_t> corr_rows;
  auto dense = [&](const SeqInput& in) { (void)model.forward({in}, corr_rows); };
  auto t0 = clock::now();
  const int64_t chunk = std::max<int64_t>(1, opt.prefill_chunk);
  int32_t tok = 0;
  for (size_t off = 0; off < prompt.size(); off += size_t(chunk)) {
    const int64_t n = std::min<int64_t>(chunk, int64_t(prompt.size() - off));
    tok = run(prompt.data() + off, n);
  }
  auto t1 = clock::now();
  st.prefill_seconds = std::chrono::duration<double>(t1 - t0).count();
  st.step_ms.reserve(size_t(std::max<int64_t>(0, opt.max_new_tokens)));
  for (int64_t i = 0; i < opt.max_new_tokens; ++i) {
    history.push_back(tok);
    ++st.generated_tokens;
    bool is_stop = std::find(opt.stop_ids.begin(), opt.stop_ids.end(), tok) != opt.stop_ids.end();
    if (!on_token(tok)) break;
    if (is_stop) {
      st.stopped_by_stop_id = true;
      break;
    }
    if (i + 1 == opt.max_new_tokens || pt.length + 1 > c.max_context) break;
    const auto ts = clock::now();
    tok = run(&history.back(), 1);
    // The sampled token is on the host: a correction may run the model again.
    if (cc && cc->after_decode(dense, pt, history.back(), state)) ++st.corrections;
    st.step_ms.push_back(float(1e3 * std::chrono::duration<double>(clock::now() - ts).count()));
  }
  st.decode_seconds = std::chrono::duration<double>(clock::now() - t1).count();
  return st;
}

}  // namespace spade
#endif  // SPADE_HAVE_CUDA
