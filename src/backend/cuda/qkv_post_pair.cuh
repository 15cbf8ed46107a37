// One dimension pair (i, i + D/2) of one head of qkv_post (ops.h): RoPE for q and k heads, the
// bf16 store to q_out or to the paged K/V cache, and (k heads, Quest decode steps) the page's
// min / max metadata. Shared by qkv_post_kernel (ops.cu) and the qkv GEMV that fuses it
// (gemv.cu), so both compute every output with the same expressions, bit for bit.
#pragma once
#include <cuda_bf16.h>

#include "backend/cuda/ops.h"
#include "kv/fp8_e4m3.h"

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

// x_lo, x_hi: the pair after bias and q/k norm. Rotates q / k pairs, stores both as bf16 and
// returns the stored (bf16-rounded) values in x_lo / x_hi.
__device__ __forceinline__ void qkv_post_pair(const QkvPostArgs& a, int t, int head, int i,
                                              bf16* dst, float& x_lo, float& x_hi) {
  const int half = a.D / 2;
  float x0 = x_lo, x1 = x_hi;
  if (head < a.Hq + a.Hkv) {  // q or k
    // Explicit FMAs: with plain `a * b - c * d` the compiler may fuse either product, and it
    // chose differently in the two kernels (1-ulp differences after the bf16 rounding). These
    // are the forms ptxas made of qkv_post's `lo * cs - hi * sn` / `hi * cs + lo * sn` before
    // the fusion (its SASS: FFMA lo, cs, -(hi * sn) and FFMA lo, sn, hi * cs), so its outputs
    // did not change.
    float sn, cs;
    sincosf(__fmul_rn(float(a.pos[t]), a.inv_freq[i]), &sn, &cs);
    x0 = fmaf(x_lo, cs, -__fmul_rn(sn, x_hi));
    x1 = fmaf(x_lo, sn, __fmul_rn(cs, x_hi));
  }
  if (head >= a.Hq && (a.kv_scale || a.kv_amax)) {  // fp8 cache (ops.h QkvPostArgs::kv_scale)
    if (a.kv_amax) {  // calibration pass: the caller reduces the values; nothing is stored
      x_lo = x0, x_hi = x1;
      return;
    }
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
