// Test helper: builds GGUF images byte by byte (valid ones, and broken ones through the
// raw overrides), and a scratch directory that removes itself.
#pragma once
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "core/half.h"

namespace spade::test {

class ByteSink {
 public:
  template <typename T>
  void put(T v) {
    uint8_t b[sizeof(T)];
    std::memcpy(b, &v, sizeof(T));
    bytes.insert(bytes.end(), b, b + sizeof(T));
  }
  void put_str(const std::string& s) {
    put<uint64_t>(s.size());
    bytes.insert(bytes.end(), s.begin(), s.end());
  }
  std::vector<uint8_t> bytes;
};

struct GgufTensorSpec {
  std::string name;
  std::vector<uint64_t> ne;  // ggml order
  uint32_t type = 0;
  std::vector<uint8_t> data;
  std::optional<uint64_t> offset;  // override the computed offset
  std::optional<uint32_t> n_dims;  // override the written n_dims
};

class GgufWriter {
 public:
  explicit GgufWriter(uint32_t version = 3, uint32_t alignment = 32)
      : version_(version), alignment_(alignment) {}

  // Value types: 4 = u32, 5 = i32, 6 = f32, 7 = bool, 8 = string, 9 = array, 10 = u64.
  void kv_u32(const std::string& k, uint32_t v) { begin(k, 4).put(v); }
  void kv_i32(const std::string& k, int32_t v) { begin(k, 5).put(v); }
  void kv_f32(const std::string& k, float v) { begin(k, 6).put(v); }
  void kv_bool(const std::string& k, bool v) { begin(k, 7).put<uint8_t>(v); }
  void kv_u64(const std::string& k, uint64_t v) { begin(k, 10).put(v); }
  void kv_u8(const std::string& k, uint8_t v) { begin(k, 0).put(v); }
  void kv_i64(const std::string& k, int64_t v) { begin(k, 11).put(v); }
  void kv_f64(const std::string& k, double v) { begin(k, 12).put(v); }
  void kv_str(const std::string& k, const std::string& v) { begin(k, 8).put_str(v); }
  void kv_str_array(const std::string& k, const std::vector<std::string>& v) {
    ByteSink& s = begin(k, 9);
    s.put<uint32_t>(8);
    s.put<uint64_t>(v.size());
    for (const auto& x : v) s.put_str(x);
  }
  void kv_i32_array(const std::string& k, const std::vector<int32_t>& v) {
    ByteSink& s = begin(k, 9);
    s.put<uint32_t>(5);
    s.put<uint64_t>(v.size());
    for (int32_t x : v) s.put(x);
  }
  void kv_f32_array(const std::string& k, const std::vector<float>& v) {
    ByteSink& s = begin(k, 9);
    s.put<uint32_t>(6);
    s.put<uint64_t>(v.size());
    for (float x : v) s.put(x);
  }
  // Appends raw bytes as one kv entry (key + type + payload written by the caller).
  void kv_raw(const std::vector<uint8_t>& entry) {
    kv_.bytes.insert(kv_.bytes.end(), entry.begin(), entry.end());
    ++n_kv_;
  }

  void tensor(GgufTensorSpec t) { tensors_.push_back(std::move(t)); }
  void tensor_f32(const std::string& name, std::vector<uint64_t> ne, const std::vector<float>& v) {
    GgufTensorSpec t{name, std::move(ne), 0, {}, {}, {}};
    t.data.resize(v.size() * 4);
    std::memcpy(t.data.data(), v.data(), t.data.size());
    tensors_.push_back(std::move(t));
  }

  std::vector<uint8_t> build() const {
    ByteSink s;
    s.bytes.insert(s.bytes.end(), {'G', 'G', 'U', 'F'});
    s.put<uint32_t>(version_);
    s.put<uint64_t>(tensors_.size());
    s.put<uint64_t>(n_kv_);
    s.bytes.insert(s.bytes.end(), kv_.bytes.begin(), kv_.bytes.end());
    std::vector<uint64_t> offsets;
    uint64_t off = 0;
    for (const auto& t : tensors_) {
      offsets.push_back(off);
      off = align(off + t.data.size());
    }
    for (size_t i = 0; i < tensors_.size(); ++i) {
      const auto& t = tensors_[i];
      s.put_str(t.name);
      s.put<uint32_t>(t.n_dims.value_or(uint32_t(t.ne.size())));
      for (uint64_t d : t.ne) s.put<uint64_t>(d);
      s.put<uint32_t>(t.type);
      s.put<uint64_t>(t.offset.value_or(offsets[i]));
    }
    if (tensors_.empty()) return s.bytes;
    s.bytes.resize(align(s.bytes.size()), 0);
    const size_t data_start = s.bytes.size();
    for (size_t i = 0; i < tensors_.size(); ++i) {
      s.bytes.resize(data_start + offsets[i], 0);
      s.bytes.insert(s.bytes.end(), tensors_[i].data.begin(), tensors_[i].data.end());
    }
    return s.bytes;
  }

 private:
  ByteSink& begin(const std::string& k, uint32_t type) {
    kv_.put_str(k);
    kv_.put<uint32_t>(type);
    ++n_kv_;
    return kv_;
  }
  uint64_t align(uint64_t x) const { return (x + alignment_ - 1) / alignment_ * alignment_; }

  uint32_t version_, alignment_;
  ByteSink kv_;
  uint64_t n_kv_ = 0;
  std::vector<GgufTensorSpec> tensors_;
};

inline std::vector<uint8_t> f32_bytes(const std::vector<float>& v) {
  std::vector<uint8_t> b(v.size() * 4);
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}
inline std::vector<uint8_t> f16_bytes(const std::vector<float>& v) {
  std::vector<uint8_t> b(v.size() * 2);
  for (size_t i = 0; i < v.size(); ++i) {
    uint16_t h = f32_to_f16(v[i]);
    std::memcpy(&b[2 * i], &h, 2);
  }
  return b;
}
inline std::vector<uint8_t> bf16_bytes(const std::vector<float>& v) {
  std::vector<uint8_t> b(v.size() * 2);
  for (size_t i = 0; i < v.size(); ++i) {
    uint16_t h = f32_to_bf16(v[i]);
    std::memcpy(&b[2 * i], &h, 2);
  }
  return b;
}

inline void write_file(const std::string& path, const std::vector<uint8_t>& b) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(b.data()), std::streamsize(b.size()));
}
inline void write_file(const std::string& path, const std::string& s) {
  std::ofstream f(path, std::ios::binary);
  f << s;
}

// A fresh directory under the system temp dir, removed with its contents on destruction.
class TempDir {
 public:
  explicit TempDir(const std::string& tag) {
    static int counter = 0;
    path_ = (std::filesystem::temp_directory_path() /
             ("spade_" + tag + "_" + std::to_string(::getpid()) + "_" + std::to_string(counter++)))
                .string();
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

}  // namespace spade::test
