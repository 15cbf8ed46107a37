// Twilight pruner on the GPU: INT4 bulk quantizer, estimate, top-p, compaction (API and
// formats in twilight.h).
//
// int4_quantize_kernel
//   reads  n_valid bf16 key rows of each listed (page, KV head): D*2 bytes per row
//   writes D/2 code bytes + one uint32 scale/zero per row (int4_keys.cuh's format)
//   one warp per (listed page, KV head, row).
// twl_estimate_kernel<D, NTILE>
//   reads  per base token D/2 code bytes + 4 scale/zero bytes (68 B at D = 128, a quarter of
//          the 256 B bf16 K row; the pruner's byte floor), the list's entries (4 B per entry),
//          q of the G heads once per warp
//   writes logits fp32 [list][G][max_slots] (4*G B per token: scratch, L2-resident)
//   CTA = 4 warps of one list (b, KV head); a warp takes 16-slot tiles, two per iteration
//   with all loads issued first: lane (row r = lane/4, t = lane%4) loads 16-byte pieces of
//   rows r and r+8 (bytes [t*D/8, t*D/8 + D/8) = dims
//   [t*D/4, t*D/4 + D/4)), turns each code byte into a bf16x2 (0x4300 | c is 128 + c, minus
//   128: exact) and feeds mma.m16n8k16 (A = codes, 16 rows x 16 dims; B = q^T, 16 dims x 8
//   heads, held in registers: lane's head r, the same dims). Within a k-step lane t's
//   k = 2t, 2t+1, 2t+8, 2t+9 are its own dims t*D/4 + 4s + 0..3 for A and B alike, so no
//   shuffle is needed; products are exact, accumulation fp32.
// twl_topp_kernel
//   reads  one (list, query head) logit row fp32 once (L2-hot after the estimate); the
//          passes then read the fp32 weights from registers (lists up to 8192 slots),
//          shared memory (up to 49152 slots) or global memory
//   writes the head's kept mask (1 B per slot), its threshold; the last CTA of the list
//          reads the G masks and writes the kept positions int32 [list][max_slots] in
//          selection order and the kept count
//   CTA = one (list, query head): 512 threads (2 CTAs per SM) with 16 weights each in
//   registers (lists up to 8192 slots), else 256 threads over shared / global memory; one
//   barrier per reduction (partials double-
//   buffered). The bisection is sparse::topp_binary_search step for step (double midpoints,
//   its termination test; masses fp32 within a thread's <= 16 weights, double across
//   threads), two steps per pass: a pass measures the masses at m1 and at both candidate
//   next midpoints and the min/max of each quarter of [l, r).
// twl_compact_kernel
//   reads  kept counts (B*Hkv ints) and the kept positions; writes CSR offsets / indices.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>

#include "backend/cuda/block_scan.cuh"
#include "backend/cuda/int4_keys.cuh"
#include "backend/cuda/twilight.h"

namespace spade::cuda {
namespace {

__global__ void int4_quantize_kernel(const bf16* __restrict__ k, uint8_t* __restrict__ codes,
                                     uint32_t* __restrict__ sz, const int32_t* page_ids,
                                     const int32_t* n_valid, int n, int Hkv, int P, int D) {
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
  if (warp >= n * Hkv * P) return;
  const int i = warp / (Hkv * P), h = (warp / P) % Hkv, r = warp % P;
  if (r >= n_valid[i]) return;
  const int64_t row = (int64_t(page_ids[i]) * Hkv + h) * P + r;
  const bf16* src = k + row * D;
  const int half = D / 2;
  float lo[4], hi[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int d = lane + 32 * j;
    lo[j] = d < half ? __bfloat162float(src[d]) : 0.f;
    hi[j] = d < half ? __bfloat162float(src[half + d]) : 0.f;
  }
  int4_quantize_row_warp(lo, hi, half, codes + row * half, sz + row);
}

// Byte k (0..3) of w: its two codes as bf16x2 {low nibble, high nibble}, exact.
template <int K>
__device__ __forceinline__ uint32_t codes_bf16x2(uint32_t w) {
  const uint32_t x = w >> (8 * K);
  const uint32_t v = (x & 0xfu) | ((x & 0xf0u) << 12) | 0x43004300u;  // 128 + c, per half
  __nv_bfloat162 b = *reinterpret_cast<const __nv_bfloat162*>(&v);
  b = __hsub2(b, __floats2bfloat162_rn(128.f, 128.f));
  return *reinterpret_cast<const uint32_t*>(&b);
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

constexpr int kEstWarps = 4;
constexpr int kEstTilesPerWarp = 2;

template <int D, int NTILE>
__global__ void __launch_bounds__(kEstWarps * 32) twl_estimate_kernel(const TwilightStep st,
                                                                       float* __restrict__ logits,
                                                                       int Hq, int Hkv, int P,
                                                                       int max_slots) {
  constexpr int W = D / 32;  // 32-bit code words per lane per row (D/8 bytes)
  constexpr int QW = D / 8;  // bf16x2 q words per lane and head tile (D/4 dims)
  const int list = blockIdx.y, b = list / Hkv, h = list % Hkv;
  const int G = Hq / Hkv;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int r = lane >> 2, t = lane & 3;
  const int e0 = st.base_off[list], ne = st.base_off[list + 1] - e0;
  const bool chunk = st.gran == SelGran::Chunk16;
  const int n_slots = min(chunk ? 16 * ne : ne, max_slots);  // longer lists: caller's bug
  const int n_tiles = (n_slots + 15) / 16;
  const int first = blockIdx.x * kEstWarps + warp, stride = gridDim.x * kEstWarps;
  if (first >= n_tiles) return;
  const int L = st.kv_len[b];
  const int32_t* pt = st.page_table + st.page_off[b];
  // q of head nt*8 + r, dims [t*D/4, t*D/4 + D/4), as bf16x2; its full sum over D.
  uint32_t qf[NTILE][QW];
  float qs_a[NTILE], qs_b[NTILE];
#pragma unroll
  for (int nt = 0; nt < NTILE; ++nt) {
    const int n = nt * 8 + r;
    float part = 0.f;
    if (n < G) {
      const uint4* src = reinterpret_cast<const uint4*>(st.q + (int64_t(b) * Hq + h * G + n) * D + t * (D / 4));
#pragma unroll
      for (int c = 0; c < QW / 4; ++c) {
        const uint4 v = src[c];
        qf[nt][4 * c] = v.x, qf[nt][4 * c + 1] = v.y, qf[nt][4 * c + 2] = v.z, qf[nt][4 * c + 3] = v.w;
      }
#pragma unroll
      for (int c = 0; c < QW; ++c) {
        const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&qf[nt][c]));
        part += f.x + f.y;
      }
    } else {
#pragma unroll
      for (int c = 0; c < QW; ++c) qf[nt][c] = 0u;
    }
    part += __shfl_xor_sync(0xffffffffu, part, 1);
    part += __shfl_xor_sync(0xffffffffu, part, 2);  // sum(q) of head nt*8 + r
    // This lane's accumulator columns are heads nt*8 + 2t and nt*8 + 2t + 1.
    qs_a[nt] = __shfl_sync(0xffffffffu, part, (2 * t) * 4);
    qs_b[nt] = __shfl_sync(0xffffffffu, part, (2 * t + 1) * 4);
  }
  // kEstTilesPerWarp tiles per iteration: all their index, page and code loads are issued
  // before any math (memory-level parallelism; a warp's tiles are `stride` apart).
  constexpr int U = kEstTilesPerWarp;
  for (int tile0 = first; tile0 < n_tiles; tile0 += U * stride) {
    int pos[U][2];
    bool ok[U][2];
    uint32_t w[U][2][W], szr[U][2];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int tile = tile0 + u * stride;
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int slot = tile * 16 + r + 8 * hr;
        if (chunk) {
          ok[u][hr] = tile < n_tiles;
          pos[u][hr] = ok[u][hr] ? __ldg(st.base_idx + e0 + tile) * 16 + r + 8 * hr : 0;
          ok[u][hr] = ok[u][hr] && pos[u][hr] < L;
        } else {
          ok[u][hr] = slot < n_slots;
          pos[u][hr] = ok[u][hr] ? __ldg(st.base_idx + e0 + slot) : 0;
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        if (ok[u][hr]) {
          const int p = pos[u][hr];
          const int64_t row = (int64_t(__ldg(pt + p / P)) * Hkv + h) * P + p % P;
          const uint8_t* src = st.codes + row * (D / 2) + t * (D / 8);
          if constexpr (W == 4) {
            const uint4 v = __ldg(reinterpret_cast<const uint4*>(src));
            w[u][hr][0] = v.x, w[u][hr][1] = v.y, w[u][hr][2] = v.z, w[u][hr][3] = v.w;
          } else {
            const uint2 v = __ldg(reinterpret_cast<const uint2*>(src));
            w[u][hr][0] = v.x, w[u][hr][1] = v.y;
          }
          szr[u][hr] = __ldg(st.sz + row);
        } else {
#pragma unroll
          for (int c = 0; c < W; ++c) w[u][hr][c] = 0u;
          szr[u][hr] = 0u;
        }
      }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int tile = tile0 + u * stride;
      if (tile >= n_tiles) break;  // warp-uniform
      float acc[NTILE][4];
#pragma unroll
      for (int nt = 0; nt < NTILE; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
#pragma unroll
      for (int c = 0; c < W; ++c) {  // word c holds k-steps 2c (bytes 0, 1) and 2c + 1 (2, 3)
        const uint32_t a00 = codes_bf16x2<0>(w[u][0][c]), a01 = codes_bf16x2<1>(w[u][0][c]);
        const uint32_t a02 = codes_bf16x2<2>(w[u][0][c]), a03 = codes_bf16x2<3>(w[u][0][c]);
        const uint32_t a10 = codes_bf16x2<0>(w[u][1][c]), a11 = codes_bf16x2<1>(w[u][1][c]);
        const uint32_t a12 = codes_bf16x2<2>(w[u][1][c]), a13 = codes_bf16x2<3>(w[u][1][c]);
#pragma unroll
        for (int nt = 0; nt < NTILE; ++nt) {
          mma_bf16(acc[nt], a00, a10, a01, a11, qf[nt][4 * c], qf[nt][4 * c + 1]);
          mma_bf16(acc[nt], a02, a12, a03, a13, qf[nt][4 * c + 2], qf[nt][4 * c + 3]);
        }
      }
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int slot = tile * 16 + r + 8 * hr;
        if (slot >= n_slots) continue;
        const __half2 p2 = *reinterpret_cast<const __half2*>(&szr[u][hr]);
        const float s = __low2float(p2), z = __high2float(p2);
#pragma unroll
        for (int nt = 0; nt < NTILE; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int g = nt * 8 + 2 * t + e;
            if (g >= G) continue;
            const float qsum = e ? qs_b[nt] : qs_a[nt];
            const float v = ok[u][hr] ? st.scale * (z * qsum + s * acc[nt][2 * hr + e]) : -INFINITY;
            logits[(int64_t(list) * G + g) * max_slots + slot] = v;
          }
      }
    }
  }
}

// One CTA per (list, query head). Lists up to kTpRegSlots slots keep their weights in
// registers (kTpRegThreads threads x kTpEpt each); longer ones in shared or global memory.
constexpr int kTpRegThreads = 512, kTpEpt = 16, kTpRegSlots = kTpRegThreads * kTpEpt;
constexpr int kTpMemThreads = 256;
constexpr int kTpWarps = 32;  // partial slots (the most warps of a CTA)
constexpr size_t kTpSmemMax = 192u << 10;       // fp32 weights: lists up to 49152 slots

// Partials of one bisection pass (two of Algorithm 1's steps): masses at the three candidate
// midpoints and min / max of the weights in the four quarter intervals. Weights are >= 0, so
// min / max run on their fp32 bit patterns as unsigned integers (order-preserving; an empty
// quarter has min = +inf, max = 0, a negative span, which ends the search as the CPU's
// (+inf, -inf) does).
struct Red {
  double s[3];
  unsigned mn[4], mx[4];
};

__device__ __forceinline__ Red red_init() {
  Red x;
#pragma unroll
  for (int k = 0; k < 3; ++k) x.s[k] = 0.0;
#pragma unroll
  for (int k = 0; k < 4; ++k) x.mn[k] = 0x7f800000u, x.mx[k] = 0u;
  return x;
}

__device__ __forceinline__ void red_warp(Red& x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
#pragma unroll
    for (int k = 0; k < 3; ++k) x.s[k] += __shfl_xor_sync(0xffffffffu, x.s[k], o);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    x.mn[k] = __reduce_min_sync(0xffffffffu, x.mn[k]);
    x.mx[k] = __reduce_max_sync(0xffffffffu, x.mx[k]);
  }
}

struct RedSmem {
  double s[2][3][kTpWarps];
  unsigned mn[2][4][kTpWarps], mx[2][4][kTpWarps];
  float f[2][kTpWarps];
  double d[2][kTpWarps];
};

// Block reduction; every thread gets the same result (lane i of every warp takes warp i's
// partial, then the same fixed shuffle tree). Partials double-buffered (parity): one barrier
// per reduction.
__device__ __forceinline__ Red red_block(Red x, RedSmem& sm, int& parity) {
  red_warp(x);
  const int pb = parity;
  parity ^= 1;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) {
#pragma unroll
    for (int k = 0; k < 3; ++k) sm.s[pb][k][warp] = x.s[k];
#pragma unroll
    for (int k = 0; k < 4; ++k) sm.mn[pb][k][warp] = x.mn[k], sm.mx[pb][k][warp] = x.mx[k];
  }
  __syncthreads();
  Red y = red_init();
  if (lane < int(blockDim.x >> 5)) {
#pragma unroll
    for (int k = 0; k < 3; ++k) y.s[k] = sm.s[pb][k][lane];
#pragma unroll
    for (int k = 0; k < 4; ++k) y.mn[k] = sm.mn[pb][k][lane], y.mx[k] = sm.mx[pb][k][lane];
  }
  red_warp(y);
  return y;
}

// Block max of a float / sum of a double (softmax passes), same scheme.
__device__ __forceinline__ float max_block(float v, RedSmem& sm, int& parity) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int pb = parity;
  parity ^= 1;
  if ((threadIdx.x & 31) == 0) sm.f[pb][threadIdx.x >> 5] = v;
  __syncthreads();
  float y = (threadIdx.x & 31) < (blockDim.x >> 5) ? sm.f[pb][threadIdx.x & 31] : -INFINITY;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) y = fmaxf(y, __shfl_xor_sync(0xffffffffu, y, o));
  return y;
}
__device__ __forceinline__ double sum_block(double v, RedSmem& sm, int& parity) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int pb = parity;
  parity ^= 1;
  if ((threadIdx.x & 31) == 0) sm.d[pb][threadIdx.x >> 5] = v;
  __syncthreads();
  double y = (threadIdx.x & 31) < (blockDim.x >> 5) ? sm.d[pb][threadIdx.x & 31] : 0.0;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) y += __shfl_xor_sync(0xffffffffu, y, o);
  return y;
}

struct TpArgs {
  const int32_t* base_off;
  const int32_t* base_idx;
  SelGran gran;
  const float* logits;
  float* wglob;      // weights when they do not fit in shared memory: [list][G][max_slots]
  uint8_t* mask;     // [list][max_slots][G]
  int* counters;     // [list], zero between launches
  float* thr;
  int32_t* kept;
  int32_t* kept_cnt;
  int G, max_slots;
  double p, eps;
  int use_smem;
};


// EPT > 0: NT threads hold the weights of slots tid + k * NT, k < EPT, in registers;
// EPT == 0: the weights live in shared memory (a.use_smem) or global memory.
template <int NT, int EPT>
__global__ void __launch_bounds__(NT, 2) twl_topp_kernel(const TpArgs a) {
  extern __shared__ float sWf[];
  __shared__ RedSmem sred;
  __shared__ int s_warp[64];
  __shared__ int s_last;
  const int G = a.G, list = blockIdx.x / G, g = blockIdx.x % G, tid = threadIdx.x;
  const int e0 = a.base_off[list], ne = a.base_off[list + 1] - e0;
  const bool chunk = a.gran == SelGran::Chunk16;
  const int n = min(chunk ? 16 * ne : ne, EPT > 0 ? NT * EPT : a.max_slots);
  if (n == 0) {  // every CTA of the list leaves here: the counter is not used
    if (tid == 0) {
      a.thr[list * G + g] = INFINITY;
      if (g == 0) a.kept_cnt[list] = 0;
    }
    return;
  }
  const float* lg = a.logits + (int64_t(list) * G + g) * a.max_slots;
  float wr[EPT > 0 ? EPT : 1];
  float* wm = nullptr;
  if constexpr (EPT == 0) wm = a.use_smem ? sWf : a.wglob + (int64_t(list) * G + g) * a.max_slots;
  // f(i, weight&) over this thread's slots.
  auto each = [&](auto&& f) {
    if constexpr (EPT > 0) {
#pragma unroll
      for (int k = 0; k < EPT; ++k) {
        const int i = tid + k * NT;
        if (i < n) f(i, wr[k]);
      }
    } else {
      for (int i = tid; i < n; i += NT) f(i, wm[i]);
    }
  };
  int parity = 0;
  // Softmax as the CPU computes it: float max, float exp, double sum, float reciprocal,
  // float product; invalid slots (-inf logits) hold -1. The largest weight is inv itself
  // (the max logit's exp is 1, every other is <= 1).
  float vmax = -INFINITY;
  each([&](int i, float& v) {
    v = __ldg(lg + i);
    vmax = fmaxf(vmax, v);
  });
  const float lmax = max_block(vmax, sred, parity);
  double sum = 0.0;
  each([&](int, float& v) {
    if (v != -INFINITY) {
      v = expf(v - lmax);
      sum += double(v);
    } else {
      v = -1.f;
    }
  });
  const float inv = float(1.0 / sum_block(sum, sred, parity));
  const float wmax = inv;
  double at_max = 0.0;  // mass of the weights equal to the largest
  each([&](int, float& v) {
    if (v >= 0.f) {
      v *= inv;
      if (v == wmax) at_max += double(v);
    }
  });
  float thr;
  if (sum_block(at_max, sred, parity) >= a.p) {
    thr = wmax;
  } else {
    // Algorithm 1 (sparse::topp_binary_search), two bisection steps per pass: the pass
    // measures the masses at the midpoint m1 and at both possible next midpoints, and the
    // undecided spans of the four quarters, so both steps (and their termination tests)
    // are decided as the sequential loop decides them. Float weights against double
    // thresholds compare as against the thresholds rounded up to float (exact); masses are
    // summed in fp32 over a thread's <= 16 weights, then in double across threads.
    double l = 0, r = wmax;
    int it = 0;
    const float feps = float(a.eps);
    auto f = [](unsigned u) { return __uint_as_float(u); };
    while (r - l >= a.eps && it < 64) {
      const double m1 = 0.5 * (l + r), mL = 0.5 * (l + m1), mR = 0.5 * (m1 + r);
      const float lf = __double2float_ru(l), rf = __double2float_ru(r);
      const float m1f = __double2float_ru(m1), mLf = __double2float_ru(mL), mRf = __double2float_ru(mR);
      float s0 = 0.f, s1 = 0.f, s2 = 0.f;
      Red x = red_init();
      each([&](int, float& v) {
        if (v < lf) return;
        if (v >= mLf) s0 += v;
        if (v >= m1f) s1 += v;
        if (v >= mRf) s2 += v;
        if (v < rf) {
          const unsigned u = __float_as_uint(v);
          if (v >= mRf) x.mn[3] = min(x.mn[3], u), x.mx[3] = max(x.mx[3], u);
          else if (v >= m1f) x.mn[2] = min(x.mn[2], u), x.mx[2] = max(x.mx[2], u);
          else if (v >= mLf) x.mn[1] = min(x.mn[1], u), x.mx[1] = max(x.mx[1], u);
          else x.mn[0] = min(x.mn[0], u), x.mx[0] = max(x.mx[0], u);
        }
      });
      x.s[0] = s0, x.s[1] = s1, x.s[2] = s2;
      const Red y = red_block(x, sred, parity);
      // Step 1: midpoint m1.
      const bool right = y.s[1] >= a.p;
      float lo, hi;
      if (right) l = m1, lo = f(min(y.mn[2], y.mn[3])), hi = f(max(y.mx[2], y.mx[3]));
      else r = m1, lo = f(min(y.mn[0], y.mn[1])), hi = f(max(y.mx[0], y.mx[1]));
      ++it;
      if (!(hi - lo >= feps)) break;
      if (!(r - l >= a.eps && it < 64)) break;
      // Step 2: midpoint mR (right half) or mL (left half), the same doubles.
      const double m = 0.5 * (l + r);
      if (right) {
        if (y.s[2] >= a.p) l = m, lo = f(y.mn[3]), hi = f(y.mx[3]);
        else r = m, lo = f(y.mn[2]), hi = f(y.mx[2]);
      } else {
        if (y.s[0] >= a.p) l = m, lo = f(y.mn[1]), hi = f(y.mx[1]);
        else r = m, lo = f(y.mn[0]), hi = f(y.mx[0]);
      }
      ++it;
      if (!(hi - lo >= feps)) break;
    }
    thr = float(l);
    if (double(thr) > l) thr = nextafterf(thr, -INFINITY);
  }
  if (tid == 0) a.thr[list * G + g] = thr;
  uint8_t* mk = a.mask + int64_t(list) * a.max_slots * G + g;
  each([&](int i, float& v) { mk[int64_t(i) * G] = v >= thr ? 1 : 0; });
  // The last of the G CTAs of the list emits the union, in selection order.
  __threadfence();
  __syncthreads();
  if (tid == 0) s_last = atomicAdd(a.counters + list, 1) == G - 1;
  __syncthreads();
  if (!s_last) return;
  if (tid == 0) a.counters[list] = 0;
  __threadfence();
  const uint8_t* ml = a.mask + int64_t(list) * a.max_slots * G;
  auto keep = [&](int i) {
    if (G == 4) return __ldcg(reinterpret_cast<const unsigned int*>(ml) + i) != 0u;
    for (int k = 0; k < G; ++k)
      if (__ldcg(ml + int64_t(i) * G + k)) return true;
    return false;
  };
  // Thread t takes the contiguous slots [t * seg, t * seg + seg): bit j of `bits` = keep.
  const int seg = (n + NT - 1) / NT;
  const int i0 = min(n, tid * seg), i1 = min(n, i0 + seg);
  int cnt = 0;
  uint32_t bits = 0;
  if (seg <= 32) {
#pragma unroll 8
    for (int j = 0; j < i1 - i0; ++j)
      if (keep(i0 + j)) bits |= 1u << j, ++cnt;
  } else {
    for (int i = i0; i < i1; ++i) cnt += keep(i);
  }
  int tot;
  int o = block_exclusive_scan(cnt, s_warp, &tot);
  int32_t* out = a.kept + int64_t(list) * a.max_slots;
  auto pos_of = [&](int i) {
    return chunk ? __ldg(a.base_idx + e0 + i / 16) * 16 + i % 16 : __ldg(a.base_idx + e0 + i);
  };
  if (seg <= 32) {
    while (bits) {
      const int j = __ffs(bits) - 1;
      bits &= bits - 1;
      out[o++] = pos_of(i0 + j);
    }
  } else {
    for (int i = i0; i < i1; ++i)
      if (keep(i)) out[o++] = pos_of(i);
  }
  if (tid == 0) a.kept_cnt[list] = tot;
}

__global__ void twl_compact_kernel(const int32_t* kept, const int32_t* cnt, int max_slots,
                                   int n_lists, int32_t* off, int32_t* idx) {
  __shared__ int s_start;
  const int list = blockIdx.x;
  if (threadIdx.x < 32) {
    int s = 0;
    for (int i = threadIdx.x; i < list; i += 32) s += cnt[i];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (threadIdx.x == 0) s_start = s;
  }
  __syncthreads();
  const int start = s_start, n = cnt[list];
#pragma unroll 4
  for (int j = threadIdx.x; j < n; j += blockDim.x)
    idx[start + j] = kept[int64_t(list) * max_slots + j];
  if (threadIdx.x == 0) {
    off[list] = start;
    if (list == n_lists - 1) off[list + 1] = start + n;
  }
}

}  // namespace

void int4_quantize_pages(const bf16* k_cache, uint8_t* codes, uint32_t* sz,
                         const int32_t* page_ids, const int32_t* n_valid, int n, int Hkv, int P,
                         int D, cudaStream_t s) {
  SPADE_CHECK(D % 4 == 0 && D <= 256, "int4_quantize_pages: head dim ", D);
  if (n <= 0) return;
  const int64_t warps = int64_t(n) * Hkv * P;
  int4_quantize_kernel<<<unsigned((warps + 7) / 8), 256, 0, s>>>(k_cache, codes, sz, page_ids,
                                                                  n_valid, n, Hkv, P, D);
  SPADE_CUDA_LAUNCH();
}

TwilightPruner::TwilightPruner(DeviceArena& arena, int max_batch, int Hq, int Hkv, int D, int P,
                               int max_slots, double p, double eps)
    : max_batch_(max_batch), Hq_(Hq), Hkv_(Hkv), D_(D), P_(P), max_slots_(max_slots), p_(p),
      eps_(eps) {
  SPADE_CHECK(D == 64 || D == 128, "twilight: head dim ", D, " (64 or 128)");
  SPADE_CHECK(Hq % Hkv == 0 && Hq / Hkv <= 32, "twilight: G = Hq / Hkv must divide and be <= 32");
  SPADE_CHECK(max_slots > 0 && max_batch > 0, "twilight: bad sizes");
  SPADE_CHECK(p > 0 && p <= 1 && eps > 0, "twilight: p in (0, 1], eps > 0");
  max_slots_ = (max_slots + 15) / 16 * 16;
  const size_t lists = size_t(max_batch) * Hkv, G = size_t(Hq / Hkv), ms = size_t(max_slots_);
  logits_ = arena.alloc_n<float>(lists * G * ms, "twilight logits");
  if (ms > size_t(kTpRegSlots) && ms * 4 > kTpSmemMax)
    wglob_ = arena.alloc_n<float>(lists * G * ms, "twilight weights");
  mask_ = arena.alloc_n<uint8_t>(lists * ms * G, "twilight kept masks");
  counters_ = arena.alloc_n<int>(lists, "twilight list counters");
  SPADE_CUDA(cudaMemset(counters_, 0, lists * sizeof(int)));
  thr_ = arena.alloc_n<float>(lists * G, "twilight thresholds");
  kept_strided_ = arena.alloc_n<int32_t>(lists * ms, "twilight kept (strided)");
  kept_cnt_ = arena.alloc_n<int32_t>(lists, "twilight kept counts");
  kept_off_ = arena.alloc_n<int32_t>(lists + 1, "twilight kept offsets");
  kept_idx_ = arena.alloc_n<int32_t>(lists * ms, "twilight kept indices");
}

size_t TwilightPruner::arena_bytes(int max_batch, int Hq, int Hkv, int max_slots) {
  const size_t lists = size_t(max_batch) * Hkv, G = size_t(Hq / Hkv);
  const size_t ms = size_t((max_slots + 15) / 16 * 16);
  size_t b = lists * G * ms * 4 + lists * ms * G + lists * ms * 4 * 2 + lists * (G * 4 + 16) + 4096;
  if (ms > size_t(kTpRegSlots) && ms * 4 > kTpSmemMax) b += lists * G * ms * 4;
  return b;
}

void TwilightPruner::estimate(const TwilightStep& st, cudaStream_t s) {
  SPADE_CHECK(st.B >= 1 && st.B <= max_batch_, "twilight: batch ", st.B);
  SPADE_CHECK(st.gran == SelGran::Token || (st.gran == SelGran::Chunk16 && P_ % 16 == 0),
              "twilight: base lists must be Token or Chunk16 (P % 16 == 0)");
  const int G = Hq_ / Hkv_, NTILE = (G + 7) / 8;
  const int tiles = (max_slots_ + 15) / 16;
  dim3 grid(unsigned(std::max(1, (tiles + kEstWarps * kEstTilesPerWarp - 1) /
                                     (kEstWarps * kEstTilesPerWarp))),
            unsigned(st.B * Hkv_));
  auto go = [&](auto kernel) {
    kernel<<<grid, kEstWarps * 32, 0, s>>>(st, logits_, Hq_, Hkv_, P_, max_slots_);
  };
  if (D_ == 128) {
    if (NTILE == 1) go(twl_estimate_kernel<128, 1>);
    else if (NTILE == 2) go(twl_estimate_kernel<128, 2>);
    else go(twl_estimate_kernel<128, 4>);
  } else {
    if (NTILE == 1) go(twl_estimate_kernel<64, 1>);
    else if (NTILE == 2) go(twl_estimate_kernel<64, 2>);
    else go(twl_estimate_kernel<64, 4>);
  }
  SPADE_CUDA_LAUNCH();
}

void TwilightPruner::topp(const TwilightStep& st, cudaStream_t s) {
  const int G = Hq_ / Hkv_;
  TpArgs a{st.base_off, st.base_idx, st.gran, logits_, wglob_, mask_, counters_, thr_,
           kept_strided_, kept_cnt_, G, max_slots_, p_, eps_, 0};
  if (max_slots_ <= kTpRegSlots) {
    twl_topp_kernel<kTpRegThreads, kTpEpt><<<st.B * Hkv_ * G, kTpRegThreads, 0, s>>>(a);
  } else {
    const size_t smem = size_t(max_slots_) * 4;
    a.use_smem = smem <= kTpSmemMax ? 1 : 0;
    SPADE_CHECK(a.use_smem || wglob_, "twilight: no weight buffer");
    static bool attr_done = false;
    if (!attr_done) {
      SPADE_CUDA(cudaFuncSetAttribute(twl_topp_kernel<kTpMemThreads, 0>,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize, int(kTpSmemMax)));
      attr_done = true;
    }
    twl_topp_kernel<kTpMemThreads, 0><<<st.B * Hkv_ * G, kTpMemThreads, a.use_smem ? smem : 0, s>>>(a);
  }
  SPADE_CUDA_LAUNCH();
}

void TwilightPruner::compact(const TwilightStep& st, cudaStream_t s) {
  const int n_lists = st.B * Hkv_;
  twl_compact_kernel<<<n_lists, 1024, 0, s>>>(kept_strided_, kept_cnt_, max_slots_, n_lists,
                                             kept_off_, kept_idx_);
  SPADE_CUDA_LAUNCH();
}

void TwilightPruner::run(const TwilightStep& st, cudaStream_t s) {
  estimate(st, s);
  topp(st, s);
  compact(st, s);
}

}  // namespace spade::cuda
