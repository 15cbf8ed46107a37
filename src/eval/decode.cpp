// SharedPrefill of src/eval/decode.h.
#include "eval/decode.h"

#include <algorithm>
#include <chrono>

#include "core/error.h"
#include "engine/sampler.h"
#include "sparse/cache_correction.h"

namespace spade::eval {

namespace {
using clk = std::chrono::steady_clock;
double since(clk::time_point t) { return std::chrono::duration<double>(clk::now() - t).count(); }

KVLayout layout_of(const ModelConfig& c, int page_size, KvDtype t, float kv_scale) {
  SPADE_CHECK(page_size > 0, "page size must be positive");
  KVLayout l{c.n_layers, c.n_kv_heads, c.head_dim, page_size};
  l.dtype = t;
  l.kv_scale = kv_scale;
  return l;
}
}  // namespace

SharedPrefill::SharedPrefill(const ModelWeights& w, int64_t max_prompt, int64_t max_new,
                             int page_size, int64_t chunk, const Tokenizer* tok,
                             KvDtype kv_dtype, float kv_scale)
    : w_(w),
      kv_(layout_of(w.config, page_size, kv_dtype, kv_scale),
          (max_prompt + page_size - 1) / page_size + (max_new + page_size - 1) / page_size + 3),
      model_(w, kv_),
      chunk_(std::max<int64_t>(1, chunk)),
      tok_(tok) {}

SharedPrefill::~SharedPrefill() { kv_.release(base_); }

double SharedPrefill::prefill(const std::vector<int32_t>& prompt) {
  SPADE_CHECK(!prompt.empty(), "empty prompt");
  kv_.release(base_);
  base_ = PageTable{};
  kv_.reset_scales();  // fp8, auto: this prompt's prefill sets them (as a fresh server's would)
  text_.clear();
  if (tok_)
    for (int32_t t : prompt) text_.push_back(tok_->token_bytes(t));
  const auto t0 = clk::now();
  const int V = w_.config.vocab;
  std::vector<SeqInput> batch(1);
  for (size_t off = 0; off < prompt.size(); off += size_t(chunk_)) {
    batch[0] = {&base_, prompt.data() + off,
                std::min<int64_t>(chunk_, int64_t(prompt.size() - off)), false, nullptr};
    const auto& lg = model_.forward(batch, row_of_);
    last_.assign(lg.begin() + row_of_[0] * V, lg.begin() + (row_of_[0] + 1) * V);
  }
  return since(t0);
}

Corrector::Corrector(int64_t every, int vocab, sparse::CacheCorrection::Forward dense)
    : vocab_(vocab), dense_(std::move(dense)) {
  if (every > 0) cc_ = std::make_unique<sparse::CacheCorrection>(every);
}
Corrector::~Corrector() = default;

const float* Corrector::after_step(const float* logits, PageTable& pt, int32_t fed,
                                   sparse::MethodState* state, DecodeResult& r) {
  if (!cc_) return logits;
  kept_.assign(logits, logits + vocab_);  // a correction runs the model again
  if (!cc_->after_decode(dense_, pt, fed, state)) return logits;
  ++r.corrections;
  return kept_.data();
}

void decode_steps(const DecodeOptions& opt, int vocab, const float* first_logits,
                  const std::function<const float*(int32_t)>& step, DecodeResult& r) {
  SPADE_CHECK(!opt.forced || int64_t(opt.forced->size()) >= opt.max_new,
              "teacher forcing needs ", opt.max_new, " tokens");
  r.tokens.reserve(size_t(std::max<int64_t>(0, opt.max_new)));
  const float* logits = first_logits;
  for (int64_t i = 0; i < opt.max_new; ++i) {
    if (opt.on_logits) opt.on_logits(i, logits);
    const int32_t t = opt.forced ? (*opt.forced)[size_t(i)] : argmax(logits, vocab);
    r.tokens.push_back(t);
    if (i + 1 == opt.max_new) break;
    if (!opt.forced && std::find(opt.stop.begin(), opt.stop.end(), t) != opt.stop.end()) break;
    logits = step(t);
  }
}

DecodeResult SharedPrefill::decode(std::shared_ptr<const sparse::SparseMethod> method,
                                   const DecodeOptions& opt) {
  SPADE_CHECK(base_.length > 0, "decode before prefill");
  const ModelConfig& c = w_.config;
  PageTable pt = kv_.fork(base_);
  sparse::SparseSession session(std::move(method), c, kv_, {opt.measure_recall, false});
  session.reserve(base_.length + opt.max_new);
  if (opt.on_step) session.on_step = opt.on_step;
  for (const auto& piece : text_) session.append_token_text(piece);
  DecodeResult r;
  std::vector<SeqInput> batch(1);
  Corrector corr(opt.correction_every, c.vocab,
                 [&](const SeqInput& in) { model_.forward({in}, corr_rows_); });
  const auto t0 = clk::now();
  decode_steps(opt, c.vocab, last_.data(), [&](int32_t t) {
    if (tok_) session.append_token_text(tok_->token_bytes(t));
    batch[0] = {&pt, &r.tokens.back(), 1, false, &session.attention()};
    const auto& lg = model_.forward(batch, row_of_);
    return corr.after_step(lg.data() + row_of_[0] * c.vocab, pt, r.tokens.back(), nullptr, r);
  }, r);
  r.seconds = since(t0) - session.totals().measure_seconds;
  r.totals = session.totals();
  kv_.release(pt);
  return r;
}

}  // namespace spade::eval
