// LycheeCluster on the GPU (backend/cuda/cluster_index.h): index build, search, lazy update,
// next to our dense attention on the same shape in the same process (Llama-3-8B attention
// shape: Hq = 32, Hkv = 8, D = 128, page 16, bf16).
//   build   one layer's index (8 KV heads) over a 32K context (chunks 8..16 tokens after a
//           16-token sink) vs the dense causal prefill attention of that layer at 32K
//           (AttentionWorkspace, q_len = kv_len = 32K)
//   decode  at 64K, batch 1 and 8: search (one launch, every (request, KV head)) + CSR
//           compaction, lazy update (insert of the ~10 chunks that close every 128 decode
//           tokens, per request; reported per insert call and amortized per step), the
//           sparse attention over the lists (SparseAttention, Token lists), vs dense decode
//           attention (AttentionWorkspace v3 auto) -- all per layer
// Keys: structured (8 drifting topics + shared offset + noise, per-token norms 0.5..2x),
// generated on the device; q ~ N(0.3, 1). Prints one JSON object (argv[1] = output path,
// argv[2] = date, argv[3] = commit, argv[4] = command).
// Build: nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -Isrc
//        bench/bench_lycheecluster.cu build/libspade_cuda.a -lcublasLt -lcublas
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/attention.h"
#include "backend/cuda/cluster_index.h"
#include "backend/cuda/gemm.h"
#include "backend/cuda/sparse_attention.h"

using namespace spade;
using namespace spade::cuda;

namespace {

__device__ float hash_normal(uint64_t x) {  // two uniforms from a splitmix hash -> Box-Muller
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  x ^= x >> 31;
  const float u1 = (float((x >> 40) & 0xffffff) + 0.5f) / 16777216.f;
  const float u2 = float((x >> 16) & 0xffffff) / 16777216.f;
  return sqrtf(-2.f * logf(u1)) * cosf(6.2831853f * u2);
}

// kv[page][Hkv][P][D] for the tokens of one request (pages = page table in token order).
__global__ void fill_keys(bf16* kv, const int32_t* pages, int64_t L, int Hkv, int P, int D, uint64_t seed) {
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= L * Hkv * D) return;
  const int d = int(e % D), h = int((e / D) % Hkv);
  const int64_t p = e / (int64_t(D) * Hkv);
  const int topic = int((p / 40) % 8);
  const float off = 3.f * hash_normal(seed * 1315423911ull + uint64_t(h) * 977 + d);
  const float tp = 2.f * hash_normal(seed * 2654435761ull + uint64_t((h * 8 + topic) * 1024 + d));
  const float scale = 0.5f + 1.5f * float((p * 7919) % 101) / 100.f;
  const float v = scale * (off + tp + 0.7f * hash_normal(seed ^ (uint64_t(e) * 0x9e37ull)));
  kv[((int64_t(pages[p / P]) * Hkv + h) * P + p % P) * D + d] = __float2bfloat16(v);
}
__global__ void fill_normal(bf16* x, int64_t n, float mean, uint64_t seed) {
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e < n) x[e] = __float2bfloat16(mean + hash_normal(seed * 0x51ed27ull + uint64_t(e)));
}

template <typename F>
double time_ms(F&& f, int reps) {
  cudaEvent_t a, b;
  SPADE_CUDA(cudaEventCreate(&a));
  SPADE_CUDA(cudaEventCreate(&b));
  f();
  SPADE_CUDA(cudaDeviceSynchronize());
  std::vector<float> v;
  for (int r = 0; r < reps; ++r) {
    SPADE_CUDA(cudaEventRecord(a));
    f();
    SPADE_CUDA(cudaEventRecord(b));
    SPADE_CUDA(cudaEventSynchronize(b));
    float ms = 0;
    SPADE_CUDA(cudaEventElapsedTime(&ms, a, b));
    v.push_back(ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::vector<int32_t> make_starts(int64_t L, int sink, std::mt19937& rng) {
  std::vector<int32_t> s{int32_t(sink)};
  std::uniform_int_distribution<int> len(8, 16);
  while (s.back() + 16 <= L) s.push_back(s.back() + len(rng));
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string out_path = argc > 1 ? argv[1] : "lycheecluster.json";
  const std::string date = argc > 2 ? argv[2] : "unknown", commit = argc > 3 ? argv[3] : "unknown";
  const std::string command = argc > 4 ? argv[4] : "bench_lycheecluster";
  const int Hq = 32, Hkv = 8, D = 128, P = 16, sink = 16, Bmax = 8;
  const int64_t L_build = 32768, L_dec = 65536, budget = 1024;
  const float scale = 1.f / std::sqrt(float(D));
  std::mt19937 rng(1);
  DeviceArena arena(size_t(14) << 30);
  std::string json = "{\"device\": \"" + device_summary() + "\", \"date\": \"" + date + "\", \"commit\": \"" +
                     commit + "\", \"command\": \"" + command + "\", \"shape\": {\"Hq\": 32, \"Hkv\": 8, \"D\": 128, \"P\": 16}";

  // ---------------- build at 32K vs dense prefill attention at 32K ----------------
  {
    const int64_t np = L_build / P;
    bf16* k = arena.alloc_n<bf16>(size_t(np) * Hkv * P * D, "k");
    bf16* v = arena.alloc_n<bf16>(size_t(np) * Hkv * P * D, "v");
    std::vector<int32_t> pages(static_cast<size_t>(np));
    std::iota(pages.begin(), pages.end(), 0);
    std::shuffle(pages.begin(), pages.end(), rng);
    int32_t* pt = arena.alloc_n<int32_t>(size_t(np), "pt");
    SPADE_CUDA(cudaMemcpy(pt, pages.data(), 4 * np, cudaMemcpyHostToDevice));
    fill_keys<<<unsigned((L_build * Hkv * D + 255) / 256), 256>>>(k, pt, L_build, Hkv, P, D, 7);
    fill_keys<<<unsigned((L_build * Hkv * D + 255) / 256), 256>>>(v, pt, L_build, Hkv, P, D, 8);
    auto st = make_starts(L_build, sink, rng);
    const int M = int(st.size()) - 1;
    LcIndexConfig cfg;
    cfg.slots = 1;
    cfg.max_chunks = 4096;
    LcIndexGpu ix(arena, cfg);
    const double t_build = time_ms([&] { ix.build(0, k, pt, st.data(), M, nullptr); }, 5);
    const auto h0 = ix.download(0, 0);
    ix.set_build_timing(true);
    ix.build(0, k, pt, st.data(), M, nullptr);
    const auto ph = ix.build_phase_ms();
    ix.set_build_timing(false);
    std::printf("  build phases (ms): pool %.4f, fine k-means %.4f, coarse k-means %.4f, assembly %.4f\n",
                ph[0], ph[1], ph[2], ph[3]);
    // Breakdown: the same build with 0 Lloyd iterations (pooling, seeding, one assignment,
    // final centroids, assembly) -> the rest is the 2 x 10 k-means iterations (early stop).
    double t_build0 = 0;
    {
      const size_t mark = arena.used();
      LcIndexConfig c0 = cfg;
      c0.iterations = 0;
      LcIndexGpu ix0(arena, c0);
      t_build0 = time_ms([&] { ix0.build(0, k, pt, st.data(), M, nullptr); }, 5);
      SPADE_CUDA(cudaDeviceSynchronize());
      arena.reset(mark);
    }
    // Dense prefill attention of the layer.
    AttnLimits lim;
    lim.max_batch = 1;
    lim.max_q_tokens = L_build;
    lim.max_pages = np;
    AttentionWorkspace ws(arena, lim, Hq, Hkv, D, P);
    bf16* q = arena.alloc_n<bf16>(size_t(L_build) * Hq * D, "q");
    bf16* o = arena.alloc_n<bf16>(size_t(L_build) * Hq * D, "o");
    fill_normal<<<unsigned((L_build * Hq * D + 255) / 256), 256>>>(q, L_build * Hq * D, 0.f, 3);
    std::vector<AttnSeq> batch{{pages.data(), int(np), int(L_build), int(L_build)}};
    ws.plan(batch, nullptr);
    const double t_attn = time_ms([&] { ws.run(q, k, v, o, scale, nullptr); }, 5);
    // The layer's linear layers at 32K tokens (Llama-3-8B: hidden 4096, 32 x 128 q heads,
    // 8 x 128 kv heads, FFN 14336): QKV, O, gate+up, down, bf16 cuBLASLt (Gemm), so that the
    // build can also be set against a whole layer's prefill (attention + GEMMs; norms, RoPE
    // and the activation are not counted).
    double t_gemm = 0;
    {
      const size_t mark = arena.used();
      const int T = int(L_build), Hd = 4096, F = 14336;
      Gemm gm(arena);
      bf16* x = arena.alloc_n<bf16>(size_t(T) * F, "x");
      bf16* y = arena.alloc_n<bf16>(size_t(T) * 2 * F, "y");
      bf16* W = arena.alloc_n<bf16>(size_t(2 * F) * Hd, "W");
      fill_normal<<<unsigned((int64_t(T) * F + 255) / 256), 256>>>(x, int64_t(T) * F, 0.f, 11);
      fill_normal<<<unsigned((int64_t(2 * F) * Hd + 255) / 256), 256>>>(W, int64_t(2 * F) * Hd, 0.f, 12);
      t_gemm = time_ms([&] {
        gm.run_bf16(x, W, y, T, 6144, Hd, nullptr);    // QKV
        gm.run_bf16(x, W, y, T, Hd, Hd, nullptr);      // O
        gm.run_bf16(x, W, y, T, 2 * F, Hd, nullptr);   // gate + up
        gm.run_bf16(x, W, y, T, Hd, F, nullptr);       // down
      }, 5);
      SPADE_CUDA(cudaDeviceSynchronize());
      arena.reset(mark);
    }
    char buf[1024];
    std::snprintf(buf, sizeof buf,
                  ", \"build_32k\": {\"L\": %lld, \"chunks\": %d, \"fine_head0\": %d, \"coarse_head0\": %d, "
                  "\"build_ms\": %.4f, \"build_ms_0_iterations\": %.4f, \"dense_prefill_attention_ms\": %.4f, \"build_over_attention\": %.4f, "
                  "\"layer_gemms_ms\": %.4f, \"build_over_attention_plus_gemms\": %.4f, "
                  "\"index_bytes\": %zu, \"phases_ms\": {\"pool\": %.4f, \"fine_kmeans\": %.4f, "
                  "\"coarse_kmeans\": %.4f, \"assembly\": %.4f}}",
                  (long long)L_build, M, h0.n_fine, h0.n_coarse, t_build, t_build0, t_attn, t_build / t_attn, t_gemm, t_build / (t_attn + t_gemm),
                  ix.device_bytes(), ph[0], ph[1], ph[2], ph[3]);
    json += buf;
    std::printf("build 32K: %d chunks, %.3f ms; dense prefill attention %.3f ms; ratio %.3f; layer GEMMs %.3f ms; "
                "build / (attention + GEMMs) %.3f\n", M, t_build, t_attn, t_build / t_attn, t_gemm,
                t_build / (t_attn + t_gemm));
    SPADE_CUDA(cudaDeviceSynchronize());
  }
  arena.reset(0);

  // ---------------- decode at 64K, batch 1 and 8 ----------------
  {
    const int64_t np = L_dec / P;  // the decode token is the last of the L_dec
    const int64_t total_pages = np * Bmax;
    bf16* k = arena.alloc_n<bf16>(size_t(total_pages) * Hkv * P * D, "k");
    bf16* v = arena.alloc_n<bf16>(size_t(total_pages) * Hkv * P * D, "v");
    std::vector<int32_t> all(static_cast<size_t>(total_pages));
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    int32_t* pt = arena.alloc_n<int32_t>(size_t(total_pages), "pt");
    SPADE_CUDA(cudaMemcpy(pt, all.data(), 4 * total_pages, cudaMemcpyHostToDevice));
    LcIndexConfig cfg;
    cfg.slots = Bmax;
    cfg.max_chunks = 8192;
    LcIndexGpu ix(arena, cfg);
    std::vector<std::vector<int32_t>> starts(Bmax);
    // Context: L_dec tokens; index over the chunks that close before L_dec - 128 (the rest
    // waits in the lazy-update buffer), then ~128 tokens of new chunks for the insert timing.
    std::vector<int> M0(Bmax);
    int ins_chunks = 0;
    std::vector<std::vector<int32_t>> pending(Bmax);
    double t_build64 = 0;
    for (int b = 0; b < Bmax; ++b) {
      fill_keys<<<unsigned((L_dec * Hkv * D + 255) / 256), 256>>>(k, pt + b * np, L_dec, Hkv, P, D, 100 + b);
      fill_keys<<<unsigned((L_dec * Hkv * D + 255) / 256), 256>>>(v, pt + b * np, L_dec, Hkv, P, D, 200 + b);
      auto st = make_starts(L_dec, sink, rng);
      int m = 0;
      while (m + 1 < int(st.size()) && st[size_t(m) + 1] <= L_dec - 128) ++m;
      M0[size_t(b)] = m;
      pending[size_t(b)].assign(st.begin() + m + 1, st.end());
      ins_chunks += int(pending[size_t(b)].size());
      starts[size_t(b)].assign(st.begin(), st.begin() + m + 1);
      cudaEvent_t e0, e1;
      cudaEventCreate(&e0);
      cudaEventCreate(&e1);
      cudaEventRecord(e0);
      ix.build(b, k, pt + b * np, starts[size_t(b)].data(), m, nullptr);
      cudaEventRecord(e1);
      cudaEventSynchronize(e1);
      float ms = 0;
      cudaEventElapsedTime(&ms, e0, e1);
      t_build64 += ms;
    }
    SPADE_CUDA(cudaDeviceSynchronize());
    const int cap = sink + int(budget) + 256;
    int32_t* lists = arena.alloc_n<int32_t>(size_t(Bmax) * Hkv * cap, "lists");
    int32_t* counts = arena.alloc_n<int32_t>(size_t(Bmax) * Hkv, "counts");
    int32_t* sel_off = arena.alloc_n<int32_t>(size_t(Bmax) * Hkv + 1, "sel_off");
    int32_t* sel_idx = arena.alloc_n<int32_t>(size_t(Bmax) * Hkv * cap, "sel_idx");
    int32_t* dslot = arena.alloc_n<int32_t>(Bmax, "slot");
    int32_t* dlen = arena.alloc_n<int32_t>(Bmax, "len");
    std::vector<int32_t> hslot(Bmax), hlen(Bmax, int32_t(L_dec));
    std::iota(hslot.begin(), hslot.end(), 0);
    SPADE_CUDA(cudaMemcpy(dslot, hslot.data(), 4 * Bmax, cudaMemcpyHostToDevice));
    SPADE_CUDA(cudaMemcpy(dlen, hlen.data(), 4 * Bmax, cudaMemcpyHostToDevice));
    bf16* q = arena.alloc_n<bf16>(size_t(Bmax) * Hq * D, "q");
    bf16* o = arena.alloc_n<bf16>(size_t(Bmax) * Hq * D, "o");
    fill_normal<<<unsigned((Bmax * Hq * D + 255) / 256), 256>>>(q, int64_t(Bmax) * Hq * D, 0.3f, 5);
    AttnLimits lim;
    lim.max_batch = Bmax;
    lim.max_q_tokens = Bmax;
    lim.max_pages = total_pages;
    AttentionWorkspace ws(arena, lim, Hq, Hkv, D, P);
    SparseAttention sa(arena, Bmax, total_pages, Hq, Hkv, D, P);
    char buf[2048];
    std::snprintf(buf, sizeof buf,
                  ", \"decode_64k\": {\"L\": %lld, \"budget\": %lld, \"build_ms_per_request\": %.4f, "
                  "\"insert_chunks_per_flush\": %.1f, \"points\": [",
                  (long long)L_dec, (long long)budget, t_build64 / Bmax, ins_chunks / double(Bmax));
    json += buf;
    bool first = true;
    for (int B : {1, 8}) {
      // Lazy update: one flush (the ~128 tokens of closed chunks of every request) as one
      // insert_batch launch; each rep rebuilds the B indexes first (a flush mutates them).
      std::vector<float> fl;
      for (int rep = 0; rep < 3; ++rep) {
        for (int b = 0; b < B; ++b) ix.build(b, k, pt + b * np, starts[size_t(b)].data(), M0[size_t(b)], nullptr);
        std::vector<LcInsert> reqs;
        for (int b = 0; b < B; ++b)
          reqs.push_back({b, pt + b * np, M0[size_t(b)], pending[size_t(b)].data(), int(pending[size_t(b)].size())});
        cudaEvent_t e0, e1;
        cudaEventCreate(&e0);
        cudaEventCreate(&e1);
        cudaEventRecord(e0);
        ix.insert_batch(reqs, k, nullptr);
        cudaEventRecord(e1);
        cudaEventSynchronize(e1);
        float ms = 0;
        cudaEventElapsedTime(&ms, e0, e1);
        fl.push_back(ms);
      }
      std::sort(fl.begin(), fl.end());
      const double t_flush = fl[1];
      LcSearchArgs a;
      a.q = q;
      a.slot = dslot;
      a.kv_len = dlen;
      a.B = B;
      a.Hq = Hq;
      a.budget = budget;
      a.sink = sink;
      a.cap = cap;
      a.lists = lists;
      a.counts = counts;
      auto search = [&] {
        ix.search(a, nullptr);
        LcIndexGpu::compact(lists, counts, B * Hkv, cap, sel_off, sel_idx, nullptr);
      };
      const double t_search = time_ms(search, 20);
      const double t_search_only = time_ms([&] { ix.search(a, nullptr); }, 20);
      // Phase stamps of 11 traced searches (SM cycles; each the last of 10 back to back): per
      // phase the max over lists, then the median over the searches, in kilocycles; sizes of
      // list 0 (slots 12-15).
      constexpr int TS = kLcTraceSlots;
      unsigned long long* tr = arena.alloc_n<unsigned long long>(size_t(B) * Hkv * TS, "trace");
      std::vector<std::vector<double>> ph_runs(11);
      std::vector<unsigned long long> ht(size_t(B) * Hkv * TS);
      auto span = [&](int l, int from, int to) {
        const unsigned long long t0 = ht[size_t(l) * TS + from], t1 = ht[size_t(l) * TS + to];
        return t0 && t1 && t1 >= t0 ? double(t1 - t0) / 1000.0 : 0.0;  // kilocycles
      };
      // Phases 0-6 (q/norms, coarse, fine scores, sort, flatten, greedy, emit), then the coarse
      // phase's parts: scoring, ranking, k_g + scans, candidates.
      // Then the first phase's loads and q norms.
      const int from[13] = {0, 1, 2, 3, 4, 5, 6, 1, 8, 9, 10, 0, 11},
                to[13] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 2, 11, 1};
      for (auto& run : ph_runs) {
        SPADE_CUDA(cudaMemset(tr, 0, sizeof(unsigned long long) * B * Hkv * TS));
        a.trace = tr;
        // Back to back, the last one's stamps kept: clocks as in a decode loop, not idle ones.
        for (int w = 0; w < 10; ++w) ix.search(a, nullptr);
        a.trace = nullptr;
        SPADE_CUDA(cudaMemcpy(ht.data(), tr, 8 * ht.size(), cudaMemcpyDeviceToHost));
        for (int p = 0; p < 13; ++p) {
          double mx = 0;
          for (int l = 0; l < B * Hkv; ++l) mx = std::max(mx, span(l, from[p], to[p]));
          run.push_back(mx);
        }
      }
      auto med_phase = [&](int p) {
        std::vector<double> v;
        for (auto& run : ph_runs) v.push_back(run[size_t(p)]);
        std::sort(v.begin(), v.end());
        return v[v.size() / 2];
      };
      std::string phases = "[", coarse_parts = "[";
      for (int p = 0; p < 7; ++p) phases += (p ? ", " : "") + std::to_string(med_phase(p));
      for (int p = 7; p < 11; ++p) coarse_parts += (p > 7 ? ", " : "") + std::to_string(med_phase(p));
      const std::string first_parts = "[" + std::to_string(med_phase(11)) + ", " + std::to_string(med_phase(12)) + "]";
      phases += "]";
      coarse_parts += "]";
      char sizes[160];
      std::snprintf(sizes, sizeof sizes, "{\"coarse_nodes\": %llu, \"fine_candidates\": %llu, \"flat_chunks\": %llu, \"chosen_chunks\": %llu}",
                    ht[12], ht[13], ht[14], ht[15]);
      std::printf("  search phases (kcycles, max over lists, median of 11): q/norms, coarse, fine scores, sort, flatten, greedy, emit = %s\n"
                  "  coarse phase parts: scoring, ranking, k_g + scans, candidates = %s; first phase: loads, q norms = %s; list 0 sizes %s\n",
                  phases.c_str(), coarse_parts.c_str(), first_parts.c_str(), sizes);
      search();
      std::vector<int32_t> hc(size_t(B) * Hkv);
      SPADE_CUDA(cudaMemcpy(hc.data(), counts, 4 * hc.size(), cudaMemcpyDeviceToHost));
      double mean_list = 0;
      for (int32_t c : hc) mean_list += c;
      mean_list /= double(hc.size());
      std::vector<AttnSeq> dense;
      std::vector<SparseSeq> sparse;
      for (int b = 0; b < B; ++b) {
        dense.push_back({all.data() + b * np, int(np), int(L_dec), 1});
        sparse.push_back({all.data() + b * np, int(np), int(L_dec)});
      }
      ws.plan(dense, nullptr);
      const double t_dense = time_ms([&] { ws.run(q, k, v, o, scale, nullptr); }, 20);
      std::vector<int> maxe(size_t(B) * Hkv, cap);
      sa.plan(sparse, SelGran::Token, Hkv, maxe, nullptr, nullptr);
      const double t_sparse = time_ms([&] { sa.run(q, k, v, sel_off, sel_idx, o, scale, nullptr); }, 20);
      // Per decode step: search every step; one flush (insert) every 128 tokens per request.
      const double t_upd_step = t_flush / 128.0;
      std::snprintf(buf, sizeof buf,
                    "%s{\"B\": %d, \"mean_list_tokens\": %.1f, \"search_compact_ms\": %.4f, \"search_only_ms\": %.4f, \"search_phases_kcycles\": %s, \"coarse_parts_kcycles\": %s, \"first_parts_kcycles\": %s, \"search_sizes\": %s, "
                    "\"update_amortized_ms\": %.5f, \"update_flush_ms\": %.4f, \"sparse_attention_ms\": %.4f, "
                    "\"dense_attention_ms\": %.4f, \"search_update_over_dense\": %.4f, "
                    "\"attention_speedup_sparse_plus_search\": %.3f}",
                    first ? "" : ", ", B, mean_list, t_search, t_search_only, phases.c_str(), coarse_parts.c_str(), first_parts.c_str(), sizes, t_upd_step, t_flush, t_sparse, t_dense,
                    (t_search + t_upd_step) / t_dense, t_dense / (t_sparse + t_search + t_upd_step));
      json += buf;
      first = false;
      std::printf("64K B=%d: search+compact %.4f ms, update/step %.5f ms (flush %.4f), sparse attn %.4f ms, "
                  "dense attn %.4f ms, list %.0f tokens\n",
                  B, t_search, t_upd_step, t_flush, t_sparse, t_dense, mean_list);
    }
    json += "]}";
  }
  json += "}\n";
  FILE* f = std::fopen(out_path.c_str(), "w");
  if (f) {
    std::fputs(json.c_str(), f);
    std::fclose(f);
  }
  std::fputs(json.c_str(), stdout);
  return 0;
}
