// LycheeCluster GPU index, lazy update: lc_insert_kernel (new chunks into the nearest coarse
// unit's nearest fine cluster), LcIndexGpu::insert and insert_batch. Numerics: the comment
// atop cluster_index.cu.
#include <algorithm>
#include <cstdint>
#include <vector>

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
        const __half* blk = level ? s.gc + go * D : s.fc + fo * D;  // piece-major
        const int maxN = level ? s.maxG : s.maxF;
        float dp = 0.f;
        double nn = 0.0;
#pragma unroll 4
        for (int d0 = 0; d0 < D; d0 += 8) {
          const uint4 raw = *reinterpret_cast<const uint4*>(blk + lc_cen_off(maxN, n, d0));
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
      __half* blk = level ? s.gc + go * D : s.fc + fo * D;  // piece-major
      const int maxN = level ? s.maxG : s.maxF;
      int32_t* cntp = level ? s.gcnt + go + node : s.fcnt + fo + node;
      int32_t* tokp = level ? s.gtok + go + node : s.ftok + fo + node;
      float* radp = level ? s.gr + go + node : s.fr + fo + node;
      const int n = *cntp;
      const double wgt = double(m) / double(n + m);
      for (int d = t; d < D; d += blockDim.x) {
        const float oc = __half2float(blk[lc_cen_off(maxN, node, d)]);
        oldc[d] = oc;
        double v = __dadd_rn(double(oc), __dmul_rn(wgt, __dsub_rn(mean[d], double(oc))));
        v = fmin(fmax(v, -65000.0), 65000.0);
        const __half hv = __float2half_rn(__double2float_rn(v));
        blk[lc_cen_off(maxN, node, d)] = hv;
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

}  // namespace

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

}  // namespace spade::cuda
