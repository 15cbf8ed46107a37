// GGUF (v2/v3) reader: key/value metadata, tensor directory, memory-mapped tensor data.
// Every offset, count and length read from the file is validated against the file size
// before use; malformed files raise spade::Error naming the file and the field.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/mmap_file.h"
#include "core/tensor.h"

namespace spade {

enum class GgufValueType : uint32_t {
  UINT8 = 0, INT8 = 1, UINT16 = 2, INT16 = 3, UINT32 = 4, INT32 = 5, FLOAT32 = 6,
  BOOL = 7, STRING = 8, ARRAY = 9, UINT64 = 10, INT64 = 11, FLOAT64 = 12,
};

// One metadata value. Scalars are widened (integers to int64/uint64, floats to double);
// arrays keep their element type and hold their elements in `array` (or, for the large
// string arrays of vocabularies, in `strings`).
struct GgufValue {
  GgufValueType type = GgufValueType::UINT32;
  GgufValueType elem_type = GgufValueType::UINT32;  // for arrays
  int64_t i = 0;       // signed integer scalars and bool
  uint64_t u = 0;      // unsigned integer scalars
  double f = 0;        // float scalars
  std::string s;       // string scalar
  std::vector<std::string> strings;  // array of strings
  std::vector<double> numbers;       // array of numbers (any numeric element type)

  bool is_array() const { return type == GgufValueType::ARRAY; }
  int64_t as_int() const;       // any integer or bool scalar; throws otherwise
  double as_float() const;      // any numeric scalar
};

struct GgufTensorInfo {
  std::string name;
  DType dtype = DType::F32;     // meaningful only when dtype_known
  uint32_t ggml_type = 0;       // raw ggml type id as stored
  bool dtype_known = false;     // spade can dequantize this ggml type
  std::vector<int64_t> ne;      // ggml order: ne[0] is the contiguous (innermost) dim
  uint64_t offset = 0;          // relative to the data section
  const uint8_t* data = nullptr;
  size_t nbytes = 0;             // 0 (and data null) for ggml type ids unknown to spade
  int64_t numel() const;
  std::string type_name() const;           // "q4_1", "ggml_type_99"
  std::vector<int64_t> shape() const;      // row-major order (reversed ne): [rows, cols]
};

class GgufFile {
 public:
  static std::unique_ptr<GgufFile> open(const std::string& path);
  // Parses an in-memory image (fuzzing, tests). `data` must outlive the object.
  static std::unique_ptr<GgufFile> parse(const uint8_t* data, size_t size,
                                         const std::string& name);

  uint32_t version() const { return version_; }
  const std::string& path() const { return path_; }
  const std::map<std::string, GgufValue>& metadata() const { return kv_; }
  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }

  const GgufValue* find(const std::string& key) const;
  const GgufTensorInfo* find_tensor(const std::string& name) const;
  // Typed getters: throw spade::Error naming the key when missing or of the wrong type.
  std::string get_string(const std::string& key) const;
  int64_t get_int(const std::string& key) const;
  double get_float(const std::string& key) const;
  std::optional<int64_t> get_int_opt(const std::string& key) const;
  std::optional<double> get_float_opt(const std::string& key) const;
  std::optional<std::string> get_string_opt(const std::string& key) const;
  // Length of an array value (vocabularies); throws when missing or not an array.
  size_t get_array_size(const std::string& key) const;

  // The tensor's data as a row-major view (shape = reversed ne). Throws spade::Error naming
  // the tensor and its ggml type when spade cannot read that type.
  TensorView view(const GgufTensorInfo& t) const;
  TensorView view(const std::string& name) const;  // throws when the tensor is missing

  uint32_t alignment() const { return alignment_; }
  uint64_t data_offset() const { return data_offset_; }  // start of the tensor data section
  size_t file_size() const { return size_; }

 private:
  GgufFile() = default;
  void parse_image(const uint8_t* data, size_t size);
  MappedFile file_;
  std::string path_;
  uint32_t version_ = 0;
  uint32_t alignment_ = 32;
  uint64_t data_offset_ = 0;
  size_t size_ = 0;
  std::map<std::string, GgufValue> kv_;
  std::vector<GgufTensorInfo> tensors_;
  std::map<std::string, size_t> tensor_index_;
};

}  // namespace spade
