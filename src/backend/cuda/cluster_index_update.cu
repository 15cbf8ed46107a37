// LycheeCluster GPU index, lazy update: lc_insert_kernel (new chunks into the nearest coarse
// unit's nearest fine cluster), LcIndexGpu::insert and insert_batch. Numerics: the comment
// atop cluster_index.cu.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "backend/cuda/attention_common.cuh"
#include "backend/cuda/per_device.h"
#include "backend/cuda/cluster_index_common.cuh"

namespace spade::cuda {
using namespace lc_detail;
namespace {

// ---------------------------------------------------------------------------------------
// Lazy update.
struct InsertReq {
  static constexpr int kMax = 32;
  int slot, n_old, n_new;
  const int32_t* pt;
  const bf16* k;  // its layer's K cache
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
//   reads  the new chunks' K rows once (2*D B per token; staged together in dynamic shared
//          memory with cp.async when they fit stage_rows rows, else read from global memory
//          where used: the same values in the same order), every coarse center and the chosen unit's fine centers (2*D B each)
//   writes per chunk the two nodes' fp16 center (2*D B), radius, counters, the chunk's links;
//          head 0's CTA appends the chunk end to the slot's starts.
//   Pooling, norms and distances in double in the CPU's order; similarities fp32 dots
//   (warp-reduced) / float(|c|), ties -> lower id.
// Latency layout (a flush is ~11 dependent chunk inserts per layer): 4 block barriers per chunk;
// the fine and coarse node updates (independent) run side by side; the pooled vector's norm chain
// is computed by each warp that scores nodes (no broadcast barrier), beside the prefetched coarse
// centers' norm chains; radius maxima are warp-reduced (fmax is exact in any order); the next
// chunk is pooled by warps 0-3 while warps 4-7 compute the radii; K rows are read 8 values per
// load, with the staged / paged choice made per row (ncu: the per-element choice kept the page
// index division inside the distance loop, the radii were ~45% of the kernel).
// stage_rows (<= kInsStageRows): K rows the launch's dynamic shared memory holds (ins_dyn_max():
// as many as the device's per-block limit leaves beside the static arrays).
constexpr int kInsThreads = 256, kInsStageRows = 256, kInsNW = kInsThreads / 32, kInsPoolThreads = 128;

// The 8-dim pieces [d0, d0 + 128) of node n's piece-major fp16 center: one round of loads.
__device__ __forceinline__ void ins_load_center(const __half* blk, int maxN, int n, int d0, int D,
                                                uint4 (&raw)[16]) {
#pragma unroll
  for (int j = 0; j < 16; ++j)
    raw[j] = d0 + 8 * j < D ? *reinterpret_cast<const uint4*>(blk + lc_cen_off(maxN, n, d0 + 8 * j))
                            : make_uint4(0, 0, 0, 0);
}
// f(d, c[d]) for d in [d0, min(d0 + 128, D)) ascending, from the loaded pieces.
template <typename F>
__device__ __forceinline__ void ins_each_center_value(const uint4 (&raw)[16], int d0, int D, F&& f) {
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    if (d0 + 8 * j >= D) break;
    const __half* hv = reinterpret_cast<const __half*>(&raw[j]);
#pragma unroll
    for (int e = 0; e < 8; ++e) f(d0 + 8 * j + e, __half2float(hv[e]));
  }
}
// nn += c[d]^2 (double): the CPU most_similar's center-norm chain over the loaded range.
__device__ __forceinline__ void ins_center_nn(const uint4 (&raw)[16], int d0, int D, double& nn) {
  ins_each_center_value(raw, d0, D, [&](int, float c) { nn = __dadd_rn(nn, __dmul_rn(double(c), double(c))); });
}
// dp += unit[d] * c[d] (fp32, no FMA, d ascending; unit scaled by fi first when scale): the CPU
// most_similar's dot chain over the same range.
__device__ __forceinline__ void ins_center_dp(const uint4 (&raw)[16], const float* unit, int d0, int D,
                                              bool scale, float fi, float& dp) {
  ins_each_center_value(raw, d0, D, [&](int d, float c) {
    const float u = scale ? __fmul_rn(unit[d], fi) : unit[d];
    dp = __fadd_rn(dp, __fmul_rn(u, c));
  });
}
// af, ag += (k[d] - cf[d])^2, (k[d] - cg[d])^2 in double, d ascending (the CPU's distance
// chains), for one bf16 row (16-byte aligned; shared or global) read 8 values per load.
__device__ __forceinline__ void ins_dist2(const bf16* row, const double* cf, const double* cg, int D,
                                          double& af, double& ag) {
  for (int d0 = 0; d0 < D; d0 += 8) {
    const uint4 raw = *reinterpret_cast<const uint4*>(row + d0);
    const bf16* kv = reinterpret_cast<const bf16*>(&raw);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const double kd = double(__bfloat162float(kv[e]));
      const double xf = __dsub_rn(kd, cf[d0 + e]), xg = __dsub_rn(kd, cg[d0 + e]);
      af = __dadd_rn(af, __dmul_rn(xf, xf));
      ag = __dadd_rn(ag, __dmul_rn(xg, xg));
    }
  }
}
// Best (sim, id) of the block (ties: lower id): warp shuffles, one slot per warp in wb / wk,
// one barrier, then every thread reduces the warps' slots (no second barrier).
__device__ __forceinline__ int ins_block_argmax(float bsim, int bk, float* wb, int* wk) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  for (int o = 16; o > 0; o >>= 1) {
    const float os = __shfl_xor_sync(kFull, bsim, o);
    const int ok = __shfl_xor_sync(kFull, bk, o);
    if (ok >= 0 && (bk < 0 || os > bsim || (os == bsim && ok < bk))) {
      bsim = os;
      bk = ok;
    }
  }
  if (lane == 0) {
    wb[w] = bsim;
    wk[w] = bk;
  }
  __syncthreads();
  float bb = -INFINITY;
  int kk = -1;
  for (int j = 0; j < kInsNW; ++j)
    if (wk[j] >= 0 && (kk < 0 || wb[j] > bb || (wb[j] == bb && wk[j] < kk))) {
      bb = wb[j];
      kk = wk[j];
    }
  return kk;
}

__global__ void __launch_bounds__(kInsThreads, 1) lc_insert_kernel(SlotPtrs z, InsertBatch batch,
                                                                    int stage_rows) {
  extern __shared__ __align__(16) unsigned char ins_dyn[];
  bf16* kr = reinterpret_cast<bf16*>(ins_dyn);  // [stage_rows][D] staged K rows
  const InsertReq& rq = batch.r[blockIdx.y];
  const SlotPtrs s = slot_ptrs(z, rq.slot);
  int32_t* starts_rw = const_cast<int32_t*>(s.starts);
  const int32_t* pt = rq.pt;
  const bf16* k = rq.k;
  const int h = blockIdx.x, t = threadIdx.x, lane = t & 31, w = t >> 5;
  const int D = s.D;
  __shared__ double mean[256], sq[256];
  __shared__ float unit[256];
  __shared__ double oldc[2][256], newc[2][256];  // [fine, coarse][d], the centers as doubles
  __shared__ float wbest[2][kInsNW];
  __shared__ double rmd[2][kInsNW];
  __shared__ int wbk[2][kInsNW];
  __shared__ int gfirst[65];
  const int64_t fo = int64_t(h) * s.maxF, go = int64_t(h) * s.maxG, co = int64_t(h) * s.maxC;
  const int n_coarse = s.n_coarse[h];
  for (int g = t; g <= max(n_coarse, 1); g += blockDim.x) gfirst[g] = s.gfirst[int64_t(h) * (s.maxG + 1) + g];
  // Every new chunk's K rows in one round of cp.async (none of them change during the flush).
  const int b0 = starts_rw[rq.n_old];
  const int nrows = rq.ends[rq.n_new - 1] - b0;
  const bool staged = nrows <= stage_rows;
  if (staged) {
    const int pcs = D / 8;
    for (int x = t; x < nrows * pcs; x += blockDim.x) {
      const int r = x / pcs, pc = x - r * pcs;
      attn_detail::cp_async16(kr + r * D + pc * 8, key_row(k, pt, b0 + r, h, s.Hkv, s.P, D) + pc * 8, true);
    }
    attn_detail::cp_async_commit();
    attn_detail::cp_async_wait<0>();
  }
  __syncthreads();
  // Token p's K row: the staged copy or the paged cache (the branch is uniform and taken once per
  // row, outside the d loops: a per-element select kept the page-index division in them).
  auto global_row = [&](int p) { return key_row(k, pt, p, h, s.Hkv, s.P, D); };
  const __half* gblk = s.gc + go * D;  // piece-major
  __half* fblk = s.fc + fo * D;
  // Pool chunk i (threads [0, kInsPoolThreads), thread per d, tokens in order): mean, its
  // float rounding and the squares of those. Chunk i + 1's pooling runs beside chunk i's radii.
  auto pool = [&](int i) {
    const int b = i == 0 ? b0 : rq.ends[i - 1], e = rq.ends[i];
    for (int d = t; d < D; d += kInsPoolThreads) {
      double a = 0.0;
      if (staged)
        for (int p = b; p < e; ++p) a = __dadd_rn(a, double(__bfloat162float(kr[(p - b0) * D + d])));
      else
        for (int p = b; p < e; ++p) a = __dadd_rn(a, double(__bfloat162float(global_row(p)[d])));
      const double mn = __dmul_rn(a, 1.0 / double(max(1, e - b)));
      mean[d] = mn;
      unit[d] = __double2float_rn(mn);
      sq[d] = __dmul_rn(double(unit[d]), double(unit[d]));
    }
  };
  if (t < kInsPoolThreads) pool(0);
  __syncthreads();
  for (int i = 0; i < rq.n_new; ++i) {
    const int c = rq.n_old + i;
    const int b = i == 0 ? b0 : rq.ends[i - 1], e = rq.ends[i], m = e - b;
    if (h == 0 && t == 0) starts_rw[c + 1] = e;
    // Coarse: thread per unit; its first center's loads go out before the norm chain.
    uint4 raw[16];
    const bool has0 = t < n_coarse;
    if (has0) ins_load_center(gblk, s.maxG, t, 0, D, raw);
    // |pooled|, d ascending, computed by each warp that scores a node (no broadcast barrier),
    // once per chunk.
    bool have_norm = false, scale = false;
    float fi = 1.f;
    auto norm = [&] {
      if (have_norm) return;
      double ss = 0.0;
#pragma unroll 8
      for (int d = 0; d < D; ++d) ss = __dadd_rn(ss, sq[d]);
      const double un = sqrt(ss);
      scale = un > 0;
      fi = scale ? __double2float_rn(1.0 / un) : 1.f;
      have_norm = true;
    };
    double nn0 = 0.0;
    if (has0) ins_center_nn(raw, 0, D, nn0);
    if (32 * w < n_coarse) norm();
    float bsim = -INFINITY;
    int bk = -1;
    // Score node n: the first 128 dims' center norm may be done already (nn_pre, from the
    // prefetched row: that chain ran beside the pooled vector's norm chain).
    auto score = [&](const __half* blk, int maxN, int n, bool loaded, double nn_pre) {
      float dp = 0.f;
      double nn = loaded ? nn_pre : 0.0;
      for (int d0 = 0; d0 < D; d0 += 128) {
        if (!(loaded && d0 == 0)) {
          ins_load_center(blk, maxN, n, d0, D, raw);
          ins_center_nn(raw, d0, D, nn);
        }
        ins_center_dp(raw, unit, d0, D, scale, fi, dp);
      }
      const float nf = __double2float_rn(sqrt(nn));
      const float sim = nf > 0 ? dp / nf : -INFINITY;
      if (bk < 0 || sim > bsim) {
        bsim = sim;
        bk = n;
      }
    };
    for (int n = t; n < n_coarse; n += blockDim.x) score(gblk, s.maxG, n, n == t && has0, nn0);
    int kk = ins_block_argmax(bsim, bk, wbest[1], wbk[1]);  // B2
    const int g = kk < 0 ? 0 : kk;
    const int lo = gfirst[g], hi = gfirst[g + 1];
    bsim = -INFINITY;
    bk = -1;
    if (lo + 32 * w < hi) norm();
    for (int n = lo + t; n < hi; n += blockDim.x) score(fblk, s.maxF, n, false, 0.0);
    kk = ins_block_argmax(bsim, bk, wbest[0], wbk[0]);  // B3
    const int f = kk < 0 ? lo : kk;
    // Update the fine (level 0) and coarse (level 1) node side by side.
    for (int x = t; x < 2 * D; x += blockDim.x) {
      const int level = x >= D, d = x - level * D;
      const int node = level ? g : f;
      __half* blk = level ? s.gc + go * D : fblk;
      const int maxN = level ? s.maxG : s.maxF;
      const int n = level ? s.gcnt[go + node] : s.fcnt[fo + node];
      const double wgt = double(m) / double(n + m);
      const float oc = __half2float(blk[lc_cen_off(maxN, node, d)]);
      oldc[level][d] = double(oc);
      double v = __dadd_rn(double(oc), __dmul_rn(wgt, __dsub_rn(mean[d], double(oc))));
      v = fmin(fmax(v, -65000.0), 65000.0);
      const __half hv = __float2half_rn(__double2float_rn(v));
      blk[lc_cen_off(maxN, node, d)] = hv;
      newc[level][d] = double(__half2float(hv));
    }
    __syncthreads();  // B4
    // Radii (threads >= kInsPoolThreads; the others pool the next chunk meanwhile: mean, unit
    // and sq are no longer read): a token's distances to both new centers on the first 96 of
    // them (two interleaved chains, one conversion of the key), r + |c' - c| of both levels
    // on the last warp's lane 0.
    double rf = 0.0, rg = 0.0;  // fine, coarse
    if (t < kInsPoolThreads) {
      if (i + 1 < rq.n_new) pool(i + 1);
    } else if (t < kInsThreads - 32) {
      for (int p = b + t - kInsPoolThreads; p < e; p += kInsThreads - 32 - kInsPoolThreads) {
        double af = 0.0, ag = 0.0;
        if (staged) ins_dist2(kr + (p - b0) * D, newc[0], newc[1], D, af, ag);
        else ins_dist2(global_row(p), newc[0], newc[1], D, af, ag);
        rf = fmax(rf, sqrt(af));
        rg = fmax(rg, sqrt(ag));
      }
    } else if (lane == 0) {
      const float rof = s.fr[fo + f], rog = s.gr[go + g];
      double af = 0.0, ag = 0.0;
#pragma unroll 4
      for (int d = 0; d < D; ++d) {
        const double xf = __dsub_rn(oldc[0][d], newc[0][d]), xg = __dsub_rn(oldc[1][d], newc[1][d]);
        af = __dadd_rn(af, __dmul_rn(xf, xf));
        ag = __dadd_rn(ag, __dmul_rn(xg, xg));
      }
      rf = __dadd_rn(double(rof), sqrt(af));
      rg = __dadd_rn(double(rog), sqrt(ag));
    }
    for (int o = 16; o > 0; o >>= 1) {
      rf = fmax(rf, __shfl_xor_sync(kFull, rf, o));
      rg = fmax(rg, __shfl_xor_sync(kFull, rg, o));
    }
    if (lane == 0) {
      rmd[0][w] = rf;
      rmd[1][w] = rg;
    }
    __syncthreads();  // B5 (also the next chunk's pooled vector is complete)
    if (t == 0) {
      for (int level = 0; level < 2; ++level) {
        double rr = 0.0;
        for (int j = 0; j < kInsNW; ++j) rr = fmax(rr, rmd[level][j]);
        const int64_t o = level ? go + g : fo + f;
        (level ? s.gr : s.fr)[o] = round_up_f(rr);
        (level ? s.gcnt : s.fcnt)[o] += m;
        (level ? s.gtok : s.ftok)[o] += m;
      }
      s.cnext[co + c] = -1;
      s.cfine[co + c] = f;
      const int tail = s.ftail[fo + f];
      if (tail < 0) s.fhead[fo + f] = c;
      else s.cnext[co + tail] = c;
      s.ftail[fo + f] = c;
      s.fnch[fo + f] += 1;
      s.n_chunks[h] = c + 1;
    }
  }
}

// The kernel's static shared memory and the dynamic part its launches may take (set once):
// kInsStageRows rows of the largest D, or what the device's per-block limit leaves (sm_86 / 89:
// 99 KB, ~85 KB of it dynamic).
size_t ins_dyn_max() {
  static const size_t v = [] {
    cudaFuncAttributes fa{};
    SPADE_CUDA(cudaFuncGetAttributes(&fa, lc_insert_kernel));
    const size_t lim = smem_optin_bytes() > fa.sharedSizeBytes ? smem_optin_bytes() - fa.sharedSizeBytes : 0;
    return std::min(size_t(kInsStageRows) * 256 * sizeof(bf16), lim / 16 * 16);
  }();
  static PerDeviceOnce attr;  // per device: tensor-parallel ranks as threads (per_device.h)
  if (attr.pending()) {
    set_max_dynamic_smem(lc_insert_kernel, v);
    attr.mark();
  }
  return v;
}

}  // namespace

void LcIndexGpu::insert(int slot, const bf16* k_cache, const int32_t* page_table, int n_old,
                        const int32_t* new_ends, int n_new, cudaStream_t s) {
  insert_batch({LcInsert{slot, page_table, n_old, new_ends, n_new}}, k_cache, s);
}

void LcIndexGpu::insert_batch(const std::vector<LcInsert>& reqs, const bf16* k_cache, cudaStream_t s) {
  const int H = cfg_.Hkv, C = cfg_.max_chunks;
  // Checks without a host allocation (a flush runs inside a decode step; batches are small).
  for (size_t i = 0; i < reqs.size(); ++i) {
    const LcInsert& r = reqs[i];
    SPADE_CHECK(r.slot >= 0 && r.slot < cfg_.slots, "LcIndexGpu::insert: bad slot");
    for (size_t j = 0; j < i; ++j)
      SPADE_CHECK(reqs[j].slot != r.slot, "LcIndexGpu::insert_batch: slot ", r.slot, " twice");
    SPADE_CHECK(r.n_old >= 1 && r.n_old + r.n_new <= C, "LcIndexGpu::insert: chunk count out of range");
  }
  const SlotPtrs z{starts_, n_chunks_, n_fine_, n_coarse_, fc_, fr_, ftok_, fcnt_, fhead_, ftail_, fnch_,
                   gc_, gr_, gtok_, gcnt_, gfirst_, cnext_, cfine_, max_fine_, cfg_.max_coarse, C,
                   cfg_.D, H, cfg_.P};
  // K rows staged per launch: up to kInsStageRows, fewer where the device gives a block less
  // shared memory (D = 256 on sm_86 / 89: ~170); a flush with more rows reads the paged cache.
  const int stage_rows =
      int(std::min<size_t>(kInsStageRows, ins_dyn_max() / (size_t(cfg_.D) * sizeof(bf16))));
  const size_t smem = size_t(stage_rows) * size_t(cfg_.D) * sizeof(bf16);
  // Rounds of <= kMax chunks per request, <= kReq requests per launch.
  for (int done = 0;; done += InsertReq::kMax) {
    InsertBatch ib{};
    int n = 0;
    auto flush = [&] {
      if (n) lc_insert_kernel<<<dim3(H, n), kInsThreads, smem, s>>>(z, ib, stage_rows);
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
      q.k = r.k_cache ? r.k_cache : k_cache;
      SPADE_CHECK(q.k, "LcIndexGpu::insert: no K cache");
      for (int i = 0; i < q.n_new; ++i) q.ends[i] = r.new_ends[done + i];
      if (n == InsertBatch::kReq) flush();
    }
    flush();
    if (!any) break;
  }
  SPADE_CUDA_LAUNCH();
}

}  // namespace spade::cuda
