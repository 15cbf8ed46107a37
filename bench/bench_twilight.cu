// Twilight decode benchmark (select-then-prune on the GPU): Quest at a base budget of 8192
// tokens alone (select + attention over its 512 pages) vs Quest 8192 + the Twilight pruner
// (INT4 estimate + top-p) + attention over the kept tokens (strided lists with counts; the
// optional CSR compaction is timed alone as us_compact). Shape: Hq=32,
// Hkv=8, D=128, P=16, bf16 K/V; contexts 32K / 128K, batch 1 / 8 (mode "large": 16 / 32 / 64).
// One JSON line per point.
//
// Inputs: random N(0, 1) q and K/V; per (request, KV head) `planted` (default 256) random
// positions get keys aligned with one query head of the group, k = 2 q_g + 0.3 k (logit
// ~ 2 |q|^2 / sqrt(D) ~ 22 against N(0, 1) for the rest, and a page bound above the random
// pages', so Quest keeps them): attention is peaked, as in real decoding, and top-p keeps a
// few hundred tokens per KV head (the planted ones of its G heads). Without such structure
// (pure noise) top-p keeps most of the base set: the `flat` variant (planted = 0, B = 1,
// 32K) shows that worst case.
// Layers: per-layer caches are rotated call by call (n_layers such that the bytes a stage
// reads over the rotation exceed 2x the 50 MB L2), so no stage is timed L2-hot.
// Timing: CUDA events, median over reps of `calls` back-to-back launches (stream order, no
// graph): each stage alone (top-p also by the step-per-pass bisection, us_topp_bisection),
// and the whole step of each variant; plus the pruner's two launches of every rotated
// layer replayed from one CUDA graph (us_pruner_graph, per layer), and both whole steps the
// same way (us_quest_step_graph, us_twilight_step_graph: the form the model runs them in).
// Byte floors: the pruner moves base tokens x (D/2 + 4) B of INT4 rows + kept x 4 B; floor
// time = bytes / the copy bandwidth measured here (cudaMemcpy D2D, 2 x bytes / time).
// The SparseAttention plan for the kept lists takes the previous step's kept counts as its
// upper bounds (here: the counts of a warm-up step), as a decode loop would.
//
// Build (bench/run_gpu_twilight.sh): nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a
//   -Isrc bench/bench_twilight.cu <libspade_cuda.a> -lcublasLt -lcublas -o bench_twilight
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "backend/cuda/ops.h"
#include "backend/cuda/sparse_attention.h"
#include "backend/cuda/twilight.h"

using namespace spade;
using namespace spade::cuda;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <typename F>
double time_us(F&& f, int calls, int reps) {
  cudaEvent_t a, b;
  SPADE_CUDA(cudaEventCreate(&a));
  SPADE_CUDA(cudaEventCreate(&b));
  for (int i = 0; i < 4; ++i) f(i);
  SPADE_CUDA(cudaDeviceSynchronize());
  std::vector<double> per;
  for (int r = 0; r < reps; ++r) {
    SPADE_CUDA(cudaEventRecord(a));
    for (int i = 0; i < calls; ++i) f(i);
    SPADE_CUDA(cudaEventRecord(b));
    SPADE_CUDA(cudaEventSynchronize(b));
    float ms = 0;
    SPADE_CUDA(cudaEventElapsedTime(&ms, a, b));
    per.push_back(double(ms) * 1000.0 / calls);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return median(per);
}

// Pulls `planted` keys per (request, KV head) toward query head j % G of the group.
// One warp per planted key; reads q (D bf16) and the key row, writes the key row.
__global__ void plant_kernel(bf16* k, const bf16* q, const int32_t* pt, int npr, int L, int Hq,
                             int Hkv, int D, int P, int planted, uint32_t seed) {
  const int w = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
  const int B = gridDim.y;
  const int b = blockIdx.y;
  if (w >= Hkv * planted) return;
  const int h = w / planted, j = w % planted, G = Hq / Hkv;
  uint32_t x = seed ^ (uint32_t(b) * 0x9e3779b9u) ^ (uint32_t(w) * 0x85ebca6bu);
  x ^= x >> 16, x *= 0x7feb352du, x ^= x >> 15, x *= 0x846ca68bu, x ^= x >> 16;
  const int pos = int(x % uint32_t(L));
  bf16* row = k + ((int64_t(pt[b * npr + pos / P]) * Hkv + h) * P + pos % P) * D;
  const bf16* qg = q + (int64_t(b) * Hq + h * G + j % G) * D;
  for (int d = lane; d < D; d += 32)
    row[d] = __float2bfloat16(2.f * __bfloat162float(qg[d]) + 0.3f * __bfloat162float(row[d]));
  (void)B;
}

struct Layer {
  bf16 *k, *v, *meta, *q;
  uint8_t* codes;
  uint32_t* sz;
};

}  // namespace

// SPADE_TWL_TRACE=1: per-CTA phase stamps of the top-p launch (TwilightPruner::set_trace) of
// the last of 3 back-to-back launches; us after the earliest CTA passed its PDL wait, [min
// mean max n] over the CTAs that reached the phase (n of them; the end: the lists' last CTAs,
// whose stamp may be an earlier launch's where another CTA came last). Needs twilight.cu built
// with the stamps, linked before the library:
//   nvcc -O3 -DNDEBUG -DSPADE_TOPP_TRACE -gencode=arch=compute_90a,code=sm_90a
//     --expt-relaxed-constexpr -std=c++17 -Isrc -c src/backend/cuda/twilight.cu -o twl_trace.o
//   nvcc ... bench/bench_twilight.cu twl_trace.o <libspade_cuda.a> ...
// Also traces the kept attention (SparseAttention::set_trace, in every build).
template <class F>
void topp_trace(TwilightPruner& pr, F&& launch, int n_cta, FILE* out, const char* tag, int ctx,
                int B, double us_call) {
  constexpr int W = 16;
  unsigned long long* d = nullptr;
  SPADE_CUDA(cudaMalloc(&d, sizeof(unsigned long long) * W * n_cta));
  SPADE_CUDA(cudaMemset(d, 0, sizeof(unsigned long long) * W * n_cta));
  pr.set_trace(d);
  for (int i = 0; i < 3; ++i) launch();
  SPADE_CUDA(cudaDeviceSynchronize());
  pr.set_trace(nullptr);
  std::vector<unsigned long long> t(size_t(W) * n_cta);
  SPADE_CUDA(cudaMemcpy(t.data(), d, 8 * t.size(), cudaMemcpyDeviceToHost));
  cudaFree(d);
  unsigned long long t0 = ~0ull;
  for (int i = 0; i < n_cta; ++i) t0 = std::min(t0, t[size_t(W) * i + 1]);
  const char* names[13] = {"entry", "wait", "max", "sum", "binned1", "pass1", "pass2", "pass3",
                           "pass4", "search", "masks", "handoff", "end"};
  std::fprintf(out, "{\"kind\":\"topp_trace\",\"variant\":\"%s\",\"ctx\":%d,\"batch\":%d,\"ctas\":%d,\"us_per_call\":%.3f",
               tag, ctx, B, n_cta, us_call);
  std::printf("top-p trace %s ctx=%d B=%d (%d CTAs, %.2f us/call), us after the first wait [min mean max n]:\n",
              tag, ctx, B, n_cta, us_call);
  for (int k = 0; k < 13; ++k) {
    double mn = 1e30, mx = -1e30, sum = 0;
    int n = 0;
    for (int i = 0; i < n_cta; ++i) {
      const unsigned long long v = t[size_t(W) * i + k];
      if (!v) continue;
      const double us = (double(v) - double(t0)) * 1e-3;
      mn = std::min(mn, us), mx = std::max(mx, us), sum += us, ++n;
    }
    if (!n) continue;
    std::fprintf(out, ",\"%s\":[%.3f,%.3f,%.3f,%d]", names[k], mn, sum / n, mx, n);
    std::printf("  %-8s %7.2f %7.2f %7.2f  %d\n", names[k], mn, sum / n, mx, n);
  }
  std::fprintf(out, "}\n");
  std::fflush(out);
}

// SPADE_TWL_TRACE=1: per-CTA phase stamps of a SparseAttention launch (set_trace; the last of
// 3 back-to-back launches): us after the earliest CTA passed its PDL wait, [min mean max].
template <class F>
void attention_trace(SparseAttention& sa, F&& launch, FILE* out, const char* what, int ctx, int B) {
  const int n = sa.n_items();
  unsigned long long* d = nullptr;
  SPADE_CUDA(cudaMalloc(&d, sizeof(unsigned long long) * 8 * n));
  sa.set_trace(d);
  for (int i = 0; i < 3; ++i) launch();
  SPADE_CUDA(cudaDeviceSynchronize());
  sa.set_trace(nullptr);
  std::vector<unsigned long long> t(size_t(8) * n);
  SPADE_CUDA(cudaMemcpy(t.data(), d, 8 * t.size(), cudaMemcpyDeviceToHost));
  cudaFree(d);
  unsigned long long t0 = ~0ull;
  for (int i = 0; i < n; ++i) t0 = std::min(t0, t[8 * size_t(i) + 1]);
  const char* names[6] = {"entry", "wait", "issued", "loop", "merged", "end"};
  std::fprintf(out, "{\"kind\":\"attention_trace\",\"what\":\"%s\",\"ctx\":%d,\"batch\":%d,\"items\":%d", what, ctx, B, n);
  std::printf("attention trace %s ctx=%d B=%d (%d items), us after the first wait [min mean max]:\n", what, ctx, B, n);
  for (int k = 0; k < 6; ++k) {
    double mn = 1e30, mx = -1e30, sum = 0;
    for (int i = 0; i < n; ++i) {
      const double us = (double(t[8 * size_t(i) + k]) - double(t0)) * 1e-3;
      mn = std::min(mn, us), mx = std::max(mx, us), sum += us;
    }
    std::fprintf(out, ",\"%s\":[%.3f,%.3f,%.3f]", names[k], mn, sum / n, mx);
    std::printf("  %-8s %7.2f %7.2f %7.2f\n", names[k], mn, sum / n, mx);
  }
  std::fprintf(out, "}\n");
  std::fflush(out);
}

int main(int argc, char** argv) {
  const std::string out_path = argc > 1 ? argv[1] : "twilight.jsonl";
  const std::string mode = argc > 2 ? argv[2] : "all";
  FILE* out = std::fopen(out_path.c_str(), "w");
  if (!out) return 1;
  const int Hq = 32, Hkv = 8, D = 128, P = 16;
  const int base_budget = 8192, k_pages = base_budget / 16;
  const float scale = 1.f / std::sqrt(float(D));
  std::printf("%s\n", device_summary().c_str());
  // Copy bandwidth (the floor's denominator).
  double bw = 0;
  {
    const size_t n = size_t(1) << 30;
    void *a, *b;
    SPADE_CUDA(cudaMalloc(&a, n));
    SPADE_CUDA(cudaMalloc(&b, n));
    SPADE_CUDA(cudaMemset(a, 1, n));
    const double us = time_us([&](int) { SPADE_CUDA(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice)); }, 3, 5);
    bw = 2.0 * double(n) / (us * 1e-6);
    cudaFree(a);
    cudaFree(b);
    std::printf("copy bandwidth %.0f GB/s\n", bw / 1e9);
  }
  struct Pt { int ctx, B, planted; const char* tag; };
  std::vector<Pt> pts;
  for (int ctx : {32768, 131072})
    for (int B : {1, 8}) pts.push_back({ctx, B, 256, "peaked"});
  pts.push_back({32768, 1, 0, "flat"});
  if (mode == "quick") pts = {{32768, 1, 256, "peaked"}, {32768, 8, 256, "peaked"}};
  if (mode == "large") {  // serving batches (the paper measures batch 16-256)
    pts.clear();
    for (int ctx : {32768, 131072})
      for (int B : {16, 32, 64}) pts.push_back({ctx, B, 256, "peaked"});
  }
  if (mode.rfind("point:", 0) == 0) {  // point:<ctx>:<B>:<peaked|flat> (profiling one point)
    Pt one{32768, 1, 256, "peaked"};
    char tag[16] = {0};
    if (std::sscanf(mode.c_str(), "point:%d:%d:%15s", &one.ctx, &one.B, tag) != 3) return 2;
    one.planted = std::string(tag) == "flat" ? 0 : 256;
    one.tag = one.planted ? "peaked" : "flat";
    pts = {one};
  }
  for (const Pt& pt : pts) {
    const int ctx = pt.ctx, B = pt.B;
    const int npr = ctx / P;  // pages per request
    const int64_t pages = int64_t(B) * npr;
    const double sel_bytes = double(B) * Hkv * base_budget * 2 * D * 2;  // Quest attention K+V
    const int n_layers = int(std::min<double>(8, std::max<double>(1, std::ceil(200e6 / sel_bytes))));
    const size_t kv_elems = size_t(pages) * Hkv * P * D;
    size_t free_b = 0, total_b = 0;
    SPADE_CUDA(cudaMemGetInfo(&free_b, &total_b));
    const size_t per_layer = kv_elems * 2 * 2 + kv_elems / 2 + kv_elems / D * 4 + size_t(pages) * Hkv * 2 * D * 2;
    const size_t arena_bytes = per_layer * size_t(n_layers) + (size_t(1) << 30);
    if (arena_bytes > free_b) {
      std::printf("skip ctx=%d B=%d: needs %.1f GB\n", ctx, B, arena_bytes / 1e9);
      continue;
    }
    DeviceArena arena(arena_bytes);
    std::vector<int32_t> table(static_cast<size_t>(pages)), ids(table.size()), nv(table.size(), P);
    for (int64_t i = 0; i < pages; ++i) table[size_t(i)] = int32_t(i), ids[size_t(i)] = int32_t(i);
    int32_t* d_ids = arena.alloc_n<int32_t>(ids.size(), "ids");
    int32_t* d_nv = arena.alloc_n<int32_t>(nv.size(), "nv");
    SPADE_CUDA(cudaMemcpy(d_ids, ids.data(), 4 * ids.size(), cudaMemcpyHostToDevice));
    SPADE_CUDA(cudaMemcpy(d_nv, nv.data(), 4 * nv.size(), cudaMemcpyHostToDevice));
    std::vector<Layer> layers(static_cast<size_t>(n_layers));
    for (int l = 0; l < n_layers; ++l) {
      Layer& y = layers[size_t(l)];
      y.k = arena.alloc_n<bf16>(kv_elems, "k");
      y.v = arena.alloc_n<bf16>(kv_elems, "v");
      y.codes = arena.alloc_n<uint8_t>(kv_elems / 2, "codes");
      y.sz = arena.alloc_n<uint32_t>(kv_elems / D, "sz");
      y.meta = arena.alloc_n<bf16>(size_t(pages) * Hkv * 2 * D, "meta");
      y.q = arena.alloc_n<bf16>(size_t(B) * Hq * D, "q");
      fill_random_bf16(y.k, int64_t(kv_elems), 11 + l, 1.f, 0.f, 0);
      fill_random_bf16(y.v, int64_t(kv_elems), 101 + l, 1.f, 0.f, 0);
      fill_random_bf16(y.q, int64_t(B) * Hq * D, 1001 + l, 1.f, 0.f, 0);
      if (pt.planted > 0) {
        dim3 grid(unsigned((Hkv * pt.planted * 32 + 255) / 256), unsigned(B));
        plant_kernel<<<grid, 256>>>(y.k, y.q, d_ids, npr, ctx, Hq, Hkv, D, P, pt.planted, 7 + l);
        SPADE_CUDA_LAUNCH();
      }
      quest_update_meta(y.k, y.meta, d_ids, d_nv, int(pages), Hkv, P, D, 0);
      int4_quantize_pages(y.k, y.codes, y.sz, d_ids, d_nv, int(pages), Hkv, P, D, 0);
    }
    SPADE_CUDA(cudaDeviceSynchronize());
    // Quest: selection + CSR lists, attention planned over them.
    SparseAttention sa_q(arena, B, pages, Hq, Hkv, D, P), sa_t(arena, B, pages, Hq, Hkv, D, P),
        sa_d(arena, B, pages, Hq, Hkv, D, P), sa_h(arena, B, pages, Hq, Hkv, D, P);
    std::vector<SparseSeq> seqs;
    for (int b = 0; b < B; ++b) seqs.push_back({table.data() + size_t(b) * npr, npr, ctx});
    sa_q.plan(seqs, SelGran::Chunk16, Hkv, std::vector<int>(size_t(B) * Hkv, k_pages), nullptr, 0);
    std::vector<uint8_t> all_dense(size_t(Hkv), 1);
    sa_d.plan(seqs, SelGran::Token, Hkv, std::vector<int>(size_t(B) * Hkv, 0), &all_dense, 0);
    float* scores = arena.alloc_n<float>(size_t(B) * Hkv * npr, "scores");
    int32_t* boff = arena.alloc_n<int32_t>(size_t(B) * Hkv + 1, "base off");
    int32_t* bidx = arena.alloc_n<int32_t>(size_t(B) * Hkv * k_pages, "base idx");
    bf16* att = arena.alloc_n<bf16>(size_t(B) * Hq * D, "att");
    TwilightPruner pr(arena, B, Hq, Hkv, D, P, base_budget, 0.95, 1e-6);
    auto qargs = [&](int l) {
      const Layer& y = layers[size_t(l % n_layers)];
      QuestArgs qa{y.q, y.meta, sa_q.dev_page_table(), sa_q.dev_page_off(), sa_q.dev_kv_len(),
                   scores, bidx, B, Hq, Hkv, D, npr, k_pages};
      qa.fast = 1;
      qa.csr_off = boff;  // CSR from the top-k itself, as CudaModel runs it
      return qa;
    };
    auto tstep = [&](int l) {
      const Layer& y = layers[size_t(l % n_layers)];
      TwilightStep st;
      st.q = y.q, st.codes = y.codes, st.sz = y.sz;
      st.page_table = sa_q.dev_page_table(), st.page_off = sa_q.dev_page_off(), st.kv_len = sa_q.dev_kv_len();
      st.base_off = boff, st.base_idx = bidx, st.gran = SelGran::Chunk16, st.B = B, st.scale = scale;
      return st;
    };
    auto select = [&](int l) { quest_select(qargs(l), 0); };
    // Warm-up step: kept counts per list (the next plan's upper bounds) and statistics.
    std::vector<int32_t> cnt(size_t(B) * Hkv);
    double kept_mean = 0;
    int kept_max = 0;
    for (int l = 0; l < n_layers; ++l) {
      select(l);
      pr.run(tstep(l), 0);
      SPADE_CUDA(cudaMemcpy(cnt.data(), pr.kept_count(), 4 * cnt.size(), cudaMemcpyDeviceToHost));
      for (int c : cnt) kept_mean += c, kept_max = std::max(kept_max, c);
    }
    kept_mean /= double(cnt.size()) * n_layers;
    // The kept attention is planned as CudaModel plans it: each list's upper bound is the base
    // budget (the kept counts exist only on the device; the kernel reads them, sel_cnt). sa_h:
    // planned with the counts measured above instead (reference timing).
    sa_t.plan(seqs, SelGran::Token, Hkv, std::vector<int>(cnt.size(), std::min(base_budget, ctx)), nullptr, 0);
    sa_h.plan(seqs, SelGran::Token, Hkv, std::vector<int>(cnt.size(), std::max(16, kept_max)), nullptr, 0);
    const int calls = 20, reps = 7;
    auto lay = [&](int i) -> const Layer& { return layers[size_t(i % n_layers)]; };
    const double t_score = time_us([&](int i) { quest_score(qargs(i), 0); }, calls, reps);
    const double t_topk = time_us([&](int i) { quest_topk(qargs(i), 0); }, calls, reps);
    const double t_select = time_us([&](int i) { select(i); }, calls, reps);
    select(0);  // lists of layer 0 for the stage timings below (same lists for every layer)
    const double t_attn_base = time_us([&](int i) { const Layer& y = lay(i); sa_q.run(y.q, y.k, y.v, boff, bidx, att, scale, 0); }, calls, reps);
    const double t_est = time_us([&](int i) { pr.estimate(tstep(i), 0); }, calls, reps);
    // Top-p reads only the logits (L2-resident): timed on layer 0's, which match the lists.
    pr.estimate(tstep(0), 0);
    const double t_topp = time_us([&](int) { pr.topp(tstep(0), 0); }, calls, reps);
    if (std::getenv("SPADE_TWL_TRACE")) topp_trace(pr, [&] { pr.topp(tstep(0), 0); }, B * Hq, out, pt.tag, ctx, B, t_topp);
    pr.set_topp_bisection_only(true);  // the step-per-pass search, same thresholds (tests)
    const double t_topp_bisect = time_us([&](int) { pr.topp(tstep(0), 0); }, calls, reps);
    pr.set_topp_bisection_only(false);
    const double t_cmp = time_us([&](int i) { pr.compact(tstep(i), 0); }, calls, reps);
    const double t_pruner = time_us([&](int i) { pr.run(tstep(i), 0); }, calls, reps);
    // The pruner's two launches per layer, every layer once, replayed from a CUDA graph
    // (launch gaps removed); per layer.
    auto graph_us = [&](auto&& enqueue) {  // enqueue(layer, stream) of every layer, one graph
      cudaStream_t gs;
      SPADE_CUDA(cudaStreamCreateWithFlags(&gs, cudaStreamNonBlocking));
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      SPADE_CUDA(cudaStreamBeginCapture(gs, cudaStreamCaptureModeGlobal));
      for (int l = 0; l < n_layers; ++l) enqueue(l, gs);
      SPADE_CUDA(cudaStreamEndCapture(gs, &graph));
      SPADE_CUDA(cudaGraphInstantiate(&exec, graph, 0));
      const double t = time_us([&](int) { SPADE_CUDA(cudaGraphLaunch(exec, 0)); }, calls, reps) / n_layers;
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
      cudaStreamDestroy(gs);
      return t;
    };
    const double t_pruner_graph = graph_us([&](int l, cudaStream_t gs) { pr.run(tstep(l), gs); });
    pr.run(tstep(0), 0);  // layer 0's kept lists (its q over its selection) for the stage below
    const double t_attn_kept = time_us([&](int i) { const Layer& y = lay(i); sa_t.run(y.q, y.k, y.v, pr.kept_strided_off(), pr.kept_strided_idx(), att, scale, 0, 0, nullptr, 0, {}, pr.kept_count()); }, calls, reps);
    const double t_attn_kept_hint = time_us([&](int i) { const Layer& y = lay(i); sa_h.run(y.q, y.k, y.v, pr.kept_strided_off(), pr.kept_strided_idx(), att, scale, 0, 0, nullptr, 0, {}, pr.kept_count()); }, calls, reps);
    if (std::getenv("SPADE_TWL_TRACE")) {
      const Layer& y = lay(0);
      attention_trace(sa_t, [&] { sa_t.run(y.q, y.k, y.v, pr.kept_strided_off(), pr.kept_strided_idx(), att, scale, 0, 0, nullptr, 0, {}, pr.kept_count()); }, out, "kept_lists", ctx, B);
    }
    const double t_dense = time_us([&](int i) { const Layer& y = lay(i); sa_d.run(y.q, y.k, y.v, boff, bidx, att, scale, 0); }, calls, reps);
    // Whole steps, in stream order.
    const double t_quest_step = time_us([&](int i) {
      const Layer& y = lay(i);
      select(i);
      sa_q.run(y.q, y.k, y.v, boff, bidx, att, scale, 0);
    }, calls, reps);
    const double t_tw_step = time_us([&](int i) {
      const Layer& y = lay(i);
      select(i);
      pr.run(tstep(i), 0);
      sa_t.run(y.q, y.k, y.v, pr.kept_strided_off(), pr.kept_strided_idx(), att, scale, 0, 0,
               nullptr, 0, {}, pr.kept_count());
    }, calls, reps);
    // Whole steps as the model runs them: every rotated layer's step captured in one CUDA graph
    // (launches back to back on the device, programmatic edges with PDL); per layer.
    const double t_quest_step_graph = graph_us([&](int l, cudaStream_t gs) {
      const Layer& y = lay(l);
      quest_select(qargs(l), gs);
      sa_q.run(y.q, y.k, y.v, boff, bidx, att, scale, gs);
    });
    const double t_tw_step_graph = graph_us([&](int l, cudaStream_t gs) {
      const Layer& y = lay(l);
      quest_select(qargs(l), gs);
      pr.run(tstep(l), gs);
      sa_t.run(y.q, y.k, y.v, pr.kept_strided_off(), pr.kept_strided_idx(), att, scale, gs, 0,
               nullptr, 0, {}, pr.kept_count());
    });
    const double base_tokens = double(B) * Hkv * base_budget;
    const double est_bytes = base_tokens * (D / 2 + 4);
    const double pr_bytes = double(pr.floor_bytes(int64_t(base_tokens), int64_t(kept_mean * B * Hkv)));
    const double floor_us = pr_bytes / bw * 1e6;
    char line[4096];
    std::snprintf(line, sizeof line,
                  "{\"variant\":\"%s\",\"ctx\":%d,\"batch\":%d,\"Hq\":%d,\"Hkv\":%d,\"D\":%d,\"P\":%d,"
                  "\"base_budget\":%d,\"p\":0.95,\"planted\":%d,\"layers_rotated\":%d,"
                  "\"kept_mean\":%.1f,\"kept_max\":%d,"
                  "\"us_quest_score\":%.2f,\"us_quest_topk\":%.2f,\"us_quest_select\":%.2f,"
                  "\"us_attn_base\":%.2f,\"us_estimate\":%.2f,\"us_topp\":%.2f,\"us_topp_bisection\":%.2f,\"us_compact\":%.2f,"
                  "\"us_pruner\":%.2f,\"us_pruner_graph\":%.2f,\"us_attn_kept\":%.2f,\"us_attn_kept_counts_plan\":%.2f,\"us_dense\":%.2f,"
                  "\"us_quest_step\":%.2f,\"us_twilight_step\":%.2f,"
                  "\"us_quest_step_graph\":%.2f,\"us_twilight_step_graph\":%.2f,\"speedup_vs_quest_graph\":%.3f,"
                  "\"pruner_bytes\":%.0f,\"estimate_bytes\":%.0f,\"copy_bw_gbs\":%.1f,"
                  "\"pruner_floor_us\":%.2f,\"pruner_vs_floor\":%.3f,\"estimate_vs_floor\":%.3f,"
                  "\"speedup_vs_quest\":%.3f,\"speedup_vs_dense\":%.3f}",
                  pt.tag, ctx, B, Hq, Hkv, D, P, base_budget, pt.planted, n_layers, kept_mean, kept_max,
                  t_score, t_topk, t_select, t_attn_base, t_est, t_topp, t_topp_bisect, t_cmp, t_pruner, t_pruner_graph, t_attn_kept, t_attn_kept_hint,
                  t_dense, t_quest_step, t_tw_step, t_quest_step_graph, t_tw_step_graph,
                  t_quest_step_graph / t_tw_step_graph, pr_bytes, est_bytes, bw / 1e9, floor_us,
                  t_pruner / floor_us, t_est / (est_bytes / bw * 1e6), t_quest_step / t_tw_step,
                  t_dense / t_tw_step);
    std::printf("%s\n", line);
    std::fprintf(out, "%s\n", line);
    std::fflush(out);
  }
  std::fclose(out);
  return 0;
}
