// The GEMV over K-quants (Q4_K, Q5_K, Q6_K: 256-value super-blocks; layouts in io/dequant.cpp)
// at AVX2+FMA+F16C and AVX-512, and their prefill tiles' dequantization.
//
// Each super-block is first unpacked with 256-bit integer ops into its 256 codes (one byte per
// value, in value order) and its scales as floats, computed as the scalar dequantizer computes
// them (d * scale, dmin * min: one rounding each); then:
// - Q4_K / Q5_K: value i of sub-block s (32 values) is ds_s * code_i - dm_s, so the sub-block's
//   dot with x is ds_s * sum(code_i x_i) - dm_s * sum(x_i). The first sum runs in fp32 vectors,
//   the second term comes from the per-32 sums of x (RowJob::xs), 8 of them a vector.
// - Q6_K: value i of group g (16 values) is ds_g * (code_i - 32): the codes are made signed,
//   turned into the exact dequantized values (one multiply by ds_g) and accumulated with FMAs.
// x stays fp32 (never quantized); each weight row's arithmetic does not depend on its
// neighbours or on how many x rows run with it.
#include <algorithm>
#include <cstring>

#include "backend/cpu/qgemv_internal.h"

namespace spade::cpu::qgemv_detail {

#if SPADE_QGEMV_X86
namespace {

template <DType T>
constexpr int64_t kSuperBytes = T == DType::Q4_K ? 144 : T == DType::Q5_K ? 176 : 210;

// One unpacked super-block. Q4_K / Q5_K: q unsigned (0-15 / 0-31), ds / dm per sub-block of
// 32. Q6_K: q signed (code - 32), ds per group of 16 (dm unused).
struct Super {
  alignas(64) int8_t q[256];
  alignas(64) float ds[16];
  alignas(32) float dm[8];
};

// The Q4_K / Q5_K scale field (12 bytes: 6-bit scales and mins, io/dequant.cpp's
// k_scale_min) rearranged with 32-bit ops into 8 scale bytes then 8 min bytes; then d * scale
// and dmin * min as floats.
SPADE_AVX2 inline void k_scales(const uint8_t* blk, Super& s) {
  uint32_t u[4];
  std::memcpy(u, blk + 4, 12);
  constexpr uint32_t k6 = 0x3f3f3f3f, k4 = 0x0f0f0f0f, k2 = 0x03030303;
  u[3] = ((u[2] >> 4) & k4) | (((u[1] >> 6) & k2) << 4);  // mins 4-7
  const uint32_t mins03 = u[1] & k6;
  u[1] = (u[2] & k4) | (((u[0] >> 6) & k2) << 4);  // scales 4-7
  u[2] = mins03;
  u[0] &= k6;  // scales 0-3
  uint32_t dd;
  std::memcpy(&dd, blk, 4);
  const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(int(dd)));  // d, dmin
  const __m256 d = _mm256_set1_ps(_mm_cvtss_f32(f));
  const __m256 dmin = _mm256_set1_ps(_mm_cvtss_f32(_mm_movehdup_ps(f)));
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(u));
  const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
  const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)));
  _mm256_store_ps(s.ds, _mm256_mul_ps(d, sc));
  _mm256_store_ps(s.dm, _mm256_mul_ps(dmin, mn));
}

template <DType T>
SPADE_AVX2 inline void unpack(const uint8_t* blk, Super& s) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  auto store = [&](int at, __m256i v) SPADE_AVX2 {
    _mm256_store_si256(reinterpret_cast<__m256i*>(s.q + at), v);
  };
  if constexpr (T == DType::Q4_K || T == DType::Q5_K) {
    k_scales(blk, s);
    const uint8_t* qs = blk + (T == DType::Q4_K ? 16 : 48);
    __m256i qh = _mm256_setzero_si256();
    if constexpr (T == DType::Q5_K)
      qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16));
    const __m256i bit4 = _mm256_set1_epi8(0x10);
    // Pair p: 32 bytes hold sub-block 2p (low nibbles) and 2p+1 (high nibbles); Q5_K's fifth
    // bits are bits 2p and 2p+1 of the high-bit bytes (shifts within 16-bit lanes, then masks
    // that keep only bits from the same byte).
    for (int p = 0; p < 4; ++p) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * p));
      __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
      if constexpr (T == DType::Q5_K) {
        const __m256i h = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * p));
        lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(h, 4), bit4));
        hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(h, 3), bit4));
      }
      store(64 * p, lo);
      store(64 * p + 32, hi);
    }
  } else {
    // Q6_K: per half of 128 values, low nibbles L[64], high pairs H[32], 8 int8 scales.
    uint16_t dh;
    std::memcpy(&dh, blk + 208, 2);
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(dh));
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192));
    _mm256_store_ps(s.ds, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))));
    _mm256_store_ps(s.ds + 8, _mm256_mul_ps(
                                  d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)))));
    const __m256i m2 = _mm256_set1_epi8(0x30), k32 = _mm256_set1_epi8(32);
    for (int half = 0; half < 2; ++half) {
      const uint8_t* L = blk + 64 * half;
      const __m256i la = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(L));
      const __m256i lb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(L + 32));
      const __m256i h =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * half));
      // Group g's high bits are (H >> 2g) & 3, moved to bits 4-5.
      const __m256i g0 = _mm256_or_si256(_mm256_and_si256(la, m4),
                                         _mm256_and_si256(_mm256_slli_epi16(h, 4), m2));
      const __m256i g1 = _mm256_or_si256(_mm256_and_si256(lb, m4),
                                         _mm256_and_si256(_mm256_slli_epi16(h, 2), m2));
      const __m256i g2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(la, 4), m4),
                                         _mm256_and_si256(h, m2));
      const __m256i g3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lb, 4), m4),
                                         _mm256_and_si256(_mm256_srli_epi16(h, 2), m2));
      store(128 * half, _mm256_sub_epi8(g0, k32));
      store(128 * half + 32, _mm256_sub_epi8(g1, k32));
      store(128 * half + 64, _mm256_sub_epi8(g2, k32));
      store(128 * half + 96, _mm256_sub_epi8(g3, k32));
    }
  }
}

// 8 / 16 codes at q as floats (unsigned for Q4_K / Q5_K, signed for Q6_K).
template <DType T>
SPADE_AVX2 inline __m256 codes8(const int8_t* q) {
  const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q));
  return _mm256_cvtepi32_ps(T == DType::Q6_K ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v));
}
template <DType T>
SPADE_AVX512 inline __m512 codes16(const int8_t* q) {
  const __m128i v = _mm_load_si128(reinterpret_cast<const __m128i*>(q));
  return _mm512_cvtepi32_ps(T == DType::Q6_K ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v));
}

// MR rows of x from m0 against weight rows [n0, n1). Two accumulators per x row (even and odd
// sub-blocks / groups) so no FMA waits on the one before it.
template <DType T, int MR>
SPADE_AVX512 void rows_avx512(const RowJob& j, int64_t m0, int64_t n0, int64_t n1) {
  const int64_t nsb = j.K / 256;
  Super s;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = j.row(n);
    __m512 acc0[MR], acc1[MR];
    __m256 macc[MR];
    for (int m = 0; m < MR; ++m) {
      acc0[m] = acc1[m] = _mm512_setzero_ps();
      macc[m] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < nsb; ++b) {
      unpack<T>(w + b * kSuperBytes<T>, s);
      const float* x = j.x + m0 * j.K + b * 256;
      if constexpr (T == DType::Q6_K) {
        for (int g = 0; g < 16; g += 2) {
          const __m512 w0 = _mm512_mul_ps(_mm512_set1_ps(s.ds[g]), codes16<T>(s.q + 16 * g));
          const __m512 w1 =
              _mm512_mul_ps(_mm512_set1_ps(s.ds[g + 1]), codes16<T>(s.q + 16 * g + 16));
          for (int m = 0; m < MR; ++m) {
            const float* xb = x + m * j.K + 16 * g;
            acc0[m] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xb), acc0[m]);
            acc1[m] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + 16), acc1[m]);
          }
        }
      } else {
        for (int sb = 0; sb < 8; sb += 2) {
          const __m512 c0 = codes16<T>(s.q + 32 * sb), c1 = codes16<T>(s.q + 32 * sb + 16);
          const __m512 c2 = codes16<T>(s.q + 32 * sb + 32), c3 = codes16<T>(s.q + 32 * sb + 48);
          const __m512 d0 = _mm512_set1_ps(s.ds[sb]), d1 = _mm512_set1_ps(s.ds[sb + 1]);
          for (int m = 0; m < MR; ++m) {
            const float* xb = x + m * j.K + 32 * sb;
            __m512 p0 = _mm512_mul_ps(c0, _mm512_loadu_ps(xb));
            __m512 p1 = _mm512_mul_ps(c2, _mm512_loadu_ps(xb + 32));
            p0 = _mm512_fmadd_ps(c1, _mm512_loadu_ps(xb + 16), p0);
            p1 = _mm512_fmadd_ps(c3, _mm512_loadu_ps(xb + 48), p1);
            acc0[m] = _mm512_fmadd_ps(d0, p0, acc0[m]);
            acc1[m] = _mm512_fmadd_ps(d1, p1, acc1[m]);
          }
        }
        const __m256 dm = _mm256_load_ps(s.dm);
        for (int m = 0; m < MR; ++m)
          macc[m] = _mm256_fmadd_ps(dm, _mm256_loadu_ps(j.xs + (m0 + m) * j.nb + b * 8), macc[m]);
      }
    }
    for (int m = 0; m < MR; ++m) {
      float y = hsum16(_mm512_add_ps(acc0[m], acc1[m]));
      if constexpr (T != DType::Q6_K) y -= hsum8(macc[m]);
      j.y[(m0 + m) * j.ldy + n] = y;
    }
  }
}

template <DType T, int MR>
SPADE_AVX2 void rows_avx2(const RowJob& j, int64_t m0, int64_t n0, int64_t n1) {
  const int64_t nsb = j.K / 256;
  Super s;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = j.row(n);
    __m256 acc0[MR], acc1[MR], macc[MR];
    for (int m = 0; m < MR; ++m) acc0[m] = acc1[m] = macc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nsb; ++b) {
      unpack<T>(w + b * kSuperBytes<T>, s);
      const float* x = j.x + m0 * j.K + b * 256;
      if constexpr (T == DType::Q6_K) {
        for (int g = 0; g < 16; ++g) {
          const __m256 d = _mm256_set1_ps(s.ds[g]);
          const __m256 w0 = _mm256_mul_ps(d, codes8<T>(s.q + 16 * g));
          const __m256 w1 = _mm256_mul_ps(d, codes8<T>(s.q + 16 * g + 8));
          for (int m = 0; m < MR; ++m) {
            const float* xb = x + m * j.K + 16 * g;
            acc0[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xb), acc0[m]);
            acc1[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xb + 8), acc1[m]);
          }
        }
      } else {
        for (int sb = 0; sb < 8; ++sb) {
          const int8_t* q = s.q + 32 * sb;
          const __m256 c0 = codes8<T>(q), c1 = codes8<T>(q + 8), c2 = codes8<T>(q + 16),
                       c3 = codes8<T>(q + 24);
          const __m256 d = _mm256_set1_ps(s.ds[sb]);
          for (int m = 0; m < MR; ++m) {
            const float* xb = x + m * j.K + 32 * sb;
            __m256 p0 = _mm256_mul_ps(c0, _mm256_loadu_ps(xb));
            __m256 p1 = _mm256_mul_ps(c1, _mm256_loadu_ps(xb + 8));
            p0 = _mm256_fmadd_ps(c2, _mm256_loadu_ps(xb + 16), p0);
            p1 = _mm256_fmadd_ps(c3, _mm256_loadu_ps(xb + 24), p1);
            if (sb & 1)
              acc1[m] = _mm256_fmadd_ps(d, _mm256_add_ps(p0, p1), acc1[m]);
            else
              acc0[m] = _mm256_fmadd_ps(d, _mm256_add_ps(p0, p1), acc0[m]);
          }
        }
        const __m256 dm = _mm256_load_ps(s.dm);
        for (int m = 0; m < MR; ++m)
          macc[m] = _mm256_fmadd_ps(dm, _mm256_loadu_ps(j.xs + (m0 + m) * j.nb + b * 8), macc[m]);
      }
    }
    for (int m = 0; m < MR; ++m) {
      float y = hsum8(_mm256_add_ps(acc0[m], acc1[m]));
      if constexpr (T != DType::Q6_K) y -= hsum8(macc[m]);
      j.y[(m0 + m) * j.ldy + n] = y;
    }
  }
}

template <DType T>
void rows_t(const RowJob& j, int64_t n0, int64_t n1, SimdLevel level) {
  for_x_blocks(j.M, [&](int64_t m0, auto rows) {
    if (level == SimdLevel::Avx512)
      rows_avx512<T, decltype(rows)::value>(j, m0, n0, n1);
    else
      rows_avx2<T, decltype(rows)::value>(j, m0, n0, n1);
  });
}

// The scalar dequantizer's values: Q4_K / Q5_K ds * code - dm (a product, then a difference:
// two roundings), Q6_K ds * (code - 32).
template <DType T>
SPADE_NO_CONTRACT void dequant_t(const uint8_t* src, float* dst, int64_t nsb) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
  Super s;
  for (int64_t b = 0; b < nsb; ++b) {
    unpack<T>(src + b * kSuperBytes<T>, s);
    float* y = dst + b * 256;
    for (int i = 0; i < 32; ++i) {
      const __m256 c = codes8<T>(s.q + 8 * i);
      __m256 v;
      if constexpr (T == DType::Q6_K)
        v = _mm256_mul_ps(_mm256_set1_ps(s.ds[i / 2]), c);
      else
        v = _mm256_sub_ps(_mm256_mul_ps(_mm256_set1_ps(s.ds[i / 4]), c),
                          _mm256_set1_ps(s.dm[i / 4]));
      _mm256_storeu_ps(y + 8 * i, v);
    }
  }
}

}  // namespace

void rows_kquant(const RowJob& j, int64_t n0, int64_t n1, SimdLevel level) {
  switch (j.w->dtype) {
    case DType::Q4_K: return rows_t<DType::Q4_K>(j, n0, n1, level);
    case DType::Q5_K: return rows_t<DType::Q5_K>(j, n0, n1, level);
    default: return rows_t<DType::Q6_K>(j, n0, n1, level);
  }
}

void dequant_tile_kquant(DType t, const uint8_t* src, float* dst, int64_t n) {
  switch (t) {
    case DType::Q4_K: return dequant_t<DType::Q4_K>(src, dst, n / 256);
    case DType::Q5_K: return dequant_t<DType::Q5_K>(src, dst, n / 256);
    default: return dequant_t<DType::Q6_K>(src, dst, n / 256);
  }
}
#endif  // SPADE_QGEMV_X86

}  // namespace spade::cpu::qgemv_detail
