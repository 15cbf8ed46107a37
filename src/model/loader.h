// Loads a model's weights as fp32 host tensors in Hugging Face layout, from a GGUF file
// or a Hugging Face directory (config.json + model.safetensors or a sharded index).
#pragma once
#include <memory>
#include <string>

#include "model/weights.h"

namespace spade {

// Every tensor's shape is checked against the config (errors name the tensor, expected
// and found shapes); quantized data is dequantized on ThreadPool::global(). GGUF "llama"
// q/k rows are un-permuted to rotate-halves RoPE order. Tied models leave lm_head empty.
std::unique_ptr<ModelWeights> load_model(const std::string& path);

}  // namespace spade
