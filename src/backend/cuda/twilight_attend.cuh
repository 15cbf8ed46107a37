// Attention over the Twilight union inside the top-p kernel (TwilightPruner::run_attend): the
// kept rows are attended where the union is known, so the step needs no compaction and no
// separate attention launch (at batch 1 that launch, ~9.5 us of dependent loads, was a
// third of the Twilight step).
//
// Reads  the G kept masks of the list (4 B per 32 slots each, L2), the base list entries and
//        page ids of the kept slots, q (G x D bf16), and each kept K and V row once for the
//        whole GQA group: 2 x D x 2 bytes per kept token.
// Writes out bf16 [B, Hq, D] rows (b, h * G + g) for the G heads of the list; in split mode
//        also partials fp32 [list][G][G][D] + (max, sum) [list][G][G][2].
// Work:  unions of at most single_max tokens are attended by the list's last CTA alone;
//        larger ones are cut into G equal rank ranges, one per CTA of the list (the CTAs
//        that arrived earlier wait for the last one's release of the union, so every CTA of
//        the grid must be resident: TwilightPruner checks the occupancy), and the last CTA
//        of a second arrival combines the G partials by log-sum-exp.
// Per CTA: the range's rows are resolved into shared memory (entry -> page -> row id), then
//        each warp streams batches of kNB tokens (K and V rows, D / 32 elements per lane, by
//        cp.async into a 2-stage per-warp ring) with fp32 FMA dot products, warp all-reduce,
//        an online softmax in log2 units per head; warps merge through shared memory.
// Shared memory (dynamic): q fp32 [GM][D] | ring NW x 2 x kNB x (K, V) x D bf16, reused for
//        the merge NW x GM x (D + 2) fp32 | row ids int32 [rows_cap].
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "backend/cuda/block_scan.cuh"

namespace spade::cuda {
namespace twl_attend {

constexpr int kNB = 4;      // tokens per warp and ring stage
constexpr int kStages = 2;  // ring stages per warp
constexpr int kGD = 512;    // G x D the per-lane accumulators hold (16 floats per lane)

struct Args {
  const __nv_bfloat16* q = nullptr;  // [B, Hq, D]
  const __nv_bfloat16* k = nullptr;  // this layer's cache [page][Hkv][P][D]
  const __nv_bfloat16* v = nullptr;
  __nv_bfloat16* out = nullptr;      // [B, Hq, D]; nullptr: no fused attention
  const int32_t* page_table = nullptr;
  const int32_t* page_off = nullptr;
  float* part = nullptr;     // [list][G][G][D] split partials (unnormalized, at their max)
  float* part_ml = nullptr;  // [list][G][G][2] (max, sum) in log2 units
  int* arrive = nullptr;     // [list] split arrivals, zero between launches
  int* gen = nullptr;        // [list] union releases (monotone, wraps)
  int Hq = 0, Hkv = 0, P = 0;
  float scale_log2 = 0.f;    // softmax scale x log2(e)
  int single_max = 0;        // unions up to this many tokens: the last CTA alone
  // Diagnostics (-DSPADE_TOPP_TRACE builds): the top-p trace (16 uint64 per CTA); words 13-15.
  unsigned long long* trace = nullptr;
};

// Trace word k of this CTA: 13 rows resolved, 14 warps' loops done, 15 merged.
__device__ __forceinline__ void stamp(const Args& a, int k) {
#ifdef SPADE_TOPP_TRACE
  if (a.trace && threadIdx.x == 0) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    a.trace[size_t(blockIdx.x) * 16 + k] = t;
  }
#endif
}

template <int NT, int D>
struct Cfg {
  static constexpr int NW = NT / 32, DL = D / 32, GM = kGD / D;
  static constexpr size_t kQ = size_t(GM) * D * sizeof(float);
  static constexpr size_t kRing = size_t(NW) * kStages * kNB * 2 * D * 2;
  static constexpr size_t kMerge = size_t(NW) * GM * (D + 2) * sizeof(float);
  static constexpr size_t kRegion = kRing > kMerge ? kRing : kMerge;
  static constexpr size_t smem(int rows_cap) { return kQ + kRegion + size_t(rows_cap) * 4; }
};

__device__ __forceinline__ int ld_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// DL bf16 (4 or 8 bytes) from global to shared memory.
template <int BYTES>
__device__ __forceinline__ void cp_async_small(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(
                   static_cast<uint32_t>(__cvta_generic_to_shared(dst))),
               "l"(src), "n"(BYTES));
}

template <int DL>
__device__ __forceinline__ void load_lane(const __nv_bfloat16* p, float (&x)[DL]) {
  if constexpr (DL == 4) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
    const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
    x[0] = a.x, x[1] = a.y, x[2] = b.x, x[3] = b.y;
  } else {
    const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
    x[0] = a.x, x[1] = a.y;
  }
}

// Attends this CTA's share of the union of list `list` (after the first handoff; every thread
// calls it). nwords: mask words of the list (32 slots each); nw: the mask row stride;
// pos_of(slot): the token position of a base slot. Returns after the output is written.
template <int NT, int D, typename PosOf>
__device__ void attend_union(const Args& a, const uint32_t* masks, int nw, int nwords, int G,
                             int list, int g, bool last, PosOf&& pos_of, int32_t* kept_cnt,
                             unsigned char* smem, int* s_warp, int* s_flag) {
  using C = Cfg<NT, D>;
  constexpr int NW = C::NW, DL = C::DL, GM = C::GM;
  float* sQ = reinterpret_cast<float*>(smem);
  __nv_bfloat16* ring = reinterpret_cast<__nv_bfloat16*>(smem + C::kQ);
  float* sMerge = reinterpret_cast<float*>(smem + C::kQ);
  int32_t* sRows = reinterpret_cast<int32_t*>(smem + C::kQ + C::kRegion);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int b = list / a.Hkv, h = list % a.Hkv;
  const int64_t qrow = int64_t(b) * a.Hq + int64_t(h) * G;  // first query head of the group

  // The union word of this thread (nwords <= NT), q into shared memory (scaled to log2 units).
  unsigned u = 0u;
  if (tid < nwords)
    for (int k = 0; k < G; ++k) u |= __ldcg(masks + k * nw + tid);
  if (tid < G * D) sQ[tid] = __bfloat162float(a.q[qrow * D + tid]) * a.scale_log2;
  int tot;
  const int before = block_exclusive_scan(__popc(u), s_warp, &tot);  // (barriers)
  const bool single = tot <= a.single_max;
  if (single && !last) return;  // CTA-uniform
  if (last && tid == 0) kept_cnt[list] = tot;
  const int r0 = single ? 0 : int(int64_t(tot) * g / G);
  const int r1 = single ? tot : int(int64_t(tot) * (g + 1) / G);
  // Row ids of ranks [r0, r1): ((page * Hkv + h) * P + pos % P).
  if (u != 0u && before < r1 && before + __popc(u) > r0) {
    const int* pt = a.page_table + a.page_off[b];
    int rank = before;
    for (unsigned m = u; m; m &= m - 1, ++rank) {
      if (rank < r0 || rank >= r1) continue;
      const int pos = pos_of(tid * 32 + __ffs(m) - 1);
      sRows[rank - r0] = (__ldg(pt + pos / a.P) * a.Hkv + h) * a.P + pos % a.P;
    }
  }
  __syncthreads();
  stamp(a, 13);

  // Each warp: batches warp, warp + NW, ... of kNB consecutive ranks.
  const int cnt = r1 - r0, nb = (cnt + kNB - 1) / kNB;
  __nv_bfloat16* wring = ring + size_t(warp) * kStages * kNB * 2 * D;
  auto issue = [&](int bi, int stage) {
    __nv_bfloat16* st = wring + stage * kNB * 2 * D;
#pragma unroll
    for (int j = 0; j < kNB; ++j) {
      const int t = bi * kNB + j;
      if (t < cnt) {
        const int64_t off = int64_t(sRows[t]) * D + lane * DL;
        cp_async_small<DL * 2>(st + j * D + lane * DL, a.k + off);
        cp_async_small<DL * 2>(st + (kNB + j) * D + lane * DL, a.v + off);
      }
    }
    asm volatile("cp.async.commit_group;\n" ::);
  };
  float mx[GM], ls[GM], acc[GM][DL];
#pragma unroll
  for (int x = 0; x < GM; ++x) {
    mx[x] = -INFINITY, ls[x] = 0.f;
#pragma unroll
    for (int d = 0; d < DL; ++d) acc[x][d] = 0.f;
  }
  if (warp < nb) issue(warp, 0);
  for (int bi = warp, it = 0; bi < nb; bi += NW, ++it) {
    if (bi + NW < nb) issue(bi + NW, (it + 1) & 1);
    else asm volatile("cp.async.commit_group;\n" ::);
    asm volatile("cp.async.wait_group 1;\n" ::);
    __syncwarp();
    const __nv_bfloat16* st = wring + (it & 1) * kNB * 2 * D;
    const int nt = min(kNB, cnt - bi * kNB);
    // One token at a time (few live registers: the top-p kernel runs at 64 per thread).
    for (int j = 0; j < nt; ++j) {
      float kx[DL], vx[DL], s[GM];
      load_lane<DL>(st + j * D + lane * DL, kx);
      load_lane<DL>(st + (kNB + j) * D + lane * DL, vx);
#pragma unroll
      for (int x = 0; x < GM; ++x) {
        float dot = 0.f;
        if (x < G) {
          const float* qx = sQ + x * D + lane * DL;
#pragma unroll
          for (int d = 0; d < DL; ++d) dot = fmaf(qx[d], kx[d], dot);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
        s[x] = dot;
      }
#pragma unroll
      for (int x = 0; x < GM; ++x) {
        if (x >= G) break;
        const float mnew = fmaxf(mx[x], s[x]);
        const float corr = exp2f(mx[x] - mnew), p = exp2f(s[x] - mnew);  // mx = -inf first: 0
        mx[x] = mnew;
        ls[x] = fmaf(ls[x], corr, p);
#pragma unroll
        for (int d = 0; d < DL; ++d) acc[x][d] = fmaf(p, vx[d], acc[x][d] * corr);
      }
    }
    __syncwarp();  // the stage is refilled by the next iteration's issue
  }
  asm volatile("cp.async.wait_group 0;\n" ::);
  __syncthreads();  // the ring becomes the merge area
  stamp(a, 14);

  float* mA = sMerge;                          // [NW][GM][D]
  float* mML = sMerge + size_t(NW) * GM * D;   // [NW][GM][2]
#pragma unroll
  for (int x = 0; x < GM; ++x) {
    if (x >= G) break;
#pragma unroll
    for (int d = 0; d < DL; ++d) mA[(warp * GM + x) * D + lane * DL + d] = acc[x][d];
    if (lane == 0) mML[(warp * GM + x) * 2] = mx[x], mML[(warp * GM + x) * 2 + 1] = ls[x];
  }
  __syncthreads();
  // Thread (x, d) merges the warps: O = sum_w acc_w 2^(m_w - M), L likewise.
  const bool owner = tid < G * D;
  const int x = tid / D, d = tid % D;
  float M = -INFINITY, L = 0.f, O = 0.f;
  if (owner) {
    for (int w = 0; w < NW; ++w) M = fmaxf(M, mML[(w * GM + x) * 2]);
    for (int w = 0; w < NW; ++w) {
      const float mw = mML[(w * GM + x) * 2];
      if (mw == -INFINITY) continue;
      const float f = exp2f(mw - M);
      L += mML[(w * GM + x) * 2 + 1] * f;
      O += mA[(w * GM + x) * D + d] * f;
    }
  }
  stamp(a, 15);
  if (single) {
    if (owner) a.out[(qrow + x) * D + d] = __float2bfloat16(L > 0.f ? O / L : 0.f);
    return;
  }
  // Split mode: partial of share g, then the last of the G CTAs combines.
  const int64_t pbase = (int64_t(list) * G + g) * G;
  if (owner) {
    a.part[(pbase + x) * D + d] = O;
    if (d == 0) a.part_ml[(pbase + x) * 2] = M, a.part_ml[(pbase + x) * 2 + 1] = L;
  }
  __syncthreads();
  if (tid == 0) {
    __threadfence();
    const int s_last = atomicAdd(a.arrive + list, 1) == G - 1;
    if (s_last) {
      a.arrive[list] = 0;
      __threadfence();
    }
    *s_flag = s_last;
  }
  __syncthreads();
  if (!*s_flag || !owner) return;
  const int64_t p0 = int64_t(list) * G * G;
  float M2 = -INFINITY;
  for (int k = 0; k < G; ++k) M2 = fmaxf(M2, __ldcg(a.part_ml + (p0 + k * G + x) * 2));
  float L2 = 0.f, O2 = 0.f;
  for (int k = 0; k < G; ++k) {
    const float mk = __ldcg(a.part_ml + (p0 + k * G + x) * 2);
    if (mk == -INFINITY) continue;
    const float f = exp2f(mk - M2);
    L2 += __ldcg(a.part_ml + (p0 + k * G + x) * 2 + 1) * f;
    O2 += __ldcg(a.part + (p0 + k * G + x) * D + d) * f;
  }
  a.out[(qrow + x) * D + d] = __float2bfloat16(L2 > 0.f ? O2 / L2 : 0.f);
}

}  // namespace twl_attend
}  // namespace spade::cuda
