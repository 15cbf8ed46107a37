// Synthetic inputs of the speed benchmarks (see cuda_model.h): the config of a named 8B-class
// model (or any config.json) for random weights, and a KV cache of random values with the
// per-page state a prefill would have left (Quest metadata, Twilight's INT4 key copy).
#if defined(SPADE_HAVE_CUDA)
#include <algorithm>

#include "backend/cuda/cuda_common.h"
#include "backend/cuda/ops.h"
#include "backend/cuda/sparse_attention.h"
#include "backend/cuda/twilight.h"
#include "core/error.h"
#include "io/hf_config.h"
#include "model/cuda_model.h"

namespace spade {

using cuda::bf16;

namespace {
cudaStream_t S_(void* p) { return static_cast<cudaStream_t>(p); }
}  // namespace

ModelConfig synthetic_config(const std::string& name) {
  // config.json values of the published models (weights are random in synthetic mode).
  if (name == "llama3-8b" || name == "llama3.1-8b")
    return parse_hf_config(R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
      "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
      "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
      "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
      "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192, "rope_type": "llama3"},
      "tie_word_embeddings": false, "bos_token_id": 128000, "eos_token_id": 128001})",
                           "synthetic llama3-8b");
  if (name == "llama3-70b" || name == "llama3.1-70b")  // Llama-3.1-70B (TP speed runs)
    return parse_hf_config(R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
      "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
      "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
      "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
      "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192, "rope_type": "llama3"},
      "tie_word_embeddings": false, "bos_token_id": 128000, "eos_token_id": 128001})",
                           "synthetic llama3-70b");
  if (name == "qwen3-8b")
    return parse_hf_config(R"({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
      "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
      "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
      "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-06,
      "rope_theta": 1000000.0, "tie_word_embeddings": false, "attention_bias": false,
      "bos_token_id": 151643, "eos_token_id": 151645})",
                           "synthetic qwen3-8b");
  if (name == "smollm2-135m")  // the default model's shapes (SmolLM2-135M-Instruct)
    return parse_hf_config(R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
      "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
      "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
      "max_position_embeddings": 8192, "rms_norm_eps": 1e-05, "rope_theta": 100000.0,
      "tie_word_embeddings": true, "bos_token_id": 1, "eos_token_id": 2})",
                           "synthetic smollm2-135m");
  return load_hf_config(name);
}

void CudaModel::fill_kv_random(PageTable& pt, int64_t length, uint64_t seed) {
  SPADE_CHECK(pt.length == 0, "fill_kv_random: the page table must be empty");
  reserve(pt, length);
  const size_t page_elems = size_t(cfg_.n_kv_heads) * opt_.page_size * cfg_.head_dim;
  const size_t layer_elems = size_t(n_pages_) * page_elems;
  // Random values in the whole pool (cheap next to anything it is used to measure).
  if (fp8_) {  // codes of N(0, 1) values; unset auto scales become 1
    if (!scales_set_) {
      const std::vector<float> ones(size_t(cfg_.n_layers) * size_t(cfg_.n_kv_heads), 1.f);
      set_kv_scales(ones, ones);
    }
    for (int l = 0; l < cfg_.n_layers; ++l) {
      cuda::fill_random_fp8(static_cast<uint8_t*>(k_cache_) + l * layer_elems, int64_t(layer_elems),
                            seed + 2 * uint64_t(l), S_(stream_));
      cuda::fill_random_fp8(static_cast<uint8_t*>(v_cache_) + l * layer_elems, int64_t(layer_elems),
                            seed + 2 * uint64_t(l) + 1, S_(stream_));
    }
    SPADE_CUDA(cudaStreamSynchronize(S_(stream_)));
    pt.length = length;
    return;  // (no per-page method data: only full attention runs over fp8)
  }
  for (int l = 0; l < cfg_.n_layers; ++l) {
    cuda::fill_random_bf16(static_cast<bf16*>(k_cache_) + l * layer_elems, int64_t(layer_elems),
                           seed + 2 * uint64_t(l), 1.f, 0.f, S_(stream_));
    cuda::fill_random_bf16(static_cast<bf16*>(v_cache_) + l * layer_elems, int64_t(layer_elems),
                           seed + 2 * uint64_t(l) + 1, 1.f, 0.f, S_(stream_));
  }
  // Quest: the pages' key min / max, and Twilight: their INT4 key copy, as a prefill would
  // leave them (decode steps then update the last page in qkv_post, which needs its earlier
  // rows' metadata; Twilight's estimate reads the INT4 copy of every selected page).
  if ((hooks_.quest_meta || hooks_.k_int4) && upd_host_) {
    const int P = opt_.page_size, D = cfg_.head_dim, Hkv = cfg_.n_kv_heads;
    const size_t layer_meta = size_t(n_pages_) * size_t(Hkv) * 2 * D;
    const size_t layer_rows = size_t(n_pages_) * size_t(Hkv) * size_t(P);
    const int64_t n_pages = (length + P - 1) / P;
    for (int64_t p0 = 0; p0 < n_pages; p0 += upd_cap_) {
      const int n = int(std::min<int64_t>(upd_cap_, n_pages - p0));
      for (int i = 0; i < n; ++i) {
        upd_host_[i] = pt.pages[size_t(p0 + i)];
        upd_host_[upd_cap_ + i] = int32_t(std::min<int64_t>(P, length - (p0 + i) * P));
      }
      SPADE_CUDA(cudaMemcpyAsync(upd_, upd_host_, sizeof(int32_t) * size_t(2 * upd_cap_),
                                 cudaMemcpyHostToDevice, S_(stream_)));
      for (int l = 0; l < cfg_.n_layers; ++l) {
        const bf16* kc = static_cast<const bf16*>(k_cache_) + l * layer_elems;
        if (hooks_.quest_meta)
          cuda::quest_update_meta(kc, static_cast<bf16*>(hooks_.quest_meta) + l * layer_meta, upd_,
                                  upd_ + upd_cap_, n, Hkv, P, D, S_(stream_));
        if (hooks_.k_int4)
          cuda::int4_quantize_pages(kc, hooks_.k_int4 + l * layer_rows * size_t(D / 2),
                                    hooks_.k_int4_sz + l * layer_rows, upd_, upd_ + upd_cap_, n, Hkv, P,
                                    D, S_(stream_));
      }
      SPADE_CUDA(cudaStreamSynchronize(S_(stream_)));  // upd_host_ is reused
    }
  }
  SPADE_CUDA(cudaStreamSynchronize(S_(stream_)));
  pt.length = length;
}

}  // namespace spade
#endif  // SPADE_HAVE_CUDA
