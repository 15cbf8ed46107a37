// LycheeCluster index on the GPU: build (pooling, spherical k-means, assembly), search,
// lazy update. API and storage layout: cluster_index.h; design: docs/cuda_lycheecluster.md.
// Arithmetic that the CPU does in double in a fixed order (chunk means, l2 norms, center
// accumulation, token distances) is done in double with __dadd_rn / __dmul_rn (no FMA
// contraction) in the same order where the order is cheap to keep, so pooled keys, centers
// and radii match the CPU bit for bit given the same assignments. The k-means similarity
// dots are fp32 in a different summation order than the CPU's sgemm: assignments agree
// except at near-ties (tests: objective and nearest-centroid checks with tolerances, exact
// equality on well-separated data).
#include <algorithm>
#include <cmath>
#include <type_traits>

#include "backend/cuda/cluster_index.h"

namespace spade::cuda {
namespace {

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
__device__ int block_excl_scan(int v, int* sh, int& total) {
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
__device__ void block_bitonic(unsigned long long* s, int n) {
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

// ---------------------------------------------------------------------------------------
// lc_pool_kernel: chunk mean pooling + normalization.
//   reads  K rows of the chunk's tokens: [page][Hkv][P][D] bf16 via the page table (2*D B per
//          token-head, each read once)
//   writes mean[h][c][D] double (8*D B), X[h][c][D] fp32 unit chunk key (4*D B)
//   one warp per (chunk, head); lane owns d = lane + 32 j; tokens summed in position order in
//   double (the CPU's pool_chunk), then float(mean) normalized in the CPU's order.
template <int DPL>
__global__ void lc_pool_kernel(const bf16* __restrict__ k, const int32_t* __restrict__ pt,
                               const int32_t* __restrict__ starts, int M, int Hkv, int P, int D,
                               int64_t ld, double* __restrict__ mean, float* __restrict__ X) {
  const int wid = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
  if (wid >= M * Hkv) return;
  const int c = wid / Hkv, h = wid % Hkv;
  const int b = starts[c], e = starts[c + 1];
  double acc[DPL];
#pragma unroll
  for (int j = 0; j < DPL; ++j) acc[j] = 0.0;
  for (int p = b; p < e; ++p) {
    const bf16* row = key_row(k, pt, p, h, Hkv, P, D);
#pragma unroll
    for (int j = 0; j < DPL; ++j)
      if (lane + 32 * j < D) acc[j] = __dadd_rn(acc[j], double(__bfloat162float(row[lane + 32 * j])));
  }
  const double inv = 1.0 / double(max(1, e - b));
  float u[DPL];
  double* mo = mean + h * ld + int64_t(c) * D;
#pragma unroll
  for (int j = 0; j < DPL; ++j) {
    const double m = __dmul_rn(acc[j], inv);
    u[j] = __double2float_rn(m);
    if (lane + 32 * j < D) mo[lane + 32 * j] = m;
  }
  const double s = warp_seq_sumsq<DPL>(u, D);
  const double n = sqrt(s);
  float* xo = X + h * ld + int64_t(c) * D;
  const float fi = n > 0 ? __double2float_rn(1.0 / n) : 1.f;
#pragma unroll
  for (int j = 0; j < DPL; ++j)
    if (lane + 32 * j < D) xo[lane + 32 * j] = n > 0 ? __fmul_rn(u[j], fi) : u[j];
}

// ---------------------------------------------------------------------------------------
// Batched spherical k-means (one problem per head h; N, K per head on the device in ctl).
struct KmArgs {
  const float* X;  // [h] at X + h * ldX: N rows of D (unit)
  int64_t ldX;
  float* C;        // [h][maxK][D] iterating centroids
  int64_t ldC;
  double* sum;     // [h][maxK][D]
  int* cnt;        // [h][maxK]
  int64_t ldK;
  int* assign;     // [h][maxN]
  float* best;     // [h][maxN]
  int64_t ldN;
  int* ctl;        // [h][8]: 0 N, 1 K, 2 active, 3 changed, 4 K out
  float* Cout;     // [h] final centroids (compacted), at Cout + h * ldCout
  int64_t ldCout;
  int D;
};

// km_init_kernel: assign[h][i] = -1; active = 1, changed = 0. Grid (ceil(maxN/256), H).
__global__ void km_init_kernel(KmArgs a) {
  const int h = blockIdx.y, i = blockIdx.x * blockDim.x + threadIdx.x;
  int* ctl = a.ctl + h * 8;
  if (i < ctl[0]) a.assign[h * a.ldN + i] = -1;
  if (i == 0) {
    ctl[2] = 1;
    ctl[3] = 0;
  }
}

// km_seed_kernel: stride seeding, centroid k = point floor((k + 0.5) N / K).
//   reads/writes D floats per centroid; one warp per (k, h).
__global__ void km_seed_kernel(KmArgs a) {
  const int k = blockIdx.x, h = blockIdx.y;
  const int N = a.ctl[h * 8 + 0], K = a.ctl[h * 8 + 1];
  if (k >= K) return;
  int64_t i = int64_t((double(k) + 0.5) * double(N) / double(K));
  i = i < int64_t(N - 1) ? i : int64_t(N - 1);
  const float* x = a.X + h * a.ldX + i * a.D;
  float* c = a.C + h * a.ldC + int64_t(k) * a.D;
  for (int d = threadIdx.x; d < a.D; d += blockDim.x) c[d] = x[d];
}

// km_assign_kernel: a_i = argmax_k x_i . c_k (ties: lowest k), best_sim, changed flag.
//   reads  64 points x D fp32 per CTA once per centroid tile, all K centroids (fp32, L2)
//   writes assign[i] int32, best[i] fp32
//   CTA = 64 points x 128-centroid tiles, 256 threads: thread (ty = t/16, tx = t%16) owns
//   points 4ty..4ty+3 and centroids 4tx..4tx+3, 64+4tx..64+4tx+3 of each tile (4 x 8 fp32
//   accumulators; per dim one 16-byte load of x and two of c for 32 FMAs); 32-dim slices of
//   both staged in shared memory d-major with padded rows (16-byte aligned, conflict-free);
//   the 16 threads of a point reduce (max, lower k) by shuffles.
constexpr int kAP = 64, kAC = 128, kAD = 32;
__global__ void __launch_bounds__(256) km_assign_kernel(KmArgs a, int force) {
  const int h = blockIdx.y;
  int* ctl = a.ctl + h * 8;
  if (!force && !ctl[2]) return;
  const int N = ctl[0], K = ctl[1], D = a.D;
  const int p0 = blockIdx.x * kAP;
  if (p0 >= N) return;
  __shared__ __align__(16) float xs[kAD][kAP + 4];
  __shared__ __align__(16) float cs[kAD][kAC + 4];
  const int t = threadIdx.x, ty = t >> 4, tx = t & 15;
  const float* X = a.X + h * a.ldX;
  const float* C = a.C + h * a.ldC;
  float bs[4];
  int bk[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    bs[i] = -INFINITY;
    bk[i] = -1;
  }
  for (int k0 = 0; k0 < K; k0 += kAC) {
    float acc[4][8] = {};
    for (int d0 = 0; d0 < D; d0 += kAD) {
      for (int e = t; e < kAP * kAD / 4; e += 256) {
        const int r = e / (kAD / 4), d4 = (e % (kAD / 4)) * 4;
        const float4 v = (p0 + r < N) ? *reinterpret_cast<const float4*>(X + int64_t(p0 + r) * D + d0 + d4)
                                      : make_float4(0.f, 0.f, 0.f, 0.f);
        xs[d4][r] = v.x;
        xs[d4 + 1][r] = v.y;
        xs[d4 + 2][r] = v.z;
        xs[d4 + 3][r] = v.w;
      }
      for (int e = t; e < kAC * kAD / 4; e += 256) {
        const int r = e / (kAD / 4), d4 = (e % (kAD / 4)) * 4;
        const float4 v = (k0 + r < K) ? *reinterpret_cast<const float4*>(C + int64_t(k0 + r) * D + d0 + d4)
                                      : make_float4(0.f, 0.f, 0.f, 0.f);
        cs[d4][r] = v.x;
        cs[d4 + 1][r] = v.y;
        cs[d4 + 2][r] = v.z;
        cs[d4 + 3][r] = v.w;
      }
      __syncthreads();
#pragma unroll 8
      for (int d = 0; d < kAD; ++d) {
        const float4 xv = *reinterpret_cast<const float4*>(&xs[d][ty * 4]);
        const float4 c0 = *reinterpret_cast<const float4*>(&cs[d][tx * 4]);
        const float4 c1 = *reinterpret_cast<const float4*>(&cs[d][64 + tx * 4]);
        const float xa[4] = {xv.x, xv.y, xv.z, xv.w};
        const float ca[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(xa[i], ca[j], acc[i][j]);
      }
      __syncthreads();
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int k = k0 + (j < 4 ? tx * 4 + j : 64 + tx * 4 + j - 4);
      if (k < K)
#pragma unroll
        for (int i = 0; i < 4; ++i)
          if (bk[i] < 0 || acc[i][j] > bs[i] || (acc[i][j] == bs[i] && k < bk[i])) {
            bs[i] = acc[i][j];
            bk[i] = k;
          }
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    for (int o = 1; o < 16; o <<= 1) {
      const float os = __shfl_xor_sync(kFull, bs[i], o);
      const int ok = __shfl_xor_sync(kFull, bk[i], o);
      if (ok >= 0 && (bk[i] < 0 || os > bs[i] || (os == bs[i] && ok < bk[i]))) {
        bs[i] = os;
        bk[i] = ok;
      }
    }
    const int p = p0 + ty * 4 + i;
    if (tx == 0 && p < N) {
      int* as = a.assign + h * a.ldN + p;
      if (*as != bk[i]) {
        *as = bk[i];
        ctl[3] = 1;
      }
      a.best[h * a.ldN + p] = bs[i];
    }
  }
}

// km_accum_kernel: sum[a_i] += x_i (double atomics), cnt[a_i] += 1.
//   thread per (point, dim); reads X once; Grid (ceil(maxN*D/256), H).
__global__ void km_accum_kernel(KmArgs a, int force) {
  const int h = blockIdx.y;
  const int* ctl = a.ctl + h * 8;
  if (!force && !ctl[2]) return;
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t i = e / a.D;
  const int d = int(e % a.D);
  if (i >= ctl[0]) return;
  const int k = a.assign[h * a.ldN + i];
  atomicAdd(a.sum + h * a.ldC + int64_t(k) * a.D + d, double(a.X[h * a.ldX + i * a.D + d]));
  if (d == 0) atomicAdd(a.cnt + h * a.ldK + k, 1);
}

// km_normalize_kernel: c_k = normalize(float(sum_k)) for non-empty k; warp per (k, h).
//   final = 1: writes the compacted final centroid Cout[remap[k]] instead.
template <int DPL>
__global__ void km_normalize_kernel(KmArgs a, const int* remap, int final_pass) {
  const int k = blockIdx.x, h = blockIdx.y, lane = threadIdx.x;
  const int* ctl = a.ctl + h * 8;
  if (!final_pass && !ctl[2]) return;
  if (k >= ctl[1] || a.cnt[h * a.ldK + k] == 0) return;
  const double* s = a.sum + h * a.ldC + int64_t(k) * a.D;
  float v[DPL];
#pragma unroll
  for (int j = 0; j < DPL; ++j) v[j] = lane + 32 * j < a.D ? __double2float_rn(s[lane + 32 * j]) : 0.f;
  const double n = sqrt(warp_seq_sumsq<DPL>(v, a.D));
  const float fi = n > 0 ? __double2float_rn(1.0 / n) : 1.f;
  float* c = final_pass ? a.Cout + h * a.ldCout + int64_t(remap[h * a.ldK + k]) * a.D
                        : a.C + h * a.ldC + int64_t(k) * a.D;
#pragma unroll
  for (int j = 0; j < DPL; ++j)
    if (lane + 32 * j < a.D) c[lane + 32 * j] = n > 0 ? __fmul_rn(v[j], fi) : v[j];
}

// km_reseed_kernel: empty clusters (k ascending) take the worst-fitting points (lowest best
// sim, ties lowest i), each once. CTA per head, 1024 threads; shared: pow2(N) u64 sort keys.
__global__ void __launch_bounds__(1024) km_reseed_kernel(KmArgs a) {
  extern __shared__ unsigned long long keys[];
  __shared__ int sh[33];
  const int h = blockIdx.x;
  const int* ctl = a.ctl + h * 8;
  if (!ctl[2]) return;
  const int N = ctl[0], K = ctl[1];
  const int* cnt = a.cnt + h * a.ldK;
  int tot = 0;
  {
    int part = 0;
    for (int k = threadIdx.x; k < K; k += blockDim.x) part += cnt[k] == 0;
    block_excl_scan(part, sh, tot);
  }
  if (tot == 0) return;
  const int n2 = pow2_at_least(N);
  const float* best = a.best + h * a.ldN;
  for (int i = threadIdx.x; i < n2; i += blockDim.x)
    keys[i] = i < N ? (static_cast<unsigned long long>(okey(best[i])) << 32) | unsigned(i) : ~0ull;
  __syncthreads();
  block_bitonic(keys, n2);
  // j-th empty cluster (k ascending) <- j-th key.
  int base = 0;
  for (int k0 = 0; k0 < K; k0 += blockDim.x) {
    const int k = k0 + threadIdx.x;
    const int e = (k < K && cnt[k] == 0) ? 1 : 0;
    int t = 0;
    const int r = block_excl_scan(e, sh, t) + base;
    if (e && r < N) {
      const int i = int(keys[r] & 0xffffffffu);
      const float* x = a.X + h * a.ldX + int64_t(i) * a.D;
      float* c = a.C + h * a.ldC + int64_t(k) * a.D;
      for (int d = 0; d < a.D; ++d) c[d] = x[d];
    }
    base += t;
  }
}

// km_control_kernel: active = active && changed; changed = 0. One thread per head.
__global__ void km_control_kernel(int* ctl, int H) {
  const int h = threadIdx.x;
  if (h >= H) return;
  ctl[h * 8 + 2] = ctl[h * 8 + 2] && ctl[h * 8 + 3];
  ctl[h * 8 + 3] = 0;
}

// km_remap_kernel: remap[k] = rank of k among non-empty clusters, K out. CTA per head.
__global__ void km_remap_kernel(KmArgs a, int* remap) {
  __shared__ int sh[33];
  const int h = blockIdx.x;
  int* ctl = a.ctl + h * 8;
  const int K = ctl[1];
  int base = 0;
  for (int k0 = 0; k0 < K; k0 += blockDim.x) {
    const int k = k0 + threadIdx.x;
    const int e = (k < K && a.cnt[h * a.ldK + k] > 0) ? 1 : 0;
    int t = 0;
    const int r = block_excl_scan(e, sh, t) + base;
    if (k < K) remap[h * a.ldK + k] = e ? r : -1;
    base += t;
  }
  if (threadIdx.x == 0) ctl[4] = base;
}

// km_apply_remap_kernel: assign[i] = remap[assign[i]].
__global__ void km_apply_remap_kernel(KmArgs a, const int* remap) {
  const int h = blockIdx.y, i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= a.ctl[h * 8]) return;
  int* as = a.assign + h * a.ldN + i;
  *as = remap[h * a.ldK + *as];
}

// lc_coarse_params_kernel: coarse problem of head h: N = NF, K = clamp(min(max_coarse,
// ceil(sqrt(NF))), 1, NF).
__global__ void lc_coarse_params_kernel(const int* ctlF, int* ctlG, int H, int max_coarse) {
  const int h = threadIdx.x;
  if (h >= H) return;
  const int NF = ctlF[h * 8 + 4];
  int P = min(max_coarse, int(ceil(sqrt(double(NF)))));
  P = max(1, min(P, NF));
  ctlG[h * 8 + 0] = NF;
  ctlG[h * 8 + 1] = P;
}

// ---------------------------------------------------------------------------------------
// Assembly. Pointers of one slot.
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

// lc_renumber_kernel: fine ids sorted stably by coarse unit -> newid, gof, first; n_fine,
//   n_coarse. CTA per head; shared pow2(NF) u64 keys.
__global__ void __launch_bounds__(1024) lc_renumber_kernel(SlotPtrs s, const int* ctlF, const int* ctlG,
                                                           const int* gassign, int64_t ldN,
                                                           int* newid, int* gof) {
  extern __shared__ unsigned long long keys[];
  const int h = blockIdx.x;
  const int NF = ctlF[h * 8 + 4], G = ctlG[h * 8 + 4];
  const int n2 = pow2_at_least(NF);
  for (int i = threadIdx.x; i < n2; i += blockDim.x)
    keys[i] = i < NF ? (static_cast<unsigned long long>(gassign[h * ldN + i]) << 32) | unsigned(i) : ~0ull;
  __syncthreads();
  block_bitonic(keys, n2);
  int* first = s.gfirst + int64_t(h) * (s.maxG + 1);
  for (int j = threadIdx.x; j < NF; j += blockDim.x) {
    const int g = int(keys[j] >> 32), i = int(keys[j] & 0xffffffffu);
    newid[h * s.maxF + i] = j;
    gof[h * s.maxF + j] = g;
    if (j == 0 || int(keys[j - 1] >> 32) != g) first[g] = j;
  }
  if (threadIdx.x == 0) {
    first[G] = NF;
    s.n_fine[h] = NF;
    s.n_coarse[h] = G;
  }
}

// lc_lists_kernel: chunk -> fine (renumbered), per-fine chunk lists in position order
//   (head, tail, next, count). CTA per head; shared pow2(M) u64 keys (fine << 32 | chunk).
__global__ void __launch_bounds__(1024) lc_lists_kernel(SlotPtrs s, int M, const int* fassign, int64_t ldN,
                                                        const int* newid) {
  extern __shared__ unsigned long long keys[];
  const int h = blockIdx.x;
  const int64_t fo = int64_t(h) * s.maxF, co = int64_t(h) * s.maxC;
  const int NF = s.n_fine[h];
  for (int f = threadIdx.x; f < NF; f += blockDim.x) s.fnch[fo + f] = 0;
  const int n2 = pow2_at_least(M);
  for (int c = threadIdx.x; c < n2; c += blockDim.x) {
    if (c < M) {
      const int f = newid[h * s.maxF + fassign[h * ldN + c]];
      s.cfine[co + c] = f;
      keys[c] = (static_cast<unsigned long long>(f) << 32) | unsigned(c);
    } else {
      keys[c] = ~0ull;
    }
  }
  __syncthreads();
  block_bitonic(keys, n2);
  for (int j = threadIdx.x; j < M; j += blockDim.x) {
    const int f = int(keys[j] >> 32), c = int(keys[j] & 0xffffffffu);
    if (j == 0 || int(keys[j - 1] >> 32) != f) s.fhead[fo + f] = c;
    const bool last = j == M - 1 || int(keys[j + 1] >> 32) != f;
    if (last) s.ftail[fo + f] = c;
    s.cnext[co + c] = last ? -1 : int(keys[j + 1] & 0xffffffffu);
    atomicAdd(s.fnch + fo + f, 1);
  }
  if (threadIdx.x == 0) s.n_chunks[h] = M;
}

// lc_center_accum_kernel: acc[node] += mean_c * m_c (double atomics; the CPU adds in chunk
//   order: sums of a few doubles whose order differs round identically to float/fp16 in all
//   but astronomically rare cases; tests compare stored centers exactly), tokens/count += m.
//   thread per (chunk, dim); reads the chunk means (8*D B per chunk-head).
__global__ void lc_center_accum_kernel(SlotPtrs s, int M, const double* mean, int64_t ldm,
                                       const int* gof, double* acc) {
  const int h = blockIdx.y;
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int c = int(e / s.D), d = int(e % s.D);
  if (c >= M) return;
  const int f = s.cfine[int64_t(h) * s.maxC + c], g = gof[h * s.maxF + f];
  const int m = s.starts[c + 1] - s.starts[c];
  const double v = __dmul_rn(mean[h * ldm + int64_t(c) * s.D + d], double(m));
  double* a = acc + int64_t(h) * (s.maxF + s.maxG) * s.D;
  atomicAdd(a + int64_t(f) * s.D + d, v);
  atomicAdd(a + int64_t(s.maxF + g) * s.D + d, v);
  if (d == 0) {
    atomicAdd(s.ftok + h * s.maxF + f, m);
    atomicAdd(s.fcnt + h * s.maxF + f, m);
    atomicAdd(s.gtok + h * s.maxG + g, m);
    atomicAdd(s.gcnt + h * s.maxG + g, m);
  }
}

// lc_center_final_kernel: center = acc / count (acc * (1 / count), the CPU's order), clamped
//   to +-65000, stored fp16 (2*D B per node). thread per (node, dim) over fine then coarse.
__global__ void lc_center_final_kernel(SlotPtrs s, const double* acc) {
  const int h = blockIdx.y;
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int node = int(e / s.D), d = int(e % s.D);
  const int NF = s.n_fine[h], G = s.n_coarse[h];
  const bool fine = node < NF;
  if (!fine && (node < s.maxF || node - s.maxF >= G)) return;
  const int i = fine ? node : node - s.maxF;
  const int cnt = fine ? s.fcnt[h * s.maxF + i] : s.gcnt[h * s.maxG + i];
  const double inv = 1.0 / double(max(1, cnt));
  double v = __dmul_rn(acc[(int64_t(h) * (s.maxF + s.maxG) + node) * s.D + d], inv);
  v = fmin(fmax(v, -65000.0), 65000.0);
  const __half hv = __float2half_rn(__double2float_rn(v));
  if (fine) s.fc[(int64_t(h) * s.maxF + i) * s.D + d] = hv;
  else s.gc[(int64_t(h) * s.maxG + i) * s.D + d] = hv;
}

// Sequential double distance |k - c| (d ascending, the CPU's dist()).
__device__ double seq_dist_bf16(const bf16* k, const __half* c, int D) {
  double s = 0.0;
  for (int d = 0; d < D; ++d) {
    const double t = __dsub_rn(double(__bfloat162float(k[d])), double(__half2float(c[d])));
    s = __dadd_rn(s, __dmul_rn(t, t));
  }
  return sqrt(s);
}

// lc_radius_kernel: max distance of every token of each node's chunks to the stored center
//   (double, sequential over d), as u64 bits (non-negative doubles order as integers).
//   warp per (chunk, head), lane per token; reads 2*D B of K per token-head + fp16 centers.
__global__ void lc_radius_kernel(SlotPtrs s, int M, const bf16* k, const int32_t* pt,
                                 const int* gof, unsigned long long* rad) {
  const int wid = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
  if (wid >= M * s.Hkv) return;
  const int c = wid / s.Hkv, h = wid % s.Hkv;
  const int f = s.cfine[int64_t(h) * s.maxC + c], g = gof[h * s.maxF + f];
  const __half* fcen = s.fc + (int64_t(h) * s.maxF + f) * s.D;
  const __half* gcen = s.gc + (int64_t(h) * s.maxG + g) * s.D;
  double rf = 0.0, rg = 0.0;
  for (int p = s.starts[c] + lane; p < s.starts[c + 1]; p += 32) {
    const bf16* row = key_row(k, pt, p, h, s.Hkv, s.P, s.D);
    rf = fmax(rf, seq_dist_bf16(row, fcen, s.D));
    rg = fmax(rg, seq_dist_bf16(row, gcen, s.D));
  }
  for (int o = 16; o > 0; o >>= 1) {
    rf = fmax(rf, __shfl_xor_sync(kFull, rf, o));
    rg = fmax(rg, __shfl_xor_sync(kFull, rg, o));
  }
  if (lane == 0) {
    unsigned long long* r = rad + int64_t(h) * (s.maxF + s.maxG);
    atomicMax(r + f, static_cast<unsigned long long>(__double_as_longlong(rf)));
    atomicMax(r + s.maxF + g, static_cast<unsigned long long>(__double_as_longlong(rg)));
  }
}

// lc_radius_final_kernel: radius = double rounded up to float. thread per node.
__global__ void lc_radius_final_kernel(SlotPtrs s, const unsigned long long* rad) {
  const int h = blockIdx.y, node = blockIdx.x * blockDim.x + threadIdx.x;
  const int NF = s.n_fine[h], G = s.n_coarse[h];
  const double r = __longlong_as_double(static_cast<long long>(rad[int64_t(h) * (s.maxF + s.maxG) + node]));
  if (node < NF) s.fr[h * s.maxF + node] = round_up_f(r);
  else if (node >= s.maxF && node - s.maxF < G) s.gr[h * s.maxG + node - s.maxF] = round_up_f(r);
}

// ---------------------------------------------------------------------------------------
// Lazy update.
struct InsertReq {
  static constexpr int kMax = 32;
  int slot, n_old, n_new;
  const int32_t* pt;
  int ends[kMax];
};
struct InsertBatch {
  static constexpr int kReq = 16;
  InsertReq r[kReq];
};

__device__ SlotPtrs slot_ptrs(const SlotPtrs& z, int slot) {  // z: the pointers of slot 0
  SlotPtrs s = z;
  const int64_t so = int64_t(slot) * z.Hkv;
  s.starts = z.starts + int64_t(slot) * (z.maxC + 1);
  s.n_chunks += so; s.n_fine += so; s.n_coarse += so;
  s.fc += so * z.maxF * z.D; s.fr += so * z.maxF; s.ftok += so * z.maxF; s.fcnt += so * z.maxF;
  s.fhead += so * z.maxF; s.ftail += so * z.maxF; s.fnch += so * z.maxF;
  s.gc += so * z.maxG * z.D; s.gr += so * z.maxG; s.gtok += so * z.maxG; s.gcnt += so * z.maxG;
  s.gfirst += so * (z.maxG + 1); s.cnext += so * z.maxC; s.cfine += so * z.maxC;
  return s;
}

// lc_insert_kernel: inserts, for each request r of the batch (blockIdx.y), its chunks
//   n_old .. n_old + n_new - 1 in order. CTA per (KV head, request), 256 threads.
//   reads  the chunk's K rows once (2*D B per token, staged in shared memory as bf16 for
//          chunks <= 32 tokens; longer chunks read global memory), every coarse center and the
//          chosen unit's fine centers (2*D B each)
//   writes the two nodes' fp16 center (2*D B), radius, counters, the chunk's links; head 0's
//          CTA appends the chunk end to the slot's starts.
//   Pooling, norms and distances in double in the CPU's order; similarities fp32 dots
//   (warp-reduced) / float(|c|), ties -> lower id.
constexpr int kInsThreads = 256, kInsTok = 32;
__global__ void __launch_bounds__(kInsThreads) lc_insert_kernel(SlotPtrs z, const bf16* k, InsertBatch batch) {
  const InsertReq& rq = batch.r[blockIdx.y];
  const SlotPtrs s = slot_ptrs(z, rq.slot);
  int32_t* starts_rw = const_cast<int32_t*>(s.starts);
  const int32_t* pt = rq.pt;
  const int h = blockIdx.x, t = threadIdx.x, lane = t & 31, w = t >> 5, nw = blockDim.x >> 5;
  const int D = s.D;
  __shared__ double mean[256];
  __shared__ float unit[256], oldc[256], newc[256];
  __shared__ double sq[256];
  __shared__ float wbest[32];
  __shared__ int wbk[32];
  __shared__ int sel[2];
  __shared__ double rmax[kInsThreads];
  __shared__ bf16 kr[kInsTok][256];
  const int64_t fo = int64_t(h) * s.maxF, go = int64_t(h) * s.maxG, co = int64_t(h) * s.maxC;
  for (int i = 0; i < rq.n_new; ++i) {
    const int c = rq.n_old + i;
    const int b = i == 0 ? starts_rw[c] : rq.ends[i - 1], e = rq.ends[i];
    const bool staged = e - b <= kInsTok;
    __syncthreads();
    if (h == 0 && t == 0) starts_rw[c + 1] = e;
    if (staged)
      for (int x = t; x < (e - b) * D; x += blockDim.x)
        kr[x / D][x % D] = key_row(k, pt, b + x / D, h, s.Hkv, s.P, D)[x % D];
    __syncthreads();
    auto kv = [&](int p, int d) {
      return staged ? __bfloat162float(kr[p - b][d]) : __bfloat162float(key_row(k, pt, p, h, s.Hkv, s.P, D)[d]);
    };
    // Pool.
    for (int d = t; d < D; d += blockDim.x) {
      double a = 0.0;
      for (int p = b; p < e; ++p) a = __dadd_rn(a, double(kv(p, d)));
      const double m = __dmul_rn(a, 1.0 / double(max(1, e - b)));
      mean[d] = m;
      unit[d] = __double2float_rn(m);
      sq[d] = __dmul_rn(double(unit[d]), double(unit[d]));
    }
    __syncthreads();
    if (t == 0) {
      double ss = 0.0;
      for (int d = 0; d < D; ++d) ss = __dadd_rn(ss, sq[d]);
      sq[0] = sqrt(ss);
    }
    __syncthreads();
    const double un = sq[0];
    __syncthreads();
    if (un > 0) {
      const float fi = __double2float_rn(1.0 / un);
      for (int d = t; d < D; d += blockDim.x) unit[d] = __fmul_rn(unit[d], fi);
    }
    __syncthreads();
    // Most similar coarse unit, then fine cluster within it.
    for (int level = 1; level >= 0; --level) {
      const int lo = level ? 0 : s.gfirst[int64_t(h) * (s.maxG + 1) + sel[1]];
      const int hi = level ? s.n_coarse[h] : s.gfirst[int64_t(h) * (s.maxG + 1) + sel[1] + 1];
      // Thread per node: float dot in d order without FMA and the double norm, as the CPU's
      // most_similar (bit-identical similarities); best per warp (ties: lower id).
      float bsim = -INFINITY;
      int bk = -1;
      for (int n = lo + t; n < hi; n += blockDim.x) {
        const __half* cen = level ? s.gc + (go + n) * D : s.fc + (fo + n) * D;
        float dp = 0.f;
        double nn = 0.0;
#pragma unroll 4
        for (int d0 = 0; d0 < D; d0 += 8) {
          const uint4 raw = *reinterpret_cast<const uint4*>(cen + d0);
          const __half* hv = reinterpret_cast<const __half*>(&raw);
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            const float cv = __half2float(hv[j]);
            dp = __fadd_rn(dp, __fmul_rn(unit[d0 + j], cv));
            nn = __dadd_rn(nn, __dmul_rn(double(cv), double(cv)));
          }
        }
        const float nf = __double2float_rn(sqrt(nn));
        const float sim = nf > 0 ? dp / nf : -INFINITY;
        if (bk < 0 || sim > bsim) {
          bsim = sim;
          bk = n;
        }
      }
      for (int o = 16; o > 0; o >>= 1) {
        const float os = __shfl_xor_sync(kFull, bsim, o);
        const int ok = __shfl_xor_sync(kFull, bk, o);
        if (ok >= 0 && (bk < 0 || os > bsim || (os == bsim && ok < bk))) {
          bsim = os;
          bk = ok;
        }
      }
      if (lane == 0) {
        wbest[w] = bsim;
        wbk[w] = bk;
      }
      __syncthreads();
      if (t == 0) {
        float bb = -INFINITY;
        int kk = -1;
        for (int j = 0; j < nw; ++j)
          if (wbk[j] >= 0 && (kk < 0 || wbest[j] > bb || (wbest[j] == bb && wbk[j] < kk))) {
            bb = wbest[j];
            kk = wbk[j];
          }
        sel[level] = kk < 0 ? lo : kk;
      }
      __syncthreads();
    }
    // Update fine (level 0) then coarse (level 1).
    const int m = e - b;
    for (int level = 0; level < 2; ++level) {
      const int node = sel[level];
      __half* cen = level ? s.gc + (go + node) * D : s.fc + (fo + node) * D;
      int32_t* cntp = level ? s.gcnt + go + node : s.fcnt + fo + node;
      int32_t* tokp = level ? s.gtok + go + node : s.ftok + fo + node;
      float* radp = level ? s.gr + go + node : s.fr + fo + node;
      const int n = *cntp;
      const double wgt = double(m) / double(n + m);
      for (int d = t; d < D; d += blockDim.x) {
        const float oc = __half2float(cen[d]);
        oldc[d] = oc;
        double v = __dadd_rn(double(oc), __dmul_rn(wgt, __dsub_rn(mean[d], double(oc))));
        v = fmin(fmax(v, -65000.0), 65000.0);
        const __half hv = __float2half_rn(__double2float_rn(v));
        cen[d] = hv;
        newc[d] = __half2float(hv);
      }
      __syncthreads();
      // Distances: thread 0 = |c' - c|; threads 1.. = new tokens.
      double r = 0.0;
      if (t == 0) {
        double ss = 0.0;
        for (int d = 0; d < D; ++d) {
          const double x = __dsub_rn(double(oldc[d]), double(newc[d]));
          ss = __dadd_rn(ss, __dmul_rn(x, x));
        }
        r = __dadd_rn(double(*radp), sqrt(ss));
      }
      for (int p = b + t; p < e; p += blockDim.x) {
        double ss = 0.0;
        for (int d = 0; d < D; ++d) {
          const double x = __dsub_rn(double(kv(p, d)), double(newc[d]));
          ss = __dadd_rn(ss, __dmul_rn(x, x));
        }
        r = fmax(r, sqrt(ss));
      }
      rmax[t] = r;
      __syncthreads();
      if (t == 0) {
        double rr = 0.0;
        for (int j = 0; j < blockDim.x; ++j) rr = fmax(rr, rmax[j]);
        *radp = round_up_f(rr);
        *cntp = n + m;
        *tokp += m;
      }
      __syncthreads();
    }
    if (t == 0) {
      const int f = sel[0];
      s.cnext[co + c] = -1;
      s.cfine[co + c] = f;
      const int tail = s.ftail[fo + f];
      if (tail < 0) s.fhead[fo + f] = c;
      else s.cnext[co + tail] = c;
      s.ftail[fo + f] = c;
      s.fnch[fo + f] += 1;
      s.n_chunks[h] = c + 1;
    }
    __syncthreads();
  }
}

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
  int64_t off_cand, off_flat, off_q, off_lens, off_flag;  // shared-memory layout (bytes)
};

// Shared-memory layout of lc_search_kernel (bytes, 16-aligned regions): keys [pow2(maxF)] u64 |
// cand [maxF] i32 | flat [max(maxC, 256)] i32 (also the sorted chosen chunks of the output) |
// q [G][D] f32 | lens [maxC] i16 | flag [maxC] u8.
inline size_t search_smem_layout(SearchK& k, int G) {
  auto al = [](size_t x) { return (x + 15) / 16 * 16; };
  size_t o = al(size_t(pow2_at_least(k.maxF)) * 8);
  k.off_cand = int64_t(o);
  o += al(size_t(k.maxF) * 4);
  k.off_flat = int64_t(o);
  const size_t flat_bytes = std::max(size_t(k.maxC), size_t(256)) * 4;  // >= 256: output ranks
  o += al(flat_bytes);
  k.off_q = int64_t(o);
  o += al(size_t(G) * k.D * 4);
  k.off_lens = int64_t(o);
  o += al(size_t(k.maxC) * 2);
  k.off_flag = int64_t(o);
  o += al(size_t(k.maxC));
  return o;
}

// lc_search_kernel: CTA per (KV head, request), kSearchThreads threads.
//   reads  q of the G heads (2*D B each); coarse centers (2*D B each) + radii + token counts;
//          the kept units' fine centers (2*D B each) + radii; per-fine chunk counts and links
//          and the candidate chunks' starts
//   writes the strided Token list (4 B per token: sink + chosen chunks ascending + tail) and
//          the count
//   shared: sort keys [pow2(maxF)] u64, candidate fine ids [maxF], flat chunk ids [maxC] i32,
//   q [G][D] f32, flat lengths [maxC] i16, chosen flags [maxC] u8; coarse scores / order /
//   tokens / ranges; up to 256 chosen chunk ids (sorted for the output; more: a flag scan).
//   Every serial step runs over shared memory (the coarse k_g rule, the budget tail) so the
//   latency of one search is a few block-wide phases.
constexpr int kSearchThreads = kSearchThreadsHost;
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long x;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(x));
  return x;
}
// Phase timestamps (bench only, a.trace non-null): [list][8] ns.
#define LC_TRACE(i) \
  if (a.trace && t == 0) a.trace[(int64_t(b) * k.Hkv + h) * 8 + (i)] = global_ns()
__global__ void __launch_bounds__(kSearchThreads) lc_search_kernel(SearchK k) {
  extern __shared__ unsigned long long smem_u64[];
  const LcSearchArgs& a = k.a;
  const int h = blockIdx.x, b = blockIdx.y, t = threadIdx.x, lane = t & 31, w = t >> 5;
  const int nw = blockDim.x >> 5, D = k.D, G = a.Hq / k.Hkv;
  const int slot = a.slot[b];
  const int sh_ = slot * k.Hkv + h;
  const int32_t* starts = k.starts + int64_t(slot) * (k.maxC + 1);
  const int M = k.n_chunks[sh_], NG = k.n_coarse[sh_];
  const int L = a.kv_len[b];
  LC_TRACE(0);
  const int n2max = pow2_at_least(k.maxF);
  (void)n2max;
  char* smem_b = reinterpret_cast<char*>(smem_u64);
  unsigned long long* keys = smem_u64;                                  // [pow2(maxF)]
  int32_t* cand = reinterpret_cast<int32_t*>(smem_b + k.off_cand);     // [maxF]
  int32_t* flat = reinterpret_cast<int32_t*>(smem_b + k.off_flat);     // [maxC]
  float* q = reinterpret_cast<float*>(smem_b + k.off_q);               // [G][D]
  int16_t* lens = reinterpret_cast<int16_t*>(smem_b + k.off_lens);     // [maxC]
  uint8_t* flag = reinterpret_cast<uint8_t*>(smem_b + k.off_flag);     // [maxC] chosen chunks
  __shared__ float qn[64], gscore[64];
  __shared__ int gorder[64], goff[65], keep[64], gtok[64], gfirst[65];
  __shared__ int sh[33];
  __shared__ int s_nsel, s_minlen;
  __shared__ unsigned long long selk[256];  // chosen chunk ids (sorted for the output)

  for (int e = t; e < G * D; e += blockDim.x)
    q[e] = __bfloat162float(a.q[(int64_t(b) * a.Hq + h * G) * D + e]);
  if (t < NG) {
    gtok[t] = k.gtok[int64_t(sh_) * k.maxG + t];
    keep[t] = 0;
  }
  if (t <= NG) gfirst[t] = k.gfirst[int64_t(sh_) * (k.maxG + 1) + t];
  for (int c = t; c < M; c += blockDim.x) flag[c] = 0;
  if (t == 0) {
    s_nsel = 0;
    s_minlen = 1 << 30;
  }
  __syncthreads();
  for (int g = w; g < G; g += nw) {
    float v[kMaxDPL];
#pragma unroll
    for (int j = 0; j < kMaxDPL; ++j) v[j] = lane + 32 * j < D ? q[g * D + lane + 32 * j] : 0.f;
    const double s = warp_seq_sumsq<kMaxDPL>(v, D);
    if (lane == 0) qn[g] = __double2float_rn(sqrt(s));
  }
  __syncthreads();
    LC_TRACE(1);
  // Bound of one node aggregated (max) over the group, one thread per node: q_g . c summed
  // in d order with __fmul_rn / __fadd_rn (the CPU's dot(), no FMA) plus |q_g| * r, so the
  // scores are bit-identical to ClusterIndex::search's.
  auto bound = [&](const __half* cen, float r) {
    float best = -INFINITY;
    for (int g0 = 0; g0 < G; g0 += 4) {
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
      for (int d0 = 0; d0 < D; d0 += 8) {
        const uint4 raw = *reinterpret_cast<const uint4*>(cen + d0);
        const __half* hv = reinterpret_cast<const __half*>(&raw);
        float c[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) c[j] = __half2float(hv[j]);
#pragma unroll
        for (int gg = 0; gg < 4; ++gg) {
          if (g0 + gg < G) {
            const float* qg = q + (g0 + gg) * D + d0;
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[gg] = __fadd_rn(acc[gg], __fmul_rn(qg[j], c[j]));
          }
        }
      }
#pragma unroll
      for (int gg = 0; gg < 4; ++gg)
        if (g0 + gg < G) best = fmaxf(best, __fadd_rn(acc[gg], __fmul_rn(qn[g0 + gg], r)));
    }
    return best;
  };
  const bool run = M > 0 && a.budget > 0 && NG > 0;
  if (run) {
    // One thread per node (a staged-rows variant measured slower: the sequential dot chain
    // dominates, and tiles of staged rows serialize it).
    for (int g = t; g < NG; g += blockDim.x)
      gscore[g] = bound(k.gc + (int64_t(sh_) * k.maxG + g) * D, k.gr[int64_t(sh_) * k.maxG + g]);
    __syncthreads();
    if (t < NG) {
      const float x = gscore[t];
      int r = 0;
      for (int u = 0; u < NG; ++u) {
        const float y = gscore[u];
        const bool nx = x != x, ny = y != y;
        const bool before = (nx != ny) ? nx : (nx ? u < t : (y > x || (y == x && u < t)));
        r += before;
      }
      gorder[r] = t;
    }
    __syncthreads();
    if (t == 0) {
      int kg = NG;
      if (a.coarse_topk > 0) {
        kg = min(NG, a.coarse_topk);
      } else {
        const double want = a.coarse_cover * double(a.budget);
        double have = 0;
        for (kg = 0; kg < NG && have < want; ++kg) have += double(gtok[gorder[kg]]);
      }
      for (int j = 0; j < kg; ++j) keep[gorder[j]] = 1;
      int o = 0;
      for (int g = 0; g < NG; ++g) {
        goff[g] = o;
        if (keep[g]) o += gfirst[g + 1] - gfirst[g];
      }
      goff[NG] = o;
    }
    __syncthreads();
    const int nc = goff[NG];
    for (int g = w; g < NG; g += nw)
      if (keep[g])
        for (int f = gfirst[g] + lane; f < gfirst[g + 1]; f += 32) cand[goff[g] + f - gfirst[g]] = f;
    __syncthreads();
    LC_TRACE(2);
    const int n2 = pow2_at_least(max(nc, 1));
    for (int j = t; j < n2; j += blockDim.x) {
      unsigned long long key = ~0ull;
      if (j < nc) {
        const int f = cand[j];
        const float sc = bound(k.fc + (int64_t(sh_) * k.maxF + f) * D, k.fr[int64_t(sh_) * k.maxF + f]);
        key = (static_cast<unsigned long long>(~okey(sc)) << 32) | unsigned(j);
      }
      keys[j] = key;
    }
    __syncthreads();
    LC_TRACE(3);
    if (nc <= int(blockDim.x)) {
      // Rank by counting (keys are distinct): few candidates, one pass over shared memory.
      const unsigned long long my = t < nc ? keys[t] : 0ull;
      int r = 0;
      if (t < nc)
        for (int i = 0; i < nc; ++i) r += keys[i] < my;
      __syncthreads();
      if (t < nc) keys[r] = my;
      __syncthreads();
    } else {
      block_bitonic(keys, n2);
    }
    LC_TRACE(4);
    // Flatten: chunks of the ranked clusters, in rank order, each list in position order.
    int base = 0;
    for (int j0 = 0; j0 < nc; j0 += blockDim.x) {
      const int j = j0 + t;
      const int f = j < nc ? cand[int(keys[j] & 0xffffffffu)] : -1;
      const int cntj = f >= 0 ? k.fnch[int64_t(sh_) * k.maxF + f] : 0;
      int tot = 0;
      const int off = block_excl_scan(cntj, sh, tot) + base;
      if (f >= 0) {
        int c = k.fhead[int64_t(sh_) * k.maxF + f];
        for (int i = 0; i < cntj && c >= 0; ++i) {
          flat[off + i] = c;
          lens[off + i] = int16_t(starts[c + 1] - starts[c]);
          c = k.cnext[int64_t(sh_) * k.maxC + c];
        }
      }
      base += tot;
    }
    __syncthreads();
    LC_TRACE(5);
    const int nflat = base;
    // Greedy fill: the prefix whose running sum fits the budget is taken as is (a chunk is
    // never skipped before the first one that does not fit); the rest sequentially from
    // i0, stopping once `left` is below the shortest remaining chunk.
    int carry = 0, i0 = nflat;
    for (int j0 = 0; j0 < nflat; j0 += blockDim.x) {
      const int j = j0 + t;
      const int len = j < nflat ? lens[j] : 0;
      int tot = 0;
      const int ex = block_excl_scan(len, sh, tot) + carry;
      const bool fits = j < nflat && int64_t(ex) + len <= a.budget;
      if (fits) {
        flag[flat[j]] = 1;
        const int r = atomicAdd(&s_nsel, 1);
        if (r < 256) selk[r] = static_cast<unsigned long long>(flat[j]);
      }
      const int nfit = __syncthreads_count(fits);
      carry += tot;
      if (nfit < min(int(blockDim.x), nflat - j0)) {
        i0 = j0 + nfit;
        break;
      }
    }
    int used = 0;
    {
      int part = 0, mn = 1 << 30;
      for (int j = t; j < nflat; j += blockDim.x) {
        if (j < i0) part += lens[j];
        else mn = min(mn, int(lens[j]));
      }
      int tot = 0;
      block_excl_scan(part, sh, tot);
      used = tot;
      if (mn < (1 << 30)) atomicMin(&s_minlen, mn);
    }
    __syncthreads();
    if (t == 0) {
      int64_t left = a.budget - used;
      const int mn = s_minlen;
      for (int j = i0; j < nflat && left >= mn; ++j)
        if (lens[j] <= left) {
          flag[flat[j]] = 1;
          if (s_nsel < 256) selk[s_nsel] = static_cast<unsigned long long>(flat[j]);
          ++s_nsel;
          left -= lens[j];
        }
    }
    __syncthreads();
    LC_TRACE(6);
  }
  // Emit: sink, chosen chunks ascending, tail.
  int32_t* out = a.lists + int64_t(b * k.Hkv + h) * a.cap;
  const int sink = min(a.sink, L);
  for (int p = t; p < sink && p < a.cap; p += blockDim.x) out[p] = p;
  int pos = sink;
  const int nsel = s_nsel;
  if (nsel > 0 && nsel <= 256) {
    // Few chunks (<= 256; budget / 8-token chunks): sort their ids, scan their lengths.
    // Rank by counting (chunk ids are distinct) into flat (free now; >= 256 entries).
    if (t < nsel) {
      const unsigned long long my = selk[t];
      int r = 0;
      for (int i = 0; i < nsel; ++i) r += selk[i] < my;
      flat[r] = int(my);
    }
    __syncthreads();
    const int c = t < nsel ? flat[t] : -1;
    const int len = c >= 0 ? starts[c + 1] - starts[c] : 0;
    int tot = 0;
    const int off = block_excl_scan(len, sh, tot) + pos;
    for (int i = 0; i < len; ++i)
      if (off + i < a.cap) out[off + i] = starts[c] + i;
    pos += tot;
  } else if (nsel > 256) {
    // Many chunks: scan all M chunks in position order over the chosen flags.
    for (int c0 = 0; c0 < M; c0 += blockDim.x) {
      const int c = c0 + t;
      const int len = (c < M && flag[c]) ? starts[c + 1] - starts[c] : 0;
      int tot = 0;
      const int off = block_excl_scan(len, sh, tot) + pos;
      for (int i = 0; i < len; ++i)
        if (off + i < a.cap) out[off + i] = starts[c] + i;
      pos += tot;
    }
  }
  const int rb = M > 0 ? starts[M] : sink;
  const int tb = max(rb, sink);
  for (int p = tb + t; p < L; p += blockDim.x)
    if (pos + p - tb < a.cap) out[pos + p - tb] = p;
  if (t == 0) {
    const int total = pos + max(0, L - tb);
    a.counts[b * k.Hkv + h] = min(total, a.cap);
    if (a.trace) a.trace[(int64_t(b) * k.Hkv + h) * 8 + 7] = global_ns();
    if (a.chosen) a.chosen[b * k.Hkv + h] = pos - sink;
  }
}

// lc_compact_kernel: strided lists -> CSR. CTA per list: its offset = sum of the earlier
//   counts (block reduction over <= n_lists ints), then a coalesced copy (4 B read + 4 B
//   written per entry); the last CTA writes off[n].
__global__ void lc_compact_kernel(const int32_t* lists, const int32_t* counts, int n, int cap,
                                  int32_t* off, int32_t* idx) {
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

template <typename T>
void launch_dpl(int D, T&& f) {
  if (D <= 64) f(std::integral_constant<int, 2>{});
  else if (D <= 128) f(std::integral_constant<int, 4>{});
  else f(std::integral_constant<int, 8>{});
}

}  // namespace

LcIndexGpu::LcIndexGpu(DeviceArena& arena, const LcIndexConfig& cfg) : cfg_(cfg) {
  SPADE_CHECK(cfg.D % 32 == 0 && cfg.D <= 256, "LcIndexGpu: D must be a multiple of 32, <= 256");
  SPADE_CHECK(cfg.max_chunks >= 1 && cfg.max_chunks <= 16384, "LcIndexGpu: max_chunks in [1, 16384]");
  SPADE_CHECK(cfg.max_coarse >= 1 && cfg.max_coarse <= 64, "LcIndexGpu: max_coarse in [1, 64]");
  SPADE_CHECK(cfg.chunks_per_fine > 0 && cfg.slots >= 1 && cfg.Hkv >= 1, "LcIndexGpu: bad config");
  const int S = cfg.slots, H = cfg.Hkv, D = cfg.D, C = cfg.max_chunks, G = cfg.max_coarse;
  max_fine_ = int(std::ceil(double(C) / cfg.chunks_per_fine));
  const int F = max_fine_;
  const size_t used0 = arena.used();
  const size_t SH = size_t(S) * H;
  starts_ = arena.alloc_n<int32_t>(size_t(S) * (C + 1), "lc starts");
  n_chunks_ = arena.alloc_n<int32_t>(SH, "lc n_chunks");
  n_fine_ = arena.alloc_n<int32_t>(SH, "lc n_fine");
  n_coarse_ = arena.alloc_n<int32_t>(SH, "lc n_coarse");
  fc_ = arena.alloc_n<__half>(SH * F * D, "lc fine centers");
  fr_ = arena.alloc_n<float>(SH * F, "lc fine radii");
  ftok_ = arena.alloc_n<int32_t>(SH * F, "lc fine tokens");
  fcnt_ = arena.alloc_n<int32_t>(SH * F, "lc fine counts");
  fhead_ = arena.alloc_n<int32_t>(SH * F, "lc fine heads");
  ftail_ = arena.alloc_n<int32_t>(SH * F, "lc fine tails");
  fnch_ = arena.alloc_n<int32_t>(SH * F, "lc fine chunk counts");
  gc_ = arena.alloc_n<__half>(SH * G * D, "lc coarse centers");
  gr_ = arena.alloc_n<float>(SH * G, "lc coarse radii");
  gtok_ = arena.alloc_n<int32_t>(SH * G, "lc coarse tokens");
  gcnt_ = arena.alloc_n<int32_t>(SH * G, "lc coarse counts");
  gfirst_ = arena.alloc_n<int32_t>(SH * (G + 1), "lc coarse first");
  cnext_ = arena.alloc_n<int32_t>(SH * C, "lc chunk next");
  cfine_ = arena.alloc_n<int32_t>(SH * C, "lc chunk fine");
  X_ = arena.alloc_n<float>(size_t(H) * C * D, "lc chunk keys");
  mean_ = arena.alloc_n<double>(size_t(H) * C * D, "lc chunk means");
  C_ = arena.alloc_n<float>(size_t(H) * F * D, "lc kmeans centroids");
  FC_ = arena.alloc_n<float>(size_t(H) * F * D, "lc fine centroids");
  GC_ = arena.alloc_n<float>(size_t(H) * G * D, "lc coarse centroids");
  sum_ = arena.alloc_n<double>(size_t(H) * F * D, "lc kmeans sums");
  acc_ = arena.alloc_n<double>(size_t(H) * (F + G) * D, "lc center acc");
  rad2_ = arena.alloc_n<unsigned long long>(size_t(H) * (F + G), "lc radii acc");
  cnt_ = arena.alloc_n<int32_t>(size_t(H) * F, "lc kmeans counts");
  assign_ = arena.alloc_n<int32_t>(size_t(H) * C, "lc assign");
  fassign_ = arena.alloc_n<int32_t>(size_t(H) * C, "lc fine assign");
  gassign_ = arena.alloc_n<int32_t>(size_t(H) * C, "lc coarse assign");
  remap_ = arena.alloc_n<int32_t>(size_t(H) * F, "lc remap");
  newid_ = arena.alloc_n<int32_t>(size_t(H) * F, "lc new ids");
  gof_ = arena.alloc_n<int32_t>(size_t(H) * F, "lc coarse of fine");
  best_ = arena.alloc_n<float>(size_t(H) * C, "lc best sim");
  ctl_ = arena.alloc_n<int32_t>(size_t(2) * H * 8, "lc kmeans control");
  bytes_ = arena.used() - used0;
  SPADE_CUDA(cudaMemset(n_chunks_, 0, SH * sizeof(int32_t)));
  SPADE_CUDA(cudaMemset(n_fine_, 0, SH * sizeof(int32_t)));
  SPADE_CUDA(cudaMemset(n_coarse_, 0, SH * sizeof(int32_t)));
  sort_cap_ = pow2_at_least(C);
  const int big = int(std::min<size_t>(size_t(sort_cap_) * 8, 200 * 1024));
  SPADE_CUDA(cudaFuncSetAttribute(km_reseed_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, big));
  SPADE_CUDA(cudaFuncSetAttribute(lc_renumber_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, big));
  SPADE_CUDA(cudaFuncSetAttribute(lc_lists_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, big));
}

namespace {
void run_kmeans(const KmArgs& a, int H, int maxN, int maxK, int iterations, int D, cudaStream_t s) {
  const dim3 gN((maxN + 255) / 256, H), gK(maxK, H), gA((maxN + kAP - 1) / kAP, H);
  const dim3 gNd(unsigned((int64_t(maxN) * D + 255) / 256), H);
  const size_t sortb = size_t(pow2_at_least(maxN)) * 8;
  km_init_kernel<<<gN, 256, 0, s>>>(a);
  km_seed_kernel<<<gK, 32, 0, s>>>(a);
  km_assign_kernel<<<gA, 256, 0, s>>>(a, 0);
  SPADE_CUDA_LAUNCH();
  launch_dpl(D, [&](auto dpl) {
    for (int it = 0; it < iterations; ++it) {
      SPADE_CUDA(cudaMemsetAsync(a.sum, 0, sizeof(double) * size_t(H) * a.ldC, s));
      SPADE_CUDA(cudaMemsetAsync(a.cnt, 0, sizeof(int) * size_t(H) * a.ldK, s));
      km_accum_kernel<<<gNd, 256, 0, s>>>(a, 0);
      km_normalize_kernel<decltype(dpl)::value><<<gK, 32, 0, s>>>(a, nullptr, 0);
      km_reseed_kernel<<<H, 1024, sortb, s>>>(a);
      km_assign_kernel<<<gA, 256, 0, s>>>(a, 0);
      km_control_kernel<<<1, 32, 0, s>>>(a.ctl, H);
    }
    SPADE_CUDA(cudaMemsetAsync(a.sum, 0, sizeof(double) * size_t(H) * a.ldC, s));
    SPADE_CUDA(cudaMemsetAsync(a.cnt, 0, sizeof(int) * size_t(H) * a.ldK, s));
    km_accum_kernel<<<gNd, 256, 0, s>>>(a, 1);
  });
  SPADE_CUDA_LAUNCH();
}
}  // namespace

void LcIndexGpu::build(int slot, const bf16* k_cache, const int32_t* page_table,
                       const int32_t* starts, int M, cudaStream_t s) {
  SPADE_CHECK(slot >= 0 && slot < cfg_.slots, "LcIndexGpu::build: bad slot");
  SPADE_CHECK(M >= 1 && M <= cfg_.max_chunks, "LcIndexGpu::build: chunks ", M, " not in [1, ",
              cfg_.max_chunks, "]");
  const int H = cfg_.Hkv, D = cfg_.D, C = cfg_.max_chunks, F = max_fine_, G = cfg_.max_coarse;
  int32_t* st = starts_ + int64_t(slot) * (C + 1);
  SPADE_CUDA(cudaMemcpyAsync(st, starts, sizeof(int32_t) * (M + 1), cudaMemcpyHostToDevice, s));
  auto mark = [&](int i) {
    if (timing_) SPADE_CUDA(cudaEventRecord(ev_[i], s));
  };
  mark(0);
  const int64_t ld = int64_t(C) * D;
  launch_dpl(D, [&](auto dpl) {
    lc_pool_kernel<decltype(dpl)::value><<<(M * H + 3) / 4, 128, 0, s>>>(
        k_cache, page_table, st, M, H, cfg_.P, D, ld, mean_, X_);
  });
  SPADE_CUDA_LAUNCH();
  mark(1);
  // Fine level.
  const int K = int(std::clamp<double>(std::ceil(double(M) / cfg_.chunks_per_fine), 1.0, double(M)));
  std::vector<int32_t> ctl(size_t(2) * H * 8, 0);
  for (int h = 0; h < H; ++h) {
    ctl[size_t(h) * 8 + 0] = M;
    ctl[size_t(h) * 8 + 1] = K;
  }
  SPADE_CUDA(cudaMemcpyAsync(ctl_, ctl.data(), sizeof(int32_t) * ctl.size(), cudaMemcpyHostToDevice, s));
  KmArgs fa{X_, ld, C_, int64_t(F) * D, sum_, cnt_, F, fassign_, best_, C, ctl_, FC_, int64_t(F) * D, D};
  run_kmeans(fa, H, M, K, cfg_.iterations, D, s);
  launch_dpl(D, [&](auto dpl) {
    km_remap_kernel<<<H, 1024, 0, s>>>(fa, remap_);
    km_normalize_kernel<decltype(dpl)::value><<<dim3(K, H), 32, 0, s>>>(fa, remap_, 1);
    km_apply_remap_kernel<<<dim3((M + 255) / 256, H), 256, 0, s>>>(fa, remap_);
  });
  mark(2);
  // Coarse level over the fine centroids.
  int* ctlG = ctl_ + H * 8;
  lc_coarse_params_kernel<<<1, 32 * ((H + 31) / 32), 0, s>>>(ctl_, ctlG, H, cfg_.max_coarse);
  KmArgs ga{FC_, int64_t(F) * D, C_, int64_t(F) * D, sum_, cnt_, F, gassign_, best_, C, ctlG, GC_, int64_t(G) * D, D};
  const int maxP = std::min(cfg_.max_coarse, int(std::ceil(std::sqrt(double(K)))));
  run_kmeans(ga, H, K, std::max(1, maxP), cfg_.iterations, D, s);
  launch_dpl(D, [&](auto dpl) {
    km_remap_kernel<<<H, 1024, 0, s>>>(ga, remap_);
    km_normalize_kernel<decltype(dpl)::value><<<dim3(std::max(1, maxP), H), 32, 0, s>>>(ga, remap_, 1);
    km_apply_remap_kernel<<<dim3((K + 255) / 256, H), 256, 0, s>>>(ga, remap_);
  });
  SPADE_CUDA_LAUNCH();
  mark(3);
  // Assembly.
  const int64_t so = int64_t(slot) * H;
  SlotPtrs sp{st, n_chunks_ + so, n_fine_ + so, n_coarse_ + so, fc_ + so * F * D, fr_ + so * F,
              ftok_ + so * F, fcnt_ + so * F, fhead_ + so * F, ftail_ + so * F, fnch_ + so * F,
              gc_ + so * G * D, gr_ + so * G, gtok_ + so * G, gcnt_ + so * G,
              gfirst_ + so * (G + 1), cnext_ + so * C, cfine_ + so * C, F, G, C, D, H, cfg_.P};
  lc_renumber_kernel<<<H, 1024, size_t(pow2_at_least(K)) * 8, s>>>(sp, ctl_, ctlG, gassign_, C, newid_, gof_);
  lc_lists_kernel<<<H, 1024, size_t(pow2_at_least(M)) * 8, s>>>(sp, M, fassign_, C, newid_);
  SPADE_CUDA_LAUNCH();
  SPADE_CUDA(cudaMemsetAsync(acc_, 0, sizeof(double) * size_t(H) * (F + G) * D, s));
  SPADE_CUDA(cudaMemsetAsync(rad2_, 0, sizeof(unsigned long long) * size_t(H) * (F + G), s));
  SPADE_CUDA(cudaMemsetAsync(sp.ftok, 0, sizeof(int32_t) * size_t(H) * F, s));
  SPADE_CUDA(cudaMemsetAsync(sp.fcnt, 0, sizeof(int32_t) * size_t(H) * F, s));
  SPADE_CUDA(cudaMemsetAsync(sp.gtok, 0, sizeof(int32_t) * size_t(H) * G, s));
  SPADE_CUDA(cudaMemsetAsync(sp.gcnt, 0, sizeof(int32_t) * size_t(H) * G, s));
  lc_center_accum_kernel<<<dim3(unsigned((int64_t(M) * D + 255) / 256), H), 256, 0, s>>>(sp, M, mean_, ld, gof_, acc_);
  lc_center_final_kernel<<<dim3(unsigned((int64_t(F + G) * D + 255) / 256), H), 256, 0, s>>>(sp, acc_);
  lc_radius_kernel<<<(M * H + 3) / 4, 128, 0, s>>>(sp, M, k_cache, page_table, gof_, rad2_);
  lc_radius_final_kernel<<<dim3((F + G + 255) / 256, H), 256, 0, s>>>(sp, rad2_);
  SPADE_CUDA_LAUNCH();
  mark(4);
}

void LcIndexGpu::set_build_timing(bool on) {
  if (on && !ev_[0])
    for (auto& e : ev_) SPADE_CUDA(cudaEventCreate(&e));
  timing_ = on;
}

std::vector<float> LcIndexGpu::build_phase_ms() const {
  std::vector<float> r;
  if (!ev_[0]) return r;
  SPADE_CUDA(cudaEventSynchronize(ev_[4]));
  for (int i = 0; i < 4; ++i) {
    float ms = 0;
    SPADE_CUDA(cudaEventElapsedTime(&ms, ev_[i], ev_[i + 1]));
    r.push_back(ms);
  }
  return r;
}

void LcIndexGpu::insert(int slot, const bf16* k_cache, const int32_t* page_table, int n_old,
                        const int32_t* new_ends, int n_new, cudaStream_t s) {
  insert_batch({LcInsert{slot, page_table, n_old, new_ends, n_new}}, k_cache, s);
}

void LcIndexGpu::insert_batch(const std::vector<LcInsert>& reqs, const bf16* k_cache, cudaStream_t s) {
  const int H = cfg_.Hkv, C = cfg_.max_chunks;
  std::vector<uint8_t> seen(size_t(cfg_.slots), 0);
  for (const auto& r : reqs) {
    SPADE_CHECK(r.slot >= 0 && r.slot < cfg_.slots, "LcIndexGpu::insert: bad slot");
    SPADE_CHECK(!seen[size_t(r.slot)], "LcIndexGpu::insert_batch: slot ", r.slot, " twice");
    seen[size_t(r.slot)] = 1;
    SPADE_CHECK(r.n_old >= 1 && r.n_old + r.n_new <= C, "LcIndexGpu::insert: chunk count out of range");
  }
  const SlotPtrs z{starts_, n_chunks_, n_fine_, n_coarse_, fc_, fr_, ftok_, fcnt_, fhead_, ftail_, fnch_,
                   gc_, gr_, gtok_, gcnt_, gfirst_, cnext_, cfine_, max_fine_, cfg_.max_coarse, C,
                   cfg_.D, H, cfg_.P};
  // Rounds of <= kMax chunks per request, <= kReq requests per launch.
  for (int done = 0;; done += InsertReq::kMax) {
    InsertBatch ib{};
    int n = 0;
    auto flush = [&] {
      if (n) lc_insert_kernel<<<dim3(H, n), kInsThreads, 0, s>>>(z, k_cache, ib);
      n = 0;
    };
    bool any = false;
    for (const auto& r : reqs) {
      if (r.n_new <= done) continue;
      any = true;
      InsertReq& q = ib.r[n++];
      q.slot = r.slot;
      q.n_old = r.n_old + done;
      q.n_new = std::min(InsertReq::kMax, r.n_new - done);
      q.pt = r.page_table;
      for (int i = 0; i < q.n_new; ++i) q.ends[i] = r.new_ends[done + i];
      if (n == InsertBatch::kReq) flush();
    }
    flush();
    if (!any) break;
  }
  SPADE_CUDA_LAUNCH();
}

void LcIndexGpu::search(const LcSearchArgs& a, cudaStream_t s) const {
  SPADE_CHECK(a.Hq % cfg_.Hkv == 0 && a.Hq / cfg_.Hkv <= 64, "LcIndexGpu::search: bad Hq");
  SearchK k{a, starts_, n_chunks_, n_fine_, n_coarse_, fc_, gc_, fr_, gr_, gtok_, gfirst_,
            fhead_, fnch_, cnext_, max_fine_, cfg_.max_coarse, cfg_.max_chunks, cfg_.D, cfg_.Hkv};
  const int G = a.Hq / cfg_.Hkv;
  const size_t smem = search_smem_layout(k, G);
  static size_t set_bytes = 0;
  if (smem > 48 * 1024 && smem > set_bytes) {
    SPADE_CUDA(cudaFuncSetAttribute(lc_search_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    set_bytes = smem;
  }
  lc_search_kernel<<<dim3(cfg_.Hkv, a.B), kSearchThreads, smem, s>>>(k);
  SPADE_CUDA_LAUNCH();
}

void LcIndexGpu::compact(const int32_t* lists, const int32_t* counts, int n_lists, int cap,
                         int32_t* sel_off, int32_t* sel_idx, cudaStream_t s) {
  lc_compact_kernel<<<n_lists, 256, 0, s>>>(lists, counts, n_lists, cap, sel_off, sel_idx);
  SPADE_CUDA_LAUNCH();
}

LcIndexGpu::Host LcIndexGpu::download(int slot, int h) const {
  const int H = cfg_.Hkv, D = cfg_.D, C = cfg_.max_chunks, F = max_fine_, G = cfg_.max_coarse;
  const int64_t sh = int64_t(slot) * H + h;
  SPADE_CUDA(cudaDeviceSynchronize());
  Host o;
  auto get = [](const auto* p, size_t n) {
    std::vector<std::remove_const_t<std::remove_pointer_t<decltype(p)>>> v(n);
    if (n) SPADE_CUDA(cudaMemcpy(v.data(), p, n * sizeof(*p), cudaMemcpyDeviceToHost));
    return v;
  };
  o.n_chunks = get(n_chunks_ + sh, 1)[0];
  o.n_fine = get(n_fine_ + sh, 1)[0];
  o.n_coarse = get(n_coarse_ + sh, 1)[0];
  auto h2f = [](const std::vector<__half>& v) {
    std::vector<float> r(v.size());
    for (size_t i = 0; i < v.size(); ++i) r[i] = __half2float(v[i]);
    return r;
  };
  o.fine_c = h2f(get(fc_ + sh * F * D, size_t(o.n_fine) * D));
  o.coarse_c = h2f(get(gc_ + sh * G * D, size_t(o.n_coarse) * D));
  o.fine_r = get(fr_ + sh * F, size_t(o.n_fine));
  o.coarse_r = get(gr_ + sh * G, size_t(o.n_coarse));
  o.fine_tokens = get(ftok_ + sh * F, size_t(o.n_fine));
  o.fine_count = get(fcnt_ + sh * F, size_t(o.n_fine));
  o.coarse_tokens = get(gtok_ + sh * G, size_t(o.n_coarse));
  o.coarse_count = get(gcnt_ + sh * G, size_t(o.n_coarse));
  o.coarse_first = get(gfirst_ + sh * (G + 1), size_t(o.n_coarse) + 1);
  o.fine_of = get(cfine_ + sh * C, size_t(o.n_chunks));
  const auto head = get(fhead_ + sh * F, size_t(o.n_fine));
  const auto next = get(cnext_ + sh * C, size_t(o.n_chunks));
  o.fine_chunks.resize(size_t(o.n_fine));
  for (int f = 0; f < o.n_fine; ++f)
    for (int32_t c = head[size_t(f)]; c >= 0 && o.fine_chunks[size_t(f)].size() <= size_t(o.n_chunks); c = next[size_t(c)])
      o.fine_chunks[size_t(f)].push_back(c);
  return o;
}

}  // namespace spade::cuda
