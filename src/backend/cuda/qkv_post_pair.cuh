// One dimension pair (i, i + D/2) of one head of qkv_post (ops.h): RoPE for q and k heads, the
// bf16 store to q_out or to the paged K/V cache (or fp8 codes), and (k heads, Quest decode
// steps) the page's min / max metadata; the warp's key rotation of fp8 caches. Shared by qkv_post_kernel (ops.cu) and the qkv GEMV that fuses it
// (gemv.cu), so both compute every output with the same expressions, bit for bit.
#pragma once
#include <cuda_bf16.h>

#include "backend/cuda/ops.h"
#include "kv/fp8_e4m3.h"
#include "kv/key_rotation.h"

namespace spade::cuda {

// Where head `head` of token t goes: q_out [T, Hq, D], or the cache row (page[t], pos[t] % P)
// of K / V head `head - Hq` / `head - Hq - Hkv`.
__device__ __forceinline__ bf16* qkv_post_dst(const QkvPostArgs& a, int t, int head) {
  if (head < a.Hq) return a.q_out + (int64_t(t) * a.Hq + head) * a.D;
  const bool is_k = head < a.Hq + a.Hkv;
  const int kh = is_k ? head - a.Hq : head - a.Hq - a.Hkv;
  bf16* base = is_k ? a.k_cache : a.v_cache;
  return base + ((int64_t(a.page[t]) * a.Hkv + kh) * a.P + a.pos[t] % a.P) * a.D;
}

// x_lo, x_hi: the pair after bias and q/k norm -> the pair after RoPE (q and k heads; v heads
// unchanged).
__device__ __forceinline__ void qkv_post_rope(const QkvPostArgs& a, int t, int head, int i,
                                              float& x_lo, float& x_hi) {
  if (head >= a.Hq + a.Hkv) return;  // v
  // Explicit FMAs: with plain `a * b - c * d` the compiler may fuse either product, and it
  // chose differently in the two kernels (1-ulp differences after the bf16 rounding). These
  // are the forms ptxas made of qkv_post's `lo * cs - hi * sn` / `hi * cs + lo * sn` before
  // the fusion (its SASS: FFMA lo, cs, -(hi * sn) and FFMA lo, sn, hi * cs), so its outputs
  // did not change.
  float sn, cs;
  sincosf(__fmul_rn(float(a.pos[t]), a.inv_freq[i]), &sn, &cs);
  const float x0 = fmaf(x_lo, cs, -__fmul_rn(sn, x_hi));
  const float x1 = fmaf(x_lo, sn, __fmul_rn(cs, x_hi));
  x_lo = x0, x_hi = x1;
}

// x_lo, x_hi: the pair ready to store (after RoPE, and the key rotation where a.rotate_qk) ->
// stored as bf16 (q_out, the bf16 cache) or fp8 codes; returns the stored values in x_lo /
// x_hi (the fp8 calibration pass stores nothing and returns them unchanged).
__device__ __forceinline__ void qkv_post_store(const QkvPostArgs& a, int t, int head, int i,
                                               bf16* dst, float& x_lo, float& x_hi) {
  const int half = a.D / 2;
  const float x0 = x_lo, x1 = x_hi;
  if (head >= a.Hq && (a.kv_scale || a.kv_amax)) {  // fp8 cache (ops.h QkvPostArgs::kv_scale)
    if (a.kv_amax) return;  // calibration pass: the caller reduces the values; nothing is stored
    const bool is_k = head < a.Hq + a.Hkv;
    const int kh = is_k ? head - a.Hq : head - a.Hq - a.Hkv;
    const float sc = a.kv_scale[is_k ? kh : a.Hkv + kh];
    uint8_t* d8 = reinterpret_cast<uint8_t*>(is_k ? a.k_cache : a.v_cache) +
                  ((int64_t(a.page[t]) * a.Hkv + kh) * a.P + a.pos[t] % a.P) * a.D;
    const uint8_t c0 = fp8_e4m3_from_f32(__fdiv_rn(x0, sc));
    const uint8_t c1 = fp8_e4m3_from_f32(__fdiv_rn(x1, sc));
    d8[i] = c0;
    d8[i + half] = c1;
    x_lo = fp8_e4m3_to_f32(c0) * sc;  // the cached values
    x_hi = fp8_e4m3_to_f32(c1) * sc;
    return;
  }
  dst[i] = __float2bfloat16(x0);
  dst[i + half] = __float2bfloat16(x1);
  x_lo = __bfloat162float(__float2bfloat16(x0));  // the cached (bf16) values
  x_hi = __bfloat162float(__float2bfloat16(x1));
}

// Both of the above: rotates q / k pairs, stores, and returns the stored values in x_lo / x_hi.
__device__ __forceinline__ void qkv_post_pair(const QkvPostArgs& a, int t, int head, int i,
                                              bf16* dst, float& x_lo, float& x_hi) {
  qkv_post_rope(a, t, head, i, x_lo, x_hi);
  qkv_post_store(a, t, head, i, dst, x_lo, x_hi);
}

// The key rotation of fp8 caches (kv/key_rotation.h) on one head held by a warp as
// qkv_post_kernel holds it: lane `lane` has elements i = lane + 32 j (lo[j]) and i + D/2 (hi[j])
// for i < D/2, j < 4 (D <= 256, a power of two). Element index bits: the lane's low bits, then
// j's, then the lo / hi bit; the butterfly stages run in the order of rotate_key_row
// (len = 1, 2, ..., D/2) with its operations (a + b, a - b), then the product by
// key_rotation_scale(D), so every value equals the CPU's bit for bit. Every lane of the warp
// takes part (the shuffles); entries with i >= D/2 are zeros and stay unused.
__device__ __forceinline__ void rotate_key_warp(float (&lo)[4], float (&hi)[4], int D, int lane) {
  const int half = D / 2;
  for (int len = 1; len < half && len < 32; len <<= 1) {  // lane bits
    const bool upper = (lane & len) != 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float pl = __shfl_xor_sync(0xffffffffu, lo[j], len);
      const float ph = __shfl_xor_sync(0xffffffffu, hi[j], len);
      lo[j] = upper ? pl - lo[j] : lo[j] + pl;  // upper: a - b with a the lower partner
      hi[j] = upper ? ph - hi[j] : hi[j] + ph;
    }
  }
  auto bfly = [](float& x, float& y) {
    const float u = x, w = y;
    x = u + w;
    y = u - w;
  };
  if (half > 32) {  // len 32: j bit 0
    bfly(lo[0], lo[1]), bfly(lo[2], lo[3]);
    bfly(hi[0], hi[1]), bfly(hi[2], hi[3]);
  }
  if (half > 64) {  // len 64: j bit 1
    bfly(lo[0], lo[2]), bfly(lo[1], lo[3]);
    bfly(hi[0], hi[2]), bfly(hi[1], hi[3]);
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) bfly(lo[j], hi[j]);  // len D/2
  const float s = key_rotation_scale(D);
#pragma unroll
  for (int j = 0; j < 4; ++j) lo[j] *= s, hi[j] *= s;
}

// Quest decode steps (a.quest_meta, k heads): the page's min / max rows with this key's pair
// (stored values lo, hi), fminf / fmaxf from +-inf as quest_update_meta's row loop (exact: bf16
// values); a page's first row sets them.
__device__ __forceinline__ void qkv_post_meta_pair(const QkvPostArgs& a, int t, int head, int i,
                                                   float lo, float hi) {
  const int D = a.D, half = D / 2;
  bf16* mn = a.quest_meta + (int64_t(a.page[t]) * a.Hkv + (head - a.Hq)) * 2 * D;
  bf16* mx = mn + D;
  const bool first = a.pos[t] % a.P == 0;
  const float n0 = fminf(first ? INFINITY : __bfloat162float(mn[i]), lo);
  const float n1 = fminf(first ? INFINITY : __bfloat162float(mn[i + half]), hi);
  const float x0 = fmaxf(first ? -INFINITY : __bfloat162float(mx[i]), lo);
  const float x1 = fmaxf(first ? -INFINITY : __bfloat162float(mx[i + half]), hi);
  mn[i] = __float2bfloat16(n0), mn[i + half] = __float2bfloat16(n1);
  mx[i] = __float2bfloat16(x0), mx[i + half] = __float2bfloat16(x1);
}

}  // namespace spade::cuda
