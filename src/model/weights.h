// Model weights as fp32 host tensors in Hugging Face layout: Linear weights are
// [out_features, in_features] row-major (y = W x), RoPE is the "rotate halves" form (GGUF
// llama q/k rows are un-permuted at load so every format ends up here).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/config.h"

namespace spade {

struct LayerWeights {
  HostTensor attn_norm;          // [hidden]
  HostTensor wq, wk, wv, wo;     // [Hq*D, hidden], [Hkv*D, hidden], [Hkv*D, hidden], [hidden, Hq*D]
  HostTensor bq, bk, bv;         // Qwen2 biases (empty otherwise)
  HostTensor q_norm, k_norm;     // Qwen3 [D] (empty otherwise)
  HostTensor ffn_norm;           // [hidden]
  HostTensor w_gate, w_up;       // [ffn, hidden]
  HostTensor w_down;             // [hidden, ffn]
};

struct ModelWeights {
  ModelConfig config;
  HostTensor tok_embeddings;  // [vocab, hidden]
  std::vector<LayerWeights> layers;
  HostTensor final_norm;      // [hidden]
  HostTensor lm_head;         // [vocab, hidden]; empty when tied (use tok_embeddings)
  std::string source;         // path it was loaded from

  const HostTensor& output_weight() const {
    return lm_head.numel() ? lm_head : tok_embeddings;
  }
  int64_t parameter_count() const;
};

}  // namespace spade
