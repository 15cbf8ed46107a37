// The read ceiling of the Twilight estimate's access pattern (docs/cuda_twilight.md): what a
// kernel that only loads the bytes the estimate must read gets from HBM, no math.
//
// Layout read (as the INT4 key copy, twilight.h): codes [page][Hkv][16][64 B] and scale/zero
// [page][Hkv][16][4 B], D = 128, page = 16 tokens. A list = (sequence, KV head) reads `sel`
// page-heads picked at random among its sequence's pages (a Quest selection): 1 KB of codes
// + 64 B of scale/zero each, 1088 B (the estimate's floor bytes).
// Placements: quest (the pages of each list at random in a shuffled pool, as the estimate
// reads them), contig (each list's 1088 B pieces one after another: a streamed copy of the
// same bytes).
// Kernel: a warp takes page-heads w, w + warps, ... of its list; per page-head the 32 lanes
// load the 1 KB of codes (two 16-byte loads each) and lanes 0..15 the 64 B of scale/zero;
// U page-heads' loads are issued before any is folded (xor into a sink).
// Rotation: R pools, call i reads pool i % R (each > the 50 MB L2).
// Build: nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -Isrc
//   bench/bench_int4_pattern.cu <libspade_cuda.a> -o bench_int4_pattern
// Usage: bench_int4_pattern OUT.jsonl COMMIT COMMAND   (JSON lines: device, date, commit,
// command, placement, B, lists, bytes, us, GB/s, copy GB/s, x of the copy floor)
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <numeric>
#include <random>
#include <vector>

#include "backend/cuda/load_stream.cuh"
#include "bench_record.h"
#include "copy_bandwidth.h"


namespace {

constexpr int kHkv = 8, kCodeBytes = 1024, kSzBytes = 64, kU = 4;
using spade::cuda::ld_stream;

// offs[list][sel]: byte offsets of the page-head's codes (in codes) and scale/zero (in sz).
__global__ void __launch_bounds__(128) pattern_kernel(const char* codes, const char* sz,
                                                      const long long* code_off,
                                                      const long long* sz_off, int sel,
                                                      int warps_per_list, unsigned* sink) {
  const int list = blockIdx.y, lane = threadIdx.x & 31;
  const int w = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (w >= warps_per_list) return;
  unsigned x = 0;
  for (int j0 = w; j0 < sel; j0 += kU * warps_per_list) {
    uint4 a[kU], b[kU];
    unsigned s[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int j = j0 + u * warps_per_list;
      if (j < sel) {
        const long long i = static_cast<long long>(list) * sel + j;
        const uint4* c = reinterpret_cast<const uint4*>(codes + code_off[i]);
        a[u] = ld_stream(c + lane), b[u] = ld_stream(c + 32 + lane);
        s[u] = lane < 16 ? reinterpret_cast<const unsigned*>(sz + sz_off[i])[lane] : 0u;
      } else {
        a[u] = b[u] = make_uint4(0, 0, 0, 0), s[u] = 0;
      }
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) x ^= a[u].x ^ a[u].y ^ a[u].z ^ a[u].w ^ b[u].x ^ b[u].w ^ s[u];
  }
  if (x == 0x9e3779b9u) sink[0] = x;  // keeps the loads
}

}  // namespace

int main(int argc, char** argv) {
  BenchRecord rec;
  if (!open_bench_record(argc, argv, "%Y-%m-%d", rec)) return 2;
  FILE* out = rec.out;
  const cudaDeviceProp& prop = rec.prop;
  const char* date = rec.date;
  const double copy_bw = copy_bandwidth();  // the floors' denominator (bench/copy_bandwidth.h)
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  float ms = 0;
  unsigned* sink;
  CK(cudaMalloc(&sink, 4));
  const int pages_per_seq = 2048, sel = 512;  // 32K context, Quest budget 8192 tokens
  for (int B : {1, 8, 32}) {
    const int lists = B * kHkv;
    const long long pool_pages = static_cast<long long>(B) * pages_per_seq;
    const size_t code_bytes = size_t(pool_pages) * kHkv * kCodeBytes, sz_bytes = size_t(pool_pages) * kHkv * kSzBytes;
    const double bytes = double(lists) * sel * (kCodeBytes + kSzBytes);
    const int R = std::max<int>(2, int(std::ceil(200e6 / double(code_bytes + sz_bytes))) + 1);
    for (int contig = 0; contig < 2; ++contig) {
      std::vector<char*> pc(static_cast<size_t>(R)), ps(static_cast<size_t>(R));
      std::vector<long long*> dco(static_cast<size_t>(R)), dso(static_cast<size_t>(R));
      std::mt19937 rng(1234u + unsigned(B));
      for (int r = 0; r < R; ++r) {
        CK(cudaMalloc(&pc[size_t(r)], code_bytes));
        CK(cudaMalloc(&ps[size_t(r)], sz_bytes));
        CK(cudaMemset(pc[size_t(r)], r + 1, code_bytes));
        CK(cudaMemset(ps[size_t(r)], r + 1, sz_bytes));
        // A shuffled pool: sequence b's pages are random page ids; each list picks `sel`.
        std::vector<long long> ids(static_cast<size_t>(pool_pages));
        std::iota(ids.begin(), ids.end(), 0LL);
        std::shuffle(ids.begin(), ids.end(), rng);
        std::vector<long long> co(size_t(lists) * sel), so(co.size());
        for (int b = 0; b < B; ++b) {
          for (int h = 0; h < kHkv; ++h) {
            std::vector<int> pick(pages_per_seq);
            std::iota(pick.begin(), pick.end(), 0);
            std::shuffle(pick.begin(), pick.end(), rng);
            pick.resize(sel);
            std::sort(pick.begin(), pick.end());
            for (int j = 0; j < sel; ++j) {
              const size_t i = (size_t(b) * kHkv + h) * sel + j;
              const long long ph = contig ? static_cast<long long>(i)
                                          : ids[size_t(b) * pages_per_seq + size_t(pick[size_t(j)])] * kHkv + h;
              co[i] = ph * kCodeBytes;
              so[i] = ph * kSzBytes;
            }
          }
        }
        CK(cudaMalloc(&dco[size_t(r)], co.size() * 8));
        CK(cudaMalloc(&dso[size_t(r)], so.size() * 8));
        CK(cudaMemcpy(dco[size_t(r)], co.data(), co.size() * 8, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dso[size_t(r)], so.data(), so.size() * 8, cudaMemcpyHostToDevice));
      }
      // Warps per list: ~16 resident warps per SM over all lists, at least 1 page-head each.
      const int wpl = std::max(1, std::min(sel, prop.multiProcessorCount * 16 / lists));
      const dim3 grid(unsigned((wpl + 3) / 4), unsigned(lists));
      auto run = [&](int i) {
        const int r = i % R;
        pattern_kernel<<<grid, 128>>>(pc[size_t(r)], ps[size_t(r)], dco[size_t(r)], dso[size_t(r)], sel, wpl, sink);
      };
      for (int i = 0; i < 2 * R; ++i) run(i);
      CK(cudaDeviceSynchronize());
      std::vector<float> per;
      const int calls = 20;
      for (int rep = 0; rep < 15; ++rep) {
        CK(cudaEventRecord(e0));
        for (int i = 0; i < calls; ++i) run(i);
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        CK(cudaEventElapsedTime(&ms, e0, e1));
        per.push_back(ms * 1e3f / calls);
      }
      std::sort(per.begin(), per.end());
      const double us = per[per.size() / 2], floor_us = bytes / copy_bw * 1e6;
      std::fprintf(out,
                   "{\"device\":\"%s\",\"date\":\"%s\",\"commit\":\"%s\",\"command\":\"%s\","
                   "\"placement\":\"%s\",\"B\":%d,\"lists\":%d,\"page_heads_per_list\":%d,"
                   "\"warps_per_list\":%d,\"bytes\":%.0f,\"us\":%.3f,\"GBps\":%.1f,"
                   "\"copy_GBps\":%.1f,\"floor_us\":%.3f,\"x_floor\":%.3f}\n",
                   prop.name, date, argv[2], argv[3], contig ? "contig" : "quest", B, lists, sel, wpl,
                   bytes, us, bytes / us * 1e-3, copy_bw * 1e-9, floor_us, us / floor_us);
      std::fflush(out);
      std::fprintf(stderr, "B=%d %s: %.2f us, %.1f GB/s, %.2fx the copy floor\n", B,
                   contig ? "contig" : "quest", us, bytes / us * 1e-3, us / floor_us);
      for (int r = 0; r < R; ++r) {
        CK(cudaFree(pc[size_t(r)]));
        CK(cudaFree(ps[size_t(r)]));
        CK(cudaFree(dco[size_t(r)]));
        CK(cudaFree(dso[size_t(r)]));
      }
    }
  }
  std::fclose(out);
  return 0;
}
