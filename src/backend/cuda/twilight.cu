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
//   CTA = 4 warps of one list (b, KV head); a warp takes 16-slot tiles: lane (row r = lane/4,
//   t = lane%4) loads 16-byte pieces of rows r and r+8 (bytes [t*D/8, t*D/8 + D/8) = dims
//   [t*D/4, t*D/4 + D/4)), turns each code byte into a bf16x2 (0x4300 | c is 128 + c, minus
//   128: exact) and feeds mma.m16n8k16 (A = codes, 16 rows x 16 dims; B = q^T, 16 dims x 8
//   heads, held in registers: lane's head r, the same dims). Within a k-step lane t's
//   k = 2t, 2t+1, 2t+8, 2t+9 are its own dims t*D/4 + 4s + 0..3 for A and B alike, so no
//   shuffle is needed; products are exact, accumulation fp32.
// twl_topp_kernel
//   reads  the list's G logit rows (fp32) once; the bisection passes then read shared memory
//          (G * slots * 4 B <= 200 KB) or, for longer lists, the rows in global memory (L2)
//   writes kept positions int32 [list][max_slots] in selection order, kept counts, the G
//          thresholds
//   CTA = one list, 1024 threads in NG = min(G, 8) (power of two) groups; group k runs the
//   softmax and Algorithm 1 for heads k, k + NG, ... with named barriers (one per reduction,
//   partials double-buffered); the bisection is sparse::topp_binary_search step for step
//   (double midpoints, double masses, its termination test), so equal weights give an equal
//   threshold. Then the whole CTA marks the union and compacts it by a block scan.
// twl_compact_kernel
//   reads  kept counts (B*Hkv ints) and the kept positions; writes CSR offsets / indices.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>

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
  for (int tile = first; tile < n_tiles; tile += stride) {
    int pos[2];
    bool ok[2];
    uint32_t w[2][W], szr[2];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int slot = tile * 16 + r + 8 * hr;
      if (chunk) {
        pos[hr] = st.base_idx[e0 + tile] * 16 + r + 8 * hr;
        ok[hr] = pos[hr] < L;
      } else {
        ok[hr] = slot < n_slots;
        pos[hr] = ok[hr] ? st.base_idx[e0 + slot] : 0;
      }
      if (ok[hr]) {
        const int64_t row = (int64_t(pt[pos[hr] / P]) * Hkv + h) * P + pos[hr] % P;
        const uint8_t* src = st.codes + row * (D / 2) + t * (D / 8);
        if constexpr (W == 4) {
          const uint4 v = __ldg(reinterpret_cast<const uint4*>(src));
          w[hr][0] = v.x, w[hr][1] = v.y, w[hr][2] = v.z, w[hr][3] = v.w;
        } else {
          const uint2 v = __ldg(reinterpret_cast<const uint2*>(src));
          w[hr][0] = v.x, w[hr][1] = v.y;
        }
        szr[hr] = __ldg(st.sz + row);
      } else {
#pragma unroll
        for (int c = 0; c < W; ++c) w[hr][c] = 0u;
        szr[hr] = 0u;
      }
    }
    float acc[NTILE][4];
#pragma unroll
    for (int nt = 0; nt < NTILE; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
#pragma unroll
    for (int c = 0; c < W; ++c) {  // word c holds k-steps 2c (bytes 0, 1) and 2c + 1 (2, 3)
      const uint32_t a00 = codes_bf16x2<0>(w[0][c]), a01 = codes_bf16x2<1>(w[0][c]);
      const uint32_t a02 = codes_bf16x2<2>(w[0][c]), a03 = codes_bf16x2<3>(w[0][c]);
      const uint32_t a10 = codes_bf16x2<0>(w[1][c]), a11 = codes_bf16x2<1>(w[1][c]);
      const uint32_t a12 = codes_bf16x2<2>(w[1][c]), a13 = codes_bf16x2<3>(w[1][c]);
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
      const __half2 p2 = *reinterpret_cast<const __half2*>(&szr[hr]);
      const float s = __low2float(p2), z = __high2float(p2);
#pragma unroll
      for (int nt = 0; nt < NTILE; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int g = nt * 8 + 2 * t + e;
          if (g >= G) continue;
          const float qsum = e ? qs_b[nt] : qs_a[nt];
          const float v = ok[hr] ? st.scale * (z * qsum + s * acc[nt][2 * hr + e]) : -INFINITY;
          logits[(int64_t(list) * G + g) * max_slots + slot] = v;
        }
    }
  }
}

constexpr int kTpThreads = 1024;
constexpr size_t kTpSmemMax = 200u << 10;

struct Red {
  double m;        // sum
  float a, b;      // min, max (first interval)
  float c, d;      // min, max (second interval)
};

__device__ __forceinline__ Red red_warp(Red x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    x.m += __shfl_xor_sync(0xffffffffu, x.m, o);
    x.a = fminf(x.a, __shfl_xor_sync(0xffffffffu, x.a, o));
    x.b = fmaxf(x.b, __shfl_xor_sync(0xffffffffu, x.b, o));
    x.c = fminf(x.c, __shfl_xor_sync(0xffffffffu, x.c, o));
    x.d = fmaxf(x.d, __shfl_xor_sync(0xffffffffu, x.d, o));
  }
  return x;
}

__device__ __forceinline__ void group_bar(int grp, int gt) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(grp + 1), "r"(gt) : "memory");
}

// Reduction over the gt threads of group grp; every thread gets the same result (partials
// summed in warp order). sred: [2][32] per group, used alternately (parity).
__device__ __forceinline__ Red red_group(Red x, Red* sred, int& parity, int grp, int gt) {
  x = red_warp(x);
  const int wig = (threadIdx.x % gt) >> 5, nw = gt >> 5;
  Red* buf = sred + parity * 32;
  parity ^= 1;
  if ((threadIdx.x & 31) == 0) buf[wig] = x;
  group_bar(grp, gt);
  Red y = buf[0];
  for (int i = 1; i < nw; ++i) {
    const Red z = buf[i];
    y.m += z.m;
    y.a = fminf(y.a, z.a), y.b = fmaxf(y.b, z.b), y.c = fminf(y.c, z.c), y.d = fmaxf(y.d, z.d);
  }
  return y;
}

__device__ __forceinline__ Red red_init() { return Red{0.0, INFINITY, -INFINITY, INFINITY, -INFINITY}; }

struct TpArgs {
  const int32_t* base_off;
  const int32_t* base_idx;
  const int32_t* kv_len;
  SelGran gran;
  float* logits;
  float* thr;
  int32_t* kept;
  int32_t* kept_cnt;
  int Hkv, G, max_slots, ng;
  double p, eps;
  int use_smem;  // weights in shared memory (G * slots floats) or in place in logits
};

__device__ __forceinline__ int block_scan_excl(int v, int* s_warp, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) s_warp[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int w = s_warp[lane];  // kTpThreads / 32 == 32 warps
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += y;
    }
    s_warp[32 + lane] = w;
  }
  __syncthreads();
  const int before = (warp > 0 ? s_warp[32 + warp - 1] : 0) + x - v;
  *total = s_warp[32 + 31];
  __syncthreads();
  return before;
}

__global__ void __launch_bounds__(kTpThreads) twl_topp_kernel(const TpArgs a) {
  extern __shared__ float sW[];
  __shared__ Red sred[8][64];
  __shared__ float s_thr[32];
  __shared__ int s_warp[64];
  const int list = blockIdx.x;
  const int G = a.G;
  const int e0 = a.base_off[list], ne = a.base_off[list + 1] - e0;
  const bool chunk = a.gran == SelGran::Chunk16;
  const int n = min(chunk ? 16 * ne : ne, a.max_slots);
  const int tid = threadIdx.x;
  if (n == 0) {
    if (tid == 0) a.kept_cnt[list] = 0;
    for (int g = tid; g < G; g += kTpThreads) a.thr[list * G + g] = INFINITY;
    return;
  }
  const int gt = kTpThreads / a.ng, grp = tid / gt, gtid = tid % gt;
  int parity = 0;
  auto wrow = [&](int g) -> float* {
    return a.use_smem ? sW + int64_t(g) * n : a.logits + (int64_t(list) * G + g) * a.max_slots;
  };
  for (int g = grp; g < G; g += a.ng) {
    const float* lg = a.logits + (int64_t(list) * G + g) * a.max_slots;
    float* w = wrow(g);
    Red x = red_init();
    for (int i = gtid; i < n; i += gt) x.b = fmaxf(x.b, lg[i]);
    const float mx = red_group(x, sred[grp], parity, grp, gt).b;
    // Softmax (the CPU's: float exp, double sum, float reciprocal); invalid slots -> -1.
    x = red_init();
    for (int i = gtid; i < n; i += gt) {
      const float v = lg[i];
      float e = -1.f;
      if (v != -INFINITY) {
        e = expf(v - mx);
        x.m += double(e);
      }
      w[i] = e;
    }
    const float inv = float(1.0 / red_group(x, sred[grp], parity, grp, gt).m);
    x = red_init();
    for (int i = gtid; i < n; i += gt) {
      const float e = w[i];
      if (e >= 0.f) {
        w[i] = e * inv;
        x.b = fmaxf(x.b, e * inv);
      }
    }
    const float wmax = red_group(x, sred[grp], parity, grp, gt).b;
    x = red_init();
    for (int i = gtid; i < n; i += gt)
      if (w[i] >= wmax) x.m += double(w[i]);
    float thr;
    if (red_group(x, sred[grp], parity, grp, gt).m >= a.p) {
      thr = wmax;
    } else {
      double l = 0, r = wmax;
      int it = 0;
      while (r - l >= a.eps && it < 64) {
        const double m = 0.5 * (l + r);
        x = red_init();
        for (int i = gtid; i < n; i += gt) {
          const float v = w[i];
          if (v >= m) {
            x.m += double(v);
            if (v < r) x.a = fminf(x.a, v), x.b = fmaxf(x.b, v);
          } else if (v >= l) {
            x.c = fminf(x.c, v), x.d = fmaxf(x.d, v);
          }
        }
        const Red y = red_group(x, sred[grp], parity, grp, gt);
        float lo, hi;
        if (y.m >= a.p) l = m, lo = y.a, hi = y.b;
        else r = m, lo = y.c, hi = y.d;
        ++it;
        if (!(hi - lo >= float(a.eps))) break;
      }
      thr = float(l);
      if (double(thr) > l) thr = nextafterf(thr, -INFINITY);
    }
    if (gtid == 0) {
      s_thr[g] = thr;
      a.thr[list * G + g] = thr;
    }
  }
  __syncthreads();
  // Union of the G kept sets, compacted in selection order.
  const int seg = (n + kTpThreads - 1) / kTpThreads;
  const int i0 = min(n, tid * seg), i1 = min(n, i0 + seg);
  auto keep = [&](int i) {
    for (int g = 0; g < G; ++g)
      if (wrow(g)[i] >= s_thr[g]) return true;  // invalid slots hold -1 < any threshold
    return false;
  };
  int cnt = 0;
  for (int i = i0; i < i1; ++i) cnt += keep(i);
  int tot;
  int o = block_scan_excl(cnt, s_warp, &tot);
  int32_t* out = a.kept + int64_t(list) * a.max_slots;
  for (int i = i0; i < i1; ++i)
    if (keep(i)) out[o++] = chunk ? a.base_idx[e0 + i / 16] * 16 + i % 16 : a.base_idx[e0 + i];
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
  const size_t lists = size_t(max_batch) * Hkv, G = size_t(Hq / Hkv);
  logits_ = arena.alloc_n<float>(lists * G * size_t(max_slots), "twilight logits");
  thr_ = arena.alloc_n<float>(lists * G, "twilight thresholds");
  kept_strided_ = arena.alloc_n<int32_t>(lists * size_t(max_slots), "twilight kept (strided)");
  kept_cnt_ = arena.alloc_n<int32_t>(lists, "twilight kept counts");
  kept_off_ = arena.alloc_n<int32_t>(lists + 1, "twilight kept offsets");
  kept_idx_ = arena.alloc_n<int32_t>(lists * size_t(max_slots), "twilight kept indices");
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
  int ng = 1;
  while (ng * 2 <= std::min(G, 8)) ng *= 2;
  const size_t smem = size_t(G) * size_t(max_slots_) * 4;
  const bool use_smem = smem <= kTpSmemMax;
  static bool attr_done = false;
  if (!attr_done) {
    SPADE_CUDA(cudaFuncSetAttribute(twl_topp_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    int(kTpSmemMax)));
    attr_done = true;
  }
  TpArgs a{st.base_off, st.base_idx, st.kv_len, st.gran, logits_, thr_, kept_strided_, kept_cnt_,
           Hkv_, G, max_slots_, ng, p_, eps_, use_smem ? 1 : 0};
  twl_topp_kernel<<<st.B * Hkv_, kTpThreads, use_smem ? smem : 0, s>>>(a);
  SPADE_CUDA_LAUNCH();
}

void TwilightPruner::compact(const TwilightStep& st, cudaStream_t s) {
  const int n_lists = st.B * Hkv_;
  twl_compact_kernel<<<n_lists, 256, 0, s>>>(kept_strided_, kept_cnt_, max_slots_, n_lists,
                                             kept_off_, kept_idx_);
  SPADE_CUDA_LAUNCH();
}

void TwilightPruner::run(const TwilightStep& st, cudaStream_t s) {
  estimate(st, s);
  topp(st, s);
  compact(st, s);
}

}  // namespace spade::cuda
