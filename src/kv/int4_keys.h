// INT4 copy of the key cache (Twilight, section 4.2.1): every cached key row (one token, one
// KV head, D values) is kept a second time as 4-bit codes with an asymmetric fp16 scale and
// zero point,
//     k'[d] = zero + code[d] * scale,   code[d] in [0, 15],
// zero = min_d k[d] rounded down to fp16, scale = (max_d k[d] - zero) / 15 rounded up to
// fp16, so every code lies in [0, 15] without clamping and |k[d] - k'[d]| <= scale / 2.
// Two codes share a byte (even d in the low nibble). A row costs D/2 + 4 bytes against 4*D
// for the fp32 row (D = 64: 36 vs 256 bytes).
//
// The store is filled on append (sync() quantizes the rows written since the last call,
// each row once, never per step) and read by the Twilight pruner to estimate q.k.
#pragma once
#include <cstdint>
#include <vector>

#include "kv/kv_pool.h"

namespace spade {

// Quantizes x[0..D) (D even) into codes[D/2] and fp16 bit patterns of scale and zero.
void int4_quantize_row(const float* x, int D, uint8_t* codes, uint16_t* scale_f16,
                       uint16_t* zero_f16);
// Reconstructs k'[0..D) from a quantized row.
void int4_dequantize_row(const uint8_t* codes, float scale, float zero, int D, float* out);
// sum_d q[d] * k'[d] = zero * q_sum + scale * sum_d q[d] * code[d]  (q_sum = sum_d q[d]).
float int4_dot(const float* q, float q_sum, const uint8_t* codes, float scale, float zero, int D);

// The INT4 keys of one request: rows [layer][pos][kv_head], positions 0..length(layer).
class Int4KeyStore {
 public:
  Int4KeyStore() = default;
  Int4KeyStore(int n_layers, int n_kv_heads, int head_dim) { init(n_layers, n_kv_heads, head_dim); }
  void init(int n_layers, int n_kv_heads, int head_dim);
  bool initialized() const { return n_layers_ > 0; }

  // Quantizes the rows [length(layer), L) of `layer` from the fp32 cache (every KV head).
  // Rows already quantized are left alone; L smaller than length(layer) truncates (the
  // sequence was rewound).
  void sync(const KVPool& kv, int layer, const PageTable& pt, int64_t L);
  // Reserves room for `n` positions per layer (avoids growth during decode).
  void reserve(int64_t n);
  void clear();

  int64_t length(int layer) const { return len_[size_t(layer)]; }
  const uint8_t* codes(int layer, int64_t pos, int head) const {
    return codes_[size_t(layer)].data() + (pos * hkv_ + head) * (d_ / 2);
  }
  float scale(int layer, int64_t pos, int head) const;
  float zero(int layer, int64_t pos, int head) const;
  int head_dim() const { return d_; }
  // Bytes held (codes + scale/zero), over every layer.
  size_t bytes() const;

 private:
  int n_layers_ = 0, hkv_ = 0, d_ = 0;
  std::vector<int64_t> len_;
  std::vector<std::vector<uint8_t>> codes_;    // [layer] -> [pos][head][D/2]
  std::vector<std::vector<uint16_t>> params_;  // [layer] -> [pos][head][scale, zero] (fp16)
};

}  // namespace spade
