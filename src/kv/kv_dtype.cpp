#include "kv/kv_dtype.h"

#include <cstring>

#include "core/error.h"
#include "core/half.h"

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
  }
  return "?";
}

size_t kv_dtype_bytes(KvDtype t) {
  switch (t) {
    case KvDtype::F32: return 4;
    case KvDtype::BF16:
    case KvDtype::F16: return 2;
  }
  fail("KV dtype ", int(t), ": unknown");
}

const char* kv_dtype_choices() { return "f32|bf16|f16"; }

KvDtype parse_kv_dtype(const std::string& s, const std::string& option) {
  if (s == "f32" || s == "fp32" || s == "float32") return KvDtype::F32;
  if (s == "bf16" || s == "bfloat16") return KvDtype::BF16;
  if (s == "f16" || s == "fp16" || s == "float16") return KvDtype::F16;
  fail(option, ": unknown KV cache type '", s, "' (expected one of ", kv_dtype_choices(), ")");
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
#endif
}  // namespace

void kv_to_f32(KvDtype t, const void* src, int64_t n, float* dst) {
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
  }
  fail("KV dtype ", int(t), ": unknown");
}

void kv_from_f32(KvDtype t, const float* src, int64_t n, void* dst) {
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
  }
  fail("KV dtype ", int(t), ": unknown");
}

}  // namespace spade
