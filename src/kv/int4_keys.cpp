#include "kv/int4_keys.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/half.h"

namespace spade {

namespace {

// Neighbouring fp16 values (bit patterns), toward -inf and +inf.
uint16_t f16_down(uint16_t h) {
  if ((h & 0x7fffu) == 0) return 0x8001u;  // +-0 -> the negative smallest subnormal
  return (h & 0x8000u) ? uint16_t(h + 1) : uint16_t(h - 1);
}
uint16_t f16_up(uint16_t h) {
  if ((h & 0x7fffu) == 0) return 0x0001u;
  return (h & 0x8000u) ? uint16_t(h - 1) : uint16_t(h + 1);
}

}  // namespace

void int4_quantize_row(const float* x, int D, uint8_t* codes, uint16_t* scale_f16,
                       uint16_t* zero_f16) {
  float mn = x[0], mx = x[0];
  for (int d = 1; d < D; ++d) {
    mn = std::min(mn, x[d]);
    mx = std::max(mx, x[d]);
  }
  SPADE_CHECK(std::isfinite(mn) && std::isfinite(mx) && mn > -65000.f && mx < 65000.f,
              "int4_quantize_row: key values outside the fp16 range (min ", mn, ", max ", mx, ")");
  // zero: the largest fp16 <= min.  scale: the smallest fp16 with zero + 15 * scale >= max.
  uint16_t zh = f32_to_f16(mn);
  while (f16_to_f32(zh) > mn) zh = f16_down(zh);
  const float z = f16_to_f32(zh);
  uint16_t sh = f32_to_f16((mx - z) / 15.f);
  while (z + 15.f * f16_to_f32(sh) < mx) sh = f16_up(sh);
  const float s = f16_to_f32(sh);
  const float inv = s > 0.f ? 1.f / s : 0.f;
  for (int d = 0; d < D; d += 2) {
    int c0 = int(std::lrint((x[d] - z) * inv));
    int c1 = int(std::lrint((x[d + 1] - z) * inv));
    c0 = std::clamp(c0, 0, 15);  // only rounding of (x - z) * inv can step outside
    c1 = std::clamp(c1, 0, 15);
    codes[d / 2] = uint8_t(c0 | (c1 << 4));
  }
  *scale_f16 = sh;
  *zero_f16 = zh;
}

void int4_dequantize_row(const uint8_t* codes, float scale, float zero, int D, float* out) {
  for (int d = 0; d < D; d += 2) {
    out[d] = zero + float(codes[d / 2] & 15) * scale;
    out[d + 1] = zero + float(codes[d / 2] >> 4) * scale;
  }
}

float int4_dot(const float* q, float q_sum, const uint8_t* codes, float scale, float zero, int D) {
  float acc0 = 0.f, acc1 = 0.f;
  for (int d = 0; d < D; d += 2) {
    acc0 += q[d] * float(codes[d / 2] & 15);
    acc1 += q[d + 1] * float(codes[d / 2] >> 4);
  }
  return zero * q_sum + scale * (acc0 + acc1);
}

void Int4KeyStore::init(int n_layers, int n_kv_heads, int head_dim) {
  SPADE_CHECK(n_layers > 0 && n_kv_heads > 0 && head_dim > 0 && head_dim % 2 == 0,
              "Int4KeyStore: bad shape ", n_layers, "x", n_kv_heads, "x", head_dim);
  n_layers_ = n_layers;
  hkv_ = n_kv_heads;
  d_ = head_dim;
  len_.assign(size_t(n_layers), 0);
  codes_.assign(size_t(n_layers), {});
  params_.assign(size_t(n_layers), {});
}

void Int4KeyStore::reserve(int64_t n) {
  for (int l = 0; l < n_layers_; ++l) {
    codes_[size_t(l)].reserve(size_t(n * hkv_ * (d_ / 2)));
    params_[size_t(l)].reserve(size_t(n * hkv_ * 2));
  }
}

void Int4KeyStore::clear() {
  std::fill(len_.begin(), len_.end(), 0);
  for (auto& c : codes_) c.clear();
  for (auto& p : params_) p.clear();
}

void Int4KeyStore::sync(const KVPool& kv, int layer, const PageTable& pt, int64_t L) {
  SPADE_CHECK(initialized(), "Int4KeyStore::sync before init");
  // pt.length may lag behind the rows written (the layer loop bumps it after the last
  // layer): the caller names how many rows exist.
  SPADE_CHECK(layer >= 0 && layer < n_layers_ && L <= pt.capacity(kv.layout().page_size),
              "Int4KeyStore::sync: layer ", layer, " length ", L, " (cache has ",
              pt.capacity(kv.layout().page_size), " token slots)");
  int64_t& have = len_[size_t(layer)];
  auto& codes = codes_[size_t(layer)];
  auto& params = params_[size_t(layer)];
  if (L < have) have = L;  // rewound: the rows past L will be rewritten
  if (L == have) return;
  const int64_t row_bytes = d_ / 2;
  // Position-major rows: growing the vectors (geometrically) keeps the earlier rows.
  if (int64_t(codes.size()) < L * hkv_ * row_bytes) {
    codes.resize(size_t(L * hkv_ * row_bytes));
    params.resize(size_t(L * hkv_ * 2));
  }
  // The key widened to fp32 (a 16-bit cache); grown once per thread, so a step allocates nothing.
  thread_local std::vector<float> key;
  if (key.size() < size_t(d_)) key.resize(size_t(d_));
  for (int64_t p = have; p < L; ++p)
    for (int h = 0; h < hkv_; ++h) {
      const size_t r = size_t(p * hkv_ + h);
      kv.load_k(layer, pt, p, h, 1, key.data());
      int4_quantize_row(key.data(), d_, codes.data() + r * size_t(row_bytes),
                        &params[2 * r], &params[2 * r + 1]);
    }
  have = L;
}

float Int4KeyStore::scale(int layer, int64_t pos, int head) const {
  return f16_to_f32(params_[size_t(layer)][size_t(2 * (pos * hkv_ + head))]);
}
float Int4KeyStore::zero(int layer, int64_t pos, int head) const {
  return f16_to_f32(params_[size_t(layer)][size_t(2 * (pos * hkv_ + head) + 1)]);
}

size_t Int4KeyStore::bytes() const {
  size_t b = 0;
  for (int l = 0; l < n_layers_; ++l)
    b += size_t(len_[size_t(l)] * hkv_) * size_t(d_ / 2 + 4);
  return b;
}

}  // namespace spade
