// CudaDecoder of src/eval/cuda_decode.h.
#if defined(SPADE_HAVE_CUDA)
#include "eval/cuda_decode.h"

#include <algorithm>
#include <chrono>

#include "core/error.h"

namespace spade::eval {

namespace {
using clk = std::chrono::steady_clock;
double since(clk::time_point t) { return std::chrono::duration<double>(clk::now() - t).count(); }
}  // namespace

CudaDecoder::CudaDecoder(const ModelWeights& w, int64_t max_prompt, int64_t max_new,
                         int page_size, int64_t chunk, const Tokenizer* tok, bool deterministic,
                         KvDtype kv_dtype, float kv_scale)
    : w_(w), tok_(tok), chunk_(std::max<int64_t>(1, chunk)) {
  SPADE_CHECK(page_size > 0, "page size must be positive");
  opt_.deterministic = deterministic;
  opt_.kv_dtype = kv_dtype == KvDtype::FP8 ? KvDtype::FP8 : KvDtype::BF16;
  opt_.kv_scale = kv_dtype == KvDtype::FP8 ? kv_scale : 0.f;
  opt_.page_size = page_size;
  opt_.max_tokens = max_prompt + max_new + page_size;
  opt_.max_batch = 1;  // eval decodes one sequence at a time
  opt_.max_step_tokens = chunk_;
}

CudaDecoder::~CudaDecoder() = default;

int64_t CudaDecoder::pages_in_use() const {
  int64_t n = 0;
  for (const auto& [key, m] : models_) n += m->total_pages() - m->free_pages();
  return n;
}

CudaModel& CudaDecoder::model(const std::string& key, const CudaSparse& sparse) {
  auto it = models_.find(key);
  if (it != models_.end()) return *it->second;
  CudaModelOptions o = opt_;
  o.sparse = sparse;
  return *models_.emplace(key, std::make_unique<CudaModel>(w_, o)).first->second;
}

DecodeResult CudaDecoder::decode(const std::string& key, const CudaSparse& sparse,
                                 const std::vector<int32_t>& prompt, const DecodeOptions& opt) {
  SPADE_CHECK(!prompt.empty(), "empty prompt");
  SPADE_CHECK(!opt.measure_recall && !opt.on_step,
              "--device cuda: attention recall and per-step counters are CPU-only");
  CudaModel& m = model(key, sparse);
  m.reset_kv_scales();  // fp8 auto scales: each prompt's own (no page is in use between decodes)
  const int V = w_.config.vocab;
  PageTable pt;
  DecodeResult r;
  r.gpu = true;
  // The method's request state (LycheeCluster: token text, chunks, index slots); it also
  // counts the decode rows the method read (density).
  auto state = m.new_request_state(0);
  const ModelConfig& c = w_.config;
  int64_t dense_rows = 0;
  const bool text = tok_ && state && state->wants_token_text();
  if (text)
    for (int32_t t : prompt) state->append_token_text(tok_->token_bytes(t));
  try {
    std::vector<SeqInput> batch(1);
    auto t0 = clk::now();
    for (size_t off = 0; off < prompt.size(); off += size_t(chunk_)) {
      batch[0] = {&pt, prompt.data() + off,
                  std::min<int64_t>(chunk_, int64_t(prompt.size() - off)), false, nullptr,
                  state.get()};
      const auto& lg = m.forward(batch, row_of_);
      if (off + size_t(chunk_) >= prompt.size())
        last_.assign(lg.begin() + row_of_[0] * V, lg.begin() + (row_of_[0] + 1) * V);
    }
    r.prefill_seconds = since(t0);
    Corrector corr(opt.correction_every, V,
                   [&](const SeqInput& in) { (void)m.forward({in}, corr_rows_); });
    t0 = clk::now();
    decode_steps(opt, V, last_.data(), [&](int32_t t) {
      if (text) state->append_token_text(tok_->token_bytes(t));
      batch[0] = {&pt, &r.tokens.back(), 1, false, nullptr, state.get()};
      dense_rows += int64_t(c.n_layers) * c.n_kv_heads * (pt.length + 1);
      const auto& lg = m.forward(batch, row_of_);
      return corr.after_step(lg.data() + row_of_[0] * V, pt, r.tokens.back(), state.get(), r);
    }, r);
    r.seconds = since(t0);
    if (dense_rows > 0) r.gpu_density = double(state->attended_rows()) / double(dense_rows);
  } catch (...) {
    m.release(pt);
    throw;
  }
  m.release(pt);
  return r;
}

}  // namespace spade::eval
#endif  // SPADE_HAVE_CUDA
