// `spade eval --device cuda`: the GPU counterpart of SharedPrefill (src/eval/decode.h). A
// CudaModel takes its sparse method at construction, so there is one model per GPU method
// (keyed by the run's label; built on first use, weights uploaded once per model and kept for
// the whole sweep). Each decode prefills the prompt on that method's model (dense for every
// method except BLASST with prefill=1, as in `spade serve`), then decodes greedily or
// teacher-forced with CudaModel::forward (logits on the host) through decode_steps, and
// releases the pages. The prefill is not shared across methods: a GPU prefill of a few
// thousand tokens takes milliseconds, far less than forking pages between models would save.
#pragma once
#if defined(SPADE_HAVE_CUDA)
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "eval/decode.h"
#include "model/cuda_model.h"
#include "model/weights.h"
#include "tokenizer/tokenizer.h"

namespace spade::eval {

class CudaDecoder {
 public:
  // Models sized for prompts up to `max_prompt` tokens plus `max_new` decoded tokens, one
  // sequence, prefill chunks of `chunk` tokens. `tok`: token text for the methods that chunk
  // by it (LycheeCluster; without it their chunks are fixed 16-token runs). `deterministic`:
  // every model decodes with the static attention schedule (CudaModelOptions::deterministic).
  // `kv_dtype` fp8: every model keeps an fp8 cache with scales `kv_scale` (0: auto, set by each
  // prompt's first step, as the CPU's SharedPrefill does); any other type: bf16.
  CudaDecoder(const ModelWeights& w, int64_t max_prompt, int64_t max_new, int page_size = 16,
              int64_t chunk = 1024, const Tokenizer* tok = nullptr, bool deterministic = false,
              KvDtype kv_dtype = KvDtype::BF16, float kv_scale = 0.f);
  ~CudaDecoder();
  CudaDecoder(const CudaDecoder&) = delete;
  CudaDecoder& operator=(const CudaDecoder&) = delete;

  // Prefill of `prompt` then decode on the model of `key` (built from `sparse` on first use;
  // the same key must always come with the same CudaSparse). r.prefill_seconds is this
  // decode's own prefill; r.totals stays empty.
  DecodeResult decode(const std::string& key, const CudaSparse& sparse,
                      const std::vector<int32_t>& prompt, const DecodeOptions& opt);
  size_t models() const { return models_.size(); }
  int64_t pages_in_use() const;  // over every model: 0 between decodes

 private:
  CudaModel& model(const std::string& key, const CudaSparse& sparse);

  const ModelWeights& w_;
  const Tokenizer* tok_;
  CudaModelOptions opt_;
  int64_t chunk_;
  std::map<std::string, std::unique_ptr<CudaModel>> models_;
  std::vector<float> last_;
  std::vector<int64_t> row_of_;
  std::vector<int64_t> corr_rows_;  // cache-correction chunks (logits dropped)
};

}  // namespace spade::eval
#endif  // SPADE_HAVE_CUDA
