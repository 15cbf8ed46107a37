// A model file opened for loading or inspection, whatever its format: a GGUF file or a
// Hugging Face directory (config.json + safetensors). Gives the config, the tensor
// directory in a common form (row-major shapes, as Hugging Face writes them), and the
// file's name for each weight.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "io/gguf.h"
#include "io/safetensors.h"
#include "model/config.h"

namespace spade {

enum class WeightRole {
  Embed, AttnNorm, Q, K, V, O, QBias, KBias, VBias, QNorm, KNorm, FfnNorm, Gate, Up, Down,
  FinalNorm, LmHead,
};

struct SourceTensor {
  std::string name;
  std::vector<int64_t> shape;  // row-major; for GGUF the reverse of ne
  std::string type;            // as the file names it: "q4_1", "f32", "BF16", ...
  bool readable = false;       // spade can convert it to fp32
  DType dtype = DType::F32;    // valid when readable
  const void* data = nullptr;
  int64_t numel() const;
};

class TensorSource {
 public:
  enum class Format { Gguf, Safetensors };

  // `path`: a .gguf file, a directory with config.json and safetensors, or a directory
  // holding exactly one .gguf file.
  static std::unique_ptr<TensorSource> open(const std::string& path);

  Format format() const { return format_; }
  const std::string& path() const { return path_; }
  std::string format_description() const;  // "GGUF v3", "safetensors (2 shards)"
  const ModelConfig& config() const { return config_; }
  const std::vector<SourceTensor>& tensors() const { return tensors_; }  // file order
  const SourceTensor* find(const std::string& name) const;
  std::string name_of(WeightRole role, int layer) const;  // layer ignored for global roles
  const GgufFile* gguf() const { return gguf_.get(); }    // null unless GGUF

 private:
  Format format_ = Format::Gguf;
  std::string path_;
  ModelConfig config_;
  std::unique_ptr<GgufFile> gguf_;
  std::unique_ptr<SafetensorsModel> st_;
  std::vector<SourceTensor> tensors_;
  std::map<std::string, size_t> index_;
};

}  // namespace spade
