// FP8 E4M3 (OCP 8-bit floating point, the "fn" variant of NVIDIA's __nv_fp8_e4m3) for the KV
// cache (--kv-dtype fp8, issue 40): host C++ and CUDA device code share these functions, so the
// CPU reference and the GPU append quantize to the same bits.
//
// A code is s eeee mmm, exponent bias 7. e > 0: (-1)^s (1 + m / 8) 2^(e - 7); e = 0 (subnormal):
// (-1)^s (m / 8) 2^-6. The largest finite magnitude is 448 (0x7E); there are no infinities and
// 0x7F / 0xFF are NaN. 0x80 is -0.
//
// fp8_e4m3_from_f32 rounds to nearest, ties to even, and saturates: every finite value beyond
// +-448 and +-inf become +-448 (as cvt.rn.satfinite.e4m3x2.f32 / __NV_SATFINITE). Every NaN,
// whatever its sign or payload, gives the one canonical code 0x7F (as the hardware's cvt with
// satfinite does): a NaN's sign is not portable (x86 keeps it through x / scale, a GPU's
// division returns the canonical positive NaN), so both devices store 0x7F. 0xFF is still read
// as NaN but never written. fp8_e4m3_to_f32 is exact.
//
// The cache's scales (one per layer, KV head, K and V; kv/kv_pool.h) are powers of two:
// stored code = fp8_e4m3_from_f32(x / scale), value read = fp8_e4m3_to_f32(code) * scale; both
// the division and the product are exact in fp32 (and the product in bf16: 4 significant
// bits), so every reader and both devices see the same values whatever order they multiply
// in. fp8_e4m3_scale_for_amax is the rule of `--kv-scale auto`.
#pragma once
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define SPADE_HD __host__ __device__
#else
#define SPADE_HD
#endif

namespace spade {

SPADE_HD inline uint32_t fp8_bits_of(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

SPADE_HD inline float fp8_float_of(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

constexpr float kFp8E4m3Max = 448.f;

// Exact value of an E4M3 code (NaN for 0x7F / 0xFF).
SPADE_HD inline float fp8_e4m3_to_f32(uint8_t c) {
  const uint32_t sign = uint32_t(c & 0x80u) << 24;
  const uint32_t mag = c & 0x7Fu;
  if (mag == 0x7Fu) return fp8_float_of(sign | 0x7FC00000u);
  if (mag < 8u)  // subnormal (or zero): m * 2^-9, exact in fp32
    return fp8_float_of(sign | fp8_bits_of(float(mag) * 0.001953125f));
  // Normal: exponent e - 7 + 127 = e + 120, the 3 mantissa bits on top of fp32's 23.
  return fp8_float_of(sign | ((mag + (120u << 3)) << 20));
}

// Round to nearest even, saturating to +-448 (inf included); every NaN -> 0x7F (no sign).
SPADE_HD inline uint8_t fp8_e4m3_from_f32(float x) {
  const uint32_t u = fp8_bits_of(x);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return uint8_t(0x7Fu);  // NaN: canonical, sign dropped
  const uint32_t E = a >> 23;                          // fp32 biased exponent
  uint32_t code;
  if (E >= 121u) {  // |x| >= 2^-6: a normal E4M3 value (or beyond the range)
    // Exponent and the top 3 mantissa bits, rebiased (127 -> 7), then the 20 bits below
    // rounded to nearest even; a carry moves into the exponent as it should.
    code = (a >> 20) - (120u << 3);
    const uint32_t rem = a & 0xFFFFFu;
    if (rem > 0x80000u || (rem == 0x80000u && (code & 1u))) ++code;
    if (code > 0x7Eu) code = 0x7Eu;  // saturate (0x7F would be NaN)
  } else if (E >= 117u) {  // 2^-10 <= |x| < 2^-6: subnormal m * 2^-9, m = round(|x| 2^9)
    const uint32_t mant = (a & 0x7FFFFFu) | 0x800000u;  // |x| = mant 2^(E - 150)
    const uint32_t shift = 141u - E;                    // 21..24: |x| 2^9 = mant >> shift
    code = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (code & 1u))) ++code;  // 8 is 2^-6, the smallest normal
  } else {
    code = 0;  // |x| < 2^-10: rounds to zero
  }
  return uint8_t(sign | code);
}

// The `--kv-scale auto` rule: the smallest power of two s with amax <= 224 s (amax, the largest
// |value| of a (layer, KV head)'s K or V in the prefill that sets it, maps to at most half of
// E4M3's 448: 2x headroom for later values before they saturate), clamped to
// [2^-40, 2^40]; amax <= 0 (or not finite) gives 1. Exact: 224 s is exact in fp32.
constexpr float kFp8ScaleMin = 9.094947017729282e-13f;  // 2^-40
constexpr float kFp8ScaleMax = 1099511627776.f;         // 2^40
SPADE_HD inline float fp8_e4m3_scale_for_amax(float amax) {
  if (!(amax > 0.f) || !(amax <= 3.4028234663852886e38f)) return 1.f;
  const uint32_t E = fp8_bits_of(amax) >> 23;  // amax in [2^(E-127), 2^(E-126)) (normal)
  if (E < 1u + 7u + 40u) return kFp8ScaleMin;  // amax < 2^-79 (or subnormal): far below
  // Candidate 2^(e - 7), e = E - 127: 224 s = 1.75 2^e; double it when amax > 1.75 2^e.
  float s = fp8_float_of((E - 7u) << 23);
  if (amax > 224.f * s) s *= 2.f;
  if (s < kFp8ScaleMin) return kFp8ScaleMin;
  if (s > kFp8ScaleMax) return kFp8ScaleMax;
  return s;
}

// The smallest power of two >= x (x > 0 finite), for a fixed `--kv-scale X`: rounded up, so a
// value that fits under 448 X fits under 448 s. Clamped to [2^-40, 2^40] by the caller's check.
SPADE_HD inline float fp8_pow2_ceil(float x) {
  const uint32_t u = fp8_bits_of(x);
  if ((u & 0x7FFFFFu) == 0u) return x;  // a power of two already (normal)
  return fp8_float_of((u & 0x7F800000u) + 0x800000u);
}

}  // namespace spade
