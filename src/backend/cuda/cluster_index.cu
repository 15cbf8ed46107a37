// LycheeCluster index on the GPU: build (pooling, spherical k-means, assembly), search,
// lazy update. API and storage layout: cluster_index.h; design: docs/cuda_lycheecluster.md.
// This file: the constructor (allocation) and download(); the kernels live in
// cluster_index_build.cu, cluster_index_update.cu and cluster_index_search.cu, their shared
// helpers in cluster_index_common.cuh.
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
#include <vector>

#include "backend/cuda/cluster_index_common.cuh"

namespace spade::cuda {
using namespace lc_detail;

LcIndexGpu::LcIndexGpu(DeviceArena& arena, const LcIndexConfig& cfg) : LcIndexGpu(&arena, cfg) {}

LcIndexGpu::~LcIndexGpu() {
  if (stage_ev_) {
    cudaEventSynchronize(static_cast<cudaEvent_t>(stage_ev_));
    cudaEventDestroy(static_cast<cudaEvent_t>(stage_ev_));
  }
  if (stage_) cudaFreeHost(stage_);
  for (auto& e : ev_)
    if (e) cudaEventDestroy(e);
}

size_t LcIndexGpu::arena_bytes(const LcIndexConfig& cfg) { return LcIndexGpu(nullptr, cfg).bytes_; }

int LcIndexGpu::build_heads_within(const LcIndexConfig& cfg, size_t bytes) {
  LcIndexConfig one = cfg, two = cfg;
  one.build_heads = cfg.Hkv;
  two.build_heads = 2 * cfg.Hkv;
  // The scratch (and staging) of one slot's heads.
  const size_t per_slot = std::max<size_t>(1, arena_bytes(two) - arena_bytes(one));
  const size_t n = bytes / per_slot;
  return int(std::clamp<size_t>(n, 1, size_t(cfg.slots))) * cfg.Hkv;
}

LcIndexGpu::LcIndexGpu(DeviceArena* arena, const LcIndexConfig& cfg) : cfg_(cfg) {
  SPADE_CHECK(cfg.D % 32 == 0 && cfg.D <= 256, "LcIndexGpu: D must be a multiple of 32, <= 256");
  SPADE_CHECK(cfg.max_chunks >= 1 && cfg.max_chunks <= 16384, "LcIndexGpu: max_chunks in [1, 16384]");
  SPADE_CHECK(cfg.max_coarse >= 1 && cfg.max_coarse <= 64, "LcIndexGpu: max_coarse in [1, 64]");
  SPADE_CHECK(cfg.chunks_per_fine > 0 && cfg.slots >= 1 && cfg.Hkv >= 1, "LcIndexGpu: bad config");
  SPADE_CHECK(cfg.build_heads >= 0 && cfg.build_heads % cfg.Hkv == 0 &&
                  cfg.build_heads <= cfg.slots * cfg.Hkv,
              "LcIndexGpu: build_heads must be a multiple of Hkv, at most slots * Hkv");
  build_heads_ = cfg.build_heads ? cfg.build_heads : cfg.Hkv;
  const int S = cfg.slots, H = build_heads_, D = cfg.D, C = cfg.max_chunks, G = cfg.max_coarse;
  const int SG = build_heads_ / cfg.Hkv;  // slots per build sequence
  max_fine_ = int(std::ceil(double(C) / cfg.chunks_per_fine));
  const int F = max_fine_;
  const size_t SH = size_t(S) * cfg.Hkv;
  // Every array: taken from the arena, or only counted (arena_bytes).
  auto take = [&](auto*& p, size_t n, const char* what) {
    using T = std::remove_pointer_t<std::remove_reference_t<decltype(p)>>;
    if (arena) p = arena->alloc_n<T>(n, what);
    bytes_ += align_up(n * sizeof(T), 256);
  };
  take(starts_, size_t(S) * (C + 1), "lc starts");
  take(n_chunks_, SH, "lc n_chunks");
  take(n_fine_, SH, "lc n_fine");
  take(n_coarse_, SH, "lc n_coarse");
  take(fc_, SH * F * D, "lc fine centers");
  take(fr_, SH * F, "lc fine radii");
  take(ftok_, SH * F, "lc fine tokens");
  take(fcnt_, SH * F, "lc fine counts");
  take(fhead_, SH * F, "lc fine heads");
  take(ftail_, SH * F, "lc fine tails");
  take(fnch_, SH * F, "lc fine chunk counts");
  take(gc_, SH * G * D, "lc coarse centers");
  take(gr_, SH * G, "lc coarse radii");
  take(gtok_, SH * G, "lc coarse tokens");
  take(gcnt_, SH * G, "lc coarse counts");
  take(gfirst_, SH * (G + 1), "lc coarse first");
  take(cnext_, SH * C, "lc chunk next");
  take(cfine_, SH * C, "lc chunk fine");
  take(X_, size_t(H) * C * D, "lc chunk keys");
  take(mean_, size_t(H) * C * D, "lc chunk means");
  take(C_, size_t(H) * F * D, "lc kmeans centroids");
  take(FC_, size_t(H) * F * D, "lc fine centroids");
  take(GC_, size_t(H) * G * D, "lc coarse centroids");
  take(sum_, size_t(H) * F * D, "lc kmeans sums");
  take(acc_, size_t(H) * (F + G) * D, "lc center acc");
  take(rad2_, size_t(H) * (F + G), "lc radii acc");
  take(cnt_, size_t(H) * F, "lc kmeans counts");
  take(assign_, size_t(H) * C, "lc assign");
  take(fassign_, size_t(H) * C, "lc fine assign");
  take(gassign_, size_t(H) * C, "lc coarse assign");
  take(remap_, size_t(H) * F, "lc remap");
  take(newid_, size_t(H) * F, "lc new ids");
  take(gof_, size_t(H) * F, "lc coarse of fine");
  take(best_, size_t(H) * C, "lc best sim");
  take(ctl_, size_t(2) * H * 8, "lc kmeans control");
  {
    lc_detail::LcGroupDev* g = nullptr;
    take(g, size_t(SG), "lc build groups");
    grp_ = g;
  }
  take(sbuf_, size_t(SG) * (C + 1), "lc staged starts");
  sort_cap_ = pow2_at_least(C);
  // The build's block sorts (pow2(chunks) u64 keys per head) beyond the device's shared memory
  // per block (sm_86 / 89: more than 8192 chunks) sort keys in global memory.
  const bool sort_global = cfg.spill_smem || size_t(sort_cap_) * 8 > build_sort_smem_limit();
  if (sort_global) take(sort_keys_, size_t(H) * sort_cap_, "lc build sort keys");
  // The search's working arrays past the device's shared memory per block (sm_86 / 89: more than
  // ~4K chunks): a region per (request, KV head) of a search (search_batch requests).
  search_stride_ = search_scratch_stride(F, C, D, cfg.spill_smem);
  if (search_stride_) {
    search_ctas_ = (cfg.search_batch > 0 ? std::min(cfg.search_batch, S) : S) * cfg.Hkv;
    take(search_scratch_, size_t(search_ctas_) * search_stride_, "lc search scratch");
  }
  if (!arena) return;
  SPADE_CUDA(cudaMemset(n_chunks_, 0, SH * sizeof(int32_t)));
  SPADE_CUDA(cudaMemset(n_fine_, 0, SH * sizeof(int32_t)));
  SPADE_CUDA(cudaMemset(n_coarse_, 0, SH * sizeof(int32_t)));
  const int big = int(std::min<size_t>(size_t(sort_cap_) * 8, build_sort_smem_limit()));
  set_build_sort_smem(big);
}

void LcIndexGpu::reset(int slot, cudaStream_t s) {
  SPADE_CHECK(slot >= 0 && slot < cfg_.slots, "LcIndexGpu::reset: bad slot");
  const size_t o = size_t(slot) * cfg_.Hkv, n = size_t(cfg_.Hkv) * sizeof(int32_t);
  SPADE_CUDA(cudaMemsetAsync(n_chunks_ + o, 0, n, s));
  SPADE_CUDA(cudaMemsetAsync(n_fine_ + o, 0, n, s));
  SPADE_CUDA(cudaMemsetAsync(n_coarse_ + o, 0, n, s));
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
  // Centers are piece-major on the device (lc_cen_off): gather row-major rows.
  auto rows = [&](const __half* blk, int maxN, int n) {
    const std::vector<__half> all = get(blk, size_t(maxN) * D);
    std::vector<float> r(size_t(n) * D);
    for (int i = 0; i < n; ++i)
      for (int d = 0; d < D; ++d) r[size_t(i) * D + d] = __half2float(all[size_t(lc_detail::lc_cen_off(maxN, i, d))]);
    return r;
  };
  o.fine_c = rows(fc_ + sh * F * D, F, o.n_fine);
  o.coarse_c = rows(gc_ + sh * G * D, G, o.n_coarse);
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
