// Internal to the LycheeCluster GPU index (cluster_index*.cu): the constants, device helpers
// and the slot pointer block shared by the build, lazy-update and search kernels. API and
// storage layout: cluster_index.h; numerics: the comment atop cluster_index.cu; design:
// docs/cuda_lycheecluster.md.
#pragma once
#include <cmath>
#include <cstdint>

#include "backend/cuda/cluster_index.h"

namespace spade::cuda::lc_detail {

constexpr int kMaxDPL = 8;  // D <= 256: dims per lane
constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ uint32_t okey(float x) {  // order-preserving, NaN lowest, -0 = +0
  if (x != x) return 0u;
  if (x == 0.f) x = 0.f;
  const uint32_t u = __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Sequential (d ascending) double sum of squares of the lane-distributed vector v (lane owns
// d = lane + 32 j): the CPU's l2_normalize / norm order. Every lane gets the result.
template <int DPL>
__device__ double warp_seq_sumsq(const float (&v)[DPL], int D) {
  double s = 0.0;
#pragma unroll
  for (int j = 0; j < DPL; ++j) {
    if (32 * j >= D) break;
    for (int src = 0; src < 32; ++src) {
      const double x = double(__shfl_sync(kFull, v[j], src));
      s = __dadd_rn(s, __dmul_rn(x, x));
    }
  }
  return s;
}

// Exclusive block scan (blockDim.x multiple of 32, <= 1024); sh: 33 ints of shared memory.
__device__ inline int block_excl_scan(int v, int* sh, int& total) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
  int x = v;
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(kFull, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) sh[w] = x;
  __syncthreads();
  if (w == 0) {
    int t = lane < nw ? sh[lane] : 0;
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(kFull, t, o);
      if (lane >= o) t += y;
    }
    if (lane < nw) sh[lane] = t;  // inclusive warp totals
    if (lane == 31) sh[32] = t;
  }
  __syncthreads();
  const int res = (w > 0 ? sh[w - 1] : 0) + x - v;
  total = sh[32];
  __syncthreads();
  return res;
}

// Ascending bitonic sort of s[0, n), n a power of two.
__device__ inline void block_bitonic(unsigned long long* s, int n) {
  for (int k = 2; k <= n; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const int ixj = i ^ j;
        if (ixj > i) {
          const unsigned long long a = s[i], b = s[ixj];
          const bool up = (i & k) == 0;
          if ((a > b) == up) {
            s[i] = b;
            s[ixj] = a;
          }
        }
      }
      __syncthreads();
    }
  }
}

// Ascending sort of n <= blockDim.x distinct keys s[0, n), all below ~0 (s holds at least
// roundup(n, 32) entries): each warp sorts 32 of them in registers (bitonic through shuffles,
// padded with ~0), then every key's rank is its lane plus, for each other warp's sorted run,
// the number of that run's keys below it (a 5-step binary search in shared memory), and the
// key is stored at its rank. 15 shuffle steps, 4 barriers, and at most 15 short searches per
// thread, instead of n comparisons per key or a barrier per bitonic step. All threads call it.
__device__ inline void block_merge_sort(unsigned long long* s, int n) {
  const int t = threadIdx.x, lane = t & 31, w = t >> 5;
  const int runs = (n + 31) >> 5;
  unsigned long long v = t < n ? s[t] : ~0ull;
  for (int k = 2; k <= 32; k <<= 1)
    for (int j = k >> 1; j > 0; j >>= 1) {
      const unsigned long long o = __shfl_xor_sync(kFull, v, j);
      const bool keep_min = ((lane & j) == 0) == ((lane & k) == 0);
      v = keep_min ? (v < o ? v : o) : (v < o ? o : v);
    }
  if (runs == 1) {  // one warp: already in order
    __syncthreads();
    if (t < n) s[t] = v;
    __syncthreads();
    return;
  }
  __syncthreads();
  if (w < runs) s[t] = v;
  __syncthreads();
  int r = lane;
  if (t < n) {
    // Keys of run o below v (its own run counts 0: the lane is its rank there). Unrolled and
    // branch-free so several runs' 5-step searches are in flight together.
#pragma unroll 4
    for (int o = 0; o < runs; ++o) {
      const unsigned long long* run = s + 32 * o;
      int lo = 0;  // the first index whose key is >= v, or 31
#pragma unroll
      for (int step = 16; step > 0; step >>= 1) lo += run[lo + step - 1] < v ? step : 0;
      const int below = lo + (lo == 31 && run[31] < v ? 1 : 0);
      r += o == w ? 0 : below;
    }
  }
  __syncthreads();
  if (t < n) s[r] = v;
  __syncthreads();
}

__host__ __device__ inline int pow2_at_least(int n) {
  int p = 1;
  while (p < n) p <<= 1;
  return p;
}

__device__ __forceinline__ float round_up_f(double x) {
  float f = __double2float_rn(x);
  if (double(f) < x) f = nextafterf(f, INFINITY);
  return f;
}

__device__ __forceinline__ const bf16* key_row(const bf16* k, const int32_t* pt, int p, int h,
                                               int Hkv, int P, int D) {
  return k + ((int64_t(pt[p / P]) * Hkv + h) * P + (p % P)) * D;
}

// Center storage (fine and coarse; cluster_index.h): per (slot, head) a block of maxN nodes x D
// fp16, PIECE-MAJOR: dims [8p, 8p + 8) of node n are the 16 bytes at halves (p * maxN + n) * 8
// of the block. The search's thread-per-node loads of one piece are then contiguous across a
// warp (row-major rows made every 16-byte load of a warp touch 32 cache lines).
__host__ __device__ __forceinline__ int64_t lc_cen_off(int maxN, int n, int d) {
  return (int64_t(d >> 3) * maxN + n) * 8 + (d & 7);
}

// Pointers of one slot (assembly in the build; the lazy update offsets slot 0's).
struct SlotPtrs {
  const int32_t* starts;
  int32_t *n_chunks, *n_fine, *n_coarse;  // [Hkv]
  __half* fc;
  float* fr;
  int32_t *ftok, *fcnt, *fhead, *ftail, *fnch;
  __half* gc;
  float* gr;
  int32_t *gtok, *gcnt, *gfirst;
  int32_t *cnext, *cfine;
  int maxF, maxG, maxC, D, Hkv, P;
};

// One slot of a build sequence (LcIndexGpu::build_batch), on the device: its layer's K cache,
// its request's page table, its chunk starts (staged, n_chunks + 1 entries), slot and chunk
// count. Build kernels index scratch by vh = group * Hkv + h and the slot's arrays by
// slot_head(): slot * Hkv + h.
struct LcGroupDev {
  const bf16* k;
  const int32_t* pt;
  const int32_t* starts;
  int slot, M;
};
__device__ __forceinline__ int64_t slot_head(const LcGroupDev* g, int vh, int Hkv) {
  return int64_t(g[vh / Hkv].slot) * Hkv + vh % Hkv;
}

// Sets the dynamic shared-memory limit of the build's block-sort kernels (km_reseed,
// lc_renumber, lc_lists; cluster_index_build.cu) to `bytes`; called by the constructor.
void set_build_sort_smem(int bytes);
// The most dynamic shared memory those kernels take (200 KB, or the device's per-block limit
// less 1 KB for their static arrays: sm_86 / 89 98 KB); a sort of more keys (pow2(n) * 8 bytes)
// runs over keys in global memory (LcIndexGpu's sort_keys_).
size_t build_sort_smem_limit();
// The dynamic shared memory lc_search_kernel may take (cluster_index_search.cu): 220 KB, or the
// device's per-block limit less the kernel's static arrays.
size_t search_smem_cap();
// Bytes of global scratch per (request, KV head) the search needs where its working arrays at
// up to 8 query heads per KV head do not fit search_smem_cap (0: they fit; spill: always).
size_t search_scratch_stride(int maxF, int maxC, int D, bool spill);

}  // namespace spade::cuda::lc_detail
