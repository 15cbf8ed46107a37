// Keys of an fp8 KV cache are stored rotated (issue 40's quality bar): each head's key row k
// (after RoPE) is written as R k, R = H_D / sqrt(D), the orthonormal Walsh-Hadamard matrix, and
// every query row q that attends to such a cache is rotated the same way, so that
// (R q) . (R k) = q . k (R is orthogonal: R^T R = I). Attention, every score, Quest's bounds
// (a valid bound in any basis), cluster geometry (distances and cosines are kept) and Twilight's
// INT4 estimate all read the rotated pair; values (V) are not rotated, so outputs are unchanged.
// Why: a few key channels carry most of a key's magnitude (bias-like outliers), and E4M3 rounds
// every element with a relative error up to 2^-4, so q . k's error is dominated by those
// channels; the rotation spreads each key over all D channels. Measured on SmolLM2-135M
// (docs/results.md "FP8 keys rotated"): the fp8 perplexity excess drops from +2.3% to within 1%.
//
// Which caches: fp8 with a head dim that is a power of two in [64, 512] (kv_rotates_keys): the
// heads of the LLMs we serve (64: SmolLM2; 128: Llama-3, Qwen3, Mistral), where it was measured
// to help. Smaller heads store keys as they are: on stories260k (D = 8) the rotation spread
// little and its logit error was slightly larger (max 25% vs 16% of the peak logit, RMS 6.9%
// vs 5.8%). bf16, f16 and f32 caches store keys as they are.
//
// One rounding order on both devices (so the CPU reference and the CUDA append store the same
// codes): the butterfly stages len = 1, 2, 4, ..., D/2, each pair (x[i], x[i + len]) with bit
// `len` of i clear -> (x[i] + x[i + len], x[i] - x[i + len]), then one product by
// key_rotation_scale(D) (1/sqrt(D) as an fp32 constant: a power of two, or 1/sqrt(2) rounded
// once, times a power of two; both exact to compute on either device).
#pragma once
#include <cstdint>

#include "kv/fp8_e4m3.h"  // SPADE_HD
#include "kv/kv_dtype.h"

namespace spade {

SPADE_HD inline bool kv_rotates_keys(KvDtype t, int D) {
  return t == KvDtype::FP8 && D >= 64 && D <= 512 && (D & (D - 1)) == 0;
}

// 1/sqrt(D) for D = 2^n, n in [1, 9]: 2^(-n/2), as the fp32 nearest 1/sqrt(2) times 2^-(n/2)
// for odd n (the product is exact).
SPADE_HD inline float key_rotation_scale(int D) {
  int n = 0;
  while ((1 << n) < D) ++n;
  const float pow2 = 1.f / float(1 << (n / 2));
  return (n & 1) ? 0.70710678118654752f * pow2 : pow2;
}

// x[D] <- R x, in the order above. D: a power of two in [2, 512].
SPADE_HD inline void rotate_key_row(float* x, int D) {
  for (int len = 1; len < D; len <<= 1)
    for (int i = 0; i < D; ++i)
      if ((i & len) == 0) {
        const float a = x[i], b = x[i + len];
        x[i] = a + b;
        x[i + len] = a - b;
      }
  const float s = key_rotation_scale(D);
  for (int i = 0; i < D; ++i) x[i] *= s;
}

// n rows of D floats, each rotated (queries of [T, Hq, D]: n = T * Hq).
inline void rotate_key_rows(float* x, int64_t n, int D) {
  for (int64_t r = 0; r < n; ++r) rotate_key_row(x + r * D, D);
}

}  // namespace spade
