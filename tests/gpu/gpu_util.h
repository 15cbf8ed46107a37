// Helpers for the gpu-labelled tests: device buffers, bf16 rounding, error norms.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "backend/cuda/cuda_common.h"
#include "core/half.h"

namespace spade::test {

#define SKIP_WITHOUT_GPU()                                            \
  do {                                                                \
    if (!::spade::cuda::device_available()) GTEST_SKIP() << "no GPU"; \
  } while (0)

template <typename T>
struct DevBuf {
  T* p = nullptr;
  size_t n = 0;
  explicit DevBuf(size_t count) : n(count) { SPADE_CUDA(cudaMalloc(&p, sizeof(T) * (n ? n : 1))); }
  DevBuf(const std::vector<T>& h) : DevBuf(h.size()) { upload(h); }
  ~DevBuf() { cudaFree(p); }
  DevBuf(const DevBuf&) = delete;
  void upload(const std::vector<T>& h) {
    SPADE_CUDA(cudaMemcpy(p, h.data(), sizeof(T) * h.size(), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> h(n);
    SPADE_CUDA(cudaDeviceSynchronize());
    SPADE_CUDA(cudaMemcpy(h.data(), p, sizeof(T) * n, cudaMemcpyDeviceToHost));
    return h;
  }
  // Poison with 0xff bytes (bf16 / fp32 NaN) so unwritten outputs show up.
  void poison() { SPADE_CUDA(cudaMemset(p, 0xff, sizeof(T) * n)); }
};

inline std::vector<float> randn(size_t n, std::mt19937& rng, float scale = 1.f, float mean = 0.f) {
  std::normal_distribution<float> d(mean, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}
inline float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }
inline std::vector<float> round_bf16(const std::vector<float>& v) {
  std::vector<float> r(v.size());
  for (size_t i = 0; i < v.size(); ++i) r[i] = round_bf16(v[i]);
  return r;
}
inline std::vector<__nv_bfloat16> to_bf16(const std::vector<float>& v) {
  std::vector<__nv_bfloat16> r(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    uint16_t b = f32_to_bf16(v[i]);
    std::memcpy(static_cast<void*>(&r[i]), &b, 2);
  }
  return r;
}
inline std::vector<float> from_bf16(const std::vector<__nv_bfloat16>& v) {
  std::vector<float> r(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    uint16_t b;
    std::memcpy(&b, &v[i], 2);
    r[i] = bf16_to_f32(b);
  }
  return r;
}
// ||a - b|| / ||b|| in double; NaN anywhere -> infinity.
inline double rel_err(const float* a, const float* b, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    double d = double(a[i]) - double(b[i]);
    num += d * d;
    den += double(b[i]) * double(b[i]);
  }
  return std::sqrt(num / (den > 0 ? den : 1e-300));
}
inline double rel_err(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  return rel_err(a.data(), b.data(), std::min(a.size(), b.size()));
}

// Tolerances on ||gpu - cpu|| / ||cpu||: the CPU side gets the same bf16-rounded inputs.
constexpr double kTolF32Out = 2e-5;  // fp32 outputs of fp32 math on bf16 inputs (order only)
constexpr double kTolBf16Out = 8e-3; // one bf16 rounding of the output (2^-8 relative, rms)
constexpr double kTolGemm = 1e-3;    // fp32 accumulate; different summation order
constexpr double kTolAttn = 1e-2;    // bf16 P in the P.V product + bf16 output

// Two runs of the same decode step (e.g. with and without score emission) give the same bits,
// unless the step draws its chunks (AttentionWorkspace::draws_chunks: the summation order
// varies between runs), where they agree within one bf16 rounding of the output.
inline void expect_same_decode_output(const std::vector<__nv_bfloat16>& a,
                                      const std::vector<__nv_bfloat16>& b, bool drawn,
                                      const char* what) {
  if (drawn) EXPECT_LT(rel_err(from_bf16(a), from_bf16(b)), kTolBf16Out) << what;
  else EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0]))) << what;
}

}  // namespace spade::test
