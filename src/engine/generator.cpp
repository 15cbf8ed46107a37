#include "engine/generator.h"

#include <algorithm>
#include <memory>

#include "core/error.h"
#include "sparse/cache_correction.h"

namespace spade {

GenerateStats generate(CpuModel& model, PageTable& pt, const std::vector<int32_t>& prompt,
                       const GenerateOptions& opt,
                       const std::function<bool(int32_t)>& on_token) {
  using clock = std::chrono::steady_clock;
  const ModelConfig& c = model.config();
  GenerateStats st;
  SPADE_CHECK(!prompt.empty(), "the prompt is empty (no tokens)");
  const int64_t total = pt.length + int64_t(prompt.size());
  SPADE_CHECK(total <= c.max_context, "the prompt has ", prompt.size(), " tokens",
              pt.length ? cat(" after ", pt.length, " cached") : std::string(),
              ", more than the model's context of ", c.max_context, " tokens");
  st.prompt_tokens = int64_t(prompt.size());
  Sampler sampler(opt.sampling);
  std::vector<int32_t> history(prompt);
  history.reserve(prompt.size() + size_t(std::max<int64_t>(0, opt.max_new_tokens)));
  std::vector<int64_t> row_of;
  std::vector<SeqInput> batch(1);
  batch[0].pages = &pt;
  batch[0].attention = opt.attention;

  auto t0 = clock::now();
  const float* last_logits = nullptr;
  const int64_t chunk = std::max<int64_t>(1, opt.prefill_chunk);
  for (size_t off = 0; off < prompt.size(); off += size_t(chunk)) {
    batch[0].tokens = prompt.data() + off;
    batch[0].n_tokens = std::min<int64_t>(chunk, int64_t(prompt.size() - off));
    const auto& logits = model.forward(batch, row_of);
    last_logits = logits.data() + row_of[0] * c.vocab;
  }
  auto t1 = clock::now();
  st.prefill_seconds = std::chrono::duration<double>(t1 - t0).count();

  std::unique_ptr<sparse::CacheCorrection> cc;
  if (opt.correction_every > 0) cc = std::make_unique<sparse::CacheCorrection>(opt.correction_every);
  std::vector<int64_t> corr_rows;
  std::vector<float> kept;  // the decode step's logits while a correction runs the model again
  auto dense = [&](const SeqInput& in) { model.forward({in}, corr_rows); };
  int32_t tok = 0;
  for (int64_t i = 0; i < opt.max_new_tokens; ++i) {
    tok = sampler.sample(last_logits, c.vocab, history);
    history.push_back(tok);
    ++st.generated_tokens;
    bool is_stop = std::find(opt.stop_ids.begin(), opt.stop_ids.end(), tok) != opt.stop_ids.end();
    if (!on_token(tok)) break;
    if (is_stop) {
      st.stopped_by_stop_id = true;
      break;
    }
    if (i + 1 == opt.max_new_tokens || pt.length + 1 > c.max_context) break;
    batch[0].tokens = &history.back();
    batch[0].n_tokens = 1;
    const auto& logits = model.forward(batch, row_of);
    last_logits = logits.data() + row_of[0] * c.vocab;
    if (cc) {
      kept.assign(last_logits, last_logits + c.vocab);
      if (cc->after_decode(dense, pt, history.back())) {
        ++st.corrections;
        last_logits = kept.data();
      }
    }
  }
  st.decode_seconds = std::chrono::duration<double>(clock::now() - t1).count();
  return st;
}

}  // namespace spade
