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
  set_build_sort_smem(big);
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
