// INT4 keys on the GPU (Twilight 4.2.1), device helpers shared by the fused KV append
// (ops.cu, qkv_post) and the bulk quantizer (twilight.cu). The format is kv/int4_keys.h's,
// bit for bit: per (token, KV head) row of D keys,
//   zero  = the largest fp16 <= min_d k[d]
//   scale = the smallest fp16 with zero + 15 * scale >= max_d k[d]   (fp32 arithmetic)
//   code[d] = clamp(rint((k[d] - zero) * (1 / scale)), 0, 15)       (round half to even)
// two codes per byte, even d in the low nibble. Every fp32 operation is the explicitly
// rounded intrinsic (no FMA contraction), as the host code computes it without FMA.
// Device layout (per layer, indexed like the bf16 K cache [page][Hkv][P][D]):
//   codes [page][Hkv][P][D/2] uint8     sz [page][Hkv][P] uint32 = scale_f16 | zero_f16 << 16
#pragma once
#include <cuda_fp16.h>

#include <cstdint>

namespace spade::cuda {

__device__ __forceinline__ uint16_t i4_f16_bits(float x) {
  return __half_as_ushort(__float2half_rn(x));
}
__device__ __forceinline__ float i4_f16_val(uint16_t h) { return __half2float(__ushort_as_half(h)); }
// Neighbouring fp16 bit patterns toward -inf / +inf (kv/int4_keys.cpp's f16_down / f16_up).
__device__ __forceinline__ uint16_t i4_f16_down(uint16_t h) {
  if ((h & 0x7fffu) == 0) return 0x8001u;
  return (h & 0x8000u) ? uint16_t(h + 1) : uint16_t(h - 1);
}
__device__ __forceinline__ uint16_t i4_f16_up(uint16_t h) {
  if ((h & 0x7fffu) == 0) return 0x0001u;
  return (h & 0x8000u) ? uint16_t(h - 1) : uint16_t(h + 1);
}

// Scale / zero of a row with minimum mn and maximum mx (finite, inside the fp16 range; the
// host quantizer throws outside it, here such a row gets whatever the loops give).
__device__ __forceinline__ void i4_row_params(float mn, float mx, uint16_t* sh_out,
                                              uint16_t* zh_out, float* s_out, float* z_out) {
  uint16_t zh = i4_f16_bits(mn);
  while (i4_f16_val(zh) > mn) zh = i4_f16_down(zh);
  const float z = i4_f16_val(zh);
  uint16_t sh = i4_f16_bits(__fdiv_rn(__fsub_rn(mx, z), 15.f));
  while (__fadd_rn(z, __fmul_rn(15.f, i4_f16_val(sh))) < mx) sh = i4_f16_up(sh);
  *sh_out = sh;
  *zh_out = zh;
  *s_out = i4_f16_val(sh);
  *z_out = z;
}

__device__ __forceinline__ int i4_code(float x, float z, float inv) {
  const int c = __float2int_rn(__fmul_rn(__fsub_rn(x, z), inv));
  return c < 0 ? 0 : (c > 15 ? 15 : c);
}

// One warp quantizes one row held as in qkv_post: lane has lo[j] = k[lane + 32 j] and
// hi[j] = k[half + lane + 32 j] for lane + 32 j < half (half = D / 2, even). Writes the D/2
// code bytes of the row (even lanes, one byte per pair) and its packed scale/zero (lane 0).
// Every lane of the warp must call it (shuffles).
__device__ __forceinline__ void int4_quantize_row_warp(const float (&lo)[4], const float (&hi)[4],
                                                      int half, uint8_t* codes, uint32_t* sz) {
  const int lane = threadIdx.x & 31;
  float mn = INFINITY, mx = -INFINITY;
#pragma unroll
  for (int j = 0; j < 4; ++j)
    if (lane + 32 * j < half) {
      mn = fminf(mn, fminf(lo[j], hi[j]));
      mx = fmaxf(mx, fmaxf(lo[j], hi[j]));
    }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    mn = fminf(mn, __shfl_xor_sync(0xffffffffu, mn, o));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  }
  uint16_t sh, zh;
  float s, z;
  i4_row_params(mn, mx, &sh, &zh, &s, &z);
  const float inv = s > 0.f ? __fdiv_rn(1.f, s) : 0.f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if (32 * j >= half) break;  // uniform over the warp
    const bool ok = lane + 32 * j < half;
    const int c0 = ok ? i4_code(lo[j], z, inv) : 0, c1 = ok ? i4_code(hi[j], z, inv) : 0;
    const int n0 = __shfl_down_sync(0xffffffffu, c0, 1), n1 = __shfl_down_sync(0xffffffffu, c1, 1);
    if (ok && (lane & 1) == 0) {
      codes[(lane + 32 * j) / 2] = uint8_t(c0 | (n0 << 4));
      codes[(half + lane + 32 * j) / 2] = uint8_t(c1 | (n1 << 4));
    }
  }
  if (lane == 0) *sz = uint32_t(sh) | (uint32_t(zh) << 16);
}

}  // namespace spade::cuda
