#include "kv/kv_dtype.h"

#include <cstring>

#include <cmath>
#include <cstdlib>

#include "core/error.h"
#include "core/half.h"
#include "kv/fp8_e4m3.h"

#if defined(__x86_64__) || defined(__i386__)
#define SPADE_KVD_X86 1
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace spade {

const char* kv_dtype_name(KvDtype t) {
  switch (t) {
    case KvDtype::F32: return "f32";
    case KvDtype::BF16: return "bf16";
    case KvDtype::F16: return "f16";
    case KvDtype::FP8: return "fp8";
  }
  return "?";
}

size_t kv_dtype_bytes(KvDtype t) {
  switch (t) {
    case KvDtype::F32: return 4;
    case KvDtype::BF16:
    case KvDtype::F16: return 2;
    case KvDtype::FP8: return 1;
  }
  fail("KV dtype ", int(t), ": unknown");
}

const char* kv_dtype_choices() { return "f32|bf16|f16|fp8"; }

KvDtype parse_kv_dtype(const std::string& s, const std::string& option) {
  if (s == "f32" || s == "fp32" || s == "float32") return KvDtype::F32;
  if (s == "bf16" || s == "bfloat16") return KvDtype::BF16;
  if (s == "f16" || s == "fp16" || s == "float16") return KvDtype::F16;
  if (s == "fp8" || s == "fp8_e4m3") return KvDtype::FP8;
  fail(option, ": unknown KV cache type '", s, "' (expected one of ", kv_dtype_choices(), ")");
}

float parse_kv_scale(const std::string& s, const std::string& option) {
  if (s == "auto") return 0.f;
  const char* b = s.c_str();
  char* e = nullptr;
  const double x = s.empty() ? NAN : std::strtod(b, &e);
  SPADE_CHECK(!s.empty() && e && *e == '\0' && std::isfinite(x) && x > 0,
              option, ": '", s, "' is not auto or a positive number (the fp8 KV cache's scale)");
  const float r = fp8_pow2_ceil(float(x));
  SPADE_CHECK(float(x) > 0 && r >= kFp8ScaleMin && r <= kFp8ScaleMax, option, ": ", s,
              " is outside [2^-40, 2^40]");
  return r;
}

namespace {
#if SPADE_KVD_X86
bool have_f16c_avx2() {
  static const bool ok = [] {
    __builtin_cpu_init();
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & (1u << 29));
    return f16c && __builtin_cpu_supports("avx2");
  }();
  return ok;
}

__attribute__((target("avx2,f16c"))) int64_t f16_to_f32_avx2(const uint16_t* s, int64_t n,
                                                              float* d) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
  return i;
}
__attribute__((target("avx2,f16c"))) int64_t bf16_to_f32_avx2(const uint16_t* s, int64_t n,
                                                               float* d) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
    _mm256_storeu_ps(d + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
  }
  return i;
}
// E4M3 codes -> fp32 times a power-of-two scale, as fp8_e4m3_to_f32(c) * scale: normal codes
// by placing the exponent and mantissa bits, subnormals as m * 2^-9, 0x7F as NaN.
__attribute__((target("avx2"))) int64_t fp8_to_f32_avx2(const uint8_t* s, int64_t n, float scale,
                                                        float* d) {
  const __m256 sc = _mm256_set1_ps(scale), sub_unit = _mm256_set1_ps(0.001953125f);
  const __m256i m7f = _mm256_set1_epi32(0x7F), m80 = _mm256_set1_epi32(0x80);
  const __m256i bias = _mm256_set1_epi32(120 << 3), eight = _mm256_set1_epi32(8);
  const __m256 nan = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000));
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + i)));
    const __m256i mag = _mm256_and_si256(c, m7f);
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(c, m80), 24);
    const __m256 normal = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(mag, bias), 20));
    const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), sub_unit);
    __m256 v = _mm256_blendv_ps(normal, sub, _mm256_castsi256_ps(_mm256_cmpgt_epi32(eight, mag)));
    v = _mm256_blendv_ps(v, nan, _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, m7f)));
    v = _mm256_or_ps(v, _mm256_castsi256_ps(sign));
    _mm256_storeu_ps(d + i, _mm256_mul_ps(v, sc));
  }
  return i;
}
#endif

// The 256 E4M3 values (scalar path).
struct Fp8Table {
  float v[256];
  Fp8Table() {
    for (int c = 0; c < 256; ++c) v[c] = fp8_e4m3_to_f32(uint8_t(c));
  }
};
const Fp8Table& fp8_table() {
  static const Fp8Table t;
  return t;
}
}  // namespace

void kv_to_f32(KvDtype t, const void* src, int64_t n, float* dst, float scale) {
  switch (t) {
    case KvDtype::F32: std::memcpy(dst, src, sizeof(float) * size_t(n)); return;
    case KvDtype::BF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      int64_t i = 0;
#if SPADE_KVD_X86
      if (have_f16c_avx2()) i = bf16_to_f32_avx2(s, n, dst);
#endif
      for (; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
      return;
    }
    case KvDtype::F16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      int64_t i = 0;
#if SPADE_KVD_X86
      if (have_f16c_avx2()) i = f16_to_f32_avx2(s, n, dst);
#endif
      for (; i < n; ++i) dst[i] = f16_to_f32(s[i]);
      return;
    }
    case KvDtype::FP8: {
      const uint8_t* s = static_cast<const uint8_t*>(src);
      int64_t i = 0;
#if SPADE_KVD_X86
      if (have_f16c_avx2()) i = fp8_to_f32_avx2(s, n, scale, dst);
#endif
      const float* tab = fp8_table().v;
      for (; i < n; ++i) dst[i] = tab[s[i]] * scale;
      return;
    }
  }
  fail("KV dtype ", int(t), ": unknown");
}

void kv_from_f32(KvDtype t, const float* src, int64_t n, void* dst, float scale) {
  switch (t) {
    case KvDtype::F32: std::memcpy(dst, src, sizeof(float) * size_t(n)); return;
    case KvDtype::BF16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(src[i]);
      return;
    }
    case KvDtype::F16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = f32_to_f16(src[i]);
      return;
    }
    case KvDtype::FP8: {
      uint8_t* d = static_cast<uint8_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = fp8_e4m3_from_f32(src[i] / scale);
      return;
    }
  }
  fail("KV dtype ", int(t), ": unknown");
}

}  // namespace spade
