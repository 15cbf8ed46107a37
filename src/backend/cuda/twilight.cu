// Twilight pruner on the GPU: INT4 bulk quantizer, top-p, compaction (API and formats in
// twilight.h; the estimate kernel is in twilight_estimate.cu).
//
// int4_quantize_kernel
//   reads  n_valid bf16 key rows of each listed (page, KV head): D*2 bytes per row
//   writes D/2 code bytes + one uint32 scale/zero per row (int4_keys.cuh's format)
//   one warp per (listed page, KV head, row).
// twl_topp_kernel
//   reads  one (list, query head) logit row fp32 once (L2-hot after the estimate); the
//          passes then read the fp32 weights from registers (lists up to 8192 slots),
//          shared memory (up to 49152 slots) or global memory
//   writes the head's kept mask (1 bit per slot, one ballot per 32 slots), its threshold;
//          the last CTA of the list reads the G masks (4 B per 32 slots each) and writes
//          the kept positions int32 [list][max_slots] in selection order and the kept count
//   CTA = one (list, query head): 512 threads (2 CTAs per SM) with 16 weights each in
//   registers (lists up to 8192 slots; 1024 threads x 8 when the grid has at most one CTA
//   per SM; 128 threads x 16 for lists up to 2048 slots), else 256 threads over shared /
//   global memory.
//   Softmax: two block reductions (max; sum and the count of largest weights). The search is
//   sparse::topp_binary_search step for step (double midpoints, its termination test): eight
//   steps per pass over the weights (topp_tree_search.cuh: shared-memory atomics bin the
//   weights of [l, r) into 256 intervals, one warp builds the interval tree, one thread
//   walks it; 2 barriers per pass), then, for searches deeper than 29 steps, passes of two
//   steps (masses at m1 and both candidate next midpoints, min / max of each quarter of
//   [l, r); masses fp32 within a thread's <= 16 weights, double across threads).
// twl_compact_kernel
//   reads  kept counts (B*Hkv ints) and the kept positions; writes CSR offsets / indices.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "backend/cuda/block_scan.cuh"
#include "backend/cuda/per_device.h"
#include "backend/cuda/int4_keys.cuh"
#include "backend/cuda/topp_tree_search.cuh"
#include "backend/cuda/twilight.h"
#include "backend/cuda/twilight_topp_warp.h"
#include "backend/cuda/pdl.cuh"

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

// One CTA per (list, query head). Lists up to kTpRegSlots slots keep their weights in
// registers (kTpRegThreads threads x kTpEpt each); longer ones in shared or global memory.
constexpr int kTpRegThreads = 512, kTpEpt = 16, kTpRegSlots = kTpRegThreads * kTpEpt;
// Grids that leave most SMs idle (B = 1: B * Hq CTAs) take 1024 threads x 8 weights per
// CTA instead: half the serial work per thread between the barriers.
constexpr int kTpWideThreads = 1024, kTpWideEpt = kTpRegSlots / kTpWideThreads;
// Short lists (a small base budget: up to 2048 slots) take 128 threads x 16 weights: four
// warps meet at each barrier instead of 16 or 32 mostly idle ones.
constexpr int kTpNarrowThreads = 128, kTpNarrowSlots = kTpNarrowThreads * kTpEpt;
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
  double2 d[2][kTpWarps];
};

// kTpSmemMax within what the device gives a block, past the kernel's static shared memory
// (A100: 163 KB in all; sm_86 / 89: 99 KB).
size_t tp_smem_max() {
  return std::min(kTpSmemMax, smem_optin_bytes() - sizeof(RedSmem) - sizeof(TreeSmem) - 1024);
}

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

// Block max of a float (the softmax's max), same scheme.
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
// Block sums of two doubles (the softmax's sum and its count of largest weights).
__device__ __forceinline__ double2 sum2_block(double a, double b, RedSmem& sm, int& parity) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    a += __shfl_xor_sync(0xffffffffu, a, o);
    b += __shfl_xor_sync(0xffffffffu, b, o);
  }
  const int pb = parity;
  parity ^= 1;
  if ((threadIdx.x & 31) == 0) sm.d[pb][threadIdx.x >> 5] = make_double2(a, b);
  __syncthreads();
  double2 y = (threadIdx.x & 31) < (blockDim.x >> 5) ? sm.d[pb][threadIdx.x & 31] : make_double2(0.0, 0.0);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    y.x += __shfl_xor_sync(0xffffffffu, y.x, o);
    y.y += __shfl_xor_sync(0xffffffffu, y.y, o);
  }
  return y;
}

struct TpArgs {
  const int32_t* base_off;
  const int32_t* base_idx;
  SelGran gran;
  const float* logits;
  float* wglob;      // weights when they do not fit in shared memory: [list][G][max_slots]
  uint32_t* mask;    // kept bits [list][G][ceil(max_slots / 32)]
  int* counters;     // [list], zero between launches
  float* thr;
  int32_t* kept;
  int32_t* kept_cnt;
  int G, max_slots;
  double p, eps;
  int use_smem;
  int bisection_only;  // the step-per-pass loop alone (the reference: tests, benchmark)
  // Diagnostics (optional, TwilightPruner::set_trace; -DSPADE_TOPP_TRACE builds): 16 uint64 per CTA.
  unsigned long long* trace;
};

// Trace word k of this CTA (thread 0; globaltimer ns): 0 entry, 1 past the PDL wait, 2 max
// done, 3 sum done, 4 pass 1 binned, 5-8 tree passes 1-4 done, 9 search done, 10 masks
// stored, 11 handoff decided, 12 end (the list's last CTA). Diagnostic builds only
// (-DSPADE_TOPP_TRACE; bench/bench_twilight.cu's SPADE_TWL_TRACE): even unused, the stamps
// cost the batch-1 top-p ~0.3 us (H100, bench/results/twilight_topp_trace_cost_h100_20261127.json),
// so production builds compile none of them.
__device__ __forceinline__ void tp_stamp(const TpArgs& a, int k) {
#ifdef SPADE_TOPP_TRACE
  constexpr int kTpTraceWords = 16;
  if (a.trace && threadIdx.x == 0) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    a.trace[size_t(blockIdx.x) * kTpTraceWords + k] = t;
  }
#endif
}

// EPT > 0: NT threads hold the weights of slots tid + k * NT, k < EPT, in registers;
// EPT == 0: the weights live in shared memory (a.use_smem) or global memory.
template <int NT, int EPT>
__global__ void __launch_bounds__(NT, NT >= 1024 ? 1 : 2) twl_topp_kernel(const TpArgs a) {
  tp_stamp(a, 0);  // (the trace buffer is the benchmark's, no other kernel touches it)
  pdl_begin();  // pdl.cuh: first, before any global access
  tp_stamp(a, 1);
  extern __shared__ float sWf[];
  __shared__ RedSmem sred;
  __shared__ TreeSmem stree;
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
  if (!a.bisection_only) tree_bins_clear(stree.bins[0], tid, NT);  // ordered by the first barrier
  // Softmax as the CPU computes it: float max, float exp, double sum, float reciprocal,
  // float product; invalid slots (-inf logits) hold -1. The largest weight is inv itself
  // (the max logit's exp is 1, every other is <= 1), and a weight equals it exactly when its
  // exp is 1 (e <= 1 - 2^-24 rounds e * inv below inv), so the mass at the largest weight is
  // that count times inv (exact in double, as the CPU's sum of equal floats).
  float vmax = -INFINITY;
  each([&](int i, float& v) {
    v = __ldg(lg + i);
    vmax = fmaxf(vmax, v);
  });
  const float lmax = max_block(vmax, sred, parity);
  tp_stamp(a, 2);
  double sum = 0.0, n_max = 0.0;
  each([&](int, float& v) {
    if (v != -INFINITY) {
      v = expf(v - lmax);
      sum += double(v);
      n_max += v == 1.f ? 1.0 : 0.0;
    } else {
      v = -1.f;
    }
  });
  const double2 red = sum2_block(sum, n_max, sred, parity);
  tp_stamp(a, 3);
  const float inv = float(1.0 / red.x);
  const float wmax = inv;
  const double at_max = red.y * double(wmax);
  each([&](int, float& v) {
    if (v >= 0.f) v *= inv;
  });
  float thr;
  if (at_max >= a.p) {
    thr = wmax;
  } else {
    // Algorithm 1 (sparse::topp_binary_search) from l = 0, r = wmax: eight steps per pass
    // over the weights (topp_tree_search.cuh) while the midpoints stay exact doubles, then
    // (a deep search, or bisection_only) the step-per-pass loop below.
    double l = 0, r = wmax, mass_r = at_max;
    int it = 0;
    bool done = false;
    if (!a.bisection_only) {
      const int warp = tid >> 5;
      for (int tp = 0; it <= kTreeMaxStartDepth; tp ^= 1) {
        if (!(r - l >= a.eps && it < 64)) {
          done = true;
          break;
        }
        TreeBins& bins = stree.bins[tp];
        const TreePass pass = tree_pass(l, r);
        unsigned mn0 = kTreeEmptyMin, mx0 = 0u;
        if constexpr (EPT >= 16)
          each([&](int, float& v) { tree_bin_weight_exact(bins, v, pass, mn0, mx0); });
        else
          each([&](int, float& v) { tree_bin_weight(bins, v, pass, mn0, mx0); });
        tree_bin_flush0(bins, mn0, mx0);
        tree_bins_clear(stree.bins[tp ^ 1], tid, NT);  // last read in the previous pass's walk
        __syncthreads();
        if (it == 0) tp_stamp(a, 4);
        if (warp == 0) {
          tree_build_warp(bins, stree.nodes);
          if (tid == 0) stree.walk = tree_walk(bins, stree.nodes, l, r, mass_r, it, a.p, a.eps);
        }
        __syncthreads();
        if (it < 32) tp_stamp(a, 5 + min(3, it / 8));  // it = 0, 8, 16, 24 before passes 1-4
        const TreeWalk w = stree.walk;
        l = w.l, r = w.r, mass_r = w.mass_r, it = w.it;
        if (w.done) {
          done = true;
          break;
        }
      }
    }
    // The step-per-pass loop, two steps per pass: the pass measures the masses at m1 and at
    // both possible next midpoints and the undecided spans of the four quarters, so both
    // steps (and their termination tests) are decided as the sequential loop decides them.
    // Float weights against double thresholds compare as against the thresholds rounded up
    // to float (exact); masses are summed in fp32 over a thread's <= 16 weights, then in
    // double across threads.
    const float feps = float(a.eps);
    auto f = [](unsigned u) { return __uint_as_float(u); };
    while (!done && r - l >= a.eps && it < 64) {
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
  tp_stamp(a, 9);
  if (tid == 0) a.thr[list * G + g] = thr;
  // Kept mask: bit (i % 32) of word [list][g][i / 32]; a warp's 32 consecutive slots are one
  // ballot and one store.
  const int nw = (a.max_slots + 31) >> 5, lane = tid & 31;
  uint32_t* mw = a.mask + (int64_t(list) * G + g) * nw;
  if constexpr (EPT > 0) {
#pragma unroll
    for (int k = 0; k < EPT; ++k) {
      const int i = tid + k * NT;
      const unsigned bits = __ballot_sync(0xffffffffu, i < n && wr[k] >= thr);
      if (lane == 0 && i < n) mw[i >> 5] = bits;
    }
  } else {
    for (int i0 = tid - lane; i0 < n; i0 += NT) {
      const unsigned bits = __ballot_sync(0xffffffffu, i0 + lane < n && wm[i0 + lane] >= thr);
      if (lane == 0) mw[i0 >> 5] = bits;
    }
  }
  tp_stamp(a, 10);
  // The last of the G CTAs of the list emits the union, in selection order. The grid-sync
  // pattern of cooperative groups: the barrier orders every thread's mask stores before
  // thread 0's fence and counter add (fences are cumulative), so one thread fences instead of
  // all; the last CTA's thread 0 fences again (acquire) before the barrier that releases the
  // readers.
  __syncthreads();
  if (tid == 0) {
    __threadfence();
    s_last = atomicAdd(a.counters + list, 1) == G - 1;
    if (s_last) {
      a.counters[list] = 0;
      __threadfence();
    }
  }
  __syncthreads();
  tp_stamp(a, 11);
  if (!s_last) return;
  const uint32_t* ml = a.mask + int64_t(list) * G * nw;
  auto union_word = [&](int w) {
    unsigned m = 0u;
    for (int k = 0; k < G; ++k) m |= __ldcg(ml + k * nw + w);
    return m;
  };
  // Thread t takes the contiguous words [t * wpt, t * wpt + wpt) (32 slots each).
  const int nwords = (n + 31) >> 5, wpt = (nwords + NT - 1) / NT;
  const int w0 = min(nwords, tid * wpt), w1 = min(nwords, w0 + wpt);
  unsigned first = w0 < w1 ? union_word(w0) : 0u;
  int cnt = __popc(first);
  for (int w = w0 + 1; w < w1; ++w) cnt += __popc(union_word(w));
  int tot;
  int o = block_exclusive_scan(cnt, s_warp, &tot);
  int32_t* out = a.kept + int64_t(list) * a.max_slots;
  auto pos_of = [&](int i) {
    return chunk ? __ldg(a.base_idx + e0 + i / 16) * 16 + i % 16 : __ldg(a.base_idx + e0 + i);
  };
  for (int w = w0; w < w1; ++w) {
    unsigned m = w == w0 ? first : union_word(w);
    while (m) {
      const int j = __ffs(m) - 1;
      m &= m - 1;
      out[o++] = pos_of(w * 32 + j);
    }
  }
  if (tid == 0) a.kept_cnt[list] = tot;
  tp_stamp(a, 12);
}

__global__ void twl_compact_kernel(const int32_t* kept, const int32_t* cnt, int max_slots,
                                   int n_lists, int32_t* off, int32_t* idx) {
  pdl_begin();  // pdl.cuh: first, before any global access
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
  int dev = 0;
  SPADE_CUDA(cudaGetDevice(&dev));
  SPADE_CUDA(cudaDeviceGetAttribute(&n_sms_, cudaDevAttrMultiProcessorCount, dev));
  const size_t lists = size_t(max_batch) * Hkv, G = size_t(Hq / Hkv), ms = size_t(max_slots_);
  logits_ = arena.alloc_n<float>(lists * G * ms, "twilight logits");
  if (ms > size_t(kTpRegSlots) && ms * 4 > tp_smem_max())
    wglob_ = arena.alloc_n<float>(lists * G * ms, "twilight weights");
  mask_ = arena.alloc_n<uint32_t>(lists * G * ((ms + 31) / 32), "twilight kept masks");
  counters_ = arena.alloc_n<int>(lists, "twilight list counters");
  SPADE_CUDA(cudaMemset(counters_, 0, lists * sizeof(int)));
  thr_ = arena.alloc_n<float>(lists * G, "twilight thresholds");
  kept_strided_ = arena.alloc_n<int32_t>(lists * ms, "twilight kept (strided)");
  kept_strided_off_ = arena.alloc_n<int32_t>(lists + 1, "twilight kept (strided) offsets");
  {
    std::vector<int32_t> off(lists + 1);
    for (size_t i = 0; i <= lists; ++i) off[i] = int32_t(i * ms);
    SPADE_CUDA(cudaMemcpy(kept_strided_off_, off.data(), off.size() * 4, cudaMemcpyHostToDevice));
  }
  kept_cnt_ = arena.alloc_n<int32_t>(lists, "twilight kept counts");
  kept_off_ = arena.alloc_n<int32_t>(lists + 1, "twilight kept offsets");
  kept_idx_ = arena.alloc_n<int32_t>(lists * ms, "twilight kept indices");
}

size_t TwilightPruner::arena_bytes(int max_batch, int Hq, int Hkv, int max_slots) {
  const size_t lists = size_t(max_batch) * Hkv, G = size_t(Hq / Hkv);
  const size_t ms = size_t((max_slots + 15) / 16 * 16);
  size_t b = lists * G * ms * 4 + lists * G * ((ms + 31) / 32) * 4 + lists * ms * 4 * 2 + lists * (G * 4 + 20) + 4096;
  if (ms > size_t(kTpRegSlots) && ms * 4 > tp_smem_max()) b += lists * G * ms * 4;
  return b;
}

void TwilightPruner::topp(const TwilightStep& st, cudaStream_t s) {
  const int G = Hq_ / Hkv_;
  // Short lists (<= 512 slots): a warp per query head (twilight_topp_warp.cu), same result.
  // The bisection-only reference keeps the CTA-per-head kernel.
  if (!topp_bisection_only_ && !trace_ && topp_warp_applies(max_slots_, G)) {
    const ToppWarpArgs w{st.base_off, st.base_idx, st.gran, logits_, thr_, kept_strided_,
                         kept_cnt_, G, max_slots_, p_, eps_};
    topp_warp(w, st.B * Hkv_, s);
    return;
  }
  TpArgs a{st.base_off, st.base_idx, st.gran, logits_, wglob_, mask_, counters_, thr_,
           kept_strided_, kept_cnt_, G, max_slots_, p_, eps_, 0, topp_bisection_only_ ? 1 : 0,
           trace_};
  if (max_slots_ <= kTpNarrowSlots) {
    launch_pdl(twl_topp_kernel<kTpNarrowThreads, kTpEpt>, st.B * Hkv_ * G, kTpNarrowThreads, 0, s, a);
  } else if (max_slots_ <= kTpRegSlots) {
    const int ctas = st.B * Hkv_ * G;
    if (ctas <= n_sms_)
      launch_pdl(twl_topp_kernel<kTpWideThreads, kTpWideEpt>, ctas, kTpWideThreads, 0, s, a);
    else
      launch_pdl(twl_topp_kernel<kTpRegThreads, kTpEpt>, ctas, kTpRegThreads, 0, s, a);
  } else {
    const size_t smem = size_t(max_slots_) * 4;
    a.use_smem = smem <= tp_smem_max() ? 1 : 0;
    SPADE_CHECK(a.use_smem || wglob_, "twilight: no weight buffer");
    static PerDeviceOnce attr_done;  // per device: tensor-parallel ranks as threads
    if (attr_done.pending()) {
      set_max_dynamic_smem(twl_topp_kernel<kTpMemThreads, 0>, int(tp_smem_max()));
      attr_done.mark();
    }
    launch_pdl(twl_topp_kernel<kTpMemThreads, 0>, st.B * Hkv_ * G, kTpMemThreads, a.use_smem ? smem : 0, s, a);
  }
  SPADE_CUDA_LAUNCH();
}

void TwilightPruner::compact(const TwilightStep& st, cudaStream_t s) {
  const int n_lists = st.B * Hkv_;
  launch_pdl(twl_compact_kernel, n_lists, 1024, 0, s, kept_strided_, kept_cnt_, max_slots_, n_lists,
                                             kept_off_, kept_idx_);
  SPADE_CUDA_LAUNCH();
}

void TwilightPruner::set_trace(unsigned long long* trace) {
#ifndef SPADE_TOPP_TRACE
  SPADE_CHECK(trace == nullptr, "twilight: the top-p trace needs twilight.cu built with "
              "-DSPADE_TOPP_TRACE (bench/bench_twilight.cu says how)");
#endif
  trace_ = trace;
}

void TwilightPruner::run(const TwilightStep& st, cudaStream_t s) {
  estimate(st, s);
  topp(st, s);
}

}  // namespace spade::cuda
