// Twilight pruner in one launch (twilight.h, TwilightPruner::run when fused_ok()): estimate,
// softmax, top-p search and the union of the G heads' kept sets, per list, in one thread-block
// cluster, the logits never leaving shared memory.
//
// twl_fused_kernel<D, NP>
//   grid (C, B * Hkv), cluster (C, 1, 1): CTA `rank` of list (b, KV head) owns tiles
//   [rank * TPC, rank * TPC + TPC) of the list's 16-slot tiles (TPC = ceil(tiles / C)).
//   reads  per base token D/2 code bytes + 4 scale/zero bytes (the pruner's byte floor), the
//          list's entries, q of the G heads once per warp
//   writes per list: kept positions int32 [list][max_slots] (selection order), the kept
//          count, the G thresholds. Nothing else: the logits of the two-launch path (16 B
//          per base token at G = 4, written and read again) stay in shared memory.
//   Shared memory: logits -> weights fp32 [G][SS] (SS = 16 TPC <= 8192), then a region used
//   first by the warps' cp.async rings (estimate) and then by the search: per head TreeBins
//   of this CTA, TreeBins of the cluster's total, TreeNodes.
//   Steps (cluster barriers: barrier.cluster arrive.release / wait.acquire):
//     1. estimate (twilight_estimate.cuh) of the CTA's tiles into shared memory;
//     2. softmax as the two-launch top-p computes it (float max, float exp, double sum,
//        float reciprocal): per-head max and (sum, count at the max) of each CTA are read by
//        every CTA of the cluster through distributed shared memory and combined in rank
//        order, so every CTA holds bit-identical weights and search states;
//     3. Algorithm 1 by topp_tree_search.cuh's passes (eight bisection steps per pass, all G
//        heads at once): each CTA bins its weights (exact 64-bit fixed-point masses), then
//        CTA k sums bins k, k + C, ... of every CTA (integers: order-free, exact) and stores
//        the totals into every CTA; each CTA builds the trees (warp g: head g) and walks them
//        (identical results everywhere);
//     4. the union bit of each slot (w_g >= t_g for some g), a CTA scan and a cluster scan of
//        the counts, kept positions written in selection order.
//   Only searches that end within the tree passes (eps > 2^-24: the host's fused_ok()) run
//   here; G <= 8 (warp g builds head g's tree).
#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>

#include "backend/cuda/block_scan.cuh"
#include "backend/cuda/pdl.cuh"
#include "backend/cuda/topp_tree_search.cuh"
#include "backend/cuda/twilight.h"
#include "backend/cuda/twilight_estimate.cuh"

namespace spade::cuda {
namespace {

namespace cg = cooperative_groups;

constexpr int kFuWarps = 8, kFuThreads = kFuWarps * 32;
constexpr int kFuMaxG = 8;                 // warp g builds head g's tree
constexpr int kFuMaxSlotsCta = 8192;       // SS bound: kept bits of 256 words
constexpr int kFuMaxLogitBytes = 64 << 10; // G * SS * 4 per CTA
constexpr int kFuRing = 3;  // stages of the warps' rings: 2 CTAs (2 x 96 KB) per SM at D = 128

struct FuArgs {
  int G, Hq, Hkv, P, max_slots;
  int tpc, ss;  // tiles per CTA, slot stride of the weight rows (16 * tpc)
  double p, eps;
  float* thr;       // [list][G]
  int32_t* kept;    // [list][max_slots]
  int32_t* kept_cnt;
  unsigned long long* trace;  // diagnostics (optional): [list][C][kFuStamps] globaltimer stamps
};

constexpr int kFuStamps = 8;
__device__ __forceinline__ void fu_stamp(const FuArgs& a, int k) {
  if (a.trace == nullptr || threadIdx.x != 0) return;
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  a.trace[(size_t(blockIdx.y) * gridDim.x + blockIdx.x) * kFuStamps + k] = t;
}

struct HeadSearch {
  double l, r, mass_r, at_max;
  int it, done;
  float inv, thr;
};

// The search's part of the shared region: TreeBins of this CTA [G], the cluster's totals [G],
// TreeNodes [G].
constexpr size_t fu_topp_bytes(int G) { return size_t(G) * (2 * sizeof(TreeBins) + sizeof(TreeNodes)); }

// Cluster barrier that publishes this CTA's shared-memory writes (local or remote) made before
// it by any of its threads. barrier.cluster.arrive's default .release is a GPU-scope MEMBAR in
// every thread (SASS: MEMBAR.ALL.GPU per thread per barrier, which made the first version's
// barriers cost microseconds); here the CTA barrier orders every thread's writes before thread
// 0, whose cluster-scope fence is cumulative, and the arrive is relaxed (the cooperative-groups
// grid-sync pattern). The wait keeps its acquire.
__device__ __forceinline__ void cluster_sync_publish() {
  __syncthreads();
  if (threadIdx.x == 0) asm volatile("fence.acq_rel.cluster;" ::: "memory");
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\nbarrier.cluster.wait.aligned;" ::: "memory");
}
// Cluster barrier without publishing (the last one: no CTA exits while another may still read
// its shared memory).
__device__ __forceinline__ void cluster_sync_plain() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\nbarrier.cluster.wait.aligned;" ::: "memory");
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <int D, int NP>
__global__ void __launch_bounds__(kFuThreads, 2) twl_fused_kernel(const TwilightStep st, const FuArgs a) {
  pdl_begin();  // pdl.cuh: first, before any global access
  constexpr int W = D / 32;
  extern __shared__ __align__(16) unsigned char fu_smem[];
  __shared__ float s_fpart[kFuMaxG][kFuWarps];
  __shared__ double2 s_dpart[kFuMaxG][kFuWarps];
  __shared__ float s_cmax[kFuMaxG];        // this CTA's per-head max (read by the cluster)
  __shared__ double2 s_csum[kFuMaxG];      // this CTA's (sum, count at the max)
  __shared__ HeadSearch s_hs[kFuMaxG];
  __shared__ uint32_t s_bits[kFuMaxSlotsCta / 32];
  __shared__ int s_warp[64];
  __shared__ int s_ccount;                 // this CTA's kept count (read by the cluster)
  cg::cluster_group cl = cg::this_cluster();
  const int C = int(cl.num_blocks()), rank = int(cl.block_rank());
  const int G = a.G, list = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int b = list / a.Hkv, h = list % a.Hkv;
  const int e0 = st.base_off[list], ne = st.base_off[list + 1] - e0;
  const bool chunk = st.gran == SelGran::Chunk16;
  const int n_slots = min(chunk ? 16 * ne : ne, a.max_slots);
  if (n_slots == 0) {  // uniform over the cluster: no barrier, no remote access
    if (rank == 0 && tid < G) a.thr[list * G + tid] = INFINITY;
    if (rank == 0 && tid == 0) a.kept_cnt[list] = 0;
    return;
  }
  fu_stamp(a, 0);
  const int n_tiles = (n_slots + 15) / 16;
  const int t0 = min(n_tiles, rank * a.tpc), t1 = min(n_tiles, t0 + a.tpc);
  const int s0 = 16 * t0, n_loc = max(0, min(n_slots, 16 * t1) - s0);  // this CTA's slots
  float* sw = reinterpret_cast<float*>(fu_smem);
  unsigned char* region = fu_smem + size_t(G) * a.ss * 4;

  // 1. Estimate into shared memory.
  {
    auto* rings = reinterpret_cast<twl::EstRing<W, kFuRing>*>(region);
    twl::est_warp<D, NP, kFuRing>(st, rings[warp], list, a.Hkv, a.P, G, t0 + warp, kFuWarps, t1, n_slots,
                                  st.q + (int64_t(b) * a.Hq + h * G) * D, sw, a.ss, s0);
    fu_stamp(a, 1);  // warp 0's tiles done
  }
  TreeBins* bins = reinterpret_cast<TreeBins*>(region);
  TreeBins* tot = bins + G;
  TreeNodes* nodes = reinterpret_cast<TreeNodes*>(tot + G);
  __syncthreads();  // logits complete; the rings are free
  fu_stamp(a, 2);

  // 2. Softmax over the cluster's slots of each head.
  for (int g = 0; g < G; ++g) {
    float m = -INFINITY;
    for (int i = tid; i < n_loc; i += kFuThreads) m = fmaxf(m, sw[g * a.ss + i]);
    m = warp_max(m);
    if (lane == 0) s_fpart[g][warp] = m;
  }
  for (int i = tid; i < G * kTreeLeaves; i += kFuThreads) {  // this CTA's bins, first pass
    TreeBins& bb = bins[i / kTreeLeaves];
    const int j = i % kTreeLeaves;
    bb.mass_lo[j] = 0u, bb.mass_hi[j] = 0u, bb.mn[j] = kTreeEmptyMin, bb.mx[j] = 0u;
  }
  __syncthreads();
  if (tid < G) {
    float m = -INFINITY;
    for (int w = 0; w < kFuWarps; ++w) m = fmaxf(m, s_fpart[tid][w]);
    s_cmax[tid] = m;
  }
  cluster_sync_publish();
  __shared__ float s_gmax[kFuMaxG];
  if (tid < G) {
    float m = -INFINITY;
#pragma unroll
    for (int rr = 0; rr < 8; ++rr)
      if (rr < C) m = fmaxf(m, *cl.map_shared_rank(&s_cmax[tid], rr));
    s_gmax[tid] = m;
  }
  __syncthreads();
  for (int g = 0; g < G; ++g) {
    const float lmax = s_gmax[g];
    double sum = 0.0, n_max = 0.0;
    for (int i = tid; i < n_loc; i += kFuThreads) {
      float v = sw[g * a.ss + i];
      if (v != -INFINITY) {
        v = expf(v - lmax);
        sum += double(v);
        n_max += v == 1.f ? 1.0 : 0.0;
      } else {
        v = -1.f;
      }
      sw[g * a.ss + i] = v;
    }
    sum = warp_sum(sum), n_max = warp_sum(n_max);
    if (lane == 0) s_dpart[g][warp] = make_double2(sum, n_max);
  }
  __syncthreads();
  if (tid < G) {
    double2 x = make_double2(0.0, 0.0);
    for (int w = 0; w < kFuWarps; ++w) x.x += s_dpart[tid][w].x, x.y += s_dpart[tid][w].y;
    s_csum[tid] = x;
  }
  cluster_sync_publish();
  if (tid < G) {
    double2 x = make_double2(0.0, 0.0);
    double2 y[8];
#pragma unroll
    for (int rr = 0; rr < 8; ++rr) y[rr] = rr < C ? *cl.map_shared_rank(&s_csum[tid], rr) : make_double2(0.0, 0.0);
#pragma unroll
    for (int rr = 0; rr < 8; ++rr) x.x += y[rr].x, x.y += y[rr].y;  // rank order (zeros past C)
    HeadSearch hs;
    hs.inv = float(1.0 / x.x);
    hs.at_max = x.y * double(hs.inv);
    hs.l = 0.0, hs.r = double(hs.inv), hs.mass_r = hs.at_max, hs.it = 0;
    hs.done = hs.at_max >= a.p ? 1 : 0;
    hs.thr = hs.inv;
    s_hs[tid] = hs;
  }
  __syncthreads();
  for (int g = 0; g < G; ++g) {
    const float inv = s_hs[g].inv;
    for (int i = tid; i < n_loc; i += kFuThreads) {
      const float v = sw[g * a.ss + i];
      if (v >= 0.f) sw[g * a.ss + i] = v * inv;
    }
  }

  // 3. Algorithm 1, eight steps per pass, every head of the group at once.
  fu_stamp(a, 3);
  int passes = 0;
  for (;;) {
    __syncthreads();  // weights / last walk visible
    unsigned active = 0u;
#pragma unroll
    for (int g = 0; g < kFuMaxG; ++g) {
      if (g >= G) break;
      const HeadSearch& hs = s_hs[g];
      // The loop test of the search; a pass deeper than the tree's exact depth never starts
      // (fused_ok(): eps > 2^-24 >= wmax 2^-24, so the first test ends the search by then).
      if (!hs.done && hs.r - hs.l >= a.eps && hs.it < 64 && hs.it <= kTreeMaxStartDepth) active |= 1u << g;
    }
    if (!active) break;  // the same in every CTA of the cluster
    ++passes;
    for (int g = 0; g < G; ++g) {
      if (!(active >> g & 1u)) continue;
      const TreePass pass = tree_pass(s_hs[g].l, s_hs[g].r);
      unsigned mn0 = kTreeEmptyMin, mx0 = 0u;
      for (int i = tid; i < n_loc; i += kFuThreads) tree_bin_weight(bins[g], sw[g * a.ss + i], pass, mn0, mx0);
      tree_bin_flush0(bins[g], mn0, mx0);
    }
    cluster_sync_publish();  // every CTA's bins complete
    // CTA `rank` totals bins rank, rank + C, ... (over heads and leaves) of the cluster and
    // stores each total into every CTA.
    for (int q = rank + C * tid; q < G * kTreeLeaves; q += C * kFuThreads) {
      const int g = q / kTreeLeaves, j = q % kTreeLeaves;
      if (!(active >> g & 1u)) continue;
      unsigned long long mass = 0ull;
      unsigned mn = kTreeEmptyMin, mx = 0u;
      unsigned lo[8], hi[8], mns[8], mxs[8];
#pragma unroll
      for (int rr = 0; rr < 8; ++rr) {  // every load issued before any use
        if (rr >= C) break;
        const TreeBins* rb = cl.map_shared_rank(&bins[g], rr);
        lo[rr] = rb->mass_lo[j], hi[rr] = rb->mass_hi[j], mns[rr] = rb->mn[j], mxs[rr] = rb->mx[j];
      }
#pragma unroll
      for (int rr = 0; rr < 8; ++rr) {
        if (rr >= C) break;
        mass += (static_cast<unsigned long long>(hi[rr]) << 32) | lo[rr];
        mn = min(mn, mns[rr]), mx = max(mx, mxs[rr]);
      }
#pragma unroll
      for (int rr = 0; rr < 8; ++rr) {
        if (rr >= C) break;
        TreeBins* rt = cl.map_shared_rank(&tot[g], rr);
        rt->mass_lo[j] = unsigned(mass), rt->mass_hi[j] = unsigned(mass >> 32);
        rt->mn[j] = mn, rt->mx[j] = mx;
      }
    }
    cluster_sync_publish();  // totals everywhere; nobody reads this CTA's bins any more this pass
    for (int i = tid; i < G * kTreeLeaves; i += kFuThreads) {
      TreeBins& bb = bins[i / kTreeLeaves];
      const int j = i % kTreeLeaves;
      bb.mass_lo[j] = 0u, bb.mass_hi[j] = 0u, bb.mn[j] = kTreeEmptyMin, bb.mx[j] = 0u;
    }
    if (warp < G && (active >> warp & 1u)) {
      tree_build_warp(tot[warp], nodes[warp]);
      if (lane == 0) {
        HeadSearch& hs = s_hs[warp];
        const TreeWalk w = tree_walk(tot[warp], nodes[warp], hs.l, hs.r, hs.mass_r, hs.it, a.p, a.eps);
        hs.l = w.l, hs.r = w.r, hs.mass_r = w.mass_r, hs.it = w.it;
        if (w.done) hs.done = 2;
      }
    }
  }
  if (tid < G) {
    HeadSearch& hs = s_hs[tid];
    if (hs.done != 1) {  // 1: the mass at the largest weight reached p (threshold wmax)
      float thr = float(hs.l);
      if (double(thr) > hs.l) thr = nextafterf(thr, -INFINITY);
      hs.thr = thr;
    }
  }
  __syncthreads();
  fu_stamp(a, 4);

  // 4. Union of the heads' kept sets, in selection order.
  const int nwords = (n_loc + 31) >> 5;
  for (int w = warp; w < nwords; w += kFuWarps) {
    const int i = 32 * w + lane;
    bool keep = false;
    if (i < n_loc)
      for (int g = 0; g < G; ++g) keep = keep || sw[g * a.ss + i] >= s_hs[g].thr;
    const unsigned bits = __ballot_sync(0xffffffffu, keep);
    if (lane == 0) s_bits[w] = bits;
  }
  __syncthreads();
  const int wpt = (nwords + kFuThreads - 1) / kFuThreads;
  const int w0 = min(nwords, tid * wpt), w1 = min(nwords, w0 + wpt);
  int cnt = 0;
  for (int w = w0; w < w1; ++w) cnt += __popc(s_bits[w]);
  int cta_total;
  int o = block_exclusive_scan(cnt, s_warp, &cta_total);
  if (tid == 0) s_ccount = cta_total;
  cluster_sync_publish();
  fu_stamp(a, 5);
  int base = 0, total = 0;
  for (int rr = 0; rr < C; ++rr) {
    const int c = *cl.map_shared_rank(&s_ccount, rr);
    base += rr < rank ? c : 0;
    total += c;
  }
  int32_t* out = a.kept + int64_t(list) * a.max_slots + base;
  for (int w = w0; w < w1; ++w) {
    unsigned m = s_bits[w];
    while (m) {
      const int i = s0 + 32 * w + __ffs(m) - 1;
      m &= m - 1;
      out[o++] = chunk ? __ldg(st.base_idx + e0 + i / 16) * 16 + i % 16 : __ldg(st.base_idx + e0 + i);
    }
  }
  if (rank == 0 && tid < G) a.thr[list * G + tid] = s_hs[tid].thr;
  if (rank == 0 && tid == 0) a.kept_cnt[list] = total;
  fu_stamp(a, 6);
  if (a.trace && tid == 0) a.trace[(size_t(blockIdx.y) * gridDim.x + blockIdx.x) * kFuStamps + 7] = passes;
  cluster_sync_plain();  // no CTA leaves while another may still read its shared memory
}

using FusedKernel = void (*)(TwilightStep, FuArgs);

FusedKernel fused_kernel(int D, int G) {
  if (D == 128) return G <= 4 ? twl_fused_kernel<128, 1> : twl_fused_kernel<128, 2>;
  return G <= 4 ? twl_fused_kernel<64, 1> : twl_fused_kernel<64, 2>;
}

// Slot stride of a CTA's weight rows for cluster size C; 0 when the rows do not fit
// (kFuMaxLogitBytes, kFuMaxSlotsCta).
int fused_slot_stride(int C, int G, int max_slots) {
  const int tiles = (max_slots + 15) / 16, ss = 16 * ((tiles + C - 1) / C);
  return ss <= kFuMaxSlotsCta && int64_t(G) * ss * 4 <= kFuMaxLogitBytes ? ss : 0;
}

size_t fused_smem(int D, int G, int ss) {
  const size_t ring = size_t(kFuWarps) * (D == 128 ? sizeof(twl::EstRing<4, kFuRing>) : sizeof(twl::EstRing<2, kFuRing>));
  return size_t(G) * ss * 4 + std::max(ring, fu_topp_bytes(G));
}

cudaLaunchConfig_t fused_config(int C, int lists, size_t smem, cudaStream_t s, cudaLaunchAttribute* attr) {
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = unsigned(C), attr[0].val.clusterDim.y = 1, attr[0].val.clusterDim.z = 1;
  attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[1].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(unsigned(C), unsigned(lists));
  cfg.blockDim = dim3(kFuThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cfg.attrs = attr;
  cfg.numAttrs = pdl_enabled() ? 2 : 1;
  return cfg;
}

}  // namespace

bool TwilightPruner::fused_ok() const {
  const int G = Hq_ / Hkv_;
  // eps > 2^-24: every search ends within the tree passes (r - l = wmax 2^-24 < eps after
  // three passes, wmax <= 1), which is all the fused kernel runs.
  return fused_ && !topp_bisection_only_ && G <= kFuMaxG && eps_ > 0x1p-24 &&
         fused_slot_stride(8, G, max_slots_) > 0;
}

// Cluster size for `lists` lists: the fewest waves of clusters (cudaOccupancyMaxActiveClusters:
// a cluster's CTAs share a GPC), then the most CTAs per list while every CTA is resident at
// <= 2 per SM (small batches spread each list's estimate over more SMs). Cached per batch.
int TwilightPruner::fused_cluster_for(int lists) {
  const int G = Hq_ / Hkv_;
  if (int(fused_c_.size()) <= lists) fused_c_.resize(size_t(lists) + 1, 0);
  if (fused_c_[size_t(lists)]) return fused_c_[size_t(lists)];
  const FusedKernel kern = fused_kernel(D_, G);
  SPADE_CUDA(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, 160 << 10));
  SPADE_CUDA(cudaFuncSetAttribute(kern, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
  if (const char* e = std::getenv("SPADE_TWL_CLUSTER")) {  // A/B measurements
    const int f = std::atoi(e);
    if ((f == 1 || f == 2 || f == 4 || f == 8) && fused_slot_stride(f, G, max_slots_) > 0)
      return fused_c_[size_t(lists)] = f;
  }
  int best = 0;
  int64_t best_waves = INT64_MAX;
  for (int C = 1; C <= 8; C *= 2) {
    const int ss = fused_slot_stride(C, G, max_slots_);
    if (!ss) continue;
    cudaLaunchAttribute attr[2];
    const cudaLaunchConfig_t cfg = fused_config(C, lists, fused_smem(D_, G, ss), 0, attr);
    int n = 0;
    SPADE_CUDA(cudaOccupancyMaxActiveClusters(&n, kern, &cfg));
    if (n <= 0) continue;
    const int64_t waves = (lists + n - 1) / n;
    if (waves < best_waves || (waves == best_waves && int64_t(lists) * C <= 2 * n_sms_)) best = C, best_waves = waves;
  }
  SPADE_CHECK(best > 0, "twilight: no cluster size fits the fused pruner");
  fused_c_[size_t(lists)] = best;
  return best;
}

void TwilightPruner::run_fused(const TwilightStep& st, cudaStream_t s) {
  SPADE_CHECK(st.B >= 1 && st.B <= max_batch_, "twilight: batch ", st.B);
  SPADE_CHECK(st.gran == SelGran::Token || (st.gran == SelGran::Chunk16 && P_ % 16 == 0),
              "twilight: base lists must be Token or Chunk16 (P % 16 == 0)");
  const int G = Hq_ / Hkv_, lists = st.B * Hkv_;
  const int C = fused_cluster_for(lists);
  const int ss = fused_slot_stride(C, G, max_slots_);
  FuArgs a{G, Hq_, Hkv_, P_, max_slots_, ss / 16, ss, p_, eps_, thr_, kept_strided_, kept_cnt_, fused_trace_};
  fused_cluster_ = C;
  cudaLaunchAttribute attr[2];
  const cudaLaunchConfig_t cfg = fused_config(C, lists, fused_smem(D_, G, ss), s, attr);
  SPADE_CUDA(cudaLaunchKernelEx(&cfg, fused_kernel(D_, G), st, a));
  SPADE_CUDA_LAUNCH();
}

}  // namespace spade::cuda
