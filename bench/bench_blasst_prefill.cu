// BLASST prefill benchmark: the wgmma prefill kernel with tile skipping (SKIP instantiation,
// AttentionWorkspace::run(..., BlasstSkip)) vs the same kernel dense, causal, D = 128, page 16;
// and (3.) the generic mma.sync prefill kernel at SmolLM2's shape (Hq 9, Hkv 3, D = 64).
//
// 1. Sweep (the paper's Table 4 / Figure 5 shape): Hq = Hkv = 1, batch 148, L = 32K and 64K.
//    Data: "tile levels": q = (8, N(0,1) x 127), k = (c_j / (8 * scale), N(0,1) x 127) where
//    c_j ~ U[0, 16) is one level per 128-key tile j of a sequence (all rows see the same level
//    of a tile, the random part adds N(0,1) per score). The gap of tile j to the running max is
//    then roughly c_j - max_{i<j} c_i, spread over [-16, 0], so a lambda sweep walks the
//    sparsity from 0 to ~95% (i.i.d. random scores cannot: with 64-row blocks a tile holds some
//    row's new record so often that even lambda = 1 skips < 50%). V ~ N(0,1).
//    Per point: achieved sparsity = skipped / tiles from the kernel's counters, dense and skip
//    times (CUDA events, 1 warm-up, median of `reps`), TFLOP/s (dense-equivalent FLOPs
//    4 * D * B * L(L+1)/2 / time) and speed-up dense / skip. Dense is timed before and after
//    the sweep (both reported; the speed-up uses their mean).
// 2. Overhead at zero sparsity: Hq = 32, Hkv = 8, B = 1, L = 8K and 32K, random N(0,1) q/k/v,
//    ln(lambda) = -80 (nothing skips): dense and skip interleaved, median of 21 each.
// 3. "smollm2": sweep 1's data and lambdas at Hq 9 / Hkv 3 / D 64 (the generic kernel's skip
//    instance vs its dense one), L = 8K (batch 32) and 32K (batch 8).
// Output: JSON lines (argv[1]) with device, date, commit (argv[2]) and command (argv[3]).
//
// Build (bench/run_gpu_blasst_prefill.sh / prebuild): nvcc -std=c++17 -O2
//   -gencode=arch=compute_90a,code=sm_90a -Isrc bench/bench_blasst_prefill.cu
//   build/libspade_cuda.a -lcublasLt -lcublas -o bench_blasst_prefill
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/attention.h"
#include "backend/cuda/ops.h"

using namespace spade;
using namespace spade::cuda;

namespace {

const int P = 16;

__device__ __forceinline__ uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

// q[t][h][0] = a for every row; k[pos][h][0] = c_{pos/128} / (a * scale) (one level per tile).
__global__ void plant_q(bf16* q, int64_t rows, float a, int D) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < rows; i += int64_t(gridDim.x) * blockDim.x)
    q[i * D] = __float2bfloat16(a);
}
__global__ void plant_k(bf16* k, const int32_t* pt, int pages_per_seq, int B, int L, int Hkv,
                        float a, float scale, float C, uint32_t seed, int D) {
  const int64_t n = int64_t(B) * L * Hkv;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int h = int(i % Hkv);
    const int64_t tok = i / Hkv;
    const int b = int(tok / L), pos = int(tok % L);
    const uint32_t r = mix32(seed ^ mix32(uint32_t(b) * 0x9e3779b9U ^ mix32(uint32_t(pos / 128) * 0x85ebca6bU + h)));
    const float c = C * float(r >> 8) * (1.f / 16777216.f);
    const int64_t page = pt[int64_t(b) * pages_per_seq + pos / P];
    k[((page * Hkv + h) * P + pos % P) * D] = __float2bfloat16(c / (a * scale));
  }
}

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Ctx {
  FILE* out;
  std::string device, date, commit, command;
};

struct Setup {
  int Hq, Hkv, B, L, D;
  int64_t pages_per_seq, n_pages;
  DeviceArena arena;
  bf16 *k, *v, *q, *o;
  unsigned long long* counts;
  std::vector<int32_t> perm;
  std::unique_ptr<AttentionWorkspace> ws;
  std::vector<AttnSeq> batch;
  cudaEvent_t e0, e1;
  Setup(int hq, int hkv, int b, int l, int d = 128)
      : Hq(hq), Hkv(hkv), B(b), L(l), D(d), pages_per_seq((l + P - 1) / P), n_pages(int64_t(b) * pages_per_seq),
        arena(size_t(n_pages) * Hkv * P * d * 2 * 2 + size_t(b) * l * hq * d * 2 * 2 + (256ull << 20)) {
    const size_t kv_n = size_t(n_pages) * Hkv * P * D, q_n = size_t(B) * L * Hq * D;
    k = arena.alloc_n<bf16>(kv_n, "K");
    v = arena.alloc_n<bf16>(kv_n, "V");
    q = arena.alloc_n<bf16>(q_n, "q");
    o = arena.alloc_n<bf16>(q_n, "out");
    counts = arena.alloc_n<unsigned long long>(size_t(2 * Hkv), "counts");
    fill_random_bf16(k, int64_t(kv_n), 1, 1.f, 0.f, 0);
    fill_random_bf16(v, int64_t(kv_n), 2, 1.f, 0.f, 0);
    fill_random_bf16(q, int64_t(q_n), 3, 1.f, 0.f, 0);
    AttnLimits lim;
    lim.max_batch = B;
    lim.max_q_tokens = int64_t(B) * L;
    lim.max_pages = n_pages;
    lim.max_split = 1;
    ws = std::make_unique<AttentionWorkspace>(arena, lim, Hq, Hkv, D, P);
    perm.resize(size_t(n_pages));
    std::iota(perm.begin(), perm.end(), 0);
    std::mt19937 rng(7);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int i = 0; i < B; ++i) batch.push_back({perm.data() + i * pages_per_seq, int(pages_per_seq), L, L});
    SPADE_CUDA(cudaEventCreate(&e0));
    SPADE_CUDA(cudaEventCreate(&e1));
  }
  ~Setup() {
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
  }
  void plant(float C) {
    int32_t* pt = arena.alloc_n<int32_t>(perm.size(), "page table copy");
    SPADE_CUDA(cudaMemcpy(pt, perm.data(), perm.size() * 4, cudaMemcpyHostToDevice));
    const float a = 8.f, scale = 1.f / std::sqrt(float(D));
    plant_q<<<4096, 256>>>(q, int64_t(B) * L * Hq, a, D);
    plant_k<<<4096, 256>>>(k, pt, int(pages_per_seq), B, L, Hkv, a, scale, C, 12345u, D);
    SPADE_CUDA(cudaDeviceSynchronize());
  }
  double flops() const { return 4.0 * D * Hq * B * (double(L) * (L + 1) / 2); }
  float time_once(const BlasstSkip& sk) {
    const float scale = 1.f / std::sqrt(float(D));
    SPADE_CUDA(cudaEventRecord(e0));
    ws->run(q, k, v, o, scale, 0, sk);
    SPADE_CUDA(cudaEventRecord(e1));
    SPADE_CUDA(cudaEventSynchronize(e1));
    float ms = 0;
    SPADE_CUDA(cudaEventElapsedTime(&ms, e0, e1));
    return ms;
  }
  float time_median(const BlasstSkip& sk, int reps) {
    time_once(sk);  // warm-up
    std::vector<float> t;
    for (int i = 0; i < reps; ++i) t.push_back(time_once(sk));
    return median(t);
  }
  // One counted launch: {tiles, skipped} summed over KV heads.
  std::pair<unsigned long long, unsigned long long> count(float ln_lambda) {
    SPADE_CUDA(cudaMemset(counts, 0, sizeof(unsigned long long) * 2 * Hkv));
    BlasstSkip sk{ln_lambda, counts};
    ws->run(q, k, v, o, 1.f / std::sqrt(float(D)), 0, sk);
    std::vector<unsigned long long> h(size_t(2 * Hkv));
    SPADE_CUDA(cudaMemcpy(h.data(), counts, h.size() * 8, cudaMemcpyDeviceToHost));
    unsigned long long t = 0, s = 0;
    for (int i = 0; i < Hkv; ++i) t += h[2 * i], s += h[2 * i + 1];
    return {t, s};
  }
};

void header(const Ctx& c, char* buf, size_t n) {
  std::snprintf(buf, n, "\"device\":\"%s\",\"date\":\"%s\",\"commit\":\"%s\",\"command\":\"%s\"",
                c.device.c_str(), c.date.c_str(), c.commit.c_str(), c.command.c_str());
}

// Dense runs the default kernel, the 3-stage ring with P V one tile behind (kern 2; the
// 2-stage ring was 0-5% slower); the skip kernel always runs on 3 stages (attention_prefill.cu).
// kern 0: the generic mma.sync kernel (D = 64, SmolLM2's shape), which skips per warp (32 rows
// x 64 keys) and loads every K/V tile.
void sweep(const Ctx& c, int L, int B, int reps, int Hq = 1, int Hkv = 1, int D = 128, int kern = 2) {
  const int stages = kern == 2 ? 3 : kern == 1 ? 2 : 0;
  Setup s(Hq, Hkv, B, L, D);
  s.plant(16.f);
  s.ws->set_prefill_kernel(kern);
  s.ws->plan(s.batch, 0);
  if (kern >= 1 && !s.ws->prefill_wgmma_active()) {
    std::fprintf(stderr, "wgmma prefill not active: skipped\n");
    return;
  }
  const float dense0 = s.time_median({}, reps);
  const float lams[] = {-80.f, -16.f, -13.f, -11.f, -9.f, -7.f, -5.f, -4.f, -3.f, -2.f, -1.f, 0.f};
  struct Pt { float lam, ms; unsigned long long tiles, skipped; };
  std::vector<Pt> pts;
  for (float lam : lams) {
    auto [t, sk] = s.count(lam);
    const float ms = s.time_median({lam, nullptr}, reps);
    pts.push_back({lam, ms, t, sk});
    std::fprintf(stderr, "L=%d B=%d Hq=%d Hkv=%d D=%d ln_lambda=%g sparsity=%.3f skip %.2f ms (dense %.2f)\n", L, B,
                 Hq, Hkv, D, lam, t ? double(sk) / double(t) : 0.0, ms, dense0);
  }
  const float dense1 = s.time_median({}, reps);
  const double dense = 0.5 * (dense0 + dense1);
  char h[512];
  header(c, h, sizeof(h));
  for (auto& p : pts) {
    std::fprintf(c.out,
                 "{%s,\"kind\":\"blasst_prefill\",\"kernel\":\"%s\",\"data\":\"tile_levels_U0_16\",\"L\":%d,\"B\":%d,\"Hq\":%d,"
                 "\"Hkv\":%d,\"D\":%d,\"page\":%d,\"dense_stages\":%d,\"skip_stages\":%d,\"reps\":%d,\"ln_lambda\":%g,\"tiles\":%llu,"
                 "\"skipped\":%llu,\"sparsity\":%.4f,\"dense_ms\":%.3f,\"dense_ms_before\":%.3f,"
                 "\"dense_ms_after\":%.3f,\"skip_ms\":%.3f,\"dense_TFLOPs\":%.1f,\"skip_TFLOPs_equiv\":%.1f,"
                 "\"speedup\":%.3f}\n",
                 h, kern == 0 ? "generic_mma_sync" : "wgmma", L, B, Hq, Hkv, D, P, stages, kern == 0 ? 0 : 3, reps,
                 p.lam, p.tiles, p.skipped, p.tiles ? double(p.skipped) / double(p.tiles) : 0.0, dense, dense0,
                 dense1, p.ms, s.flops() / dense * 1e-9, s.flops() / p.ms * 1e-9, dense / p.ms);
    std::fflush(c.out);
  }
}

void overhead(const Ctx& c, int L, int stages) {
  Setup s(32, 8, 1, L);
  s.ws->set_prefill_kernel(stages == 3 ? 2 : 1);  // the dense kernel's ring; skip: 3 stages
  s.ws->plan(s.batch, 0);
  if (!s.ws->prefill_wgmma_active()) return;
  auto [t, sk] = s.count(-80.f);
  const BlasstSkip off{}, on{-80.f, nullptr};
  for (int i = 0; i < 3; ++i) s.time_once(off), s.time_once(on);
  std::vector<float> td, ts;
  for (int i = 0; i < 21; ++i) td.push_back(s.time_once(off)), ts.push_back(s.time_once(on));
  const double d = median(td), k = median(ts);
  char h[512];
  header(c, h, sizeof(h));
  std::fprintf(c.out,
               "{%s,\"kind\":\"blasst_prefill_overhead\",\"data\":\"random_N01\",\"L\":%d,\"B\":1,\"Hq\":32,"
               "\"Hkv\":8,\"D\":%d,\"page\":%d,\"dense_stages\":%d,\"skip_stages\":3,\"reps\":21,\"ln_lambda\":-80,\"tiles\":%llu,"
               "\"skipped\":%llu,\"dense_ms\":%.4f,\"skip_ms\":%.4f,\"dense_TFLOPs\":%.1f,\"skip_TFLOPs\":%.1f,"
               "\"overhead\":%.4f}\n",
               h, L, s.D, P, stages, t, sk, d, k, s.flops() / d * 1e-9, s.flops() / k * 1e-9, k / d - 1.0);
  std::fflush(c.out);
  std::fprintf(stderr, "GQA L=%d dense stages=%d: dense %.3f ms, skip(-80) %.3f ms, overhead %.2f%%\n", L, stages, d, k,
               100.0 * (k / d - 1.0));
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Ctx c;
    c.out = argc > 1 ? std::fopen(argv[1], "w") : stdout;
    c.commit = argc > 2 ? argv[2] : "unknown";
    c.command = argc > 3 ? argv[3] : "bench_blasst_prefill";
    const std::string what = argc > 4 ? argv[4] : "all";
    cudaDeviceProp prop;
    SPADE_CUDA(cudaGetDeviceProperties(&prop, 0));
    c.device = prop.name;
    char d[32];
    const std::time_t now = std::time(nullptr);
    std::strftime(d, sizeof(d), "%Y-%m-%d", std::gmtime(&now));
    c.date = d;
    std::fprintf(stderr, "device: %s\n", device_summary().c_str());
    if (what == "none") return 0;
    if (what == "all" || what == "overhead")
      for (int L : {8192, 32768})
        for (int st : {2, 3}) overhead(c, L, st);
    // profile:<L>:<ln_lambda>: one dense and one skip launch of the sweep's shape (for ncu).
    if (what.rfind("profile:", 0) == 0) {
      const int L = std::atoi(what.c_str() + 8);
      const float lam = float(std::atof(what.c_str() + what.rfind(':') + 1));
      Setup s(1, 1, 148, L);
      s.plant(16.f);
      s.ws->set_prefill_kernel(2);
      s.ws->plan(s.batch, 0);
      const float d = s.time_once({});
      auto [t, sk] = s.count(lam);
      std::fprintf(stderr, "profile L=%d ln_lambda=%g: sparsity %.3f, dense %.2f ms\n", L, lam,
                   t ? double(sk) / double(t) : 0.0, d);
      return 0;
    }
    // tiletrace:<L>:<ln_lambda>: per-tile clock64 stamps of one CTA's consumer warpgroups
    // (needs attention_prefill.cu built with -DSPADE_PREFILL_TILE_TRACE and linked first; see
    // bench/run_gpu_blasst_prefill.sh tiletrace), dense kernel and skip kernel.
    if (what.rfind("tiletrace:", 0) == 0) {
      const int L = std::atoi(what.c_str() + 10);
      const float lam = float(std::atof(what.c_str() + what.rfind(':') + 1));
      Setup s(1, 1, 148, L);
      s.plant(16.f);
      s.ws->plan(s.batch, 0);
      constexpr int kMax = 1024;
      unsigned long long* tr = s.arena.alloc_n<unsigned long long>(2 * kMax * 8, "tile trace");
      auto [t_all, t_sk] = s.count(lam);
      const double sparsity = t_all ? double(t_sk) / double(t_all) : 0.0;
      for (int skip = 0; skip < 2; ++skip) {
        const BlasstSkip sk = skip ? BlasstSkip{lam, nullptr} : BlasstSkip{};
        const float ms = s.time_median(sk, 3);
        SPADE_CUDA(cudaMemset(tr, 0xff, 2 * kMax * 8 * 8));
        s.ws->set_trace(tr);
        s.time_once(sk);
        s.ws->set_trace(nullptr);
        std::vector<unsigned long long> h(2 * kMax * 8);
        SPADE_CUDA(cudaMemcpy(h.data(), tr, h.size() * 8, cudaMemcpyDeviceToHost));
        // Phases 4 and 5: skip kernel "max + vote" / "P V or rest"; the default dense loop (3
        // stages, P V one tile behind) "max + P V(t - 1)" / "softmax + packing".
        const char* ph[6] = {"K wait", "turn + S issue", "S done", "max + vote | max + P V", "P V or rest | softmax", "to next"};
        for (int wg = 0; wg < 2; ++wg) {
          // Means per phase over tiles 1..n-2, split by the tile's decision (dense: all kept).
          double sum[2][6] = {}, cnt[2] = {}, max_done[2] = {};
          int n = 0;
          while (n < kMax && h[(size_t(wg) * kMax + n) * 8] != ~0ull) ++n;
          for (int t = 1; t + 1 < n; ++t) {
            const unsigned long long* r = &h[(size_t(wg) * kMax + t) * 8];
            const int k = skip && r[6] == 1 ? 1 : 0;
            for (int i = 0; i < 5; ++i) sum[k][i] += double(r[i + 1] - r[i]);
            sum[k][5] += double(r[8] - r[5]);  // next tile's loop top
            if (skip) max_done[k] += double(r[7] - r[3]);  // S done -> row maxima done
            cnt[k] += 1;
          }
          for (int k = 0; k < 2; ++k) {
            if (cnt[k] == 0) continue;
            std::fprintf(stderr, "tiletrace L=%d %s wg %d %s tiles %d of %d (sparsity %.3f, %.2f ms):", L,
                         skip ? "skip" : "dense", wg, k ? "skipped" : "kept", int(cnt[k]), n, sparsity, ms);
            double tot = 0;
            for (int i = 0; i < 6; ++i) tot += sum[k][i] / cnt[k];
            for (int i = 0; i < 6; ++i) std::fprintf(stderr, " %s %.0f", ph[i], sum[k][i] / cnt[k]);
            std::fprintf(stderr, " | cycles per tile %.0f (of max + vote: the maxima %.0f)\n", tot,
                         max_done[k] / cnt[k]);
            std::fprintf(c.out, "{\"kind\":\"tiletrace\",\"L\":%d,\"kernel\":\"%s\",\"wg\":%d,"
                                "\"tiles\":\"%s\",\"count\":%d,\"sparsity\":%.4f,\"ms\":%.3f,"
                                "\"cycles\":[%.1f,%.1f,%.1f,%.1f,%.1f,%.1f],\"maxima_cycles\":%.1f}\n",
                         L, skip ? "skip" : "dense", wg, k ? "skipped" : "kept", int(cnt[k]), sparsity, ms,
                         sum[k][0] / cnt[k], sum[k][1] / cnt[k], sum[k][2] / cnt[k], sum[k][3] / cnt[k],
                         sum[k][4] / cnt[k], sum[k][5] / cnt[k], max_done[k] / cnt[k]);
          }
        }
      }
      return 0;
    }
    if (what == "all" || what == "sweep") {
      sweep(c, 32768, 148, 5);
      sweep(c, 65536, 148, 3);
    }
    // SmolLM2-135M's attention shape (Hq 9, Hkv 3, head_dim 64) through the generic kernel.
    if (what == "all" || what == "smollm2")
      for (int L : {8192, 32768}) sweep(c, L, L == 8192 ? 32 : 8, 5, 9, 3, 64, 0);
    if (c.out != stdout) std::fclose(c.out);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_blasst_prefill: %s\n", e.what());
    return 1;
  }
  return 0;
}
