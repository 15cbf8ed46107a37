// spade as a library: one object that loads a model and generates for a list of prompts, each
// with its own sampling parameters and sparse method, batched by the same scheduler and
// runner (CPU or CUDA) as `spade serve` (continuous batching, per-request methods). The Python
// package (python/spade, docs/python.md) is a thin binding over this class; C++ users can
// link it directly.
//
//   spade::api::LLM llm("models/SmolLM2-135M-Instruct.Q4_1.gguf", {});
//   auto out = llm.generate({"Once upon a time"}, {spade::api::GenerateParams{}});
//   out[0].text, out[0].token_ids, out[0].finish_reason
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "model/config.h"

namespace spade::api {

struct LLMOptions {
  std::string device = "cpu";        // "cpu" or "cuda"
  int threads = 0;                   // CPU threads (0: every core); first LLM of the process only
  int64_t max_context = 0;           // longest prompt + completion (0: the model's context)
  int max_batch = 16;                // sequences per step
  int64_t max_step_tokens = 512;     // tokens per step (prefill chunks)
  int page_size = 16;                // KV page size in tokens
  int64_t kv_pages = 0;              // KV pool pages (0: sized like `spade serve`)
  double kv_mem = 0;                 // or the pages this many GiB of K and V hold (--kv-mem)
  std::string cpu_weights = "auto";  // "auto" | "native" | "f32" (--cpu-weights)
  std::string kv_dtype = "bf16";     // KV cache: "bf16" | "f16" | "f32" | "fp8" (--kv-dtype; cuda: bf16 | fp8)
  std::string kv_scale = "auto";     // fp8 cache: "auto" | a number (--kv-scale)
  std::string tokenizer;             // tokenizer path ("": the model's own)
  bool deterministic = false;        // CUDA: batch-invariant decode (--deterministic)
};

struct GenerateParams {
  int64_t max_tokens = 16;           // >= 1
  float temperature = 0.f;           // 0: greedy
  int top_k = 0;                     // 0: off
  float top_p = 1.f;
  float min_p = 0.f;
  float repetition_penalty = 1.f;
  uint64_t seed = 0;
  std::vector<std::string> stop;     // stop strings (not in the output)
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;
  int logprobs = -1;                 // < 0: off; k >= 0: the token's logprob and the top k
  std::string sparse;                // "quest:budget=256" ("" or "full": full attention)
};

struct Completion {
  std::vector<int32_t> prompt_token_ids;
  std::vector<int32_t> token_ids;
  std::string text;
  std::string finish_reason;         // "stop" | "length"
  std::vector<float> logprobs;       // with GenerateParams::logprobs >= 0: one per token
  std::vector<std::vector<std::pair<int32_t, float>>> top_logprobs;  // best first
  double density = -1;               // attention density over its decode steps (< 0: none)
};

class LLM {
 public:
  // Loads the model (GGUF file or Hugging Face directory) and its tokenizer; throws
  // spade::Error for bad files or options.
  LLM(const std::string& model, const LLMOptions& opt);
  ~LLM();
  LLM(const LLM&) = delete;
  LLM& operator=(const LLM&) = delete;

  // One completion per prompt, all submitted together. params: one per prompt, or one for
  // all. Prompts are tokenized as `spade generate` and the completions API do (special
  // tokens added, special-token text parsed). Throws spade::Error for an invalid request
  // (naming the prompt's index); other requests are cancelled then.
  std::vector<Completion> generate(const std::vector<std::string>& prompts,
                                   const std::vector<GenerateParams>& params);
  std::vector<Completion> generate_ids(const std::vector<std::vector<int32_t>>& prompts,
                                       const std::vector<GenerateParams>& params);

  std::vector<int32_t> encode(const std::string& text, bool add_special = true) const;
  std::string decode(const std::vector<int32_t>& ids) const;
  // The model's chat template applied to messages (role, content), generation prompt added;
  // throws when the model has none.
  std::string apply_chat_template(const std::vector<std::pair<std::string, std::string>>& messages) const;
  const ModelConfig& config() const;
  std::string device() const;
  int64_t max_context() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace spade::api
