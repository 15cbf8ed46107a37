// BLASST decode benchmark: the v3 decode kernel with tile skipping vs the same kernel dense,
// on the BLASST paper's decode shape (table 4: Hq=32, Hkv=4, D=128, batch 64) at 32K and 64K
// (bf16, page 16), sparsity controlled by a lambda sweep on random data, as the paper's
// artifact does. Writes one JSON line per point.
//
// Per point: achieved sparsity = skipped / visited 16-token warp chunks (the kernel's
// counters, from one extra counted launch), median time of the skip kernel and of the dense
// kernel (same inputs, same plan, same process; and our default dense decode, which may draw
// its chunks, as dense_default_us), bytes = K of every token + V of the kept
// chunks + q + out, the byte-floor speed-up (dense bytes / skip bytes) next to the measured one.
// lambda = 0 is the dense instantiation; a tiny lambda (1e-9) runs the skip instantiation at
// ~0 sparsity: its time vs dense is the overhead of the skip machinery (V loaded one chunk
// late, the vote).
// Inputs: random bf16 N(0, 1) q and K/V (q x q_scale, argv[3], default 1), page ids shuffled;
// each cache is >= 8 GB at 32K x 64, far beyond L2, so one buffer suffices.
//
// Build (bench/run_gpu_blasst.sh): nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a
//   -Isrc bench/bench_blasst.cu build/libspade_cuda.a -lcublasLt -lcublas -o bench_blasst
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/attention.h"
#include "backend/cuda/ops.h"

using namespace spade;
using namespace spade::cuda;

namespace {

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median microseconds per launch of f over `reps` timed batches of `calls` launches.
template <typename F>
std::pair<double, double> time_us(F&& f, int calls, int reps) {
  cudaEvent_t a, b;
  SPADE_CUDA(cudaEventCreate(&a));
  SPADE_CUDA(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) f();
  SPADE_CUDA(cudaDeviceSynchronize());
  std::vector<float> per;
  for (int r = 0; r < reps; ++r) {
    SPADE_CUDA(cudaEventRecord(a));
    for (int i = 0; i < calls; ++i) f();
    SPADE_CUDA(cudaEventRecord(b));
    SPADE_CUDA(cudaEventSynchronize(b));
    float ms = 0;
    SPADE_CUDA(cudaEventElapsedTime(&ms, a, b));
    per.push_back(ms * 1000.f / calls);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return {median(per), *std::min_element(per.begin(), per.end())};
}

void bench(FILE* out, int Hq, int Hkv, int L, int B, float q_scale, const std::vector<double>& lambdas,
           int kernel) {
  const int D = 128, P = 16;
  const size_t page_elems = size_t(Hkv) * P * D;
  const int64_t pages_per_seq = (L + P - 1) / P, n_pages = int64_t(B) * pages_per_seq;
  const size_t cache_bytes = size_t(n_pages) * page_elems * 2 * 2;
  size_t free_b = 0, total_b = 0;
  SPADE_CUDA(cudaMemGetInfo(&free_b, &total_b));
  if (cache_bytes + (2ull << 30) > free_b) {
    std::fprintf(stderr, "L=%d B=%d: %.1f GB does not fit, skipped\n", L, B, cache_bytes / 1e9);
    return;
  }
  DeviceArena arena(cache_bytes + (256ull << 20));
  bf16* k = arena.alloc_n<bf16>(size_t(n_pages) * page_elems, "K");
  bf16* v = arena.alloc_n<bf16>(size_t(n_pages) * page_elems, "V");
  bf16* q = arena.alloc_n<bf16>(size_t(B) * Hq * D, "q");
  bf16* o = arena.alloc_n<bf16>(size_t(B) * Hq * D, "out");
  auto* counts = arena.alloc_n<unsigned long long>(size_t(2 * Hkv), "counts");
  fill_random_bf16(k, int64_t(n_pages * page_elems), 11, 1.f, 0.f, 0);
  fill_random_bf16(v, int64_t(n_pages * page_elems), 12, 1.f, 0.f, 0);
  fill_random_bf16(q, int64_t(B) * Hq * D, 13, q_scale, 0.f, 0);
  AttnLimits lim;
  lim.max_batch = B;
  lim.max_q_tokens = B;
  lim.max_pages = n_pages;
  AttentionWorkspace ws(arena, lim, Hq, Hkv, D, P);
  ws.set_decode_kernel(kernel);
  std::vector<int32_t> perm(n_pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::mt19937 rng(3);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<AttnSeq> batch(B);
  for (int b = 0; b < B; ++b) batch[b] = {perm.data() + b * pages_per_seq, int(pages_per_seq), L, 1};
  const float scale = 1.f / std::sqrt(float(D));
  const int calls = 5, reps = 15;
  // Our default dense decode (auto may draw chunks, the DYN variants) for the same step; the
  // skip kernel and its dense twin then run the static schedule planned for BLASST.
  ws.set_blasst_decode(false);
  ws.plan(batch, 0);
  const auto dense_default = time_us([&] { ws.run(q, k, v, o, scale, 0); }, calls, reps);
  const std::string default_kernel = AttentionWorkspace::decode_kernel_name(ws.decode_variant() + 1) +
                                     std::string("/") + std::to_string(ws.n_split());
  ws.set_blasst_decode(true);
  ws.plan(batch, 0);
  const auto dense = time_us([&] { ws.run(q, k, v, o, scale, 0); }, calls, reps);
  const double kv_half = double(B) * L * Hkv * D * 2;  // K (or V) bytes
  const double qo = 2.0 * B * Hq * D * 2;
  for (double lam : lambdas) {
    const BlasstSkip timed{lam > 0 ? float(std::log(lam)) : -INFINITY, nullptr};
    double sparsity = 0;
    if (lam > 0) {
      SPADE_CUDA(cudaMemset(counts, 0, sizeof(unsigned long long) * 2 * Hkv));
      ws.run(q, k, v, o, scale, 0, BlasstSkip{timed.log_lambda, counts});
      std::vector<unsigned long long> c(2 * Hkv);
      SPADE_CUDA(cudaMemcpy(c.data(), counts, c.size() * 8, cudaMemcpyDeviceToHost));
      unsigned long long t = 0, s = 0;
      for (int h = 0; h < Hkv; ++h) t += c[2 * h], s += c[2 * h + 1];
      sparsity = t ? double(s) / double(t) : 0.0;
    }
    const auto sk = lam > 0 ? time_us([&] { ws.run(q, k, v, o, scale, 0, timed); }, calls, reps) : dense;
    const double bytes = kv_half * (2.0 - sparsity) + qo;
    const double dense_bytes = 2.0 * kv_half + qo;
    std::fprintf(out,
                 "{\"kind\":\"blasst_decode\",\"L\":%d,\"B\":%d,\"Hq\":%d,\"Hkv\":%d,\"D\":%d,\"page\":%d,"
                 "\"kernel\":\"%s\",\"warps\":%d,\"splits\":%d,\"q_scale\":%.2f,\"lambda\":%.3g,"
                 "\"sparsity\":%.4f,\"us\":%.2f,\"us_min\":%.2f,\"dense_us\":%.2f,\"speedup\":%.3f,"
                 "\"byte_floor_speedup\":%.3f,\"bytes\":%.0f,\"GBps\":%.1f,\"dense_GBps\":%.1f,"
                 "\"dense_default_us\":%.2f,\"dense_default_kernel\":\"%s\",\"speedup_vs_default\":%.3f}\n",
                 L, B, Hq, Hkv, D, P,
                 AttentionWorkspace::decode_kernel_name(ws.decode_variant() + 1), ws.decode_warps(),
                 ws.n_split(), q_scale, lam, sparsity, sk.first, sk.second, dense.first,
                 dense.first / sk.first, dense_bytes / bytes, bytes, bytes / sk.first * 1e-3,
                 dense_bytes / dense.first * 1e-3, dense_default.first, default_kernel.c_str(),
                 dense_default.first / sk.first);
    std::fflush(out);
  }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string mode = argc > 1 ? argv[1] : "paper";
    FILE* out = argc > 2 ? std::fopen(argv[2], "w") : stdout;
    const float q_scale = argc > 3 ? std::stof(argv[3]) : 1.f;
    std::fprintf(stderr, "device: %s\n", device_summary().c_str());
    const std::vector<double> sweep = {0,   1e-9, 0.02, 0.05, 0.1, 0.15, 0.2, 0.25,
                                       0.3, 0.35, 0.4,  0.5,  0.6, 0.7,  0.8};
    if (mode == "paper" || mode == "all")  // BLASST table 4 shape
      for (int L : {32768, 65536}) bench(out, 32, 4, L, 64, q_scale, sweep, 1);
    if (mode == "llama" || mode == "all")  // Llama-3-8B shape, the other v3 variant (w8)
      for (int B : {1, 8}) bench(out, 32, 8, 32768, B, q_scale, {0, 1e-9, 0.1, 0.3, 0.5}, 1);
    if (out != stdout) std::fclose(out);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_blasst: %s\n", e.what());
    return 1;
  }
  return 0;
}
