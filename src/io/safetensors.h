// Safetensors reader: u64 header length N, N bytes of JSON header, then the data section.
// The header maps tensor names to {dtype, shape, data_offsets: [begin, end)} (offsets
// relative to the data section) plus an optional "__metadata__" string map. Files are
// memory-mapped; every offset, size and shape is validated before use.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/mmap_file.h"
#include "core/tensor.h"

namespace spade {

struct SafetensorsTensor {
  std::string name;
  std::string dtype_name;     // as written in the header: "F32", "BF16", "F8_E4M3", ...
  bool dtype_known = false;   // spade can read it (F32, F16, BF16, I32, I8)
  DType dtype = DType::F32;   // meaningful only when dtype_known
  std::vector<int64_t> shape;  // row-major
  uint64_t begin = 0, end = 0;  // data_offsets
  const uint8_t* data = nullptr;
  size_t nbytes = 0;
  int64_t numel() const;
};

class SafetensorsFile {
 public:
  static std::unique_ptr<SafetensorsFile> open(const std::string& path);
  // Parses an in-memory image (fuzzing, tests). `data` must outlive the object.
  static std::unique_ptr<SafetensorsFile> parse(const uint8_t* data, size_t size,
                                                const std::string& name);

  const std::string& path() const { return path_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }  // by offset
  const SafetensorsTensor* find(const std::string& name) const;
  // Row-major view of the data; throws naming the tensor and dtype when spade cannot read
  // that dtype or the tensor has more than 4 dimensions.
  TensorView view(const SafetensorsTensor& t) const;

 private:
  SafetensorsFile() = default;
  void parse_image(const uint8_t* data, size_t size);
  MappedFile file_;
  std::string path_;
  std::map<std::string, std::string> metadata_;
  std::vector<SafetensorsTensor> tensors_;
  std::map<std::string, size_t> index_;
};

// A model's weights in one directory: `model.safetensors`, or the shards listed by
// `model.safetensors.index.json` ({"weight_map": {tensor: shard file}}). `path` may also
// name a single .safetensors file.
class SafetensorsModel {
 public:
  static std::unique_ptr<SafetensorsModel> open(const std::string& path);

  const std::string& path() const { return path_; }
  size_t shard_count() const { return shards_.size(); }
  const SafetensorsFile& shard(size_t i) const { return *shards_[i]; }
  const SafetensorsTensor* find(const std::string& name) const;
  const SafetensorsTensor& get(const std::string& name) const;  // throws naming it
  TensorView view(const std::string& name) const;
  std::vector<const SafetensorsTensor*> tensors() const;  // every shard, sorted by name

 private:
  std::string path_;
  std::vector<std::unique_ptr<SafetensorsFile>> shards_;
  std::map<std::string, std::pair<size_t, const SafetensorsTensor*>> index_;
};

}  // namespace spade
