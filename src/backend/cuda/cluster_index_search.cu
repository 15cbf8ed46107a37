// LycheeCluster GPU index, search: lc_search_kernel (coarse -> fine -> chunks under the
// token budget) with its shared-memory layout helper, lc_compact_kernel (strided lists ->
// CSR), LcIndexGpu::search and compact.
#include <algorithm>
#include <cstdint>

#include "backend/cuda/cluster_index_common.cuh"
#include "backend/cuda/per_device.h"
#include "backend/cuda/pdl.cuh"

namespace spade::cuda {
using namespace lc_detail;
namespace {

// ---------------------------------------------------------------------------------------
// Search.
constexpr int kSearchThreadsHost = 512;
struct SearchK {
  LcSearchArgs a;
  const int32_t* starts;  // [slots][maxC + 1]
  const int32_t *n_chunks, *n_fine, *n_coarse;  // [slots][Hkv]
  const __half *fc, *gc;
  const float *fr, *gr;
  const int32_t *gtok, *gfirst, *fhead, *fnch, *cnext;
  int maxF, maxG, maxC, D, Hkv;
  // Working arrays (search_smem_layout): bytes into dynamic shared memory, or (< 0) at byte
  // -1 - off of the CTA's region of gscratch (gstride bytes per (request, KV head)) where the
  // shared memory of a block is too small (sm_86 / 89 at more than ~4K chunks).
  int64_t off_keys, off_cand, off_flat, off_q, off_lens, off_flag;
  int64_t off_next, off_starts;  // staged chunk links and starts; -1 = not staged (too big)
  int64_t off_fmeta;  // candidates' chunk counts and first chunks [2][maxF] i32; -1 = not kept
  char* gscratch;
  int64_t gstride;
};

// Shared-memory layout of lc_search_kernel (bytes, 16-aligned regions): keys [pow2(maxF)] u64 |
// cand [maxF] i32 | flat [max(maxC, 256)] i32 (also the sorted chosen chunks of the output) |
// q [roundup(G, 4)][D] f32 (rows >= G zero) | lens [maxC] i16 | flag [maxC] u8 | (if the
// total stays <= kStageLimit) the slot's chunk links cnext [maxC] i32 and starts [maxC + 1]
// i32, copied in with cp.async at the start so the list walks of the flatten phase read shared
// memory instead of chasing pointers through DRAM | (if it still fits) the candidates' chunk
// counts and first chunks [2][maxF] i32, loaded during the sort (the flatten's reads).
// Where the block's shared memory (search_smem_cap: kStageLimit, or the device's per-block limit
// less the kernel's static arrays) cannot hold the first six, q stays there and the others follow
// by how often they are read (keys, cand, flag, lens, flat) while they fit; the rest live in the
// CTA's region of the global scratch (LcIndexGpu's search_scratch_, search_scratch_stride bytes
// per (request, KV head)), read and written by the same code (the block's barriers order its
// global accesses too): the same lists, more slowly.
constexpr size_t kStageLimit = 220 * 1024;
inline size_t al16(size_t x) { return (x + 15) / 16 * 16; }
struct SearchArrays {  // bytes of the working arrays
  size_t keys, cand, flat, q, lens, flag;
};
inline SearchArrays search_arrays(int maxF, int maxC, int G, int D) {
  return {al16(size_t(pow2_at_least(maxF)) * 8), al16(size_t(maxF) * 4),
          al16(std::max(size_t(maxC), size_t(256)) * 4),  // flat: >= 256 (output ranks)
          al16(size_t((G + 3) / 4 * 4) * D * 4),          // q rows padded to 4 heads (zeros)
          al16(size_t(maxC) * 2), al16(size_t(maxC))};
}
// spill (LcIndexConfig::spill_smem, tests): the fallback with only q in shared memory.
inline size_t search_smem_layout(SearchK& k, int G, bool spill) {
  size_t cap = search_smem_cap();
  const SearchArrays A = search_arrays(k.maxF, k.maxC, G, k.D);
  if (spill || A.keys + A.cand + A.flat + A.q + A.lens + A.flag > cap) {
    // Global fallback: every array but q has its place in the CTA's region; q, then the others
    // in order of use, take shared memory while it lasts.
    if (spill) cap = std::min(cap, A.q);
    SPADE_CHECK(k.gscratch, "LcIndexGpu::search: ", G, " query heads per KV head need more shared "
                "memory than this GPU's ", cap >> 10, " KB per block (the index's global scratch "
                "was sized for up to 8)");
    size_t o = 0;
    k.off_q = 0;
    o += A.q;
    SPADE_CHECK(o <= cap, "LcIndexGpu::search: q does not fit the GPU's shared memory");
    const int64_t g_keys = 0, g_cand = g_keys + int64_t(A.keys), g_flat = g_cand + int64_t(A.cand),
                  g_lens = g_flat + int64_t(A.flat), g_flag = g_lens + int64_t(A.lens);
    auto place = [&](int64_t& off, size_t bytes, int64_t goff) {
      if (o + bytes <= cap) {
        off = int64_t(o);
        o += bytes;
      } else {
        off = -1 - goff;
      }
    };
    place(k.off_keys, A.keys, g_keys);
    place(k.off_cand, A.cand, g_cand);
    place(k.off_flag, A.flag, g_flag);
    place(k.off_lens, A.lens, g_lens);
    place(k.off_flat, A.flat, g_flat);
    k.off_next = k.off_starts = k.off_fmeta = -1;
    const size_t staged = al16(size_t(k.maxC) * 4) + al16(size_t(k.maxC + 1) * 4);
    if (o + staged <= cap) {
      k.off_next = int64_t(o);
      o += al16(size_t(k.maxC) * 4);
      k.off_starts = int64_t(o);
      o += al16(size_t(k.maxC + 1) * 4);
    }
    if (o + al16(size_t(k.maxF) * 8) <= cap) {
      k.off_fmeta = int64_t(o);
      o += al16(size_t(k.maxF) * 8);
    }
    return o;
  }
  auto al = al16;
  size_t o = al(size_t(pow2_at_least(k.maxF)) * 8);
  k.off_keys = 0;
  k.off_cand = int64_t(o);
  o += al(size_t(k.maxF) * 4);
  k.off_flat = int64_t(o);
  const size_t flat_bytes = std::max(size_t(k.maxC), size_t(256)) * 4;  // >= 256: output ranks
  o += al(flat_bytes);
  k.off_q = int64_t(o);
  o += al(size_t((G + 3) / 4 * 4) * k.D * 4);  // q rows padded to 4 heads (zeros)
  k.off_lens = int64_t(o);
  o += al(size_t(k.maxC) * 2);
  k.off_flag = int64_t(o);
  o += al(size_t(k.maxC));
  const size_t staged = al(size_t(k.maxC) * 4) + al(size_t(k.maxC + 1) * 4);
  k.off_next = k.off_starts = k.off_fmeta = -1;
  if (o + staged <= cap) {
    k.off_next = int64_t(o);
    o += al(size_t(k.maxC) * 4);
    k.off_starts = int64_t(o);
    o += al(size_t(k.maxC + 1) * 4);
  }
  if (o + al(size_t(k.maxF) * 8) <= cap) {
    k.off_fmeta = int64_t(o);
    o += al(size_t(k.maxF) * 8);
  }
  return o;
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(
                   static_cast<uint32_t>(__cvta_generic_to_shared(dst))),
               "l"(src)
               : "memory");
}

// acc[gg] += q_{g0+gg}[d0, d0 + 8) . c for one 16-byte piece of a center row, for NH heads
// at once: __fmul_rn / __fadd_rn in d order (the CPU's dot(), no FMA), so the scores are
// bit-identical to the CPU's. q has a multiple of 4 head rows (rows >= G are zero and their
// sums unused), so the NH chains carry no branch and interleave (q read as float4).
template <int NH>
__device__ __forceinline__ void lc_dot_piece(const uint4& raw, const float* q, int D, int d0,
                                             int g0, float (&acc)[NH]) {
  const __half* hv = reinterpret_cast<const __half*>(&raw);
#pragma unroll
  for (int half = 0; half < 2; ++half) {  // 4 dims at a time: 4 NH q registers live
    float4 qv[NH];
#pragma unroll
    for (int gg = 0; gg < NH; ++gg) qv[gg] = reinterpret_cast<const float4*>(q + (g0 + gg) * D + d0)[half];
    float cc[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) cc[j] = __half2float(hv[4 * half + j]);
#pragma unroll
    for (int gg = 0; gg < NH; ++gg) acc[gg] = __fadd_rn(acc[gg], __fmul_rn(qv[gg].x, cc[0]));
#pragma unroll
    for (int gg = 0; gg < NH; ++gg) acc[gg] = __fadd_rn(acc[gg], __fmul_rn(qv[gg].y, cc[1]));
#pragma unroll
    for (int gg = 0; gg < NH; ++gg) acc[gg] = __fadd_rn(acc[gg], __fmul_rn(qv[gg].z, cc[2]));
#pragma unroll
    for (int gg = 0; gg < NH; ++gg) acc[gg] = __fadd_rn(acc[gg], __fmul_rn(qv[gg].w, cc[3]));
  }
}
// max(best, q_g . c + |q_g| r) over the heads g0 .. g0 + NH - 1 that exist.
template <int NH>
__device__ __forceinline__ float lc_bound_max(const float (&acc)[NH], const float* qn, float r,
                                              int g0, int G, float best) {
#pragma unroll
  for (int gg = 0; gg < NH; ++gg)
    if (g0 + gg < G) best = fmaxf(best, __fadd_rn(acc[gg], __fmul_rn(qn[g0 + gg], r)));
  return best;
}
// Bound of one node over the heads [gb, ge) (NH at a time) for D = 8 NC, from -inf (the
// node's bound is the max of such parts), with all NC 16-byte loads of the center row issued
// before any math: one DRAM round trip per row (same arithmetic, same bits per head).
// The 2 halves of the row run through ONE copy of the 8-piece body (a 2-trip loop over a
// register copy of the current half): half the code of a full unroll, which kept the warps
// waiting on instruction fetch (ncu: "no instruction" stalls in this loop).
// cen: the node's first piece; ps: halves between its pieces (piece-major blocks: maxN * 8).
template <int NC, int NH>
__device__ __forceinline__ float lc_bound_fixed(const __half* cen, int64_t ps, float r,
                                                const float* q, const float* qn, int gb, int ge,
                                                int G) {
  static_assert(NC % 2 == 0, "two halves");
  constexpr int H = NC / 2;
  uint4 lo[H], hi[H];
#pragma unroll
  for (int i = 0; i < H; ++i) {
    lo[i] = *reinterpret_cast<const uint4*>(cen + i * ps);
    hi[i] = *reinterpret_cast<const uint4*>(cen + (H + i) * ps);
  }
  float best = -INFINITY;
  for (int g0 = gb; g0 < ge; g0 += NH) {
    float acc[NH];
#pragma unroll
    for (int gg = 0; gg < NH; ++gg) acc[gg] = 0.f;
    uint4 cur[H];
#pragma unroll
    for (int i = 0; i < H; ++i) cur[i] = lo[i];
#pragma unroll 1
    for (int half = 0; half < 2; ++half) {
#pragma unroll
      for (int i = 0; i < H; ++i) lc_dot_piece<NH>(cur[i], q, 8 * NC, 8 * (H * half + i), g0, acc);
#pragma unroll
      for (int i = 0; i < H; ++i) cur[i] = hi[i];
    }
    best = lc_bound_max<NH>(acc, qn, r, g0, G, best);
  }
  return best;
}

// q_g . c of ONE head for D = 8 NC: the chain of that head in lc_bound_fixed (same operations,
// same order, same bits), so a node's bound can be assembled from one thread per head.
// raw: the node's NC pieces, loaded by the caller (early: see the coarse rows in the kernel).
template <int NC>
__device__ __forceinline__ float lc_head_dot_fixed(const uint4 (&raw)[NC], const float* qg) {
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < NC; ++i) {
    const __half* hv = reinterpret_cast<const __half*>(&raw[i]);
    const float4 lo = reinterpret_cast<const float4*>(qg + 8 * i)[0], hi = reinterpret_cast<const float4*>(qg + 8 * i)[1];
    const float qv[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
    for (int j = 0; j < 8; ++j) acc = __fadd_rn(acc, __fmul_rn(qv[j], __half2float(hv[j])));
  }
  return acc;
}

// lc_search_kernel: CTA per (KV head, request), kSearchThreads threads.
//   reads  q of the G heads (2*D B each); coarse centers (2*D B each, piece-major: a warp's
//          16-byte loads of one piece are contiguous) + radii + token counts; the kept units'
//          fine centers (2*D B each) + radii; per-fine chunk counts and links and the
//          candidate chunks' starts (staged in shared memory with cp.async)
//   writes the strided Token list (4 B per token: sink + chosen chunks ascending + tail) and
//          the count
//   shared: sort keys [pow2(maxF)] u64, candidate fine ids [maxF], flat chunk ids [maxC] i32,
//   q [roundup(G, 4)][D] f32, flat lengths [maxC] i16, chosen flags [maxC] u8; coarse scores /
//   order / tokens / ranges; up to 256 chosen chunk ids (sorted for the output; more: a flag
//   scan). Phases: loads in dependency rounds; coarse dots beside the q norms; coarse ranking,
//   k_g and candidates in warp 0; fine scoring (1-4 threads per candidate); merge sort; flatten;
//   greedy fill; emit. Every serial step runs over shared memory (the coarse k_g rule, the
//   budget tail). Measured phases: docs/cuda_lycheecluster.md.
constexpr int kSearchThreads = kSearchThreadsHost;
// Phase stamps (bench only, a.trace non-null): [list][kLcTraceSlots] SM clock cycles (clock64:
// one CTA stays on one SM, so differences are exact); slots 0-7 the phases, 8-10 inside the
// coarse phase, 11 between the loads and the q norms, 12-15 sizes (coarse nodes, fine candidates, flattened chunks, chosen chunks).
#define LC_TRACE(i) \
  if (a.trace && t == 0) a.trace[(int64_t(b) * k.Hkv + h) * kLcTraceSlots + (i)] = clock64()
#define LC_TRACE_VALUE(i, v) \
  if (a.trace && t == 0) a.trace[(int64_t(b) * k.Hkv + h) * kLcTraceSlots + (i)] = (unsigned long long)(v)
__global__ void __launch_bounds__(kSearchThreads) lc_search_kernel(SearchK k) {
  pdl_begin();  // pdl.cuh: first, before any global access
  extern __shared__ unsigned long long smem_u64[];
  const LcSearchArgs& a = k.a;
  const int h = blockIdx.x, b = blockIdx.y, t = threadIdx.x, lane = t & 31, w = t >> 5;
  const int nw = blockDim.x >> 5, D = k.D, G = a.Hq / k.Hkv;
  LC_TRACE(0);
  // Loads in dependency rounds, each issued as early as it can be: q (needs only b, h) with the
  // slot and length; then the slot's counts and coarse-node arrays; then starts[M].
  const int GD = G * D, GD4 = (G + 3) / 4 * 4 * D;  // q rows padded to 4 heads (zeros)
  const auto* qsrc = a.q + (int64_t(b) * a.Hq + h * G) * D;
  float q_r[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int e = t + i * int(blockDim.x);
    q_r[i] = e < GD ? __bfloat162float(qsrc[e]) : 0.f;
  }
  const int slot = a.slot[b];
  const int L = a.kv_len[b];
  const int sh_ = slot * k.Hkv + h;
  const int32_t* starts = k.starts + int64_t(slot) * (k.maxC + 1);
  const int M = k.n_chunks[sh_], NG = k.n_coarse[sh_];
  const int gtok_r = t < k.maxG ? k.gtok[int64_t(sh_) * k.maxG + t] : 0;
  const int gfirst_r = t <= k.maxG ? k.gfirst[int64_t(sh_) * (k.maxG + 1) + t] : 0;
  const int starts_M = M > 0 ? starts[M] : 0;  // used late (budget, tail): latency hidden
  // The coarse rows of the thread-per-(node, head) scoring below (if its shape allows it),
  // loaded now, before NG is known (rows up to maxG exist): their DRAM trip overlaps the
  // loads above instead of following them.
  const bool coarse_shape = D == 128 && G <= 32 && (G & (G - 1)) == 0 && G < nw &&
                            k.maxG * G <= 32 * (nw - G);
  const int64_t gbase = int64_t(sh_) * k.maxG;
  uint4 craw[16];
  float crad = 0.f;
  if (coarse_shape && t < k.maxG * G) {
    const __half* cen = k.gc + gbase * D + (t / G) * 8;
#pragma unroll
    for (int i = 0; i < 16; ++i) craw[i] = *reinterpret_cast<const uint4*>(cen + int64_t(i) * k.maxG * 8);
    crad = k.gr[gbase + t / G];
  }
  const int n2max = pow2_at_least(k.maxF);
  (void)n2max;
  char* smem_b = reinterpret_cast<char*>(smem_u64);
  // Each array in shared memory or in this CTA's region of the global scratch (SearchK).
  char* gcta = k.gscratch ? k.gscratch + (int64_t(b) * k.Hkv + h) * k.gstride : nullptr;
  auto at = [&](int64_t off) { return off >= 0 ? smem_b + off : gcta + (-1 - off); };
  unsigned long long* keys = reinterpret_cast<unsigned long long*>(at(k.off_keys));  // [pow2(maxF)]
  int32_t* cand = reinterpret_cast<int32_t*>(at(k.off_cand));     // [maxF]
  int32_t* flat = reinterpret_cast<int32_t*>(at(k.off_flat));     // [maxC]
  float* q = reinterpret_cast<float*>(at(k.off_q));               // [G][D]
  int16_t* lens = reinterpret_cast<int16_t*>(at(k.off_lens));     // [maxC]
  uint8_t* flag = reinterpret_cast<uint8_t*>(at(k.off_flag));     // [maxC] chosen chunks
  __shared__ float qn[64];
  __shared__ __align__(16) uint32_t gkey[64];  // okey of the coarse bounds (0 past NG)
  __shared__ int gorder[64], goff[65], keep[64], gtok[64], gfirst[65];
  __shared__ int sh[33];
  __shared__ int s_nsel, s_minlen, s_used;
  __shared__ int selk[256], selen[256];  // chosen chunk ids (rank order) and their lengths
  __shared__ int s_tot;
  // Chunk links and starts of this slot: staged in shared memory while the scoring runs (the
  // flatten and emit phases read them through nx / st, staged or not).
  const bool staged = k.off_next >= 0 && M > 0;
  const int32_t* nx = k.cnext + int64_t(sh_) * k.maxC;
  const int32_t* st = starts;
  if (staged) {
    int32_t* s_next = reinterpret_cast<int32_t*>(smem_b + k.off_next);
    int32_t* s_starts = reinterpret_cast<int32_t*>(smem_b + k.off_starts);
    for (int c = t; c < M; c += blockDim.x) cp_async4(s_next + c, nx + c);
    for (int c = t; c <= M; c += blockDim.x) cp_async4(s_starts + c, starts + c);
    asm volatile("cp.async.commit_group;\n" ::: "memory");
    nx = s_next;
    st = s_starts;
  }

#pragma unroll
  for (int i = 0; i < 2; ++i)
    if (t + i * int(blockDim.x) < GD4) q[t + i * blockDim.x] = q_r[i];
  for (int e = t + 2 * blockDim.x; e < GD4; e += blockDim.x) q[e] = e < GD ? __bfloat162float(qsrc[e]) : 0.f;
  if (t < NG) {
    gtok[t] = gtok_r;
    keep[t] = 0;
  }
  if (t < 64) gkey[t] = 0u;
  if (t <= NG) gfirst[t] = gfirst_r;
  for (int c = t; c < M; c += blockDim.x) flag[c] = 0;
  if (t == 0) {
    s_nsel = 0;
    s_minlen = 1 << 30;
  }
  __syncthreads();
  LC_TRACE(11);
  // budget_total: the budget also counts the sink and the un-indexed tail (the CPU's
  // budget_mode=total: what is left for chunks).
  const int64_t budget =
      a.budget_total ? max(int64_t(0), a.budget - min(a.sink, L) - (L - (M > 0 ? starts_M : min(a.sink, L))))
                     : a.budget;
  const bool run = M > 0 && budget > 0 && NG > 0;
  // Coarse nodes a thread per (node, head) (G a power of two <= 32: a node's heads share a warp)
  // when they fit beside the last G warps, which compute the q norms meanwhile: the norms'
  // serial double chains then hide behind the dot chains (rows loaded at the start).
  const bool coarse_par = run && coarse_shape;
  // |q_g|: the CPU's sequential double sum of squares (d ascending), by lane 0 of a warp per
  // head straight from shared memory (4 values per load; the products are exact in double, the
  // sums round in the CPU's order).
  const int norm_w0 = coarse_par ? nw - G : 0;
  for (int g = w - norm_w0; g >= 0 && g < G; g += nw)
    if (lane == 0) {
      const float4* qg = reinterpret_cast<const float4*>(q + g * D);
      double sum = 0.0;
      for (int d4 = 0; d4 < D / 4; ++d4) {
        const float4 x = qg[d4];
        sum = __dadd_rn(sum, __dmul_rn(double(x.x), double(x.x)));
        sum = __dadd_rn(sum, __dmul_rn(double(x.y), double(x.y)));
        sum = __dadd_rn(sum, __dmul_rn(double(x.z), double(x.z)));
        sum = __dadd_rn(sum, __dmul_rn(double(x.w), double(x.w)));
      }
      qn[g] = __double2float_rn(sqrt(sum));
    }
  float cdot = 0.f;
  if (coarse_par && t < NG * G) cdot = lc_head_dot_fixed<16>(craw, q + (t % G) * D);
  __syncthreads();
    LC_TRACE(1);
  // Bound of one node aggregated (max) over the group, one thread per node: q_g . c summed
  // in d order with __fmul_rn / __fadd_rn (the CPU's dot(), no FMA) plus |q_g| * r, so the
  // scores are bit-identical to ClusterIndex::search's.
  // cen: the node's first piece in its piece-major block, ps: halves between pieces.
  // part p of T (a power of two dividing G when T > 1): the heads [p G / T, (p + 1) G / T).
  auto bound = [&](const __half* cen, int64_t ps, float r, int p = 0, int T = 1) {
    const int gb = p * (G / T), ge = T == 1 ? G : gb + G / T;
    if (D == 128) {
      if (ge - gb == 1) return lc_bound_fixed<16, 1>(cen, ps, r, q, qn, gb, ge, G);
      if (ge - gb == 2) return lc_bound_fixed<16, 2>(cen, ps, r, q, qn, gb, ge, G);
      return lc_bound_fixed<16, 4>(cen, ps, r, q, qn, gb, ge, G);
    }
    float best = -INFINITY;
    for (int g0 = 0; g0 < G; g0 += 4) {
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
      for (int d0 = 0; d0 < D; d0 += 8)
        lc_dot_piece<4>(*reinterpret_cast<const uint4*>(cen + (d0 >> 3) * ps), q, D, d0, g0, acc);
      best = lc_bound_max<4>(acc, qn, r, g0, G, best);
    }
    return best;
  };
  if (run) {
    if (coarse_par) {
      // max over the node's G lanes of dot + |q_g| r, from -inf as lc_bound_max (fmaxf drops
      // NaN, so an all-NaN node is -inf either way).
      if (w < (NG * G + 31) / 32) {
        float v = -INFINITY;
        if (t < NG * G) v = fmaxf(v, __fadd_rn(cdot, __fmul_rn(qn[t % G], crad)));
        for (int o = 1; o < G; o <<= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, o));
        if (t < NG * G && t % G == 0) gkey[t / G] = okey(v);
      }
    } else {
      // One thread per node (a staged-rows variant measured slower: the sequential dot chain
      // dominates, and tiles of staged rows serialize it).
      for (int g = t; g < NG; g += blockDim.x)
        gkey[g] = okey(bound(k.gc + gbase * D + g * 8, int64_t(k.maxG) * 8, k.gr[gbase + g]));
    }
    __syncthreads();
    LC_TRACE(8);
    // Rank: score descending, NaN last, ties by node id = ascending (~okey(score), id); NG <=
    // 64 nodes ranked by warp 0, two per lane (n0 = lane, n1 = lane + 32), by counting the nodes
    // ahead of each over broadcast 16-byte reads of the keys (16 independent loads; a shuffle
    // per key ran ~35 cycles each, the 21-step bitonic network as long); keys past NG are 0
    // with a higher id: never ahead. Then k_g and the offsets below in the same warp: no block
    // barrier until the candidates are known.
    if (w == 0) {
      const uint32_t o0 = gkey[lane], o1 = gkey[lane + 32];
      int r0 = 0, r1 = 0;
#pragma unroll
      for (int q4 = 0; q4 < 16; ++q4) {
        const uint4 v = reinterpret_cast<const uint4*>(gkey)[q4];
        const uint32_t x4[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int j = 4 * q4 + e;  // node j; lane < 32 <= lane + 32
          const uint32_t x = x4[e];
          if (j < 32) {
            r0 += int(x > o0 || (x == o0 && j < lane));
            r1 += int(x >= o1);
          } else {
            r0 += int(x > o0);
            r1 += int(x > o1 || (x == o1 && j < lane + 32));
          }
        }
      }
      if (lane < NG) gorder[r0] = lane;
      if (lane + 32 < NG) gorder[r1] = lane + 32;
      __syncwarp();
    }
    LC_TRACE(9);
    // k_g: the CPU's loop (add the ranked nodes' token counts until they cover coarse_cover x
    // budget) as a scan: k_g = 1 + the first rank whose inclusive count reaches the target
    // (sums of ints: exact in the CPU's double), NG if none, 0 for a target <= 0. Then the
    // candidate offsets: exclusive scan of the kept nodes' fine counts, in node order. Both in
    // warp 0 (NG <= 64: two entries per lane), without block barriers.
    if (w == 0) {
      const int r0 = 2 * lane, r1 = r0 + 1;
      const int v0 = r0 < NG ? gtok[gorder[r0]] : 0, v1 = r1 < NG ? gtok[gorder[r1]] : 0;
      int incl = v0 + v1;
      for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(kFull, incl, o);
        if (lane >= o) incl += y;
      }
      const int before0 = incl - v0 - v1;
      int kg;
      if (a.coarse_topk > 0) {
        kg = min(NG, a.coarse_topk);
      } else {
        const double want = a.coarse_cover * double(budget);
        int first = NG;
        if (r0 < NG && double(before0 + v0) >= want) first = r0 + 1;
        else if (r1 < NG && double(before0 + v0 + v1) >= want) first = r1 + 1;
        for (int o = 16; o > 0; o >>= 1) first = min(first, __shfl_xor_sync(kFull, first, o));
        kg = want <= 0.0 ? 0 : first;
      }
      if (r0 < NG) keep[gorder[r0]] = r0 < kg;
      if (r1 < NG) keep[gorder[r1]] = r1 < kg;
      __syncwarp();
      const int n0 = r0 < NG && keep[r0] ? gfirst[r0 + 1] - gfirst[r0] : 0;  // node order now
      const int n1 = r1 < NG && keep[r1] ? gfirst[r1 + 1] - gfirst[r1] : 0;
      int inc2 = n0 + n1;
      for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(kFull, inc2, o);
        if (lane >= o) inc2 += y;
      }
      const int ex0 = inc2 - n0 - n1;
      if (r0 < NG) goff[r0] = ex0;
      if (r1 < NG) goff[r1] = ex0 + n0;
      if (lane == 31) goff[NG] = inc2;
    }
    __syncthreads();
    LC_TRACE(10);
    const int nc = goff[NG];
    LC_TRACE_VALUE(12, NG);
    LC_TRACE_VALUE(13, nc);
    for (int g = w; g < NG; g += nw)
      if (keep[g])
        for (int f = gfirst[g] + lane; f < gfirst[g + 1]; f += 32) cand[goff[g] + f - gfirst[g]] = f;
    __syncthreads();
    LC_TRACE(2);
    const int n2 = pow2_at_least(max(nc, 1));
    const int64_t fbase = int64_t(sh_) * k.maxF;
    // T threads per candidate (each a 1/T share of the heads, max-reduced over the T lanes)
    // when the candidates leave threads idle: more warps share the dot chains (D = 128, G a
    // power of two >= T).
    int T = 1;
    if (D == 128 && (G & (G - 1)) == 0)
      while (T < 4 && T * 2 <= G && nc * T * 2 <= int(blockDim.x)) T *= 2;
    for (int e0 = 0; e0 < nc * T; e0 += blockDim.x) {
      const int e = e0 + t, j = e / T, p = e % T;
      float sc = -INFINITY;
      if (j < nc) {
        const int f = cand[j];
        sc = bound(k.fc + fbase * D + f * 8, int64_t(k.maxF) * 8, k.fr[fbase + f], p, T);
      }
      for (int o = 1; o < T; o <<= 1) sc = fmaxf(sc, __shfl_xor_sync(kFull, sc, o));
      if (j < nc && p == 0) keys[j] = (static_cast<unsigned long long>(~okey(sc)) << 32) | unsigned(j);
    }
    for (int j = nc + t; j < n2; j += blockDim.x) keys[j] = ~0ull;
    // The flatten's reads of candidate t (chunk count, first chunk), in flight during the sort.
    int32_t* fm_cnt = k.off_fmeta >= 0 ? reinterpret_cast<int32_t*>(smem_b + k.off_fmeta) : nullptr;
    int32_t* fm_head = fm_cnt ? fm_cnt + k.maxF : nullptr;
    int pre_cnt = 0, pre_head = 0;
    if (fm_cnt && t < nc) {
      const int f = cand[t];
      pre_cnt = k.fnch[fbase + f];
      pre_head = k.fhead[fbase + f];
    }
    __syncthreads();
    LC_TRACE(3);
    // Keys are distinct (the low word is j).
    if (nc <= int(blockDim.x)) block_merge_sort(keys, nc);
    else block_bitonic(keys, n2);
    if (fm_cnt) {
      if (t < nc) fm_cnt[t] = pre_cnt, fm_head[t] = pre_head;
      for (int j = t + blockDim.x; j < nc; j += blockDim.x) {
        fm_cnt[j] = k.fnch[fbase + cand[j]];
        fm_head[j] = k.fhead[fbase + cand[j]];
      }
    }
    LC_TRACE(4);
    if (staged) asm volatile("cp.async.wait_all;\n" ::: "memory");
    __syncthreads();
    // Flatten: chunks of the ranked clusters, in rank order, each list in position order.
    int base = 0;
    for (int j0 = 0; j0 < nc; j0 += blockDim.x) {
      const int j = j0 + t;
      const int jj = j < nc ? int(keys[j] & 0xffffffffu) : -1;
      const int cntj = jj < 0 ? 0 : fm_cnt ? fm_cnt[jj] : k.fnch[fbase + cand[jj]];
      int tot = 0;
      const int off = block_excl_scan(cntj, sh, tot) + base;
      if (jj >= 0) {
        int c = fm_head ? fm_head[jj] : k.fhead[fbase + cand[jj]];
        for (int i = 0; i < cntj && c >= 0; ++i) {
          flat[off + i] = c;
          lens[off + i] = int16_t(st[c + 1] - st[c]);
          c = nx[c];
        }
      }
      base += tot;
    }
    __syncthreads();
    LC_TRACE(5);
    const int nflat = base;
    LC_TRACE_VALUE(14, nflat);
    // Greedy fill: the prefix whose running sum fits the budget is taken as is (a chunk is
    // never skipped before the first one that does not fit); the rest sequentially from
    // i0, stopping once `left` is below the shortest remaining chunk.
    int carry = 0, i0 = nflat;
    for (int j0 = 0; j0 < nflat; j0 += blockDim.x) {
      const int j = j0 + t;
      const int len = j < nflat ? lens[j] : 0;
      int tot = 0;
      const int ex = block_excl_scan(len, sh, tot) + carry;
      // The fitting chunks are a prefix (ex grows with j), so chunk j is the j-th chosen.
      const bool fits = j < nflat && int64_t(ex) + len <= budget;
      if (fits) {
        flag[flat[j]] = 1;
        if (j < 256) selk[j] = flat[j], selen[j] = st[flat[j] + 1] - st[flat[j]];
      }
      const int nfit = __syncthreads_count(fits);
      carry += tot;
      if (nfit < min(int(blockDim.x), nflat - j0)) {
        i0 = j0 + nfit;
        if (j == i0) s_used = ex;  // the prefix's tokens: the first misfit's exclusive sum
        break;
      }
    }
    // The shortest chunk after the prefix (the tail's early stop).
    if (i0 == nflat && t == 0) s_used = carry;
    {
      int mn = 1 << 30;
      for (int j = i0 + t; j < nflat; j += blockDim.x) mn = min(mn, int(lens[j]));
      if (mn < (1 << 30)) atomicMin(&s_minlen, mn);
    }
    __syncthreads();
    const int used = s_used;
    if (t == 0) {
      s_nsel = i0;
      int64_t left = budget - used;
      const int mn = s_minlen;
      for (int j = i0; j < nflat && left >= mn; ++j)
        if (lens[j] <= left) {
          flag[flat[j]] = 1;
          if (s_nsel < 256) selk[s_nsel] = flat[j], selen[s_nsel] = st[flat[j] + 1] - st[flat[j]];
          ++s_nsel;
          left -= lens[j];
        }
    }
    __syncthreads();
    LC_TRACE(6);
    LC_TRACE_VALUE(15, s_nsel);
  }
  // Emit: sink, chosen chunks ascending, tail.
  int32_t* out = a.lists + int64_t(b * k.Hkv + h) * a.cap;
  const int sink = min(a.sink, L);
  for (int p = t; p < sink && p < a.cap; p += blockDim.x) out[p] = p;
  int pos = sink;
  const int nsel = s_nsel;
  if (nsel > 0 && nsel <= 256) {
    // Few chunks (<= 256; budget / 8-token chunks): chunk t's place in position order and its
    // output offset by counting over the chosen ids (distinct) and summing the lengths of the
    // ones before it: one loop over shared memory, no sort and no scan (ids in position order to
    // ids_sorted, offsets to flat: free now, >= 256 entries).
    __shared__ int ids_sorted[256];
    if (t < nsel) {
      const int c = selk[t];
      int rank = 0, off = 0;
#pragma unroll 8  // the loads of 8 entries in flight: the loop is bound by shared-memory latency
      for (int j = 0; j < nsel; ++j)
        if (selk[j] < c) ++rank, off += selen[j];
      ids_sorted[rank] = c;
      flat[rank] = off;
      if (rank == nsel - 1) s_tot = off + selen[t];
    }
    __syncthreads();
    const int tot = s_tot;
    // Coalesced stores: entry i belongs to the last chosen chunk whose offset is <= i (an empty
    // chunk shares its offset with the next one and is never picked).
    for (int i = t; i < tot && pos + i < a.cap; i += blockDim.x) {
      int lo = 0, hi = nsel - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (flat[mid] <= i) lo = mid;
        else hi = mid - 1;
      }
      out[pos + i] = st[ids_sorted[lo]] + (i - flat[lo]);
    }
    pos += tot;
  } else if (nsel > 256) {
    // Many chunks: scan all M chunks in position order over the chosen flags.
    for (int c0 = 0; c0 < M; c0 += blockDim.x) {
      const int c = c0 + t;
      const int len = (c < M && flag[c]) ? st[c + 1] - st[c] : 0;
      int tot = 0;
      const int off = block_excl_scan(len, sh, tot) + pos;
      for (int i = 0; i < len; ++i)
        if (off + i < a.cap) out[off + i] = st[c] + i;
      pos += tot;
    }
  }
  const int rb = M > 0 ? starts_M : sink;
  const int tb = max(rb, sink);
  for (int p = tb + t; p < L; p += blockDim.x)
    if (pos + p - tb < a.cap) out[pos + p - tb] = p;
  if (t == 0) {
    const int total = pos + max(0, L - tb);
    a.counts[b * k.Hkv + h] = min(total, a.cap);
    if (a.trace) a.trace[(int64_t(b) * k.Hkv + h) * kLcTraceSlots + 7] = clock64();
    if (a.chosen) a.chosen[b * k.Hkv + h] = pos - sink;
  }
  if (staged && !run) asm volatile("cp.async.wait_all;\n" ::: "memory");  // (nothing read them)
}

// lc_compact_kernel: strided lists -> CSR. CTA per list: its offset = sum of the earlier
//   counts (block reduction over <= n_lists ints), then a coalesced copy (4 B read + 4 B
//   written per entry); the last CTA writes off[n].
__global__ void lc_compact_kernel(const int32_t* lists, const int32_t* counts, int n, int cap,
                                  int32_t* off, int32_t* idx) {
  pdl_begin();  // pdl.cuh: first, before any global access
  __shared__ int sh[33];
  const int i = blockIdx.x;
  int part = 0;
  for (int j = threadIdx.x; j < i; j += blockDim.x) part += counts[j];
  int o = 0;
  block_excl_scan(part, sh, o);
  if (threadIdx.x == 0) {
    off[i] = o;
    if (i == n - 1) off[n] = o + counts[i];
  }
  const int cnt = counts[i];
  for (int j = threadIdx.x; j < cnt; j += blockDim.x) idx[o + j] = lists[int64_t(i) * cap + j];
}

}  // namespace

namespace lc_detail {
size_t search_smem_cap() {
  static const size_t v = [] {
    cudaFuncAttributes fa{};
    SPADE_CUDA(cudaFuncGetAttributes(&fa, lc_search_kernel));
    const size_t lim = smem_optin_bytes() > fa.sharedSizeBytes ? smem_optin_bytes() - fa.sharedSizeBytes : 0;
    return std::min(kStageLimit, lim / 16 * 16);
  }();
  return v;
}
size_t search_scratch_stride(int maxF, int maxC, int D, bool spill) {
  const SearchArrays A = search_arrays(maxF, maxC, 8, D);
  if (!spill && A.keys + A.cand + A.flat + A.q + A.lens + A.flag <= search_smem_cap()) return 0;
  return align_up(A.keys + A.cand + A.flat + A.lens + A.flag, 256);
}
}  // namespace lc_detail

void LcIndexGpu::search(const LcSearchArgs& a, cudaStream_t s) const {
  SPADE_CHECK(a.Hq % cfg_.Hkv == 0 && a.Hq / cfg_.Hkv <= 64, "LcIndexGpu::search: bad Hq");
  SPADE_CHECK(!search_scratch_ || a.B <= search_ctas_ / cfg_.Hkv, "LcIndexGpu::search: ", a.B,
              " requests, the global scratch holds ", search_ctas_ / cfg_.Hkv, " (search_batch)");
  SearchK k{a, starts_, n_chunks_, n_fine_, n_coarse_, fc_, gc_, fr_, gr_, gtok_, gfirst_,
            fhead_, fnch_, cnext_, max_fine_, cfg_.max_coarse, cfg_.max_chunks, cfg_.D, cfg_.Hkv,
            0, 0, 0, 0, 0, 0, -1, -1, -1, search_scratch_, int64_t(search_stride_)};  // layout below
  const int G = a.Hq / cfg_.Hkv;
  const size_t smem = search_smem_layout(k, G, cfg_.spill_smem);
  // The opt-in covers dynamic + static shared memory above 48 KB: raise it whenever the
  // dynamic part grows (a threshold on the dynamic part alone misses the ~4.5 KB static).
  static PerDeviceMax set_bytes;  // per device: tensor-parallel ranks as threads
  if (set_bytes.raise(smem)) set_max_dynamic_smem(lc_search_kernel, int(smem));
  launch_pdl(lc_search_kernel, dim3(cfg_.Hkv, a.B), kSearchThreads, smem, s, k);
  SPADE_CUDA_LAUNCH();
}

void LcIndexGpu::compact(const int32_t* lists, const int32_t* counts, int n_lists, int cap,
                         int32_t* sel_off, int32_t* sel_idx, cudaStream_t s) {
  launch_pdl(lc_compact_kernel, n_lists, 256, 0, s, lists, counts, n_lists, cap, sel_off, sel_idx);
  SPADE_CUDA_LAUNCH();
}

}  // namespace spade::cuda
