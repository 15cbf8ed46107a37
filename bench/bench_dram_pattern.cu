// How the placement of 4 KB page-heads and the CTA mapping change the HBM read bandwidth a
// decode-attention-like stream gets (no attention math: every byte is loaded and xor-folded).
//
// Layout read (as the paged KV cache): K and V arrays of pages [page][Hkv][4 KB], one 4 KB
// piece = 16 tokens x 128 dims x bf16 of one KV head. A stream = (sequence, split, KV head)
// reads its pieces of K and V; bytes per run = B x L x Hkv x 256 x 2.
// Placements: contig (each head's pieces one contiguous region: SDPA's [B, Hkv, L, D] cache),
// sequential (pages of a sequence in id order: a fresh pool), shuffled (pages at random).
// Mappings: per_head (CTA = stream, 4 warps take pieces w, w + 4, ...: our v3 decode kernel),
// per_seq (CTA = (sequence, split), warp h reads head h's pieces in order: the CTA reads whole
// 32 KB pages at once).
// Loads: regs = 16-byte ld.global.nc.L1::no_allocate, one K piece and one V piece (16 per lane)
// in flight per warp and iteration; bulk_ring3 = 1-D bulk copies into a 3-stage shared-memory
// ring per warp (24 KB in flight per warp, as the decode kernel's cp.async ring).
// Usage: bench_dram_pattern OUT.jsonl COMMIT COMMAND
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/load_stream.cuh"
#include "bench_record.h"


namespace {

constexpr int kHkv = 8;
constexpr int kPiece = 4096;  // bytes of one page-head

using spade::cuda::ld_stream;

// One warp reads piece (page, head) of K and V: 2 x 4 KB, 8 loads of 16 bytes per lane each.
__device__ __forceinline__ unsigned read_piece(const char* K, const char* V, long long off,
                                               int lane) {
  const uint4* k = reinterpret_cast<const uint4*>(K + off) + lane;
  const uint4* v = reinterpret_cast<const uint4*>(V + off) + lane;
  uint4 a[8], b[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) a[i] = ld_stream(k + 32 * i), b[i] = ld_stream(v + 32 * i);
  unsigned x = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) x ^= a[i].x ^ a[i].y ^ a[i].z ^ a[i].w ^ b[i].x ^ b[i].y ^ b[i].z ^ b[i].w;
  return x;
}

// Bulk ring: lane 0 of each warp keeps `stages` pieces (K + V, 8 KB each) in flight with 1-D
// bulk copies (cp.async.bulk, completion on a per-stage mbarrier); the warp folds one word of
// each landed stage. Shared memory per warp: stages x 8 KB + barriers. evict_first: the copies
// carry an L2 evict-first policy (streamed once).
__device__ __forceinline__ void bulk_issue(uint32_t dst, const char* src, uint32_t bar,
                                           bool evict_first, uint64_t pol) {
  if (evict_first)
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], 4096, [%2], %3;\n" ::"r"(dst),
        "l"(src), "r"(bar), "l"(pol)
        : "memory");
  else
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], 4096, [%2];\n" ::"r"(dst),
        "l"(src), "r"(bar)
        : "memory");
}
__device__ __forceinline__ void bar_expect(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bar_wait(uint32_t bar, int parity) {
  uint32_t ok = 0;
  do {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(ok)
                 : "r"(bar), "r"(parity)
                 : "memory");
  } while (!ok);
}

// pages: [B][n_pages] page ids; contig: piece j of (b, h) at ((b * Hkv + h) * n_pages + j) * 4 KB.
__device__ __forceinline__ long long piece_off(const int* pages, int n_pages, int b, int h, int j,
                                               bool contig) {
  const long long idx = contig ? (static_cast<long long>(b) * kHkv + h) * n_pages + j
                               : static_cast<long long>(pages[static_cast<long long>(b) * n_pages + j]) * kHkv + h;
  return idx * kPiece;
}

__device__ unsigned warp_regs(const char* K, const char* V, const int* pages, int n_pages, int b,
                              int h, int j, int j1, int step, bool contig, int lane) {
  unsigned x = 0;
  for (; j < j1; j += step) x ^= read_piece(K, V, piece_off(pages, n_pages, b, h, j, contig), lane);
  return x;
}

extern __shared__ __align__(1024) unsigned char g_smem[];

// slot: the warp's ring in shared memory.
struct BulkOpt {
  int stages;
  bool evict_first;
};

__device__ unsigned warp_bulk(const char* K, const char* V, const int* pages, int n_pages, int b,
                              int h, int j, int j1, int step, bool contig, int slot, BulkOpt opt) {
  const int lane = threadIdx.x & 31;
  const int kStages = opt.stages;
  uint64_t pol = 0;
  if (opt.evict_first) asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(pol));
  unsigned char* ring = g_smem + size_t(slot) * (kStages * 8192 + 64);
  const uint32_t ring_s = static_cast<uint32_t>(__cvta_generic_to_shared(ring));
  const uint32_t bar0 = ring_s + kStages * 8192;
  if (lane == 0)
    for (int s = 0; s < kStages; ++s)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar0 + 8 * s) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  __syncwarp();
  const int n = j < j1 ? (j1 - j + step - 1) / step : 0;
  auto issue = [&](int i) {
    const int s = i % kStages;
    const long long off = piece_off(pages, n_pages, b, h, j + i * step, contig);
    bar_expect(bar0 + 8 * s, 8192);
    bulk_issue(ring_s + s * 8192, K + off, bar0 + 8 * s, opt.evict_first, pol);
    bulk_issue(ring_s + s * 8192 + 4096, V + off, bar0 + 8 * s, opt.evict_first, pol);
  };
  if (lane == 0)
    for (int i = 0; i < kStages && i < n; ++i) issue(i);
  unsigned x = 0;
  for (int i = 0; i < n; ++i) {
    const int s = i % kStages;
    bar_wait(bar0 + 8 * s, (i / kStages) & 1);
    x ^= reinterpret_cast<const unsigned*>(ring + s * 8192)[lane * 64];
    __syncwarp();
    if (lane == 0 && i + kStages < n) issue(i + kStages);
  }
  return x;
}

// per_head: grid (Hkv, splits, B), 4 warps.
__global__ void __launch_bounds__(128) per_head_kernel(const char* K, const char* V, const int* pages,
                                                       int n_pages, int splits, bool contig,
                                                       bool bulk, BulkOpt opt, unsigned* sink) {
  const int h = blockIdx.x, sp = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int per = (n_pages + splits - 1) / splits, j0 = sp * per, j1 = min(n_pages, j0 + per);
  const unsigned x = bulk ? warp_bulk(K, V, pages, n_pages, b, h, j0 + warp, j1, 4, contig, warp, opt)
                          : warp_regs(K, V, pages, n_pages, b, h, j0 + warp, j1, 4, contig, lane);
  if (x == 0x9e3779b9u) sink[0] = x;  // keeps the loads
}

// per_seq: grid (splits, B), Hkv warps; warp h reads head h's pieces in order.
__global__ void __launch_bounds__(256) per_seq_kernel(const char* K, const char* V, const int* pages,
                                                      int n_pages, int splits, bool contig,
                                                      bool bulk, BulkOpt opt, unsigned* sink) {
  const int sp = blockIdx.x, b = blockIdx.y;
  const int h = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int per = (n_pages + splits - 1) / splits, j0 = sp * per, j1 = min(n_pages, j0 + per);
  const unsigned x = bulk ? warp_bulk(K, V, pages, n_pages, b, h, j0, j1, 1, contig, h, opt)
                          : warp_regs(K, V, pages, n_pages, b, h, j0, j1, 1, contig, lane);
  if (x == 0x9e3779b9u) sink[0] = x;
}

}  // namespace

int main(int argc, char** argv) {
  BenchRecord rec;
  if (!open_bench_record(argc, argv, "%Y-%m-%dT%H:%M:%SZ", rec)) return 2;
  FILE* out = rec.out;
  const cudaDeviceProp& prop = rec.prop;
  const char* date = rec.date;
  const long long max_bytes = 4ll << 30;  // per array (K or V)
  char *K = nullptr, *V = nullptr;
  unsigned* sink = nullptr;
  CK(cudaMalloc(&K, max_bytes));
  CK(cudaMalloc(&V, max_bytes));
  CK(cudaMalloc(&sink, 4));
  CK(cudaMemset(K, 1, max_bytes));
  CK(cudaMemset(V, 2, max_bytes));
  int* d_pages = nullptr;
  CK(cudaMalloc(&d_pages, sizeof(int) * (max_bytes / kPiece / kHkv)));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  struct Shape {
    int L, B, splits_head, splits_seq;
  };
  // splits: the decode kernel's at these shapes (w4s3: 2 CTAs/SM); per_seq ~128 CTAs, 1 per SM.
  // Dynamic shared memory (the ring; the rest unused) pins the residency: cta_per_sm CTAs/SM.
  CK(cudaFuncSetAttribute(per_head_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 220 << 10));
  CK(cudaFuncSetAttribute(per_seq_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 220 << 10));
  struct Config {
    int mapping;  // 0 per_head, 1 per_seq
    bool bulk;
    int stages, ctas_per_sm;
    bool evict_first;
  };
  // The first four: the decode kernel's shapes (4 warps x 3 stages x 2 CTAs/SM = 192 KB in
  // flight per SM; per_seq 8 warps x 3 stages); then less or more in flight, and an L2 hint.
  const Config configs[] = {{0, false, 3, 2, false}, {1, false, 3, 1, false}, {0, true, 3, 2, false},
                            {1, true, 3, 1, false},  {0, true, 2, 2, false},  {0, true, 2, 3, false},
                            {0, true, 4, 1, false},  {1, true, 2, 1, false},  {0, true, 3, 2, true}};
  const Shape shapes[] = {{32768, 8, 4, 16}, {32768, 32, 1, 4}, {131072, 8, 4, 16}, {131072, 1, 32, 128}};
  for (const Shape& s : shapes) {
    const int n_pages = s.L / 16;
    const long long bytes = 2ll * s.B * n_pages * kHkv * kPiece;
    if (bytes / 2 > max_bytes) continue;
    for (int order = 0; order < 3; ++order) {  // contig, sequential, shuffled
      std::vector<int> perm(size_t(s.B) * n_pages);
      std::iota(perm.begin(), perm.end(), 0);
      if (order == 2) std::shuffle(perm.begin(), perm.end(), std::mt19937(1));
      CK(cudaMemcpy(d_pages, perm.data(), sizeof(int) * perm.size(), cudaMemcpyHostToDevice));
      const bool contig = order == 0;
      for (const Config& c : configs) {
        const int warps = c.mapping == 0 ? 4 : kHkv;
        const size_t ring = size_t(warps) * (c.stages * 8192 + 64);
        const size_t smem = std::max(ring, size_t(220 << 10) / c.ctas_per_sm - 2048);
        const BulkOpt opt{c.stages, c.evict_first};
        auto launch = [&] {
          if (c.mapping == 0)
            per_head_kernel<<<dim3(kHkv, s.splits_head, s.B), 128, smem>>>(K, V, d_pages, n_pages, s.splits_head, contig, c.bulk, opt, sink);
          else
            per_seq_kernel<<<dim3(s.splits_seq, s.B), 256, smem>>>(K, V, d_pages, n_pages, s.splits_seq, contig, c.bulk, opt, sink);
        };
        for (int i = 0; i < 3; ++i) launch();
        CK(cudaDeviceSynchronize());
        std::vector<float> per;
        for (int r = 0; r < 20; ++r) {
          CK(cudaEventRecord(e0));
          for (int i = 0; i < 4; ++i) launch();
          CK(cudaEventRecord(e1));
          CK(cudaEventSynchronize(e1));
          float ms = 0;
          CK(cudaEventElapsedTime(&ms, e0, e1));
          per.push_back(ms * 1000.f / 4);
        }
        CK(cudaGetLastError());
        std::sort(per.begin(), per.end());
        const double us = per[per.size() / 2];
        static const char* kOrder[] = {"contig", "sequential", "shuffled"};
        char loads[64];
        if (c.bulk) std::snprintf(loads, sizeof loads, "bulk_ring%d%s", c.stages, c.evict_first ? "_evict_first" : "");
        else std::snprintf(loads, sizeof loads, "regs");
        std::fprintf(out,
                     "{\"kind\":\"dram_pattern\",\"device\":\"%s\",\"date\":\"%s\",\"commit\":\"%s\","
                     "\"command\":\"%s\",\"L\":%d,\"B\":%d,\"Hkv\":%d,\"placement\":\"%s\",\"mapping\":\"%s\",\"loads\":\"%s\","
                     "\"ctas\":%d,\"ctas_per_sm\":%d,\"bytes_in_flight_per_sm\":%d,\"us\":%.3f,\"us_min\":%.3f,\"bytes\":%lld,\"GBps\":%.1f}\n",
                     prop.name, date, argv[2], argv[3], s.L, s.B, kHkv, kOrder[order],
                     c.mapping == 0 ? "per_head" : "per_seq", loads,
                     c.mapping == 0 ? kHkv * s.splits_head * s.B : s.splits_seq * s.B, c.ctas_per_sm,
                     c.bulk ? c.ctas_per_sm * warps * c.stages * 8192 : c.ctas_per_sm * warps * 8192,
                     us, per[0], bytes, bytes / us * 1e-3);
        std::fflush(out);
      }
    }
  }
  std::fclose(out);
  return 0;
}
