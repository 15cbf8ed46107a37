// One dense prefill shared by several attention methods: `spade eval` prefills a prompt
// once with dense attention, then every method decodes from a fork of that KV cache
// (KVPool::fork shares the full pages), through its own SparseSession. Decoding is greedy,
// or teacher-forced on given tokens (perplexity, KL against full attention); the caller
// sees the logits of every step and the session's per-step counters. Given the tokenizer,
// methods that read token text (LycheeCluster's structure-aware chunking) receive the text
// of the prompt and of every generated token.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "kv/kv_pool.h"
#include "model/cpu_model.h"
#include "model/weights.h"
#include "sparse/cache_correction.h"
#include "sparse/method.h"
#include "sparse/session.h"
#include "tokenizer/tokenizer.h"

namespace spade::eval {

struct DecodeOptions {
  int64_t max_new = 32;             // tokens to emit at most
  std::vector<int32_t> stop;        // greedy decoding stops after emitting one of these
  const std::vector<int32_t>* forced = nullptr;  // teacher forcing: token i is (*forced)[i]
  bool measure_recall = false;
  // Logits [vocab] that predict token `step` (step 0: the prefill's last logits).
  std::function<void(int64_t step, const float* logits)> on_logits;
  std::function<void(const sparse::StepStats&)> on_step;  // after every decode step
  // Cache correction every N decoded tokens (the method's SparseMethod::correction_every;
  // EvalRunner sets it per run); 0: none.
  int64_t correction_every = 0;
};

struct DecodeResult {
  std::vector<int32_t> tokens;
  sparse::SessionTotals totals;  // CPU sessions only (the GPU keeps no per-step counters)
  double seconds = 0;            // decode time, recall measurement excluded
  double prefill_seconds = 0;    // the prefill this decode started from (EvalRunner)
  bool gpu = false;              // decoded by CudaModel (src/eval/cuda_decode.h)
  // GPU: the request's attended / dense decode rows over its decode steps (the scheduler's
  // per-request density: GpuRequestState, BLASST's skipped tiles not attended); < 0: none.
  double gpu_density = -1;
  int64_t corrections = 0;       // cache corrections run (DecodeOptions::correction_every)
};

// Cache correction inside an eval decode loop: after_step(logits of the step that fed `fed`)
// runs a correction when one is due (DecodeOptions::correction_every) and returns logits that
// survive it (a copy when the model ran again).
class Corrector {
 public:
  Corrector(int64_t every, int vocab, sparse::CacheCorrection::Forward dense);
  ~Corrector();
  const float* after_step(const float* logits, PageTable& pt, int32_t fed,
                          sparse::MethodState* state, DecodeResult& r);

 private:
  int vocab_;
  sparse::CacheCorrection::Forward dense_;
  std::unique_ptr<sparse::CacheCorrection> cc_;
  std::vector<float> kept_;
};

// The step loop of every eval decode (CPU and GPU): token i is forced or the argmax of the
// logits predicting it; `step(token)` feeds it and returns the next logits [vocab]. Stops
// after max_new tokens or (greedy) after a stop token. Fills r.tokens.
void decode_steps(const DecodeOptions& opt, int vocab, const float* first_logits,
                  const std::function<const float*(int32_t)>& step, DecodeResult& r);

class SharedPrefill {
 public:
  // A pool for prompts up to `max_prompt` tokens plus one decode of `max_new` tokens, of
  // `kv_dtype` (f32: the reference) with fp8 scales `kv_scale` (0: auto, set by each prompt's
  // prefill: KVPool::reset_scales before it). `tok` (optional): token text for the methods that
  // read it.
  SharedPrefill(const ModelWeights& w, int64_t max_prompt, int64_t max_new, int page_size = 16,
                int64_t chunk = 1024, const Tokenizer* tok = nullptr,
                KvDtype kv_dtype = KvDtype::F32, float kv_scale = 0.f);
  ~SharedPrefill();
  SharedPrefill(const SharedPrefill&) = delete;
  SharedPrefill& operator=(const SharedPrefill&) = delete;

  // Dense prefill of `prompt` (the previous prefill is released). Returns its seconds.
  double prefill(const std::vector<int32_t>& prompt);
  int64_t length() const { return base_.length; }
  const std::vector<float>& last_logits() const { return last_; }
  // Decodes from a fork of the prefill through `method`.
  DecodeResult decode(std::shared_ptr<const sparse::SparseMethod> method, const DecodeOptions& opt);
  const ModelConfig& config() const { return w_.config; }
  KVPool& kv() { return kv_; }

 private:
  const ModelWeights& w_;
  KVPool kv_;
  CpuModel model_;
  PageTable base_;
  int64_t chunk_;
  const Tokenizer* tok_;
  std::vector<std::string> text_;  // token text of the prompt (with tok_)
  std::vector<float> last_;
  std::vector<int64_t> row_of_;
  std::vector<int64_t> corr_rows_;  // the rows of cache-correction chunks (logits dropped)
};

}  // namespace spade::eval
