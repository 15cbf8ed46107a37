// LessIsMore's one token set per request on the GPU (sparse_attention.h lessismore_select),
// from the per-query-head scores a selection layer's dense decode kernel emitted
// (attention.h DecodeScores::per_head). The CPU's LessIsMoreMethod::on_scores, step by step:
//   1. each query head's top n_uni of positions [sinks, hi), hi = L - n_recent: topk_rows on
//      the score rows shifted by `sinks` (radix select, ascending positions);
//   2. the merge by (rank within head, head index): rank_kernel sorts each head's n_uni
//      positions by (score desc, position asc) and atomicMin's key = rank * Hq + head into a
//      per-request array; a token's key is then its first (rank, head) slot in the CPU's
//      merge loop, keys are unique, and the merged set is the n_uni smallest keys: a second
//      topk_rows over -key (exact in fp32 below 2^24);
//   3. lists_kernel writes sinks + merged + [hi, L) as one Token list per request (CSR,
//      lists_per_req = 1); a request with L <= budget gets all of [0, L).
//
// rank_kernel
//   reads  n_uni int32 positions and their n_uni fp32 scores (one head's row)
//   writes n_uni atomicMin's into keys[b][ld]
//   CTA = one (request, query head), 1024 threads; bitonic sort of (score, position) pairs
//   padded to a power of two in dynamic shared memory (8 bytes each, <= 64 KB: n_uni <= 8192).
#include <algorithm>
#include <climits>

#include "backend/cuda/sparse_attention.h"
#include "backend/cuda/pdl.cuh"
#include "backend/cuda/per_device.h"

namespace spade::cuda {

namespace {

constexpr int kRankThreads = 1024;

__device__ __forceinline__ int hi_of(const LessIsMoreArgs& a, int L) { return L - a.n_recent; }

// row_n[b * Hq + hq] = candidates of each head row; row_n[B * Hq + b] = merged candidates
// (0 when L <= budget: that request reads everything); keys[b][0, L) = INT_MAX.
__global__ void lim_init_kernel(const LessIsMoreArgs a) {
  pdl_begin();  // pdl.cuh: first, before any global access
  const int b = blockIdx.y, L = a.kv_len[b];
  const int n = L > a.budget ? hi_of(a, L) - a.sinks : 0;
  if (blockIdx.x == 0)
    for (int h = threadIdx.x; h <= a.Hq; h += blockDim.x)
      a.row_n[h < a.Hq ? b * a.Hq + h : a.B * a.Hq + b] = n;
  int* keys = reinterpret_cast<int*>(a.keys) + int64_t(b) * a.ld;
  for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < L; j += gridDim.x * blockDim.x)
    keys[j] = INT_MAX;
}

__device__ __forceinline__ bool before(float sa, int pa, float sb, int pb) {
  return sa > sb || (sa == sb && pa < pb);  // rank order: higher score, then lower position
}

__global__ void __launch_bounds__(kRankThreads) lim_rank_kernel(const LessIsMoreArgs a, int np2) {
  pdl_begin();  // pdl.cuh: first, before any global access
  extern __shared__ unsigned char smem[];
  float* s_sc = reinterpret_cast<float*>(smem);
  int* s_pos = reinterpret_cast<int*>(s_sc + np2);
  const int row = blockIdx.x, b = row / a.Hq, hq = row % a.Hq;
  const int n = min(a.n_uni, a.row_n[row]);
  if (n <= 0) return;
  const int32_t* top = a.head_top + int64_t(row) * a.n_uni;
  const float* sc = a.scores + int64_t(row) * a.ld;
  for (int i = threadIdx.x; i < np2; i += kRankThreads) {
    if (i < n) {
      const int p = top[i] + a.sinks;
      s_pos[i] = p;
      s_sc[i] = sc[p];
    } else {
      s_pos[i] = INT_MAX;
      s_sc[i] = -INFINITY;
    }
  }
  __syncthreads();
  for (int k = 2; k <= np2; k <<= 1)
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < np2; i += kRankThreads) {
        const int ix = i ^ j;
        if (ix > i) {
          const bool up = (i & k) == 0;  // this half sorts in rank order
          const bool swap = up ? before(s_sc[ix], s_pos[ix], s_sc[i], s_pos[i])
                               : before(s_sc[i], s_pos[i], s_sc[ix], s_pos[ix]);
          if (swap) {
            const float t = s_sc[i];
            s_sc[i] = s_sc[ix], s_sc[ix] = t;
            const int u = s_pos[i];
            s_pos[i] = s_pos[ix], s_pos[ix] = u;
          }
        }
      }
      __syncthreads();
    }
  int* keys = reinterpret_cast<int*>(a.keys) + int64_t(b) * a.ld;
  const int hq_key = a.Hq_key > 0 ? a.Hq_key : a.Hq;
  for (int r = threadIdx.x; r < n; r += kRankThreads)
    atomicMin(&keys[s_pos[r]], r * hq_key + a.hq0 + hq);
}

// gather[r][b][j] = this rank's key (slot r == rank; INT_MAX and j >= L: +inf) or 0.
__global__ void lim_scatter_kernel(const LessIsMoreArgs a, float* gather, int rank, int ranks) {
  pdl_begin();  // pdl.cuh: first, before any global access
  const int b = blockIdx.y, r = blockIdx.z, L = a.kv_len[b];
  const int* ki = reinterpret_cast<const int*>(a.keys) + int64_t(b) * a.ld;
  float* g = gather + (int64_t(r) * a.B + b) * a.ld;
  for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < a.ld; j += gridDim.x * blockDim.x) {
    float v = 0.f;
    if (r == rank) v = j < L && ki[j] != INT_MAX ? float(ki[j]) : INFINITY;
    g[j] = v;
  }
}

// keys[b][j] = the smallest of the ranks' keys (+inf: INT_MAX), j < L.
__global__ void lim_min_kernel(const LessIsMoreArgs a, const float* gather, int ranks) {
  pdl_begin();  // pdl.cuh: first, before any global access
  const int b = blockIdx.y, L = a.kv_len[b];
  int* ki = reinterpret_cast<int*>(a.keys) + int64_t(b) * a.ld;
  for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < L; j += gridDim.x * blockDim.x) {
    float m = INFINITY;
    for (int r = 0; r < ranks; ++r) m = fminf(m, gather[(int64_t(r) * a.B + b) * a.ld + j]);
    ki[j] = m == INFINITY ? INT_MAX : int(m);
  }
}

// keys -> -key as fp32 over the candidates (untouched positions: -inf), in place.
__global__ void lim_key_float_kernel(const LessIsMoreArgs a) {
  pdl_begin();  // pdl.cuh: first, before any global access
  const int b = blockIdx.y, L = a.kv_len[b];
  if (L <= a.budget) return;
  const int hi = hi_of(a, L);
  int* ki = reinterpret_cast<int*>(a.keys) + int64_t(b) * a.ld;
  float* kf = a.keys + int64_t(b) * a.ld;
  for (int j = a.sinks + blockIdx.x * blockDim.x + threadIdx.x; j < hi;
       j += gridDim.x * blockDim.x) {
    const int k = ki[j];
    kf[j] = k == INT_MAX ? -INFINITY : -float(k);
  }
}

__global__ void lim_lists_kernel(const LessIsMoreArgs a) {
  pdl_begin();  // pdl.cuh: first, before any global access
  const int b = blockIdx.x;
  int start = 0;
  for (int bb = 0; bb < b; ++bb) start += min(a.kv_len[bb], a.budget);
  const int L = a.kv_len[b];
  int32_t* out = a.sel_idx + start;
  if (L <= a.budget) {
    for (int j = threadIdx.x; j < L; j += blockDim.x) out[j] = j;
  } else {
    const int hi = hi_of(a, L);
    const int32_t* merged = a.merged_top + int64_t(b) * a.n_uni;
    for (int j = threadIdx.x; j < a.budget; j += blockDim.x) {
      int p;
      if (j < a.sinks) p = j;
      else if (j < a.sinks + a.n_uni) p = merged[j - a.sinks] + a.sinks;
      else p = hi + (j - a.sinks - a.n_uni);
      out[j] = p;
    }
  }
  if (threadIdx.x == 0) {
    a.sel_off[b] = start;
    if (b == a.B - 1) a.sel_off[b + 1] = start + min(L, a.budget);
  }
}

int pow2_at_least(int n) {
  int p = 1;
  while (p < n) p <<= 1;
  return p;
}

void lim_topk(const LessIsMoreArgs& a, const float* sc, const int32_t* n, int rows, int32_t* out,
              cudaStream_t s) {
  if (a.topk_scratch && topk_long_applies(a.ld, a.n_uni))
    topk_rows_long(sc, a.ld, n, rows, a.n_uni, out, a.topk_scratch, s);
  else
    topk_rows(sc, a.ld, n, rows, a.n_uni, out, s);
}

int lim_blocks_x(const LessIsMoreArgs& a) { return int(std::min<int64_t>(64, (a.ld + 255) / 256)); }

}  // namespace

void lessismore_select(const LessIsMoreArgs& a, cudaStream_t s) {
  lessismore_keys(a, s);
  lessismore_lists(a, s);
}

void lessismore_keys(const LessIsMoreArgs& a, cudaStream_t s) {
  SPADE_CHECK(a.n_uni >= 1 && a.n_uni <= kLessIsMoreMaxUnified, "lessismore_select: ", a.n_uni,
              " merged tokens per request, outside [1, ", kLessIsMoreMaxUnified, "]");
  SPADE_CHECK(a.n_uni == a.budget - a.n_recent - a.sinks && a.ld > 0 && a.B > 0,
              "lessismore_select: inconsistent arguments");
  const int hq_key = a.Hq_key > 0 ? a.Hq_key : a.Hq;
  SPADE_CHECK(a.hq0 >= 0 && a.hq0 + a.Hq <= hq_key &&
                  int64_t(a.n_uni) * hq_key < (int64_t(1) << 24),
              "lessismore_select: heads [", a.hq0, ", ", a.hq0 + a.Hq, ") of ", hq_key,
              " (merge keys must stay below 2^24)");
  const int blocks_x = lim_blocks_x(a);
  launch_pdl(lim_init_kernel, dim3(blocks_x, a.B), 256, 0, s, a);
  SPADE_CUDA_LAUNCH();
  lim_topk(a, a.scores + a.sinks, a.row_n, a.B * a.Hq, a.head_top, s);
  const int np2 = pow2_at_least(a.n_uni);
  const size_t smem = size_t(np2) * 8;
  static PerDeviceOnce attr;  // per device: tensor-parallel ranks as threads (per_device.h)
  if (attr.pending()) {
    set_max_dynamic_smem(lim_rank_kernel, kLessIsMoreMaxUnified * 8);
    attr.mark();
  }
  launch_pdl(lim_rank_kernel, a.B * a.Hq, kRankThreads, smem, s, a, np2);
  SPADE_CUDA_LAUNCH();
}

void lessismore_lists(const LessIsMoreArgs& a, cudaStream_t s) {
  launch_pdl(lim_key_float_kernel, dim3(lim_blocks_x(a), a.B), 256, 0, s, a);
  SPADE_CUDA_LAUNCH();
  lim_topk(a, a.keys + a.sinks, a.row_n + a.B * a.Hq, a.B, a.merged_top, s);
  launch_pdl(lim_lists_kernel, a.B, 256, 0, s, a);
  SPADE_CUDA_LAUNCH();
}

void lessismore_keys_scatter(const LessIsMoreArgs& a, float* gather, int rank, int ranks,
                             cudaStream_t s) {
  SPADE_CHECK(ranks >= 1 && rank >= 0 && rank < ranks, "lessismore_keys_scatter: rank ", rank,
              " of ", ranks);
  launch_pdl(lim_scatter_kernel, dim3(lim_blocks_x(a), a.B, ranks), 256, 0, s, a, gather, rank,
             ranks);
  SPADE_CUDA_LAUNCH();
}

void lessismore_keys_min(const LessIsMoreArgs& a, const float* gather, int ranks, cudaStream_t s) {
  launch_pdl(lim_min_kernel, dim3(lim_blocks_x(a), a.B), 256, 0, s, a, gather, ranks);
  SPADE_CUDA_LAUNCH();
}

}  // namespace spade::cuda
