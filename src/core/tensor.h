// A non-owning view of a tensor: data pointer, dtype, device, shape and strides (in
// elements, row-major by default). Up to 4 dimensions, which covers every tensor spade
// passes between components. Ownership lives elsewhere (mmap, Buffer, device pool).
#pragma once
#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"

namespace spade {

struct TensorView {
  static constexpr int kMaxDims = 4;
  void* data = nullptr;
  DType dtype = DType::F32;
  Device device = Device::CPU;
  int ndim = 0;
  std::array<int64_t, kMaxDims> shape{};
  std::array<int64_t, kMaxDims> stride{};  // in elements (block types: contiguous only)

  TensorView() = default;
  TensorView(void* d, DType t, std::initializer_list<int64_t> dims, Device dev = Device::CPU)
      : data(d), dtype(t), device(dev) {
    SPADE_CHECK(dims.size() <= kMaxDims, "TensorView: at most ", kMaxDims, " dims");
    ndim = int(dims.size());
    int i = 0;
    for (int64_t s : dims) shape[i++] = s;
    set_contiguous_strides();
  }

  void set_contiguous_strides() {
    int64_t s = 1;
    for (int i = ndim - 1; i >= 0; --i) {
      stride[i] = s;
      s *= shape[i];
    }
  }
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= shape[i];
    return n;
  }
  bool is_contiguous() const {
    int64_t s = 1;
    for (int i = ndim - 1; i >= 0; --i) {
      if (shape[i] != 1 && stride[i] != s) return false;
      s *= shape[i];
    }
    return true;
  }
  template <typename T>
  T* as() const { return static_cast<T*>(data); }

  std::string shape_str() const {
    std::string s = "[";
    for (int i = 0; i < ndim; ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
    return s + "]";
  }
};

// Owning host buffer of floats with a view; used for dequantized weights and scratch.
struct HostTensor {
  std::vector<float> storage;
  TensorView view;
  HostTensor() = default;
  explicit HostTensor(std::initializer_list<int64_t> dims) {
    view = TensorView(nullptr, DType::F32, dims);
    storage.assign(size_t(view.numel()), 0.f);
    view.data = storage.data();
  }
  float* data() { return storage.data(); }
  const float* data() const { return storage.data(); }
  int64_t numel() const { return int64_t(storage.size()); }
};

}  // namespace spade
