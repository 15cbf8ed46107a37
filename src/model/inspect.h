// A human-readable description of a model file, read from the file without
// dequantizing: format, config, every tensor's name/shape/type, parameter count.
#pragma once
#include <string>

namespace spade {

// `path`: a .gguf file or a Hugging Face model directory (see load_model).
std::string describe_model(const std::string& path);

}  // namespace spade
