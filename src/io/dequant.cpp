#include "io/dequant.h"

#include <cstring>

#include "core/error.h"
#include "core/half.h"
#include "core/thread_pool.h"

namespace spade {

namespace {

uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
float load_f16(const uint8_t* p) { return f16_to_f32(load_u16(p)); }

// Q8_0, 34 bytes per 32 values: f16 scale d, then int8 q[32]; x = d * q.
void q8_0_block(const uint8_t* b, float* y) {
  float d = load_f16(b);
  const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < 32; ++j) y[j] = d * float(q[j]);
}

// Q4_0, 18 bytes per 32 values: f16 d, then 16 bytes of 4-bit codes. Byte j holds value j
// in its low nibble and value j+16 in its high nibble; x = d * (code - 8).
void q4_0_block(const uint8_t* b, float* y) {
  float d = load_f16(b);
  const uint8_t* q = b + 2;
  for (int j = 0; j < 16; ++j) {
    y[j] = d * float(int(q[j] & 0xF) - 8);
    y[j + 16] = d * float(int(q[j] >> 4) - 8);
  }
}

// Q4_1, 20 bytes per 32 values: f16 d, f16 m, then nibbles as in Q4_0; x = d * code + m.
void q4_1_block(const uint8_t* b, float* y) {
  float d = load_f16(b), m = load_f16(b + 2);
  const uint8_t* q = b + 4;
  for (int j = 0; j < 16; ++j) {
    y[j] = d * float(q[j] & 0xF) + m;
    y[j + 16] = d * float(q[j] >> 4) + m;
  }
}

// The 12-byte scale field of Q4_K/Q5_K: eight 6-bit scales and eight 6-bit mins, one pair
// per 32-value sub-block. Sub-blocks 0-3 use the low 6 bits of bytes 0-3 (scale) and 4-7
// (min); sub-blocks 4-7 take their low 4 bits from bytes 8-11 (scale: low nibble, min:
// high nibble) and their top 2 bits from the top 2 bits of bytes 0-3 (scale) and 4-7 (min).
void k_scale_min(const uint8_t* s, int j, int& scale, int& min) {
  if (j < 4) {
    scale = s[j] & 63;
    min = s[j + 4] & 63;
  } else {
    scale = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Q4_K, 144 bytes per 256 values: f16 d, f16 dmin, 12 scale bytes, 128 bytes of nibbles.
// The 8 sub-blocks of 32 are stored in pairs: 32 bytes hold sub-block 2p in their low
// nibbles and 2p+1 in their high nibbles. x = d*scale_s * code - dmin*min_s.
void q4_k_block(const uint8_t* b, float* y) {
  float d = load_f16(b), dmin = load_f16(b + 2);
  const uint8_t* sc = b + 4;
  const uint8_t* q = b + 16;
  for (int p = 0; p < 4; ++p) {
    int s0, m0, s1, m1;
    k_scale_min(sc, 2 * p, s0, m0);
    k_scale_min(sc, 2 * p + 1, s1, m1);
    float d0 = d * float(s0), c0 = dmin * float(m0);
    float d1 = d * float(s1), c1 = dmin * float(m1);
    const uint8_t* qp = q + 32 * p;
    float* yp = y + 64 * p;
    for (int l = 0; l < 32; ++l) {
      yp[l] = d0 * float(qp[l] & 0xF) - c0;
      yp[l + 32] = d1 * float(qp[l] >> 4) - c1;
    }
  }
}

// Q5_K, 176 bytes per 256 values: f16 d, f16 dmin, 12 scale bytes, 32 bytes of high bits,
// 128 bytes of low nibbles (arranged as in Q4_K). Bit s of high-bit byte l is the fifth
// bit of value l of sub-block s. x = d*scale_s * code - dmin*min_s.
void q5_k_block(const uint8_t* b, float* y) {
  float d = load_f16(b), dmin = load_f16(b + 2);
  const uint8_t* sc = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* q = b + 48;
  for (int p = 0; p < 4; ++p) {
    int s0, m0, s1, m1;
    k_scale_min(sc, 2 * p, s0, m0);
    k_scale_min(sc, 2 * p + 1, s1, m1);
    float d0 = d * float(s0), c0 = dmin * float(m0);
    float d1 = d * float(s1), c1 = dmin * float(m1);
    const uint8_t* qp = q + 32 * p;
    float* yp = y + 64 * p;
    for (int l = 0; l < 32; ++l) {
      int h0 = (qh[l] >> (2 * p)) & 1, h1 = (qh[l] >> (2 * p + 1)) & 1;
      yp[l] = d0 * float((qp[l] & 0xF) | (h0 << 4)) - c0;
      yp[l + 32] = d1 * float((qp[l] >> 4) | (h1 << 4)) - c1;
    }
  }
}

// Q6_K, 210 bytes per 256 values: 128 bytes of low nibbles, 64 bytes of 2-bit high parts,
// 16 int8 scales (one per 16 values), f16 d. Each half of 128 values uses 64 low-nibble
// bytes L and 32 high bytes H: value l + 32g (g = 0..3) has low nibble from L[l] (g=0),
// L[l+32] (g=1), L[l]>>4 (g=2), L[l+32]>>4 (g=3) and high bits (H[l] >> 2g) & 3.
// x = d * scale * (code - 32).
void q6_k_block(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  float d = load_f16(b + 208);
  for (int half = 0; half < 2; ++half) {
    const uint8_t* L = ql + 64 * half;
    const uint8_t* H = qh + 32 * half;
    const int8_t* S = sc + 8 * half;
    float* yh = y + 128 * half;
    for (int g = 0; g < 4; ++g) {
      for (int l = 0; l < 32; ++l) {
        int lo = (g & 1) ? L[l + 32] : L[l];
        lo = (g & 2) ? (lo >> 4) : (lo & 0xF);
        int code = lo | (((H[l] >> (2 * g)) & 3) << 4);
        float ds = d * float(S[2 * g + l / 16]);
        yh[32 * g + l] = ds * float(code - 32);
      }
    }
  }
}

using BlockFn = void (*)(const uint8_t*, float*);

BlockFn block_fn(DType t) {
  switch (t) {
    case DType::Q8_0: return q8_0_block;
    case DType::Q4_0: return q4_0_block;
    case DType::Q4_1: return q4_1_block;
    case DType::Q4_K: return q4_k_block;
    case DType::Q5_K: return q5_k_block;
    case DType::Q6_K: return q6_k_block;
    default: return nullptr;
  }
}

void check_args(DType t, int64_t n) {
  SPADE_CHECK(n >= 0, "dequantize: negative element count ", n);
  if (t == DType::I32 || t == DType::I8)
    fail("dequantize: ", dtype_name(t), " is not a floating-point or quantized type");
  int be = dtype_info(t).block_elems;
  SPADE_CHECK(n % be == 0, "dequantize: ", n, " elements of ", dtype_name(t),
              " is not a multiple of the block size ", be);
}

}  // namespace

void dequantize_serial(DType t, const void* src, float* dst, int64_t n) {
  check_args(t, n);
  const uint8_t* s = static_cast<const uint8_t*>(src);
  switch (t) {
    case DType::F32: std::memcpy(dst, src, size_t(n) * 4); return;
    case DType::F16:
      for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_f32(load_u16(s + 2 * i));
      return;
    case DType::BF16:
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(load_u16(s + 2 * i));
      return;
    default: break;
  }
  BlockFn fn = block_fn(t);
  const DTypeInfo& info = dtype_info(t);
  int64_t blocks = n / info.block_elems;
  for (int64_t b = 0; b < blocks; ++b)
    fn(s + b * info.block_bytes, dst + b * info.block_elems);
}

void dequantize(DType t, const void* src, float* dst, int64_t n) {
  check_args(t, n);
  const DTypeInfo& info = dtype_info(t);
  int64_t blocks = n / info.block_elems;
  constexpr int64_t kGrainElems = 1 << 16;  // below this, threads cost more than they save
  int64_t grain = (kGrainElems + info.block_elems - 1) / info.block_elems;
  const uint8_t* s = static_cast<const uint8_t*>(src);
  ThreadPool::global().parallel_for(blocks, grain, [&](int64_t b0, int64_t b1) {
    dequantize_serial(t, s + b0 * info.block_bytes, dst + b0 * info.block_elems,
                      (b1 - b0) * info.block_elems);
  });
}

}  // namespace spade
