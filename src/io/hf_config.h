// Hugging Face config.json -> ModelConfig, with the defaults transformers applies for the
// supported architectures (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
// Qwen3ForCausalLM).
#pragma once
#include <string>

#include "model/config.h"

namespace spade {

// Parses the text of a config.json; `source` names it in errors.
ModelConfig parse_hf_config(const std::string& json_text, const std::string& source);

// Reads `dir`/config.json (or `path` itself when it is a file). When the directory also
// holds generation_config.json, its eos_token_id entries are added to extra_eos_tokens.
ModelConfig load_hf_config(const std::string& path);

}  // namespace spade
