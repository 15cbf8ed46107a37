// Attention kernel benchmark: spade's paged decode (split-KV) and causal prefill kernels on
// Llama-3-8B attention shapes (Hq=32, Hkv=8, D=128, bf16, page 16). Writes JSON lines.
//
// Decode bytes counted: K + V of every context token (B*L*Hkv*D*2 bytes each) + q + out.
// Inputs: random bf16 (never zeros), page ids shuffled, and enough independent caches in
// rotation that consecutive calls never hit L2 (>= 4x the 50 MB L2 in total). Timing: CUDA
// events around a batch of calls cycling through the caches, 30 batches, median per call.
// Prefill: FLOPs counted as 4*Hq*D*sum_t(t+1) (causal, QK^T and PV), median of 15.
// FP8 KV cache (issue 40): each decode shape also runs over an E4M3 cache (random codes, scales
// 1; AttentionWorkspace::run_fp8, the v3 kernels' F8 instances; v2 has no fp8 path and is
// skipped), "kv":"fp8" in its line and half the bytes counted; SPADE_BENCH_KV=bf16|fp8|bf16,fp8
// picks the cache types (default bf16 only; both: each shape in bf16 then fp8, same process).
// The fp8 rows run the direct kernel (D = 128; "kernel":"<name>/direct"; SPADE_FP8_DIRECT=0: the
// widened-tile kernel), auto being the engine's fp8 pick (v3_w4s2).
// FP8 vs bf16 at the issue's shapes (auto kernel only):
//   SPADE_BENCH_KV=bf16,fp8 SPADE_BENCH_SHAPES=32768:1,32768:8,32768:32,131072:1,131072:8,131072:32 \
//     ./bench_attention decode attn_fp8.jsonl 1
// Every decode kernel (v2, auto and the v3 variants; argv[3] = "kernel[:split policy],..."
// to pick, policy 1 = exact waves, reported as "<name>/x") and
// both prefill kernels (wgmma, mma.sync) run on the same inputs in the same process.
//
// Build (bench/run_gpu.sh does this): nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a
//   -Isrc bench/bench_attention.cu build/libspade_cuda.a -lcublasLt -lcublas -o bench_attention
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/attention.h"
#include "backend/cuda/ops.h"
#include "core/tuning.h"

using namespace spade;
using namespace spade::cuda;

namespace {

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Timer {
  cudaEvent_t a, b;
  Timer() {
    SPADE_CUDA(cudaEventCreate(&a));
    SPADE_CUDA(cudaEventCreate(&b));
  }
  ~Timer() {
    cudaEventDestroy(a);
    cudaEventDestroy(b);
  }
};

const int Hq = 32, Hkv = 8, D = 128, P = 16;

std::vector<std::pair<int, int>> g_decode_kernels;  // (decode kernel index, split policy)

void bench_decode(FILE* out, int L, int B, int force_split, bool fp8) {
  const size_t page_elems = size_t(Hkv) * P * D;
  const int64_t pages_per_seq = (L + P - 1) / P;
  const size_t esize = fp8 ? 1 : 2;
  const size_t cache_bytes = size_t(B) * pages_per_seq * page_elems * esize * 2;  // K + V
  size_t free_b = 0, total_b = 0;
  SPADE_CUDA(cudaMemGetInfo(&free_b, &total_b));
  const size_t budget = free_b > (6ull << 30) ? free_b - (6ull << 30) : 0;
  if (cache_bytes > budget) {
    std::fprintf(stderr, "decode L=%d B=%d kv=%s: %.1f GB does not fit, skipped\n", L, B,
                 fp8 ? "fp8" : "bf16", cache_bytes / 1e9);
    return;
  }
  int nbuf = int(std::max<size_t>(1, (400ull << 20) / cache_bytes + 1));
  nbuf = int(std::min<size_t>(nbuf, budget / cache_bytes));
  nbuf = std::max(1, nbuf);
  const int64_t n_pages = int64_t(B) * pages_per_seq;
  DeviceArena arena(size_t(nbuf) * cache_bytes + (512ull << 20));
  std::vector<bf16*> kb(nbuf), vb(nbuf);
  std::vector<KvFp8> f8(nbuf);
  float* ones = arena.alloc_n<float>(Hkv, "fp8 scales");
  {
    const std::vector<float> one(Hkv, 1.f);
    SPADE_CUDA(cudaMemcpy(ones, one.data(), sizeof(float) * Hkv, cudaMemcpyHostToDevice));
  }
  for (int i = 0; i < nbuf; ++i) {
    if (fp8) {
      uint8_t* k8 = arena.alloc_n<uint8_t>(size_t(n_pages) * page_elems, "K fp8");
      uint8_t* v8 = arena.alloc_n<uint8_t>(size_t(n_pages) * page_elems, "V fp8");
      fill_random_fp8(k8, int64_t(n_pages * page_elems), 100 + i, 0);
      fill_random_fp8(v8, int64_t(n_pages * page_elems), 200 + i, 0);
      f8[i].k = k8, f8[i].v = v8, f8[i].k_scale = ones, f8[i].v_scale = ones;
      continue;
    }
    kb[i] = arena.alloc_n<bf16>(size_t(n_pages) * page_elems, "K");
    vb[i] = arena.alloc_n<bf16>(size_t(n_pages) * page_elems, "V");
    fill_random_bf16(kb[i], int64_t(n_pages * page_elems), 100 + i, 1.f, 0.f, 0);
    fill_random_bf16(vb[i], int64_t(n_pages * page_elems), 200 + i, 1.f, 0.f, 0);
  }

  bf16* q = arena.alloc_n<bf16>(size_t(B) * Hq * D, "q");
  bf16* o = arena.alloc_n<bf16>(size_t(B) * Hq * D, "out");
  fill_random_bf16(q, int64_t(B) * Hq * D, 7, 1.f, 0.f, 0);
  AttnLimits lim;
  lim.max_batch = B;
  lim.max_q_tokens = B;
  lim.max_pages = n_pages;
  AttentionWorkspace ws(arena, lim, Hq, Hkv, D, P);
  ws.set_fp8_cache(fp8);  // auto's fp8 pick (v3_w4s2 with the direct kernel at D = 128)
  std::vector<int32_t> perm(n_pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::mt19937 rng(1);
  // SPADE_BENCH_PAGE_ORDER=sequential keeps each sequence's pages in id order (what a fresh
  // KVPool hands out); the default shuffles them (a pool after churn).
  const char* order = std::getenv("SPADE_BENCH_PAGE_ORDER");
  const bool sequential = order && std::string(order) == "sequential";
  if (!sequential) std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<AttnSeq> batch(B);
  for (int b = 0; b < B; ++b)
    batch[b] = {perm.data() + b * pages_per_seq, int(pages_per_seq), L, 1};
  const float scale = 1.f / std::sqrt(float(D));
  auto run = [&](int i) {
    if (fp8) ws.run_fp8(q, f8[size_t(i)], o, scale, 0);
    else ws.run(q, kb[size_t(i)], vb[size_t(i)], o, scale, 0);
  };
  for (auto [kern, policy] : g_decode_kernels) {
    if (fp8 && kern == 0) continue;  // v2: no fp8 path (run_fp8 would widen into a scratch)
    ws.set_decode_kernel(kern);
    ws.set_split_policy(policy);
    ws.plan(batch, 0, force_split);
    for (int i = 0; i < 3 * nbuf; ++i) run(i % nbuf);
    SPADE_CUDA(cudaDeviceSynchronize());
    const int calls = std::max(nbuf, 8) / nbuf * nbuf;
    Timer t;
    std::vector<float> per;
    for (int rep = 0; rep < 30; ++rep) {
      SPADE_CUDA(cudaEventRecord(t.a));
      for (int i = 0; i < calls; ++i) run(i % nbuf);
      SPADE_CUDA(cudaEventRecord(t.b));
      SPADE_CUDA(cudaEventSynchronize(t.b));
      float ms = 0;
      SPADE_CUDA(cudaEventElapsedTime(&ms, t.a, t.b));
      per.push_back(ms * 1000.f / calls);
    }
    const double us = median(per);
    const double kv_bytes = double(B) * L * Hkv * D * double(esize) * 2;
    const double bytes = kv_bytes + 2.0 * B * Hq * D * 2;
    std::fprintf(out,
                 "{\"kind\":\"decode\",\"impl\":\"spade\",\"kv\":\"%s\",\"kernel\":\"%s%s%s\",\"variant\":\"%s\",\"L\":%d,\"B\":%d,"
                 "\"Hq\":%d,\"Hkv\":%d,\"D\":%d,\"page\":%d,\"page_order\":\"%s\",\"splits\":%d,\"buffers\":%d,"
                 "\"us\":%.3f,\"us_min\":%.3f,\"bytes\":%.0f,\"GBps\":%.1f}\n",
                 fp8 ? "fp8" : "bf16", AttentionWorkspace::decode_kernel_name(kern), policy ? "/x" : "",
                 fp8 && tuning().fp8_direct ? "/direct" : "",  // SPADE_FP8_DIRECT=1 (D = 128)
                 AttentionWorkspace::decode_kernel_name(ws.decode_variant() == 0 ? 0 : ws.decode_variant() + 1),
                 L, B, Hq, Hkv, D, P, sequential ? "sequential" : "shuffled", ws.n_split(), nbuf,
                 us, *std::min_element(per.begin(), per.end()), bytes, bytes / us * 1e-3);
    std::fflush(out);
  }
}

void bench_prefill(FILE* out, int L) {
  const int B = 1;
  const int64_t pages = (L + P - 1) / P;
  const size_t page_elems = size_t(Hkv) * P * D;
  DeviceArena arena(size_t(pages) * page_elems * 4 + size_t(L) * Hq * D * 4 + (768ull << 20));
  bf16* k = arena.alloc_n<bf16>(size_t(pages) * page_elems, "K");
  bf16* v = arena.alloc_n<bf16>(size_t(pages) * page_elems, "V");
  bf16* q = arena.alloc_n<bf16>(size_t(L) * Hq * D, "q");
  bf16* o = arena.alloc_n<bf16>(size_t(L) * Hq * D, "out");
  fill_random_bf16(k, int64_t(pages * page_elems), 1, 1.f, 0.f, 0);
  fill_random_bf16(v, int64_t(pages * page_elems), 2, 1.f, 0.f, 0);
  fill_random_bf16(q, int64_t(L) * Hq * D, 3, 1.f, 0.f, 0);
  AttnLimits lim;
  lim.max_batch = 1;
  lim.max_q_tokens = L;
  lim.max_pages = pages;
  AttentionWorkspace ws(arena, lim, Hq, Hkv, D, P);
  std::vector<int32_t> perm(pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::mt19937 rng(2);
  std::shuffle(perm.begin(), perm.end(), rng);
  const float scale = 1.f / std::sqrt(float(D));
  const char* env = std::getenv("SPADE_ATTN_PREFILL");
  const bool allow_wgmma = !(env && *env && std::atoi(env) == 0);
  // Per-CTA trace buffer (start, end, SM, tiles) for the wgmma kernels.
  const int64_t max_ctas = (int64_t(L) * (Hq / Hkv) / 128 + 1) * Hkv;
  unsigned long long* trace_dev = arena.alloc_n<unsigned long long>(size_t(max_ctas) * 4, "trace");
  for (int kern : {2, 1, 0}) {
    if (kern >= 1 && !allow_wgmma) continue;
    ws.set_prefill_kernel(kern);
    if (kern >= 1 && !ws.prefill_wgmma_active()) continue;
    ws.plan({{perm.data(), int(pages), L, L}}, 0);
    for (int i = 0; i < 2; ++i) ws.run(q, k, v, o, scale, 0);
    SPADE_CUDA(cudaDeviceSynchronize());
    Timer t;
    std::vector<float> per;
    for (int rep = 0; rep < 15; ++rep) {
      SPADE_CUDA(cudaEventRecord(t.a));
      ws.run(q, k, v, o, scale, 0);
      SPADE_CUDA(cudaEventRecord(t.b));
      SPADE_CUDA(cudaEventSynchronize(t.b));
      float ms = 0;
      SPADE_CUDA(cudaEventElapsedTime(&ms, t.a, t.b));
      per.push_back(ms);
    }
    const double ms = median(per);
    const double flops = 4.0 * Hq * D * (double(L) * (L + 1) / 2) * B;
    // Trace one more launch: SM busy fraction, per-CTA cost = X + y * tiles (least squares),
    // mean idle gap between consecutive CTAs on an SM.
    char trace_json[256] = "";
    if (kern >= 1) {
      const int n = ws.n_items() * Hkv;
      SPADE_CUDA(cudaMemset(trace_dev, 0, size_t(n) * 4 * 8));
      ws.set_trace(trace_dev);
      ws.run(q, k, v, o, scale, 0);
      ws.set_trace(nullptr);
      std::vector<unsigned long long> tr(size_t(n) * 4);
      SPADE_CUDA(cudaMemcpy(tr.data(), trace_dev, tr.size() * 8, cudaMemcpyDeviceToHost));
      unsigned long long t0 = ~0ull, t1 = 0;
      double sx = 0, sy = 0, sxx = 0, sxy = 0, busy = 0;
      std::vector<std::vector<std::pair<unsigned long long, unsigned long long>>> per_sm(256);
      for (int i = 0; i < n; ++i) {
        const unsigned long long a0 = tr[4 * i], a1 = tr[4 * i + 1];
        const double x = double(tr[4 * i + 3]), y = double(a1 - a0) * 1e-3;
        t0 = std::min(t0, a0), t1 = std::max(t1, a1);
        sx += x, sy += y, sxx += x * x, sxy += x * y, busy += y;
        per_sm[tr[4 * i + 2] % 256].push_back({a0, a1});
      }
      const double span = double(t1 - t0) * 1e-3;
      const double slope = (n * sxy - sx * sy) / (n * sxx - sx * sx);
      const double icpt = (sy - slope * sx) / n;
      double gaps = 0;
      int ngaps = 0, sms = 0;
      for (auto& v : per_sm) {
        if (v.empty()) continue;
        ++sms;
        std::sort(v.begin(), v.end());
        for (size_t j = 1; j < v.size(); ++j) gaps += double(v[j].first - v[j - 1].second) * 1e-3, ++ngaps;
      }
      std::snprintf(trace_json, sizeof(trace_json),
                    ",\"trace_span_us\":%.1f,\"trace_sm_busy\":%.3f,\"trace_cta_fixed_us\":%.2f,"
                    "\"trace_us_per_tile\":%.3f,\"trace_gap_us\":%.2f",
                    span, busy / (span * std::max(1, sms)), icpt, slope, ngaps ? gaps / ngaps : 0.0);
    }
    std::fprintf(out,
                 "{\"kind\":\"prefill\",\"impl\":\"spade\",\"kernel\":\"%s\",\"L\":%d,\"B\":%d,"
                 "\"Hq\":%d,\"Hkv\":%d,\"D\":%d,\"page\":%d,\"causal\":true,\"ms\":%.4f,"
                 "\"flops\":%.0f,\"TFLOPs\":%.1f%s}\n",
                 kern == 2 ? "wgmma_s3" : kern == 1 ? "wgmma_s2" : "mma.sync", L, B, Hq, Hkv, D, P, ms,
                 flops, flops / ms * 1e-9, trace_json);
    std::fflush(out);
  }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    std::string mode = argc > 1 ? argv[1] : "all";
    FILE* out = stdout;
    if (argc > 2) out = std::fopen(argv[2], "w");
    if (argc > 3) {  // "k[:policy],k[:policy],..."
      std::string list = argv[3];
      for (size_t p = 0; p < list.size();) {
        size_t e = list.find(',', p);
        if (e == std::string::npos) e = list.size();
        const std::string item = list.substr(p, e - p);
        const size_t c = item.find(':');
        g_decode_kernels.push_back({std::stoi(item.substr(0, c)),
                                    c == std::string::npos ? 0 : std::stoi(item.substr(c + 1))});
        p = e + 1;
      }
    } else {
      for (int i = 0; i < AttentionWorkspace::decode_kernel_count(); ++i) g_decode_kernels.push_back({i, 0});
    }
    std::fprintf(stderr, "device: %s\n", device_summary().c_str());
    if (mode == "decode" || mode == "all") {
      // SPADE_BENCH_FORCE_SPLIT=n: every decode plan with n splits per (sequence, KV head).
      const char* fs = std::getenv("SPADE_BENCH_FORCE_SPLIT");
      const int force_split = fs ? std::atoi(fs) : 0;
      // SPADE_BENCH_SHAPES="L:B,L:B": only these decode shapes.
      const char* shapes = std::getenv("SPADE_BENCH_SHAPES");
      // SPADE_BENCH_KV="bf16,fp8": the cache types, each shape in every one (default bf16).
      const char* kvs = std::getenv("SPADE_BENCH_KV");
      const std::string kv_list = std::string(",") + (kvs && *kvs ? kvs : "bf16") + ",";
      for (int L : {8192, 32768, 131072})
        for (int B : {1, 8, 32})
          if (!shapes || (std::string(",") + shapes + ",").find("," + std::to_string(L) + ":" +
                                                               std::to_string(B) + ",") != std::string::npos)
            for (const char* kv : {"bf16", "fp8"})
              if (kv_list.find(std::string(",") + kv + ",") != std::string::npos)
                bench_decode(out, L, B, force_split, std::string(kv) == "fp8");
    }
    if (mode == "prefill" || mode == "all") {
      for (int L : {8192, 32768}) bench_prefill(out, L);
    }
    if (out != stdout) std::fclose(out);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_attention: %s\n", e.what());
    return 1;
  }
  return 0;
}
