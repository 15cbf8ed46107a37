// GGUF metadata (general.architecture = llama / qwen2 / qwen3) -> ModelConfig.
#pragma once
#include "io/gguf.h"
#include "model/config.h"

namespace spade {

ModelConfig config_from_gguf(const GgufFile& g);

}  // namespace spade
