// Loads a model's weights as fp32 host tensors in Hugging Face layout, from a GGUF file
// or a Hugging Face directory (config.json + model.safetensors or a sharded index).
#pragma once
#include <memory>
#include <string>

#include "model/weights.h"

namespace spade {

// How the CPU backend holds the weights. F32: everything dequantized to fp32 at load (the
// reference the parity tests and the CUDA upload use). Native: the Linear weights and the
// embedding table stay as the file stores them when that is not fp32 (quantized, f16, bf16),
// in the mapped file, no fp32 copy; only the CPU model can run such weights. Auto: Native when
// the file has a block-quantized Linear weight (GGUF Q4_0, Q8_0, Q4_K, ...), else F32.
enum class CpuWeights { F32, Native, Auto };
// "f32" | "native" | "auto"; anything else is a spade::Error naming `option`.
CpuWeights parse_cpu_weights(const std::string& s, const std::string& option = "--cpu-weights");

// Every tensor's shape is checked against the config (errors name the tensor, expected
// and found shapes); quantized data is dequantized on ThreadPool::global(). GGUF "llama"
// q/k rows are un-permuted to rotate-halves RoPE order. Tied models leave lm_head empty.
std::unique_ptr<ModelWeights> load_model(const std::string& path,
                                         CpuWeights mode = CpuWeights::F32);

}  // namespace spade
