// LycheeCluster GPU index, build: chunk pooling, batched spherical k-means (kernels and
// run_kmeans), assembly (fine renumbering, per-fine chunk lists, centers, covering radii),
// LcIndexGpu::build and its phase timing. Numerics: the comment atop cluster_index.cu.
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "backend/cuda/cluster_index_common.cuh"

namespace spade::cuda {
using namespace lc_detail;
namespace {

// ---------------------------------------------------------------------------------------
// lc_pool_kernel: chunk mean pooling + normalization.
//   reads  K rows of the chunk's tokens: [page][Hkv][P][D] bf16 via the page table (2*D B per
//          token-head, each read once)
//   writes mean[h][c][D] double (8*D B), X[h][c][D] fp32 unit chunk key (4*D B)
//   one warp per (chunk, head) of group blockIdx.y; lane owns d = lane + 32 j; tokens summed in
//   position order in double (the CPU's pool_chunk), then float(mean) normalized in the CPU's
//   order. Scratch of (group g, head h) at vh = g * Hkv + h.
template <int DPL>
__global__ void lc_pool_kernel(const LcGroupDev* __restrict__ grp, int Hkv, int P, int D,
                               int64_t ld, double* __restrict__ mean, float* __restrict__ X) {
  const LcGroupDev g = grp[blockIdx.y];
  const int wid = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
  if (wid >= g.M * Hkv) return;
  const int c = wid / Hkv, h = wid % Hkv, vh = int(blockIdx.y) * Hkv + h;
  const bf16* __restrict__ k = g.k;
  const int32_t* __restrict__ pt = g.pt;
  const int b = g.starts[c], e = g.starts[c + 1];
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
  double* mo = mean + vh * ld + int64_t(c) * D;
#pragma unroll
  for (int j = 0; j < DPL; ++j) {
    const double m = __dmul_rn(acc[j], inv);
    u[j] = __double2float_rn(m);
    if (lane + 32 * j < D) mo[lane + 32 * j] = m;
  }
  const double s = warp_seq_sumsq<DPL>(u, D);
  const double n = sqrt(s);
  float* xo = X + vh * ld + int64_t(c) * D;
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

// The sort keys of a block-sort kernel's CTA: its dynamic shared memory, or (gkeys non-null:
// pow2(N) * 8 bytes above what the device gives a block) its own gstride keys of gkeys in
// global memory (the same sort: its barriers order global memory within the block too).
__device__ __forceinline__ unsigned long long* sort_keys(unsigned long long* gkeys, int64_t gstride) {
  extern __shared__ unsigned long long sort_smem[];
  return gkeys ? gkeys + int64_t(blockIdx.x) * gstride : sort_smem;
}

// km_reseed_kernel: empty clusters (k ascending) take the worst-fitting points (lowest best
// sim, ties lowest i), each once. CTA per head, 1024 threads; shared: pow2(N) u64 sort keys
// (sort_keys).
__global__ void __launch_bounds__(1024) km_reseed_kernel(KmArgs a, unsigned long long* gkeys,
                                                         int64_t gstride) {
  unsigned long long* keys = sort_keys(gkeys, gstride);
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

// km_control_kernel: active = active && changed; changed = 0. One thread per (group, head).
__global__ void km_control_kernel(int* ctl, int H) {
  const int h = blockIdx.x * blockDim.x + threadIdx.x;
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
  const int h = blockIdx.x * blockDim.x + threadIdx.x;
  if (h >= H) return;
  const int NF = ctlF[h * 8 + 4];
  int P = min(max_coarse, int(ceil(sqrt(double(NF)))));
  P = max(1, min(P, NF));
  ctlG[h * 8 + 0] = NF;
  ctlG[h * 8 + 1] = P;
}

// ---------------------------------------------------------------------------------------
// Assembly (SlotPtrs: cluster_index_common.cuh).

// Assembly kernels: s holds the pointers of slot 0 (a slot's arrays at slot_head()), scratch
// (newid, gof, assignments, accumulators) is per vh = blockIdx of the (group, head).

// lc_renumber_kernel: fine ids sorted stably by coarse unit -> newid, gof, first; n_fine,
//   n_coarse. CTA per (group, head); shared pow2(NF) u64 keys (sort_keys).
__global__ void __launch_bounds__(1024) lc_renumber_kernel(SlotPtrs s, const LcGroupDev* grp,
                                                           const int* ctlF, const int* ctlG,
                                                           const int* gassign, int64_t ldN,
                                                           int* newid, int* gof,
                                                           unsigned long long* gkeys, int64_t gstride) {
  unsigned long long* keys = sort_keys(gkeys, gstride);
  const int h = blockIdx.x;  // vh
  const int64_t sh = slot_head(grp, h, s.Hkv);
  const int NF = ctlF[h * 8 + 4], G = ctlG[h * 8 + 4];
  const int n2 = pow2_at_least(NF);
  for (int i = threadIdx.x; i < n2; i += blockDim.x)
    keys[i] = i < NF ? (static_cast<unsigned long long>(gassign[h * ldN + i]) << 32) | unsigned(i) : ~0ull;
  __syncthreads();
  block_bitonic(keys, n2);
  int* first = s.gfirst + sh * (s.maxG + 1);
  for (int j = threadIdx.x; j < NF; j += blockDim.x) {
    const int g = int(keys[j] >> 32), i = int(keys[j] & 0xffffffffu);
    newid[h * s.maxF + i] = j;
    gof[h * s.maxF + j] = g;
    if (j == 0 || int(keys[j - 1] >> 32) != g) first[g] = j;
  }
  if (threadIdx.x == 0) {
    first[G] = NF;
    s.n_fine[sh] = NF;
    s.n_coarse[sh] = G;
  }
}

// lc_lists_kernel: chunk -> fine (renumbered), per-fine chunk lists in position order
//   (head, tail, next, count). CTA per (group, head); shared pow2(M) u64 keys (fine << 32 |
//   chunk; sort_keys).
__global__ void __launch_bounds__(1024) lc_lists_kernel(SlotPtrs s, const LcGroupDev* grp,
                                                        const int* fassign, int64_t ldN,
                                                        const int* newid, unsigned long long* gkeys,
                                                        int64_t gstride) {
  unsigned long long* keys = sort_keys(gkeys, gstride);
  const int h = blockIdx.x;  // vh
  const int M = grp[h / s.Hkv].M;
  const int64_t sh = slot_head(grp, h, s.Hkv);
  const int64_t fo = sh * s.maxF, co = sh * s.maxC;
  const int NF = s.n_fine[sh];
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
  if (threadIdx.x == 0) s.n_chunks[sh] = M;
}

// lc_center_accum_kernel: acc[node] += mean_c * m_c (double atomics; the CPU adds in chunk
//   order: sums of a few doubles whose order differs round identically to float/fp16 in all
//   but astronomically rare cases; tests compare stored centers exactly), tokens/count += m.
//   thread per (chunk, dim); reads the chunk means (8*D B per chunk-head).
__global__ void lc_center_accum_kernel(SlotPtrs s, const LcGroupDev* grp, const double* mean,
                                       int64_t ldm, const int* gof, double* acc) {
  const int h = blockIdx.y;  // vh
  const LcGroupDev& gr = grp[h / s.Hkv];
  const int64_t sh = slot_head(grp, h, s.Hkv);
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int c = int(e / s.D), d = int(e % s.D);
  if (c >= gr.M) return;
  const int f = s.cfine[sh * s.maxC + c], g = gof[h * s.maxF + f];
  const int m = gr.starts[c + 1] - gr.starts[c];
  const double v = __dmul_rn(mean[h * ldm + int64_t(c) * s.D + d], double(m));
  double* a = acc + int64_t(h) * (s.maxF + s.maxG) * s.D;
  atomicAdd(a + int64_t(f) * s.D + d, v);
  atomicAdd(a + int64_t(s.maxF + g) * s.D + d, v);
  if (d == 0) {
    atomicAdd(s.ftok + sh * s.maxF + f, m);
    atomicAdd(s.fcnt + sh * s.maxF + f, m);
    atomicAdd(s.gtok + sh * s.maxG + g, m);
    atomicAdd(s.gcnt + sh * s.maxG + g, m);
  }
}

// lc_clear_counts_kernel: the token / count counters of every fine and coarse node of each
//   (group, head)'s slot = 0. thread per node.
__global__ void lc_clear_counts_kernel(SlotPtrs s, const LcGroupDev* grp) {
  const int h = blockIdx.y, i = blockIdx.x * blockDim.x + threadIdx.x;
  const int64_t sh = slot_head(grp, h, s.Hkv);
  if (i < s.maxF) s.ftok[sh * s.maxF + i] = 0, s.fcnt[sh * s.maxF + i] = 0;
  if (i < s.maxG) s.gtok[sh * s.maxG + i] = 0, s.gcnt[sh * s.maxG + i] = 0;
}

// lc_store_starts_kernel: each group's staged starts -> its slot's starts (M + 1 entries).
__global__ void lc_store_starts_kernel(SlotPtrs s, const LcGroupDev* grp) {
  const LcGroupDev g = grp[blockIdx.x];
  int32_t* dst = const_cast<int32_t*>(s.starts) + int64_t(g.slot) * (s.maxC + 1);
  for (int i = threadIdx.x; i <= g.M; i += blockDim.x) dst[i] = g.starts[i];
}

// lc_center_final_kernel: center = acc / count (acc * (1 / count), the CPU's order), clamped
//   to +-65000, stored fp16 (2*D B per node). thread per (node, dim) over fine then coarse.
__global__ void lc_center_final_kernel(SlotPtrs s, const LcGroupDev* grp, const double* acc) {
  const int h = blockIdx.y;  // vh
  const int64_t sh = slot_head(grp, h, s.Hkv);
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int node = int(e / s.D), d = int(e % s.D);
  const int NF = s.n_fine[sh], G = s.n_coarse[sh];
  const bool fine = node < NF;
  if (!fine && (node < s.maxF || node - s.maxF >= G)) return;
  const int i = fine ? node : node - s.maxF;
  const int cnt = fine ? s.fcnt[sh * s.maxF + i] : s.gcnt[sh * s.maxG + i];
  const double inv = 1.0 / double(max(1, cnt));
  double v = __dmul_rn(acc[(int64_t(h) * (s.maxF + s.maxG) + node) * s.D + d], inv);
  v = fmin(fmax(v, -65000.0), 65000.0);
  const __half hv = __float2half_rn(__double2float_rn(v));
  if (fine) s.fc[sh * s.maxF * s.D + lc_cen_off(s.maxF, i, d)] = hv;
  else s.gc[sh * s.maxG * s.D + lc_cen_off(s.maxG, i, d)] = hv;
}

// Sequential double distance |k - c| (d ascending, the CPU's dist()); c = node n of the
// piece-major center block `blk` of maxN nodes.
__device__ double seq_dist_bf16(const bf16* k, const __half* blk, int maxN, int n, int D) {
  double s = 0.0;
  for (int d = 0; d < D; ++d) {
    const double t = __dsub_rn(double(__bfloat162float(k[d])), double(__half2float(blk[lc_cen_off(maxN, n, d)])));
    s = __dadd_rn(s, __dmul_rn(t, t));
  }
  return sqrt(s);
}

// lc_radius_kernel: max distance of every token of each node's chunks to the stored center
//   (double, sequential over d), as u64 bits (non-negative doubles order as integers).
//   warp per (chunk, head) of group blockIdx.y, lane per token; reads 2*D B of K per
//   token-head + fp16 centers.
__global__ void lc_radius_kernel(SlotPtrs s, const LcGroupDev* grp, const int* gof,
                                 unsigned long long* rad) {
  const LcGroupDev gr = grp[blockIdx.y];
  const int wid = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
  if (wid >= gr.M * s.Hkv) return;
  const int c = wid / s.Hkv, hk = wid % s.Hkv, h = int(blockIdx.y) * s.Hkv + hk;  // h: vh
  const int64_t sh = int64_t(gr.slot) * s.Hkv + hk;
  const int f = s.cfine[sh * s.maxC + c], g = gof[h * s.maxF + f];
  const __half* fblk = s.fc + sh * s.maxF * s.D;
  const __half* gblk = s.gc + sh * s.maxG * s.D;
  double rf = 0.0, rg = 0.0;
  for (int p = gr.starts[c] + lane; p < gr.starts[c + 1]; p += 32) {
    const bf16* row = key_row(gr.k, gr.pt, p, hk, s.Hkv, s.P, s.D);
    rf = fmax(rf, seq_dist_bf16(row, fblk, s.maxF, f, s.D));
    rg = fmax(rg, seq_dist_bf16(row, gblk, s.maxG, g, s.D));
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
__global__ void lc_radius_final_kernel(SlotPtrs s, const LcGroupDev* grp, const unsigned long long* rad) {
  const int h = blockIdx.y, node = blockIdx.x * blockDim.x + threadIdx.x;  // h: vh
  const int64_t sh = slot_head(grp, h, s.Hkv);
  const int NF = s.n_fine[sh], G = s.n_coarse[sh];
  const double r = __longlong_as_double(static_cast<long long>(rad[int64_t(h) * (s.maxF + s.maxG) + node]));
  if (node < NF) s.fr[sh * s.maxF + node] = round_up_f(r);
  else if (node >= s.maxF && node - s.maxF < G) s.gr[sh * s.maxG + node - s.maxF] = round_up_f(r);
}

template <typename T>
void launch_dpl(int D, T&& f) {
  if (D <= 64) f(std::integral_constant<int, 2>{});
  else if (D <= 128) f(std::integral_constant<int, 4>{});
  else f(std::integral_constant<int, 8>{});
}

}  // namespace

namespace lc_detail {
size_t build_sort_smem_limit() { return std::min<size_t>(200 * 1024, smem_optin_bytes() - 1024); }
void set_build_sort_smem(int bytes) {
  set_max_dynamic_smem(km_reseed_kernel, bytes);
  set_max_dynamic_smem(lc_renumber_kernel, bytes);
  set_max_dynamic_smem(lc_lists_kernel, bytes);
}
}  // namespace lc_detail

namespace {
// Keys of a block sort over n entries: dynamic shared memory where pow2(n) keys fit the device's
// block (build_sort_smem_limit), else the CTA's keys of `global` (null smem bytes).
struct SortPlace {
  size_t smem = 0;
  unsigned long long* g = nullptr;
  int64_t stride = 0;
};
// spill (LcIndexConfig::spill_smem, tests): always the global keys.
SortPlace sort_place(int n, unsigned long long* global, int cap, bool spill) {
  const size_t b = size_t(pow2_at_least(n)) * 8;
  if (!spill && b <= build_sort_smem_limit()) return {b, nullptr, 0};
  SPADE_CHECK(global && pow2_at_least(n) <= cap, "LcIndexGpu: a block sort of ", n,
              " keys has no global-memory keys");
  return {0, global, cap};
}

void run_kmeans(const KmArgs& a, int H, int maxN, int maxK, int iterations, int D,
                unsigned long long* gkeys, int gcap, bool spill, cudaStream_t s) {
  const dim3 gN((maxN + 255) / 256, H), gK(maxK, H), gA((maxN + kAP - 1) / kAP, H);
  const dim3 gNd(unsigned((int64_t(maxN) * D + 255) / 256), H);
  const SortPlace sp = sort_place(maxN, gkeys, gcap, spill);
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
      km_reseed_kernel<<<H, 1024, sp.smem, s>>>(a, sp.g, sp.stride);
      km_assign_kernel<<<gA, 256, 0, s>>>(a, 0);
      km_control_kernel<<<(H + 127) / 128, 128, 0, s>>>(a.ctl, H);
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
  build_batch({LcBuild{slot, k_cache, page_table, starts, M}}, s);
}

void LcIndexGpu::build_batch(const std::vector<LcBuild>& builds, cudaStream_t s) {
  const int Hkv = cfg_.Hkv, C = cfg_.max_chunks, SG = build_heads_ / Hkv;
  for (size_t i = 0; i < builds.size(); ++i) {
    const LcBuild& b = builds[i];
    SPADE_CHECK(b.slot >= 0 && b.slot < cfg_.slots, "LcIndexGpu::build: bad slot");
    SPADE_CHECK(b.n_chunks >= 1 && b.n_chunks <= C, "LcIndexGpu::build: chunks ", b.n_chunks,
                " not in [1, ", C, "]");
    for (size_t j = 0; j < i; ++j)
      SPADE_CHECK(builds[j].slot != b.slot, "LcIndexGpu::build_batch: slot ", b.slot, " twice");
  }
  if (builds.empty()) return;
  // Pinned host staging, one region per launch sequence: the previous batch's uploads have
  // read theirs once its event completed (normally long before).
  const size_t n_seq = (builds.size() + size_t(SG) - 1) / size_t(SG);
  const size_t need = n_seq * stage_stride();
  if (stage_ev_) SPADE_CUDA(cudaEventSynchronize(static_cast<cudaEvent_t>(stage_ev_)));
  else SPADE_CUDA(cudaEventCreateWithFlags(reinterpret_cast<cudaEvent_t*>(&stage_ev_), cudaEventDisableTiming));
  if (need > stage_bytes_) {
    if (stage_) SPADE_CUDA(cudaFreeHost(stage_));
    stage_ = nullptr;
    SPADE_CUDA(cudaMallocHost(&stage_, need));
    stage_bytes_ = need;
  }
  for (size_t q = 0; q < n_seq; ++q) {
    const size_t g0 = q * size_t(SG);
    build_group(builds.data() + g0, int(std::min(builds.size() - g0, size_t(SG))),
                static_cast<unsigned char*>(stage_) + q * stage_stride(), s);
  }
  SPADE_CUDA(cudaEventRecord(static_cast<cudaEvent_t>(stage_ev_), s));
}

size_t LcIndexGpu::stage_stride() const {
  const size_t SG = size_t(build_heads_ / cfg_.Hkv);
  return align_up(SG * sizeof(LcGroupDev), 256) + align_up(size_t(2) * build_heads_ * 8 * 4, 256) +
         align_up(SG * size_t(cfg_.max_chunks + 1) * 4, 256);
}

void LcIndexGpu::build_group(const LcBuild* b, int nb, void* host, cudaStream_t s) {
  const int Hkv = cfg_.Hkv, H = nb * Hkv, D = cfg_.D, C = cfg_.max_chunks, F = max_fine_,
            G = cfg_.max_coarse;
  const size_t SG = size_t(build_heads_ / Hkv);
  // The group table, the k-means control and the starts (each distinct host array once), in
  // this sequence's pinned region, uploaded async on s.
  auto* grp = static_cast<LcGroupDev*>(host);
  auto* ctl = reinterpret_cast<int32_t*>(static_cast<unsigned char*>(host) + align_up(SG * sizeof(LcGroupDev), 256));
  int32_t* staged = ctl + align_up(size_t(2) * build_heads_ * 8 * 4, 256) / 4;
  size_t n_staged = 0;
  std::fill(ctl, ctl + size_t(2) * H * 8, 0);
  int maxM = 0, maxK = 0, maxP = 1;
  for (int g = 0; g < nb; ++g) {
    const int M = b[g].n_chunks;
    int64_t off = -1;
    for (int e = 0; e < g && off < 0; ++e)  // the layers of one request share their starts
      if (b[e].starts == b[g].starts && b[e].n_chunks == M) off = grp[e].starts - sbuf_;
    if (off < 0) {
      off = int64_t(n_staged);
      std::copy(b[g].starts, b[g].starts + M + 1, staged + n_staged);
      n_staged += size_t(M) + 1;
    }
    grp[g] = LcGroupDev{b[g].k_cache, b[g].page_table, sbuf_ + off, b[g].slot, M};
    const int K = int(std::clamp<double>(std::ceil(double(M) / cfg_.chunks_per_fine), 1.0, double(M)));
    for (int h = 0; h < Hkv; ++h) {
      ctl[size_t(g * Hkv + h) * 8 + 0] = M;
      ctl[size_t(g * Hkv + h) * 8 + 1] = K;
    }
    maxM = std::max(maxM, M);
    maxK = std::max(maxK, K);
    maxP = std::max(maxP, std::min(cfg_.max_coarse, int(std::ceil(std::sqrt(double(K))))));
  }
  auto* grp_dev = static_cast<LcGroupDev*>(grp_);
  SPADE_CUDA(cudaMemcpyAsync(sbuf_, staged, sizeof(int32_t) * n_staged, cudaMemcpyHostToDevice, s));
  SPADE_CUDA(cudaMemcpyAsync(grp_dev, grp, sizeof(LcGroupDev) * size_t(nb), cudaMemcpyHostToDevice, s));
  SPADE_CUDA(cudaMemcpyAsync(ctl_, ctl, sizeof(int32_t) * size_t(2) * H * 8, cudaMemcpyHostToDevice, s));
  const SlotPtrs sp{starts_, n_chunks_, n_fine_, n_coarse_, fc_, fr_, ftok_, fcnt_, fhead_, ftail_, fnch_,
                    gc_, gr_, gtok_, gcnt_, gfirst_, cnext_, cfine_, F, G, C, D, Hkv, cfg_.P};
  lc_store_starts_kernel<<<nb, 256, 0, s>>>(sp, grp_dev);
  auto mark = [&](int i) {
    if (timing_) SPADE_CUDA(cudaEventRecord(ev_[i], s));
  };
  mark(0);
  const int64_t ld = int64_t(C) * D;
  launch_dpl(D, [&](auto dpl) {
    lc_pool_kernel<decltype(dpl)::value><<<dim3((maxM * Hkv + 3) / 4, nb), 128, 0, s>>>(
        grp_dev, Hkv, cfg_.P, D, ld, mean_, X_);
  });
  SPADE_CUDA_LAUNCH();
  mark(1);
  // Fine level.
  KmArgs fa{X_, ld, C_, int64_t(F) * D, sum_, cnt_, F, fassign_, best_, C, ctl_, FC_, int64_t(F) * D, D};
  run_kmeans(fa, H, maxM, maxK, cfg_.iterations, D, sort_keys_, sort_cap_, cfg_.spill_smem, s);
  launch_dpl(D, [&](auto dpl) {
    km_remap_kernel<<<H, 1024, 0, s>>>(fa, remap_);
    km_normalize_kernel<decltype(dpl)::value><<<dim3(maxK, H), 32, 0, s>>>(fa, remap_, 1);
    km_apply_remap_kernel<<<dim3((maxM + 255) / 256, H), 256, 0, s>>>(fa, remap_);
  });
  mark(2);
  // Coarse level over the fine centroids.
  int* ctlG = ctl_ + H * 8;
  lc_coarse_params_kernel<<<(H + 127) / 128, 128, 0, s>>>(ctl_, ctlG, H, cfg_.max_coarse);
  KmArgs ga{FC_, int64_t(F) * D, C_, int64_t(F) * D, sum_, cnt_, F, gassign_, best_, C, ctlG, GC_, int64_t(G) * D, D};
  run_kmeans(ga, H, maxK, maxP, cfg_.iterations, D, sort_keys_, sort_cap_, cfg_.spill_smem, s);
  launch_dpl(D, [&](auto dpl) {
    km_remap_kernel<<<H, 1024, 0, s>>>(ga, remap_);
    km_normalize_kernel<decltype(dpl)::value><<<dim3(maxP, H), 32, 0, s>>>(ga, remap_, 1);
    km_apply_remap_kernel<<<dim3((maxK + 255) / 256, H), 256, 0, s>>>(ga, remap_);
  });
  SPADE_CUDA_LAUNCH();
  mark(3);
  // Assembly.
  const SortPlace pk = sort_place(maxK, sort_keys_, sort_cap_, cfg_.spill_smem),
                  pm = sort_place(maxM, sort_keys_, sort_cap_, cfg_.spill_smem);
  lc_renumber_kernel<<<H, 1024, pk.smem, s>>>(sp, grp_dev, ctl_, ctlG, gassign_, C, newid_, gof_, pk.g, pk.stride);
  lc_lists_kernel<<<H, 1024, pm.smem, s>>>(sp, grp_dev, fassign_, C, newid_, pm.g, pm.stride);
  SPADE_CUDA_LAUNCH();
  SPADE_CUDA(cudaMemsetAsync(acc_, 0, sizeof(double) * size_t(H) * (F + G) * D, s));
  SPADE_CUDA(cudaMemsetAsync(rad2_, 0, sizeof(unsigned long long) * size_t(H) * (F + G), s));
  lc_clear_counts_kernel<<<dim3((std::max(F, G) + 255) / 256, H), 256, 0, s>>>(sp, grp_dev);
  lc_center_accum_kernel<<<dim3(unsigned((int64_t(maxM) * D + 255) / 256), H), 256, 0, s>>>(sp, grp_dev, mean_, ld, gof_, acc_);
  lc_center_final_kernel<<<dim3(unsigned((int64_t(F + G) * D + 255) / 256), H), 256, 0, s>>>(sp, grp_dev, acc_);
  lc_radius_kernel<<<dim3((maxM * Hkv + 3) / 4, nb), 128, 0, s>>>(sp, grp_dev, gof_, rad2_);
  lc_radius_final_kernel<<<dim3((F + G + 255) / 256, H), 256, 0, s>>>(sp, grp_dev, rad2_);
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

}  // namespace spade::cuda
