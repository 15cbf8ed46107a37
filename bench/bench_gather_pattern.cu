// The read ceiling of attention over selections (issue 9's bar: "within 1.3x of its byte
// floor"): load-only kernels over exactly the K and V bytes SparseAttention reads, in the same
// access patterns, timed beside SparseAttention itself in the same process.
//
// Layout read (the KV pool): K and V pages [page][Hkv][P][D] bf16, P = 16, D = 128, so a row of
// one KV head is 256 B and a page-head 4 KB; Hkv = 8, the page table a shuffled permutation.
// Lists (as bench_sparse): per (request, KV head) `budget` positions, token = stratified random
// (one position in each L / budget stretch), page16 = budget / 16 random pages of 16 rows.
// Bytes per call (the floor's numerator, as bench_sparse counts them): K + V rows 2 x 256 B per
// listed row and KV head + 4 B per list entry (+ q and out for the attention rows).
//
// Kernels (no math: every 16-byte word loaded is xor-folded into a sink):
//   chain      warp = one chunk of 16 rows of a list; lanes 0-15 read the entry, then the page
//              id through the page table (the attention's dependent address chain), then the
//              warp loads the chunk's 16 K rows and 16 V rows at once (16 loads of 16 B per
//              lane in flight, 8 KB per warp); one launch, warps spread over the whole GPU
//   addr       the same loads with each row's byte offset precomputed (one coalesced hop)
//   contig     `addr` over the same number of rows laid out contiguously: the same bytes as
//              one stream (what a copy-like read of this size takes, launch and ramp included)
//   items      `chain` with SparseAttention's CTA geometry: CTA = (list, split) of the
//              planner's split count, 4 warps taking chunks w, w + 4, ..., 2 CTAs per SM
// Launched with programmatic dependent launch, like the attention (the next call's launch
// overlaps this one's tail).
// Rotation as bench_sparse: R regions of B x L tokens (>= 6.7 GB in all) and R list sets, call
// i uses region i % R, so no call finds its rows in L2.
//
// Usage: bench_gather_pattern OUT.jsonl COMMIT COMMAND [L B ...]  (default 32768 1 32768 8
//        32768 32 131072 8)
// Build: nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -Isrc
//        bench/bench_gather_pattern.cu <build>/libspade_cuda.a -lcublasLt -lcublas
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/load_stream.cuh"
#include "backend/cuda/ops.h"
#include "backend/cuda/pdl.cuh"
#include "backend/cuda/sparse_attention.h"
#include "bench_record.h"
#include "copy_bandwidth.h"
#include "rotation_timer.h"

using namespace spade;
using namespace spade::cuda;

namespace {

constexpr int Hq = 32, Hkv = 8, D = 128, P = 16, kRow = D * 2;
constexpr int kChunk = 16;  // rows per warp and chunk (one mma k-step of the attention)

struct GArgs {
  const char* K;
  const char* V;
  const int32_t* pt;        // page table of the region [B][pps]
  const int32_t* idx;       // list entries [lists][n]: positions (token) or page indices (page16)
  const long long* roff;    // addr / contig: byte offset of every row [lists * rows_per_list]
  int n, rows_per_list, pps, page16, splits;
  unsigned* sink;
};

// Byte offset of row j (< rows_per_list) of list `list`, through the page table.
__device__ __forceinline__ long long row_offset(const GArgs& a, int list, int j) {
  const int b = list / Hkv, h = list % Hkv;
  int pos;
  if (a.page16) pos = __ldg(a.idx + int64_t(list) * a.n + j / kChunk) * P + j % kChunk;
  else pos = __ldg(a.idx + int64_t(list) * a.n + j);
  const long long page = __ldg(a.pt + int64_t(b) * a.pps + pos / P);
  return ((page * Hkv + h) * P + pos % P) * kRow;
}

// The warp reads 16 rows of K and V: half-warp s takes rows 2i + s, the lane's 16 bytes at
// (lane % 16) * 16; off = this lane's row offset (lanes 0-15), -1 for none. The 32 copies of a
// lane are 16-byte cp.async into the warp's 8 KB of shared memory (buf), all in flight at once
// (register loads would let the compiler consume each before issuing the next), then one word
// per landed copy is folded.
__device__ __forceinline__ unsigned read_chunk(const char* K, const char* V, long long off, int lane,
                                               uint4* buf) {
  const int s = lane >> 4, w = lane & 15;
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(buf + lane));
  unsigned valid = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const long long o = __shfl_sync(0xffffffffu, off, 2 * i + s);
    valid |= (o >= 0 ? 3u : 0u) << (2 * i);
    const long long oc = o >= 0 ? o : 0;  // a missing row loads row 0 and is not folded
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst + 1024u * i),
                 "l"(reinterpret_cast<const uint4*>(K + oc) + w) : "memory");
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst + 1024u * i + 512u),
                 "l"(reinterpret_cast<const uint4*>(V + oc) + w) : "memory");
  }
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;" ::: "memory");
  unsigned x = 0;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const uint4 t = buf[lane + 32 * i];
    x ^= (valid >> i & 1u) ? t.x ^ t.y ^ t.z ^ t.w : 0u;
  }
  return x;
}

// chain (roff == nullptr) / addr / contig: one warp per chunk of every list.
__global__ void __launch_bounds__(256) flat_kernel(const GArgs a) {
  pdl_begin();
  const int lane = threadIdx.x & 31;
  // grid (chunks of a list / 8, lists): blockIdx.y = list, warp = chunk of it.
  const int list = blockIdx.y;
  const int j = ((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * kChunk + (lane & 15);
  long long off = -1;
  if (lane < 16)
    off = a.roff ? __ldg(a.roff + int64_t(list) * a.rows_per_list + j) : row_offset(a, list, j);
  __shared__ uint4 buf[8][16 * 32];  // 8 KB per warp
  const unsigned x = read_chunk(a.K, a.V, off, lane, buf[threadIdx.x >> 5]);
  if (x == 0x9e3779b9u) a.sink[0] = x;  // keeps the loads
}

// items: CTA = (list, split), 4 warps; warp w takes chunks w, w + 4, ... of the split.
__global__ void __launch_bounds__(128) items_kernel(const GArgs a) {
  pdl_begin();
  const int list = blockIdx.x / a.splits, sp = blockIdx.x % a.splits;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int cpl = a.rows_per_list / kChunk, per = (cpl + a.splits - 1) / a.splits;
  const int c0 = sp * per, c1 = min(cpl, c0 + per);
  __shared__ uint4 sbuf[4][16 * 32];
  unsigned x = 0;
  for (int c = c0 + warp; c < c1; c += 4) {
    const long long off = lane < 16 ? row_offset(a, list, c * kChunk + lane) : -1;
    x ^= read_chunk(a.K, a.V, off, lane, sbuf[warp]);
  }
  if (x == 0x9e3779b9u) a.sink[0] = x;
}

void run_shape(const BenchRecord& rec, double bw, int L, int B) {
  const int pps = L / P, region_pages = B * pps;
  const size_t page_bytes = size_t(Hkv) * P * kRow;  // K (or V) bytes of one page
  int R = std::max(2, int((102400 + region_pages - 1) / region_pages));
  size_t free_b = 0, total_b = 0;
  CK(cudaMemGetInfo(&free_b, &total_b));
  while (R > 2 && size_t(R) * region_pages * page_bytes * 2 + (6ull << 30) > free_b) --R;
  if (size_t(R) * region_pages * page_bytes * 2 + (5ull << 30) > free_b) {
    std::fprintf(stderr, "L=%d B=%d: does not fit, skipped\n", L, B);
    return;
  }
  const int lists = B * Hkv, max_rows = 4096;
  DeviceArena arena(size_t(R) * region_pages * page_bytes * 2 + (3ull << 30));
  char* K = reinterpret_cast<char*>(arena.alloc_n<bf16>(size_t(R) * region_pages * page_bytes / 2, "K"));
  char* V = reinterpret_cast<char*>(arena.alloc_n<bf16>(size_t(R) * region_pages * page_bytes / 2, "V"));
  fill_random_bf16(reinterpret_cast<bf16*>(K), int64_t(R) * region_pages * page_bytes / 2, 11, 1.f, 0.f, 0);
  fill_random_bf16(reinterpret_cast<bf16*>(V), int64_t(R) * region_pages * page_bytes / 2, 22, 1.f, 0.f, 0);
  bf16* q = arena.alloc_n<bf16>(size_t(R) * B * Hq * D, "q");
  bf16* o = arena.alloc_n<bf16>(size_t(B) * Hq * D, "out");
  fill_random_bf16(q, int64_t(R) * B * Hq * D, 33, 1.f, 0.f, 0);
  std::vector<int32_t> perm(region_pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::mt19937 rng(L + B);
  std::shuffle(perm.begin(), perm.end(), rng);
  int32_t* d_pt = arena.alloc_n<int32_t>(region_pages, "page table");
  CK(cudaMemcpy(d_pt, perm.data(), 4 * perm.size(), cudaMemcpyHostToDevice));
  int32_t* d_off = arena.alloc_n<int32_t>(lists + 1, "sel_off");
  int32_t* d_idx = arena.alloc_n<int32_t>(size_t(R) * lists * max_rows, "sel_idx");
  long long* d_roff = arena.alloc_n<long long>(size_t(R) * lists * max_rows, "row offsets");
  unsigned* sink = arena.alloc_n<unsigned>(1, "sink");
  std::vector<SparseSeq> seqs(B);
  for (int b = 0; b < B; ++b) seqs[b] = {perm.data() + size_t(b) * pps, pps, L};
  SparseAttention sa(arena, B, region_pages, Hq, Hkv, D, P);
  const float scale = 1.f / std::sqrt(float(D));
  const double qo_bytes = 2.0 * B * Hq * D * 2;
  int dev = 0, sms = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  // 2 CTAs per SM for items_kernel, as SparseAttention's 101 KB of shared memory allows.
  const int items_smem = 68 << 10;  // + 32 KB static: ~100 KB per CTA
  CK(cudaFuncSetAttribute(items_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, items_smem));

  for (int page16 = 0; page16 < 2; ++page16)
    for (int budget : {1024, 2048, 4096}) {
      const int n = page16 ? budget / 16 : budget;  // entries per list
      // Lists (R sets) and every row's byte offset within its region.
      std::vector<int32_t> h(size_t(R) * lists * n);
      std::vector<long long> ro(size_t(R) * lists * budget);
      for (int r = 0; r < R; ++r)
        for (int l = 0; l < lists; ++l) {
          int32_t* e = h.data() + (size_t(r) * lists + l) * n;
          if (page16) {
            std::vector<int32_t> pg(pps);
            std::iota(pg.begin(), pg.end(), 0);
            std::shuffle(pg.begin(), pg.end(), rng);
            std::sort(pg.begin(), pg.begin() + n);
            std::copy(pg.begin(), pg.begin() + n, e);
          } else {
            const double w = double(L) / n;
            for (int j = 0; j < n; ++j) {
              const int lo = int(j * w), hi = std::max(lo + 1, int((j + 1) * w));
              e[j] = lo + int(rng() % uint32_t(hi - lo));
            }
          }
          const int b = l / Hkv, hh = l % Hkv;
          for (int j = 0; j < budget; ++j) {
            const int pos = page16 ? e[j / 16] * P + j % 16 : e[j];
            const long long page = perm[size_t(b) * pps + pos / P];
            ro[(size_t(r) * lists + l) * budget + j] = ((page * Hkv + hh) * P + pos % P) * kRow;
          }
        }
      CK(cudaMemcpy(d_idx, h.data(), 4 * h.size(), cudaMemcpyHostToDevice));
      CK(cudaMemcpy(d_roff, ro.data(), 8 * ro.size(), cudaMemcpyHostToDevice));
      std::vector<int32_t> off(lists + 1);
      for (int l = 0; l <= lists; ++l) off[l] = l * n;
      CK(cudaMemcpy(d_off, off.data(), 4 * off.size(), cudaMemcpyHostToDevice));
      // Contiguous offsets: list l's rows right after list l - 1's (region-relative).
      long long* d_contig = d_roff + size_t(R - 1) * lists * budget;  // overwritten last
      const SelGran gran = page16 ? SelGran::Chunk16 : SelGran::Token;
      sa.plan(seqs, gran, Hkv, std::vector<int>(lists, n), nullptr, 0);
      const int splits = sa.max_split_used(), items = sa.n_items();
      const double kv_bytes = double(lists) * budget * 2 * kRow + double(lists) * n * 4;
      auto args = [&](int r, bool use_roff) {
        GArgs a{K + size_t(r) * region_pages * page_bytes, V + size_t(r) * region_pages * page_bytes,
                d_pt, d_idx + size_t(r) * lists * n,
                use_roff ? d_roff + size_t(r) * lists * budget : nullptr, n, budget, pps, page16,
                splits, sink};
        return a;
      };
      const dim3 flat_grid(unsigned(int64_t(budget / kChunk) * 32 / 256), unsigned(lists));
      auto emit = [&](const char* kernel, double us, double bytes, int ctas) {
        const double floor_us = bytes / bw * 1e6;
        std::fprintf(rec.out,
                     "{\"kind\":\"gather_pattern\",\"device\":\"%s\",\"date\":\"%s\",\"commit\":\"%s\","
                     "\"command\":\"%s\",\"L\":%d,\"B\":%d,\"budget\":%d,\"pattern\":\"%s\",\"kernel\":\"%s\","
                     "\"splits\":%d,\"items\":%d,\"ctas\":%d,\"rotations\":%d,\"us\":%.3f,\"bytes\":%.0f,"
                     "\"GBps\":%.1f,\"copy_GBps\":%.1f,\"floor_us\":%.3f,\"x_floor\":%.3f}\n",
                     rec.prop.name, rec.date, rec.commit, rec.command, L, B, budget,
                     page16 ? "page16" : "token", kernel, splits, items, ctas, R, us, bytes,
                     bytes / us * 1e-3, bw * 1e-9, floor_us, us / floor_us);
        std::fflush(rec.out);
        std::fprintf(stderr, "L=%6d B=%2d %-6s budget=%4d %-9s %8.2f us  x_floor %.2f\n", L, B,
                     page16 ? "page16" : "token", budget, kernel, us, us / floor_us);
      };
      // The attention itself (same lists, same regions).
      double us = time_calls(R, [&](int r) {
        sa.run(q + size_t(r) * B * Hq * D, reinterpret_cast<const bf16*>(args(r, false).K),
               reinterpret_cast<const bf16*>(args(r, false).V), d_off, d_idx + size_t(r) * lists * n,
               o, scale, 0);
      });
      emit("attention", us, kv_bytes + qo_bytes, items);
      us = time_calls(R, [&](int r) { launch_pdl(flat_kernel, flat_grid, 256, 0, 0, args(r, false)); });
      emit("chain", us, kv_bytes, int(flat_grid.x * flat_grid.y));
      us = time_calls(R, [&](int r) { launch_pdl(flat_kernel, flat_grid, 256, 0, 0, args(r, true)); });
      emit("addr", us, double(lists) * budget * 2 * kRow, int(flat_grid.x * flat_grid.y));
      us = time_calls(R, [&](int r) {
        launch_pdl(items_kernel, dim3(unsigned(lists * splits)), 128, size_t(items_smem), 0, args(r, false));
      });
      emit("items", us, kv_bytes, lists * splits);
      {
        std::vector<long long> c(size_t(lists) * budget);
        for (size_t i = 0; i < c.size(); ++i) c[i] = (long long)(i) * kRow;
        CK(cudaMemcpy(d_contig, c.data(), 8 * c.size(), cudaMemcpyHostToDevice));
        us = time_calls(R, [&](int r) {
          GArgs a = args(r, true);
          a.roff = d_contig;
          launch_pdl(flat_kernel, flat_grid, 256, 0, 0, a);
        });
        emit("contig", us, double(lists) * budget * 2 * kRow, int(flat_grid.x * flat_grid.y));
      }
    }
}

}  // namespace

int main(int argc, char** argv) {
  BenchRecord rec;
  if (!open_bench_record(argc, argv, "%Y-%m-%dT%H:%M:%SZ", rec)) return 2;
  const double bw = copy_bandwidth();
  std::fprintf(stderr, "D2D copy: %.1f GB/s\n", bw * 1e-9);
  std::vector<std::pair<int, int>> shapes;
  for (int i = 4; i + 1 < argc; i += 2) shapes.push_back({std::atoi(argv[i]), std::atoi(argv[i + 1])});
  if (shapes.empty()) shapes = {{32768, 1}, {32768, 8}, {32768, 32}, {131072, 8}};
  for (auto [L, B] : shapes) run_shape(rec, bw, L, B);
  std::fclose(rec.out);
  return 0;
}
