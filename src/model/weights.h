// Model weights as fp32 host tensors in Hugging Face layout: Linear weights are
// [out_features, in_features] row-major (y = W x), RoPE is the "rotate halves" form (GGUF
// llama q/k rows are un-permuted at load so every format ends up here). Loaded with
// CpuWeights::Native (loader.h), the Linear weights and the embedding table that the file
// stores in another type (quantized, f16, bf16) stay as stored, in the mapped file, and their
// fp32 tensors stay empty: the CPU model multiplies by them directly (backend/cpu/qgemv.h).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/cpu/qgemv.h"
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
  // CpuWeights::Native: the same Linear weights as stored (then the fp32 tensor is empty).
  cpu::QuantMatrix qwq, qwk, qwv, qwo, qw_gate, qw_up, qw_down;
};

struct ModelWeights {
  ModelConfig config;
  HostTensor tok_embeddings;  // [vocab, hidden]
  std::vector<LayerWeights> layers;
  HostTensor final_norm;      // [hidden]
  HostTensor lm_head;         // [vocab, hidden]; empty when tied (use tok_embeddings)
  std::string source;         // path it was loaded from
  // CpuWeights::Native: the embedding table / LM head as stored (fp32 tensor empty then).
  cpu::QuantMatrix q_tok_embeddings, q_lm_head;
  // Keeps what the stored weights point into alive: the mapped file, and the q/k rows of GGUF
  // "llama" files, copied in rotate-halves order.
  std::shared_ptr<const void> storage;
  std::vector<std::vector<uint8_t>> owned;
  bool native() const;  // any weight kept as stored

  const HostTensor& output_weight() const {
    return lm_head.numel() ? lm_head : tok_embeddings;
  }
  int64_t parameter_count() const;
};

}  // namespace spade
