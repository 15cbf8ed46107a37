// The GEMV over weights as stored at the NEON level (aarch64 Advanced SIMD, present on every
// aarch64 CPU): Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, f16 and bf16, fp32 activations (x is never
// quantized) and fp32 accumulation, the contract of the x86 kernels (qgemv.cpp): every weight
// is turned into its exact code or dequantized value, products with x are summed in fp32 over
// several 4-lane accumulators, and the block scale is applied to a block's partial sum.
// - Q8_0 / Q4_0: the signed codes (Q4_0: code - 8, so no offset term) times x, scaled by d.
// - Q4_1: d * sum(code x) + m * sum(x) (the per-32 sums of x, RowJob::xs).
// - Q4_K / Q5_K: each super-block unpacked to 256 byte codes and 8 scales / mins computed as
//   the scalar dequantizer computes them; ds_s * sum(code x) - dm_s * sum(x) per sub-block.
// - Q6_K: the exact dequantized values ds_g * (code - 32), accumulated with FMAs.
// - f16 (vcvt_f32_f16, baseline on aarch64) and bf16 (a 16-bit shift) widen exactly.
// Every x row runs the same arithmetic whatever the number of x rows beside it, so a weight
// row's value for an x row does not depend on M (decode of one sequence and of a batch agree).
// The file compiles on every platform; its body only where NEON is (SPADE_QGEMV_NEON).
// Tested under qemu-aarch64 by scripts/check_neon.sh against dequantize-then-dot.
#include "backend/cpu/qgemv_internal.h"

#if SPADE_QGEMV_NEON
#include <arm_neon.h>

#include <algorithm>
#include <cstring>

#include "core/half.h"
#endif

namespace spade::cpu::qgemv_detail {

#if SPADE_QGEMV_NEON
namespace {

inline float f16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return vgetq_lane_f32(vcvt_f32_f16(vreinterpret_f16_u16(vdup_n_u16(h))), 0);
}

// 16 byte codes -> four vectors of 4 floats (values 0-3, 4-7, 8-11, 12-15).
inline void widen_s8(int8x16_t v, float32x4_t c[4]) {
  const int16x8_t lo = vmovl_s8(vget_low_s8(v)), hi = vmovl_high_s8(v);
  c[0] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo)));
  c[1] = vcvtq_f32_s32(vmovl_high_s16(lo));
  c[2] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi)));
  c[3] = vcvtq_f32_s32(vmovl_high_s16(hi));
}
inline void widen_u8(uint8x16_t v, float32x4_t c[4]) {
  const uint16x8_t lo = vmovl_u8(vget_low_u8(v)), hi = vmovl_high_u8(v);
  c[0] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(lo)));
  c[1] = vcvtq_f32_u32(vmovl_high_u16(lo));
  c[2] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(hi)));
  c[3] = vcvtq_f32_u32(vmovl_high_u16(hi));
}

// The dot of 32 codes c[8] with x[32], as two independent chains per lane pair, summed:
// ((c0 x0 + c2 x2) + (c4 x4 + c6 x6)) + ((c1 x1 + c3 x3) + (c5 x5 + c7 x7)) lane-wise.
inline float32x4_t dot32(const float32x4_t c[8], const float* x) {
  float32x4_t p0 = vmulq_f32(c[0], vld1q_f32(x));
  float32x4_t p1 = vmulq_f32(c[1], vld1q_f32(x + 4));
  float32x4_t p2 = vmulq_f32(c[2], vld1q_f32(x + 8));
  float32x4_t p3 = vmulq_f32(c[3], vld1q_f32(x + 12));
  p0 = vfmaq_f32(p0, c[4], vld1q_f32(x + 16));
  p1 = vfmaq_f32(p1, c[5], vld1q_f32(x + 20));
  p2 = vfmaq_f32(p2, c[6], vld1q_f32(x + 24));
  p3 = vfmaq_f32(p3, c[7], vld1q_f32(x + 28));
  return vaddq_f32(vaddq_f32(p0, p1), vaddq_f32(p2, p3));
}

// ---- Q8_0 / Q4_0 / Q4_1: 32-value blocks ----

template <DType T>
constexpr int kBlockBytes = T == DType::Q8_0 ? 34 : T == DType::Q4_0 ? 18 : 20;

// The 32 codes of a block as floats: Q8_0 signed, Q4_0 code - 8 (signed), Q4_1 code (0-15).
template <DType T>
inline void block_codes(const uint8_t* blk, float32x4_t c[8]) {
  if constexpr (T == DType::Q8_0) {
    widen_s8(vld1q_s8(reinterpret_cast<const int8_t*>(blk + 2)), c);
    widen_s8(vld1q_s8(reinterpret_cast<const int8_t*>(blk + 18)), c + 4);
  } else {
    const uint8x16_t v = vld1q_u8(blk + (T == DType::Q4_1 ? 4 : 2));
    const uint8x16_t lo = vandq_u8(v, vdupq_n_u8(0x0F)), hi = vshrq_n_u8(v, 4);
    if constexpr (T == DType::Q4_0) {
      const int8x16_t k8 = vdupq_n_s8(8);
      widen_s8(vsubq_s8(vreinterpretq_s8_u8(lo), k8), c);
      widen_s8(vsubq_s8(vreinterpretq_s8_u8(hi), k8), c + 4);
    } else {
      widen_u8(lo, c);
      widen_u8(hi, c + 4);
    }
  }
}

// MR rows of x from m0 against weight rows [n0, n1). Per x row two vector accumulators (even
// and odd blocks) and, for Q4_1, two offset sums.
template <DType T, int MR>
void rows_block(const RowJob& j, int64_t m0, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = j.row(n);
    float32x4_t acc0[MR], acc1[MR];
    float macc0[MR], macc1[MR];
    for (int m = 0; m < MR; ++m) {
      acc0[m] = acc1[m] = vdupq_n_f32(0.f);
      macc0[m] = macc1[m] = 0.f;
    }
    auto block = [&](int64_t b, float32x4_t* acc, float* macc) {
      const uint8_t* blk = w + b * kBlockBytes<T>;
      float32x4_t c[8];
      block_codes<T>(blk, c);
      const float d = f16_at(blk);
      float off = 0.f;
      if constexpr (T == DType::Q4_1) off = f16_at(blk + 2);
      for (int m = 0; m < MR; ++m) {
        acc[m] = vfmaq_n_f32(acc[m], dot32(c, j.x + (m0 + m) * j.K + b * 32), d);
        if constexpr (T == DType::Q4_1) macc[m] += off * j.xs[(m0 + m) * j.nb + b];
      }
    };
    int64_t b = 0;
    for (; b + 2 <= j.nb; b += 2) {
      block(b, acc0, macc0);
      block(b + 1, acc1, macc1);
    }
    if (b < j.nb) block(b, acc0, macc0);
    for (int m = 0; m < MR; ++m)
      j.y[(m0 + m) * j.ldy + n] = vaddvq_f32(vaddq_f32(acc0[m], acc1[m])) + (macc0[m] + macc1[m]);
  }
}

// ---- Q4_K / Q5_K / Q6_K: 256-value super-blocks (layouts in io/dequant.cpp) ----

template <DType T>
constexpr int64_t kSuperBytes = T == DType::Q4_K ? 144 : T == DType::Q5_K ? 176 : 210;

// One unpacked super-block. Q4_K / Q5_K: q unsigned (0-15 / 0-31) in value order, ds / dm per
// sub-block of 32. Q6_K: q signed (code - 32), ds per group of 16 (dm unused).
struct Super {
  alignas(16) uint8_t q[256];
  alignas(16) float ds[16];
  alignas(16) float dm[8];
};

template <DType T>
inline void unpack(const uint8_t* blk, Super& s) {
  if constexpr (T == DType::Q4_K || T == DType::Q5_K) {
    // Scales and mins as io/dequant.cpp's k_scale_min reads them, d * scale and dmin * min:
    // one rounding each, the scalar dequantizer's values.
    const float d = f16_at(blk), dmin = f16_at(blk + 2);
    const uint8_t* sc = blk + 4;
    for (int i = 0; i < 8; ++i) {
      int scale, min;
      if (i < 4) {
        scale = sc[i] & 63;
        min = sc[i + 4] & 63;
      } else {
        scale = (sc[i + 4] & 0xF) | ((sc[i - 4] >> 6) << 4);
        min = (sc[i + 4] >> 4) | ((sc[i] >> 6) << 4);
      }
      s.ds[i] = d * float(scale);
      s.dm[i] = dmin * float(min);
    }
    const uint8_t* qs = blk + (T == DType::Q4_K ? 16 : 48);
    const uint8x16_t m4 = vdupq_n_u8(0x0F);
    uint8x16_t qh[2] = {vdupq_n_u8(0), vdupq_n_u8(0)};
    if constexpr (T == DType::Q5_K) qh[0] = vld1q_u8(blk + 16), qh[1] = vld1q_u8(blk + 32);
    // Pair p: 32 bytes hold sub-block 2p (low nibbles) and 2p+1 (high nibbles); Q5_K's fifth
    // bits are bits 2p and 2p+1 of the high-bit bytes, shifted to bit 4 (a negative count
    // shifts right).
    for (int p = 0; p < 4; ++p)
      for (int h = 0; h < 2; ++h) {
        const uint8x16_t v = vld1q_u8(qs + 32 * p + 16 * h);
        uint8x16_t lo = vandq_u8(v, m4), hi = vshrq_n_u8(v, 4);
        if constexpr (T == DType::Q5_K) {
          const uint8x16_t bit4 = vdupq_n_u8(0x10);
          lo = vorrq_u8(lo, vandq_u8(vshlq_u8(qh[h], vdupq_n_s8(int8_t(4 - 2 * p))), bit4));
          hi = vorrq_u8(hi, vandq_u8(vshlq_u8(qh[h], vdupq_n_s8(int8_t(3 - 2 * p))), bit4));
        }
        vst1q_u8(s.q + 64 * p + 16 * h, lo);
        vst1q_u8(s.q + 64 * p + 32 + 16 * h, hi);
      }
  } else {
    // Q6_K: per half of 128 values, low nibbles L[64], high pairs H[32], 8 int8 scales; value
    // l + 32 g takes its low nibble from L[l] (g 0), L[l + 32] (1), L[l] >> 4 (2),
    // L[l + 32] >> 4 (3) and its high bits from (H[l] >> 2g) & 3.
    const float d = f16_at(blk + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    for (int g = 0; g < 16; ++g) s.ds[g] = d * float(sc[g]);
    const uint8x16_t m4 = vdupq_n_u8(0x0F), m2 = vdupq_n_u8(0x30);
    const int8x16_t k32 = vdupq_n_s8(32);
    for (int half = 0; half < 2; ++half)
      for (int h = 0; h < 2; ++h) {  // values l = 16 h .. 16 h + 15 of each group
        const uint8_t* L = blk + 64 * half + 16 * h;
        const uint8x16_t la = vld1q_u8(L), lb = vld1q_u8(L + 32);
        const uint8x16_t H = vld1q_u8(blk + 128 + 32 * half + 16 * h);
        const uint8x16_t g[4] = {
            vorrq_u8(vandq_u8(la, m4), vandq_u8(vshlq_n_u8(H, 4), m2)),
            vorrq_u8(vandq_u8(lb, m4), vandq_u8(vshlq_n_u8(H, 2), m2)),
            vorrq_u8(vshrq_n_u8(la, 4), vandq_u8(H, m2)),
            vorrq_u8(vshrq_n_u8(lb, 4), vandq_u8(vshrq_n_u8(H, 2), m2))};
        for (int k = 0; k < 4; ++k)
          vst1q_u8(s.q + 128 * half + 32 * k + 16 * h,
                   vreinterpretq_u8_s8(vsubq_s8(vreinterpretq_s8_u8(g[k]), k32)));
      }
  }
}

template <DType T, int MR>
void rows_kquant(const RowJob& j, int64_t m0, int64_t n0, int64_t n1) {
  const int64_t nsb = j.K / 256;
  Super s;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = j.row(n);
    float32x4_t acc0[MR], acc1[MR], macc[MR];
    for (int m = 0; m < MR; ++m) acc0[m] = acc1[m] = macc[m] = vdupq_n_f32(0.f);
    for (int64_t b = 0; b < nsb; ++b) {
      unpack<T>(w + b * kSuperBytes<T>, s);
      const float* x = j.x + m0 * j.K + b * 256;
      if constexpr (T == DType::Q6_K) {
        // Group g of 16: the exact values ds_g * (code - 32), then FMAs with x.
        for (int g = 0; g < 16; ++g) {
          float32x4_t c[4];
          widen_s8(vreinterpretq_s8_u8(vld1q_u8(s.q + 16 * g)), c);
          for (int i = 0; i < 4; ++i) c[i] = vmulq_n_f32(c[i], s.ds[g]);
          for (int m = 0; m < MR; ++m) {
            const float* xb = x + m * j.K + 16 * g;
            acc0[m] = vfmaq_f32(acc0[m], c[0], vld1q_f32(xb));
            acc1[m] = vfmaq_f32(acc1[m], c[1], vld1q_f32(xb + 4));
            acc0[m] = vfmaq_f32(acc0[m], c[2], vld1q_f32(xb + 8));
            acc1[m] = vfmaq_f32(acc1[m], c[3], vld1q_f32(xb + 12));
          }
        }
      } else {
        for (int sb = 0; sb < 8; ++sb) {
          float32x4_t c[8];
          widen_u8(vld1q_u8(s.q + 32 * sb), c);
          widen_u8(vld1q_u8(s.q + 32 * sb + 16), c + 4);
          for (int m = 0; m < MR; ++m) {
            const float32x4_t p = dot32(c, x + m * j.K + 32 * sb);
            if (sb & 1)
              acc1[m] = vfmaq_n_f32(acc1[m], p, s.ds[sb]);
            else
              acc0[m] = vfmaq_n_f32(acc0[m], p, s.ds[sb]);
          }
        }
        const float32x4_t dm0 = vld1q_f32(s.dm), dm1 = vld1q_f32(s.dm + 4);
        for (int m = 0; m < MR; ++m) {
          const float* xs = j.xs + (m0 + m) * j.nb + b * 8;
          macc[m] = vfmaq_f32(macc[m], dm0, vld1q_f32(xs));
          macc[m] = vfmaq_f32(macc[m], dm1, vld1q_f32(xs + 4));
        }
      }
    }
    for (int m = 0; m < MR; ++m) {
      float y = vaddvq_f32(vaddq_f32(acc0[m], acc1[m]));
      if constexpr (T != DType::Q6_K) y -= vaddvq_f32(macc[m]);
      j.y[(m0 + m) * j.ldy + n] = y;
    }
  }
}

// ---- f16 / bf16 ----

template <DType T>
inline float widen1(uint16_t h) {
  return T == DType::F16 ? f16_to_f32(h) : bf16_to_f32(h);
}

// 8 stored values -> two vectors of 4 floats, exactly.
template <DType T>
inline void widen8(const uint16_t* p, float32x4_t& a, float32x4_t& b) {
  const uint16x8_t v = vld1q_u16(p);
  if constexpr (T == DType::F16) {
    a = vcvt_f32_f16(vreinterpret_f16_u16(vget_low_u16(v)));
    b = vcvt_f32_f16(vreinterpret_f16_u16(vget_high_u16(v)));
  } else {
    a = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(v), 16));
    b = vreinterpretq_f32_u32(vshll_high_n_u16(v, 16));
  }
}

// MR rows of x from m0; per x row four accumulators over 16-value steps, then 8-value steps,
// then a scalar tail (rows need not be a multiple of 8).
template <DType T, int MR>
void rows_half(const RowJob& j, int64_t m0, int64_t n0, int64_t n1) {
  const int64_t K = j.K;
  const float* x = j.x + m0 * K;
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* w = reinterpret_cast<const uint16_t*>(j.row(n));
    float32x4_t acc[MR][4];
    for (int m = 0; m < MR; ++m)
      for (int u = 0; u < 4; ++u) acc[m][u] = vdupq_n_f32(0.f);
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
      float32x4_t w0, w1, w2, w3;
      widen8<T>(w + k, w0, w1);
      widen8<T>(w + k + 8, w2, w3);
      for (int m = 0; m < MR; ++m) {
        const float* xm = x + m * K + k;
        acc[m][0] = vfmaq_f32(acc[m][0], w0, vld1q_f32(xm));
        acc[m][1] = vfmaq_f32(acc[m][1], w1, vld1q_f32(xm + 4));
        acc[m][2] = vfmaq_f32(acc[m][2], w2, vld1q_f32(xm + 8));
        acc[m][3] = vfmaq_f32(acc[m][3], w3, vld1q_f32(xm + 12));
      }
    }
    for (; k + 8 <= K; k += 8) {
      float32x4_t w0, w1;
      widen8<T>(w + k, w0, w1);
      for (int m = 0; m < MR; ++m) {
        acc[m][0] = vfmaq_f32(acc[m][0], w0, vld1q_f32(x + m * K + k));
        acc[m][1] = vfmaq_f32(acc[m][1], w1, vld1q_f32(x + m * K + k + 4));
      }
    }
    float tail[MR] = {};
    for (; k < K; ++k) {
      uint16_t h;
      std::memcpy(&h, w + k, 2);
      const float wk = widen1<T>(h);
      for (int m = 0; m < MR; ++m) tail[m] += wk * x[m * K + k];
    }
    for (int m = 0; m < MR; ++m)
      j.y[(m0 + m) * j.ldy + n] =
          vaddvq_f32(vaddq_f32(vaddq_f32(acc[m][0], acc[m][1]), vaddq_f32(acc[m][2], acc[m][3]))) +
          tail[m];
  }
}

// ---- dispatch ----

template <DType T, int MR>
void rows_mr(const RowJob& j, int64_t m0, int64_t n0, int64_t n1) {
  if constexpr (T == DType::Q8_0 || T == DType::Q4_0 || T == DType::Q4_1)
    rows_block<T, MR>(j, m0, n0, n1);
  else if constexpr (T == DType::F16 || T == DType::BF16)
    rows_half<T, MR>(j, m0, n0, n1);
  else
    rows_kquant<T, MR>(j, m0, n0, n1);
}

// x rows four at a time (each weight block decoded once for them), the tail 1-3.
template <DType T>
bool rows_t(const RowJob& j, int64_t n0, int64_t n1) {
  for_x_blocks(j.M, [&](int64_t m0, auto rows) { rows_mr<T, decltype(rows)::value>(j, m0, n0, n1); });
  return true;
}

}  // namespace

bool rows_neon(const RowJob& j, int64_t n0, int64_t n1) {
  switch (j.w->dtype) {
    case DType::Q8_0: return rows_t<DType::Q8_0>(j, n0, n1);
    case DType::Q4_0: return rows_t<DType::Q4_0>(j, n0, n1);
    case DType::Q4_1: return rows_t<DType::Q4_1>(j, n0, n1);
    case DType::Q4_K: return rows_t<DType::Q4_K>(j, n0, n1);
    case DType::Q5_K: return rows_t<DType::Q5_K>(j, n0, n1);
    case DType::Q6_K: return rows_t<DType::Q6_K>(j, n0, n1);
    case DType::F16: return rows_t<DType::F16>(j, n0, n1);
    case DType::BF16: return rows_t<DType::BF16>(j, n0, n1);
    default: return false;
  }
}

float dot_neon(const float* a, const float* b, int64_t n) {
  float32x4_t s0 = vdupq_n_f32(0.f), s1 = vdupq_n_f32(0.f), s2 = vdupq_n_f32(0.f),
              s3 = vdupq_n_f32(0.f);
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    s0 = vfmaq_f32(s0, vld1q_f32(a + k), vld1q_f32(b + k));
    s1 = vfmaq_f32(s1, vld1q_f32(a + k + 4), vld1q_f32(b + k + 4));
    s2 = vfmaq_f32(s2, vld1q_f32(a + k + 8), vld1q_f32(b + k + 8));
    s3 = vfmaq_f32(s3, vld1q_f32(a + k + 12), vld1q_f32(b + k + 12));
  }
  for (; k + 4 <= n; k += 4) s0 = vfmaq_f32(s0, vld1q_f32(a + k), vld1q_f32(b + k));
  float s = vaddvq_f32(vaddq_f32(vaddq_f32(s0, s1), vaddq_f32(s2, s3)));
  for (; k < n; ++k) s += a[k] * b[k];
  return s;
}
#endif  // SPADE_QGEMV_NEON

}  // namespace spade::cpu::qgemv_detail
