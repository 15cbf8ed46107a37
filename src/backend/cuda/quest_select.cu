// Quest on the GPU (issue 9): per-page key min/max metadata, page scoring, per-(request, KV
// head) top-k by radix select. API in sparse_attention.h.
//
// quest_update_meta_kernel
//   reads  K pages [page][Hkv][P][D] bf16: n_valid rows of each listed page-head (<= P*D*2 B)
//   writes meta [page][Hkv][2][D] bf16 (min row, max row; 4*D bytes per page-head = 1/8 of
//          the page-head's K+V at P = 16)
//   one warp per (listed page, KV head); lane owns D/32 columns.
// quest_score_kernel
//   reads  meta of every page but the last of each (request, KV head): 4*D bytes per page-head
//          (512 B at D = 128: 1/16 of the K+V bytes full attention reads), page table, q
//   writes scores fp32 [B][Hkv][max_pages] (4 B per page-head)
//   CTA = 128 pages of one (request, KV head), 256 threads: the 128 meta rows are staged in
//   shared memory (16 independent 16-byte loads per thread in flight) as 32-bit words with a
//   one-word pad per row (a thread reads its page's row: no bank conflicts); thread (page p,
//   half) then sums max(q_g[d] kmax[d], q_g[d] kmin[d]) over d = 0..D-1 IN ORDER for the heads
//   g = half, half + 2, ... (the CPU's quest_page_bound order, __fmul_rn / __fadd_rn: no FMA
//   contraction, so the fp32 scores are bit-identical) and the group max is taken over both.
//   Shared memory 75 KB at D = 128 (3 CTAs per SM).
// topk_kernel (Quest and topk_rows)
//   reads  n fp32 scores of one row once into shared memory as keys (rows up to 40960 entries,
//          one padding word per 32 keys against bank conflicts in the compaction passes;
//          longer rows re-read L2 in each pass: up to 3 histograms, 3 compaction scans)
//   writes k int32 indices, ascending
//   CTA = one row, 1024 threads. Scores map to order-preserving uint32 keys (NaN lowest, -0 =
//   +0); the keys' min / max (one block reduction), then 1-3 passes of 2048-bin histograms
//   over the remaining key range (shared-memory atomics; they stop once the boundary bin is
//   one key wide or taken whole) find the class of the k-th largest key; a block scan over
//   position order then keeps every key above the class and the lowest-index keys in it,
//   i.e. exactly the CPU's ranks_before order (higher score, then lower position). Rows of
//   <= 256 entries skip the passes: each entry's rank is counted directly (topk_row_by_rank).
#include <algorithm>
#include <climits>
#include <cmath>

#include "backend/cuda/block_scan.cuh"
#include "backend/cuda/per_device.h"
#include "backend/cuda/sparse_attention.h"
#include "backend/cuda/pdl.cuh"

namespace spade::cuda {
namespace {

constexpr int kQPB = 128;       // pages per scoring CTA
constexpr int kQThreads = 256;  // 2 threads per page

// quest_update_meta_kernel: warp per (page i, KV head h); lane owns 4 consecutive dims (per 128)
//   reads  the page's n_valid K rows of head h (8 B per lane and row: every row's load of a lane
//          is issued before any min/max, one memory round trip for a page of <= 16 rows; the
//          row-by-row loop before waited on each load: ~8 us per layer at 128K batch 8)
//   writes min [D] then max [D] bf16 (exact: bf16 in, bf16 out; +-inf for an empty page)
__global__ void quest_update_meta_kernel(const bf16* __restrict__ k, bf16* __restrict__ meta,
                                         const int32_t* __restrict__ page_ids,
                                         const int32_t* __restrict__ n_valid, int n, int Hkv,
                                         int P, int D) {
  pdl_begin();  // pdl.cuh: first, before any global access
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
  if (warp >= n * Hkv) return;
  const int i = warp / Hkv, h = warp % Hkv;
  const int pid = page_ids[i], nv = n_valid[i];
  const bf16* src = k + (int64_t(pid) * Hkv + h) * P * D;
  bf16* dst = meta + (int64_t(pid) * Hkv + h) * 2 * D;
  for (int d0 = 4 * lane; d0 < D; d0 += 128) {
    float mn[4], mx[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) mn[e] = INFINITY, mx[e] = -INFINITY;
    for (int r0 = 0; r0 < nv; r0 += 16) {
      uint2 v[16];
#pragma unroll
      for (int j = 0; j < 16; ++j)
        if (r0 + j < nv) v[j] = *reinterpret_cast<const uint2*>(src + (r0 + j) * D + d0);
#pragma unroll
      for (int j = 0; j < 16; ++j)
        if (r0 + j < nv) {
          const bf16* x = reinterpret_cast<const bf16*>(&v[j]);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float f = __bfloat162float(x[e]);
            mn[e] = fminf(mn[e], f);
            mx[e] = fmaxf(mx[e], f);
          }
        }
    }
    __nv_bfloat162 lo[2], hi[2];
    lo[0] = __floats2bfloat162_rn(mn[0], mn[1]), lo[1] = __floats2bfloat162_rn(mn[2], mn[3]);
    hi[0] = __floats2bfloat162_rn(mx[0], mx[1]), hi[1] = __floats2bfloat162_rn(mx[2], mx[3]);
    *reinterpret_cast<uint2*>(dst + d0) = *reinterpret_cast<const uint2*>(lo);
    *reinterpret_cast<uint2*>(dst + D + d0) = *reinterpret_cast<const uint2*>(hi);
  }
}

// GH: heads per thread (ceil(G / 2)); the two threads of a page take heads g = half + 2j.
template <int D, int GH>
__global__ void __launch_bounds__(kQThreads, 2) quest_score_kernel(const QuestArgs a) {
  pdl_begin();  // pdl.cuh: first, before any global access
  constexpr int RW = D + 1;  // 32-bit words per staged row (2*D bf16 + 1 pad word)
  constexpr int V = D / 4;   // 16-byte pieces per meta row (2*D bf16 = 4*D bytes)
  constexpr int IT = kQPB * V / kQThreads;
  extern __shared__ uint32_t sm_words[];
  uint32_t* rows = sm_words;                                     // [kQPB][RW]
  float* sq = reinterpret_cast<float*>(sm_words + kQPB * RW);    // [G][D]
  float* sbest = sq + 16 * D;                                    // [2][kQPB]
  int* spid = reinterpret_cast<int*>(sbest + 2 * kQPB);          // [kQPB]
  const int b = blockIdx.z, h = blockIdx.y, tid = threadIdx.x;
  const int G = a.Hq / a.Hkv;
  const int L = a.kv_len[b];
  const int np = (L + 15) / 16;
  const int n = np - 1;  // scored pages (the last one is always taken)
  const int p0 = blockIdx.x * kQPB;
  if (p0 >= n) return;
  const int cnt = min(kQPB, n - p0);
  const int* pt = a.page_table + a.page_off[b];
  if (tid < cnt) spid[tid] = __ldg(pt + p0 + tid);
  for (int i = tid; i < G * D; i += kQThreads)
    sq[i] = __bfloat162float(a.q[(int64_t(b) * a.Hq + h * G) * D + i]);
  __syncthreads();
  // Stage the meta rows: IT independent 16-byte loads per thread in flight, then the stores.
  {
    uint4 w[IT];
#pragma unroll
    for (int i = 0; i < IT; ++i) {
      const int idx = tid + i * kQThreads, p = idx / V, c = idx % V;
      if (p < cnt)
        w[i] = __ldg(reinterpret_cast<const uint4*>(a.meta + (int64_t(spid[p]) * a.Hkv + h) * 2 * D) + c);
    }
#pragma unroll
    for (int i = 0; i < IT; ++i) {
      const int idx = tid + i * kQThreads, p = idx / V, c = idx % V;
      if (p < cnt) {
        uint32_t* dst = rows + p * RW + c * 4;
        dst[0] = w[i].x, dst[1] = w[i].y, dst[2] = w[i].z, dst[3] = w[i].w;
      }
    }
  }
  __syncthreads();
  // Thread (page p, half): heads g = half, half + 2, ... (the max over g is order-free; each
  // head's sum runs over d in order, as the CPU's).
  const int p = tid % kQPB, half = tid / kQPB;
  float best = -INFINITY;
  if (p < cnt) {
    const uint32_t* row = rows + p * RW;
    float acc[GH];
#pragma unroll
    for (int j = 0; j < GH; ++j) acc[j] = 0.f;
    const bool odd_tail = half + 2 * (GH - 1) >= G;  // last head slot empty (G odd, half 1)
#pragma unroll 2
    for (int d4 = 0; d4 < D / 4; ++d4) {
      const uint32_t wmn0 = row[2 * d4], wmn1 = row[2 * d4 + 1];
      const uint32_t wmx0 = row[D / 2 + 2 * d4], wmx1 = row[D / 2 + 2 * d4 + 1];
      const float mn[4] = {__uint_as_float(wmn0 << 16), __uint_as_float(wmn0 & 0xffff0000u),
                           __uint_as_float(wmn1 << 16), __uint_as_float(wmn1 & 0xffff0000u)};
      const float mx[4] = {__uint_as_float(wmx0 << 16), __uint_as_float(wmx0 & 0xffff0000u),
                           __uint_as_float(wmx1 << 16), __uint_as_float(wmx1 & 0xffff0000u)};
#pragma unroll
      for (int j = 0; j < GH; ++j) {
        const int g = min(half + 2 * j, G - 1);  // clamped: an empty slot recomputes head G-1
        const float4 qv = *reinterpret_cast<const float4*>(sq + g * D + 4 * d4);
        const float qq[4] = {qv.x, qv.y, qv.z, qv.w};
#pragma unroll
        for (int e = 0; e < 4; ++e)
          acc[j] = __fadd_rn(acc[j], fmaxf(__fmul_rn(qq[e], mx[e]), __fmul_rn(qq[e], mn[e])));
      }
    }
#pragma unroll
    for (int j = 0; j < GH; ++j)
      if (j < GH - 1 || !odd_tail) best = fmaxf(best, acc[j]);
  }
  sbest[half * kQPB + p] = best;
  __syncthreads();
  if (tid < cnt)
    a.scores[(int64_t(b) * a.Hkv + h) * a.max_pages + p0 + tid] = fmaxf(sbest[tid], sbest[kQPB + tid]);
}

__device__ __forceinline__ uint32_t order_key(float f) {
  if (f != f) return 0u;  // NaN ranks last
  if (f == 0.f) f = 0.f;  // -0 ties with +0
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

constexpr int kTopkThreads = 1024;


// Shared-memory slot of key i: one padding word per 32 keys, so the final passes (thread t
// scans its own contiguous segment of n / 1024 keys) do not put every lane of a warp on one
// bank (a segment of 32 keys made that a 32-way conflict on every read).
__device__ __forceinline__ int topk_slot(int i) { return i + (i >> 5); }

// Writes the k best of scores[0..n) (k < n) ascending into out[0..k). CACHED: the keys are
// first copied into shared memory skeys[topk_slot(0..n)] (8 loads in flight per thread), and
// every pass reads them there; else each pass re-reads the scores (from L2).
//
// Selection by range-adaptive radix passes over the order keys: the candidate range [lo, hi]
// starts as [min key, max key] of the row (one block reduction); a pass splits it into
// <= kTopkBins bins of 2^shift keys each (bin = (u - lo) >> shift, shift the smallest that
// fits the range), counts the candidates per bin (shared-memory atomics), and keeps the bin
// that holds the rem-th largest candidate. It stops when that bin is one key value wide or is
// taken whole; then the keys above the bin are all taken and, of the keys in it, the
// lowest-index rem (all of it when taken whole): the CPU's ranks_before order. Fixed 8-bit
// digits from the top (the kernel before) spent their first passes on the sign and exponent
// bits that scores of one magnitude share; an adaptive range needs 1-3 passes.
constexpr int kTopkBins = 2048;

// Rows of at most kTopkRankMax entries (a 300-token context's tokens, or its pages): no
// histogram passes. Four threads per entry count the keys ranked before it (higher key, or
// the same key at a lower index: the CPU's ranks_before order), each over a quarter of the
// row held in shared memory; an entry is taken when fewer than k rank before it. Ballots then
// write the taken indices ascending. ~n^2 / 4 compares per thread group, two barriers: at
// n = 256 far less than the radix passes' fixed cost (histogram clears, block scans).
constexpr int kTopkRankMax = kTopkThreads / 4;
__device__ void topk_row_by_rank(const float* __restrict__ sc, int n, int k,
                                 int32_t* __restrict__ out) {
  __shared__ uint32_t s_keys[kTopkRankMax];
  __shared__ int s_cnt[kTopkThreads / 32];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int e = tid >> 2, q = tid & 3;
  if (tid < n) s_keys[tid] = order_key(sc[tid]);
  __syncthreads();
  int before = 0;
  if (e < n) {
    const uint32_t u = s_keys[e];
    const int j0 = q * n / 4, j1 = (q + 1) * n / 4;
    for (int j = j0; j < j1; ++j) {
      const uint32_t v = s_keys[j];
      before += (v > u) | ((v == u) & (j < e));
    }
  }
  before += __shfl_xor_sync(0xffffffffu, before, 1);
  before += __shfl_xor_sync(0xffffffffu, before, 2);
  const unsigned taken = __ballot_sync(0xffffffffu, q == 0 && e < n && before < k);
  if (lane == 0) s_cnt[warp] = __popc(taken);
  __syncthreads();
  if (q == 0 && e < n && before < k) {
    int pos = __popc(taken & ((1u << lane) - 1u));
    for (int w = 0; w < warp; ++w) pos += s_cnt[w];
    out[pos] = e;
  }
}

template <bool CACHED>
__device__ void topk_row(const float* __restrict__ sc, int n, int k, int32_t* __restrict__ out,
                         uint32_t* skeys) {
  if (n <= kTopkRankMax) {  // uniform over the block
    topk_row_by_rank(sc, n, k, out);
    return;
  }
  // Two histograms and two result slots, alternating between passes: the next pass's
  // histogram is cleared while this one fills.
  __shared__ uint32_t hist[2][kTopkBins];
  __shared__ int s_warp[64];
  __shared__ uint32_t s_red[2][32];
  __shared__ uint32_t s_bin[2], s_above[2], s_cnt[2];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  for (int i = tid; i < kTopkBins; i += kTopkThreads) hist[0][i] = 0;
  uint32_t kmin = 0xffffffffu, kmax = 0u;
  if (CACHED) {
    int i = tid;
    for (; i + 7 * kTopkThreads < n; i += 8 * kTopkThreads) {
      float v[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) v[u] = sc[i + u * kTopkThreads];
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const uint32_t x = order_key(v[u]);
        skeys[topk_slot(i + u * kTopkThreads)] = x;
        kmin = min(kmin, x), kmax = max(kmax, x);
      }
    }
    for (; i < n; i += kTopkThreads) {
      const uint32_t x = order_key(sc[i]);
      skeys[topk_slot(i)] = x;
      kmin = min(kmin, x), kmax = max(kmax, x);
    }
  } else {
    for (int i = tid; i < n; i += kTopkThreads) {
      const uint32_t x = order_key(sc[i]);
      kmin = min(kmin, x), kmax = max(kmax, x);
    }
  }
  auto key = [&](int i) { return CACHED ? skeys[topk_slot(i)] : order_key(sc[i]); };
  kmin = __reduce_min_sync(0xffffffffu, kmin);
  kmax = __reduce_max_sync(0xffffffffu, kmax);
  if (lane == 0) s_red[0][warp] = kmin, s_red[1][warp] = kmax;
  __syncthreads();
  if (warp == 0) {
    const int nw = kTopkThreads / 32;
    kmin = __reduce_min_sync(0xffffffffu, lane < nw ? s_red[0][lane] : 0xffffffffu);
    kmax = __reduce_max_sync(0xffffffffu, lane < nw ? s_red[1][lane] : 0u);
    if (lane == 0) s_red[0][0] = kmin, s_red[1][0] = kmax;
  }
  __syncthreads();
  uint32_t lo = s_red[0][0], span = s_red[1][0] - lo;  // candidates: lo <= u <= lo + span
  int rem = k;  // how many of the candidates are still to take
  for (int pb = 0; span > 0; pb ^= 1) {
    const int shift = max(0, 32 - __clz(span) - 11);  // (span >> shift) < kTopkBins
    uint32_t* h = hist[pb];
    for (int i = tid; i < kTopkBins; i += kTopkThreads) hist[pb ^ 1][i] = 0;
    for (int i = tid; i < n; i += kTopkThreads) {
      const uint32_t d = key(i) - lo;  // wraps above 2^31 for keys below lo: not counted
      if (d <= span) atomicAdd(&h[d >> shift], 1u);
    }
    __syncthreads();
    // Thread t owns bins kTopkBins-1-2t and kTopkBins-2-2t (descending): the keys above a
    // bin are the exclusive prefix over the threads before it.
    constexpr int kPer = kTopkBins / kTopkThreads;
    uint32_t c[kPer], sum = 0;
#pragma unroll
    for (int j = 0; j < kPer; ++j) c[j] = h[kTopkBins - 1 - kPer * tid - j], sum += c[j];
    int tot;
    uint32_t run = uint32_t(block_exclusive_scan(int(sum), s_warp, &tot));
    if (run < uint32_t(rem) && run + sum >= uint32_t(rem)) {  // exactly one thread
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        if (run + c[j] >= uint32_t(rem)) {
          s_bin[pb] = kTopkBins - 1 - kPer * tid - j;
          s_above[pb] = run;
          s_cnt[pb] = c[j];
          break;
        }
        run += c[j];
      }
    }
    __syncthreads();
    const uint32_t b = s_bin[pb];
    rem -= int(s_above[pb]);
    lo += b << shift;
    span = min(span - (b << shift), (shift >= 32 ? 0u : (1u << shift)) - 1u);
    // Every key of the boundary bin is taken: nothing below it is, the bin is the class.
    if (s_cnt[pb] == uint32_t(rem)) break;
  }
  // The class [lo, lo + span]: keys above it are taken, and the first `rem` of it by index.
  const uint32_t Tlo = lo, Thi = lo + span;
  const int seg = (n + kTopkThreads - 1) / kTopkThreads;
  const int i0 = min(n, tid * seg), i1 = min(n, i0 + seg);
  int n_eq = 0;
  for (int i = i0; i < i1; ++i) {
    const uint32_t u = key(i);
    n_eq += u >= Tlo && u <= Thi;
  }
  int tot;
  const int eq_before = block_exclusive_scan(n_eq, s_warp, &tot);
  int n_sel = 0;
  {
    int e = eq_before;
    for (int i = i0; i < i1; ++i) {
      const uint32_t u = key(i);
      if (u > Thi) ++n_sel;
      else if (u >= Tlo && e++ < rem) ++n_sel;
    }
  }
  int pos = block_exclusive_scan(n_sel, s_warp, &tot);
  {
    int e = eq_before;
    for (int i = i0; i < i1; ++i) {
      const uint32_t u = key(i);
      if (u > Thi || (u >= Tlo && e++ < rem)) out[pos++] = i;
    }
  }
}

// Dynamic shared memory of the top-k kernels: keys of rows up to kTopkCache entries (plus the
// padding of topk_slot: 165 KB), or fewer where the device gives a block less (A100: 163 KB,
// sm_86 / 89: 99 KB): topk_cache_max(). Longer rows read their keys from global memory.
// The limit covers static + dynamic bytes: topk_static_bytes() (the kernels' static arrays,
// ~35 KB: each topk_row instantiation has its own histograms) comes off it.
constexpr int kTopkCache = 40960;
constexpr size_t topk_smem_bytes(int cache) { return size_t(cache + (cache >> 5) + 1) * 4; }
size_t topk_static_bytes();
int topk_cache_max() {
  static const int c = [] {
    const int64_t words = int64_t(smem_optin_bytes() - topk_static_bytes()) / 4;
    const int64_t fit = (words - 1) * 32 / 33 / 32 * 32;         // topk_smem_bytes(fit) <= 4 * words
    return int(std::min<int64_t>(kTopkCache, fit));
  }();
  return c;
}

__global__ void __launch_bounds__(kTopkThreads) quest_topk_kernel(const QuestArgs a, int cache) {
  pdl_begin();  // pdl.cuh: first, before any global access
  extern __shared__ uint32_t skeys[];
  const int row = blockIdx.x, b = row / a.Hkv;
  const int L = a.kv_len[b];
  const int np = (L + 15) / 16;
  int32_t* out = a.sel_idx + int64_t(row) * a.k_pages;
  if (a.csr_off) {  // CSR: the row starts after the rows before it, min(k, pages) entries each
    int start = 0;
    for (int bb = 0; bb < b; ++bb) start += a.Hkv * min(a.k_pages, (a.kv_len[bb] + 15) / 16);
    const int n = min(a.k_pages, np);
    start += (row % a.Hkv) * n;
    out = a.sel_idx + start;
    if (threadIdx.x == 0) {
      a.csr_off[row] = start;
      if (row == a.B * a.Hkv - 1) a.csr_off[row + 1] = start + n;
    }
  }
  if (a.k_pages >= np) {
    for (int i = threadIdx.x; i < np; i += kTopkThreads) out[i] = i;
    return;
  }
  if (a.k_pages > 1) {
    const float* sc = a.scores + int64_t(row) * a.max_pages;
    if (np - 1 <= cache) topk_row<true>(sc, np - 1, a.k_pages - 1, out, skeys);
    else topk_row<false>(sc, np - 1, a.k_pages - 1, out, skeys);
  }
  if (threadIdx.x == 0) out[a.k_pages - 1] = np - 1;
}

__global__ void __launch_bounds__(kTopkThreads) topk_rows_kernel(const float* sc, int64_t ld,
                                                                 const int32_t* n, int k, int32_t* out,
                                                                 int cache) {
  pdl_begin();  // pdl.cuh: first, before any global access
  extern __shared__ uint32_t skeys[];
  const int row = blockIdx.x;
  const int nr = n[row];
  int32_t* o = out + int64_t(row) * k;
  if (k >= nr) {
    for (int i = threadIdx.x; i < nr; i += kTopkThreads) o[i] = i;
    return;
  }
  if (k > 0) {
    if (nr <= cache) topk_row<true>(sc + row * ld, nr, k, o, skeys);
    else topk_row<false>(sc + row * ld, nr, k, o, skeys);
  }
}

// Long rows (topk_rows_long): stage 1, CTA (chunk c, row): the k best of the row's chunk
// [c * chunk, c * chunk + chunk) (cached in shared memory), written as (score, position) pairs
// to cand[row][c * k ..]; a chunk with m <= k entries passes them all, padded with
// (-inf, INT_MAX). Candidates are in position order (chunks in order, ascending inside), so the
// stage-2 top-k's tie rule (lower index) is the CPU's (lower position).
__global__ void __launch_bounds__(kTopkThreads) topk_chunks_kernel(const float* sc, int64_t ld,
                                                                   const int32_t* n, int k,
                                                                   int chunk, int n_chunks,
                                                                   float* cs, int32_t* cp,
                                                                   int32_t* n2) {
  pdl_begin();  // pdl.cuh: first, before any global access
  extern __shared__ uint32_t skeys[];
  const int c = blockIdx.x, row = blockIdx.y;
  const int nr = n[row];
  if (c == 0 && threadIdx.x == 0) n2[row] = nr > k ? n_chunks * k : 0;
  if (nr <= k) return;  // the whole row is the answer (topk_long_map_kernel)
  const int lo = c * chunk, m = max(0, min(chunk, nr - lo));
  const float* src = sc + int64_t(row) * ld + lo;
  float* ds = cs + (int64_t(row) * n_chunks + c) * k;
  int32_t* dp = cp + (int64_t(row) * n_chunks + c) * k;
  if (m <= k) {
    for (int i = threadIdx.x; i < k; i += kTopkThreads) {
      ds[i] = i < m ? src[i] : -INFINITY;
      dp[i] = i < m ? lo + i : INT_MAX;
    }
    return;
  }
  topk_row<true>(src, m, k, dp, skeys);
  __syncthreads();  // every thread's writes of dp are visible to the block
  for (int i = threadIdx.x; i < k; i += kTopkThreads) {
    const int j = dp[i];
    ds[i] = src[j];
    dp[i] = lo + j;
  }
}

// Stage 2's candidate indices -> positions (rows with n <= k: all of [0, n)).
__global__ void topk_long_map_kernel(const int32_t* n, int k, int n_chunks, const int32_t* cp,
                                     const int32_t* idx2, int32_t* out) {
  pdl_begin();  // pdl.cuh: first, before any global access
  const int row = blockIdx.x, nr = n[row];
  int32_t* o = out + int64_t(row) * k;
  if (nr <= k) {
    for (int i = threadIdx.x; i < nr; i += blockDim.x) o[i] = i;
    return;
  }
  const int32_t* pos = cp + int64_t(row) * n_chunks * k;
  const int32_t* ix = idx2 + int64_t(row) * k;
  for (int i = threadIdx.x; i < k; i += blockDim.x) o[i] = pos[ix[i]];
}

size_t topk_static_bytes() {
  size_t b = 0;
  for (const void* f : {reinterpret_cast<const void*>(quest_topk_kernel),
                        reinterpret_cast<const void*>(topk_rows_kernel),
                        reinterpret_cast<const void*>(topk_chunks_kernel)}) {
    cudaFuncAttributes fa{};
    SPADE_CUDA(cudaFuncGetAttributes(&fa, f));
    b = std::max(b, size_t(fa.sharedSizeBytes));
  }
  return b;
}

}  // namespace

void quest_update_meta(const bf16* k_cache, bf16* meta, const int32_t* page_ids,
                       const int32_t* n_valid, int n, int Hkv, int P, int D, cudaStream_t s) {
  if (n <= 0) return;
  SPADE_CHECK(D % 4 == 0, "quest_update_meta: head dim ", D, " is not a multiple of 4");
  const int warps = n * Hkv;
  launch_pdl(quest_update_meta_kernel, (warps + 7) / 8, 256, 0, s, k_cache, meta, page_ids, n_valid, n, Hkv, P, D);
  SPADE_CUDA_LAUNCH();
}

void quest_score(const QuestArgs& a, cudaStream_t s) {
  if (a.fast) return quest_score_fast(a, s);
  SPADE_CHECK(a.D == 64 || a.D == 128, "quest_score: head dim ", a.D);
  SPADE_CHECK(a.Hq % a.Hkv == 0 && a.Hq / a.Hkv <= 16, "quest_score: G must be <= 16");
  const size_t smem = size_t(kQPB) * (a.D + 1) * 4 + size_t(16) * a.D * 4 + 3 * kQPB * 4;
  dim3 grid((a.max_pages + kQPB - 1) / kQPB, a.Hkv, a.B);
  const int GH = (a.Hq / a.Hkv + 1) / 2;
  static PerDeviceOnce attr_done[2][9];  // per device: tensor-parallel ranks as threads
  auto go = [&](auto kernel) {
    PerDeviceOnce& done = attr_done[a.D == 128][GH];
    if (done.pending()) {
      set_max_dynamic_smem(kernel, 96 << 10);
      done.mark();
    }
    launch_pdl(kernel, grid, kQThreads, smem, s, a);
  };
  switch (GH * (a.D == 128 ? 1 : -1)) {
    case 1: go(quest_score_kernel<128, 1>); break;
    case 2: go(quest_score_kernel<128, 2>); break;
    case 3: go(quest_score_kernel<128, 3>); break;
    case 4: go(quest_score_kernel<128, 4>); break;
    case 5: go(quest_score_kernel<128, 5>); break;
    case 6: go(quest_score_kernel<128, 6>); break;
    case 7: go(quest_score_kernel<128, 7>); break;
    case 8: go(quest_score_kernel<128, 8>); break;
    case -1: go(quest_score_kernel<64, 1>); break;
    case -2: go(quest_score_kernel<64, 2>); break;
    case -3: go(quest_score_kernel<64, 3>); break;
    case -4: go(quest_score_kernel<64, 4>); break;
    case -5: go(quest_score_kernel<64, 5>); break;
    case -6: go(quest_score_kernel<64, 6>); break;
    case -7: go(quest_score_kernel<64, 7>); break;
    default: go(quest_score_kernel<64, 8>); break;
  }
  SPADE_CUDA_LAUNCH();
}

template <typename K>
int topk_cache_attr(K kernel, int64_t max_n) {
  static PerDeviceOnce done;  // per device: tensor-parallel ranks as threads (per_device.h)
  if (done.pending()) {
    set_max_dynamic_smem(kernel, topk_smem_bytes(topk_cache_max()));
    done.mark();
  }
  return int(std::min<int64_t>(max_n, topk_cache_max()));
}

void quest_topk(const QuestArgs& a, cudaStream_t s) {
  const int cache = topk_cache_attr(quest_topk_kernel, a.max_pages);
  launch_pdl(quest_topk_kernel, a.B * a.Hkv, kTopkThreads, topk_smem_bytes(cache), s, a, cache);
  SPADE_CUDA_LAUNCH();
}

void quest_select(const QuestArgs& a, cudaStream_t s) {
  quest_score(a, s);
  quest_topk(a, s);
}

void topk_rows(const float* scores, int64_t ld, const int32_t* n, int n_rows, int k, int32_t* out,
               cudaStream_t s) {
  if (n_rows <= 0) return;
  const int cache = topk_cache_attr(topk_rows_kernel, ld);
  launch_pdl(topk_rows_kernel, n_rows, kTopkThreads, topk_smem_bytes(cache), s, scores, ld, n, k, out, cache);
  SPADE_CUDA_LAUNCH();
}

namespace {
constexpr int kTopkChunkMax = 32768;  // stage-1 chunk: cached in shared memory
int topk_chunk() { return std::min(kTopkChunkMax, topk_cache_max()); }
int topk_long_chunks(int64_t ld) { return int((ld + topk_chunk() - 1) / topk_chunk()); }
}  // namespace

bool topk_long_applies(int64_t ld, int k) {
  return ld > topk_cache_max() && k >= 1 && k <= topk_chunk() &&
         int64_t(topk_long_chunks(ld)) * k <= topk_cache_max();
}

size_t topk_long_scratch_bytes(int n_rows, int64_t ld, int k) {
  const size_t cand = size_t(n_rows) * size_t(topk_long_chunks(ld)) * size_t(k);
  return cand * 8 + size_t(n_rows) * 4 + size_t(n_rows) * size_t(k) * 4 + 3 * 256;
}

void topk_rows_long(const float* scores, int64_t ld, const int32_t* n, int n_rows, int k,
                    int32_t* out, void* scratch, cudaStream_t s) {
  SPADE_CHECK(topk_long_applies(ld, k), "topk_rows_long: rows of ", ld, " with k = ", k,
              " need the single-pass topk_rows");
  if (n_rows <= 0) return;
  const int nc = topk_long_chunks(ld);
  const size_t cand = size_t(n_rows) * size_t(nc) * size_t(k);
  auto align = [](size_t b) { return (b + 255) / 256 * 256; };
  unsigned char* p = static_cast<unsigned char*>(scratch);
  float* cs = reinterpret_cast<float*>(p);
  int32_t* cp = reinterpret_cast<int32_t*>(p + align(cand * 4));
  int32_t* n2 = reinterpret_cast<int32_t*>(p + align(cand * 4) + align(cand * 4));
  int32_t* idx2 = n2 + (align(size_t(n_rows) * 4) / 4);
  const int c1 = topk_cache_attr(topk_chunks_kernel, topk_chunk());
  launch_pdl(topk_chunks_kernel, dim3(unsigned(nc), unsigned(n_rows)), kTopkThreads, topk_smem_bytes(c1), s, 
      scores, ld, n, k, topk_chunk(), nc, cs, cp, n2);
  SPADE_CUDA_LAUNCH();
  topk_rows(cs, int64_t(nc) * k, n2, n_rows, k, idx2, s);
  launch_pdl(topk_long_map_kernel, n_rows, 256, 0, s, n, k, nc, cp, idx2, out);
  SPADE_CUDA_LAUNCH();
}

}  // namespace spade::cuda
