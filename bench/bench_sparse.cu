// Sparse decode benchmark (issue 9): attention over selections and the Quest selector on the
// GPU vs our full decode attention (v3, auto), Llama-3-8B attention shapes (Hq 32, Hkv 8,
// D 128, bf16, page 16), contexts 32K / 128K, batch 1 / 8 / 32, budgets 1K / 2K / 4K tokens.
// Writes JSON lines; bench/sparse_report.py merges them with the SDPA lines of the same run.
//
// Rows ("method"):
//   full         our dense decode attention (AttentionWorkspace, auto kernel)
//   token        SparseAttention over per-(request, KV head) token lists of `budget`
//                stratified-random positions (one position drawn in each L/budget stretch)
//   page16       SparseAttention over per-head lists of budget/16 random 16-token pages
//   shared_token one token list per request shared by all KV heads (LessIsMore)
//   token_skip_lnX  the token lists with BLASST skipping inside them (SelSkip, ln lambda = X;
//                lambda sweep on random data; selection_skip lines: sparsity, speed-up)
//   quest        the whole Quest step: metadata update of each request's last page, page
//                scores, top-k (radix select), attention over the selected pages
//   quest_select the selection part of `quest` alone (quest_score / quest_topk: its two stages)
//   quest_tc*    the same with the tensor-core page scores (QuestArgs::fast)
//   quest_step / quest_tc_step  scores + top-k + attention without the separate metadata
//                update: a model decode step, whose KV append writes the last page's min / max
//   hybrid90     every KV head sparse, token lists at 90% sparsity (L/10 tokens), 128K
//   hybrid_2d    KV heads 0 and 1 dense (whole context), 6 sparse heads with `budget` tokens
//   full_emit_group / full_emit_head  `full` that also writes the group-mean / per-query-head
//                scores (a TidalDecode / LessIsMore selection layer's attention)
//   tidal_select the token top-k of every (request, KV head) over those scores + CSR compaction
//                (topk_rows, or topk_rows_long past 40960 tokens); the same for oracle-topk
//   lessismore_select  per-head top-k, rank merge, sinks + window -> one list per request
//   lycheedecode_layer one hybrid launch (KV head 0 a retrieval head: whole context + scores,
//                7 sparse heads with `budget` tokens) + the retrieval head's next-layer set
//                (serial here; the model overlaps the set's top-k with the layer's GEMMs)
// Selection rows read the scores of the emit rows (real q.k values, one region: L2-warm at
// small batch).
// Bytes (what each must read + write): K and V rows it attends (2 x D x 2 B per row and KV
// head), index entries (4 B each), q + out, Quest metadata (4 x D B per page-head) + scores.
// floor_us = bytes / the device-to-device copy bandwidth measured at start (read + write).
// Rotation: R >= 2 disjoint cache regions of B x L tokens (>= 102400 pages = 6.7 GB in all);
// call i uses region i % R (its own q, selection lists and Quest metadata), so consecutive
// calls never find their rows in L2. Timing: events around a batch of calls, 30 batches,
// median per call.
//
// Trace mode (`bench_sparse OUT trace [L [B]]`): the token and page16 rows only, each followed
// by per-CTA phase stamps of one call (SparseAttention::set_trace; "trace" JSON lines).
//
// Build: nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -Isrc bench/bench_sparse.cu
//   <build>/libspade_cuda.a -lcublasLt -lcublas -o bench_sparse
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/attention.h"
#include "backend/cuda/ops.h"
#include "backend/cuda/sparse_attention.h"
#include "rotation_timer.h"

using namespace spade;
using namespace spade::cuda;

namespace {

const int Hq = 32, Hkv = 8, D = 128, P = 16;
double g_bw = 0;  // measured copy bandwidth, bytes/s
float* g_scores_group = nullptr;  // [B * Hkv][L] of the current shape
float* g_scores_head = nullptr;   // [B * Hq][L]
FILE* g_out = nullptr;
bool g_trace = false;  // trace mode: token / page16 rows only, each followed by a phase trace
unsigned long long* g_trace_buf = nullptr;  // device, 8 x uint64 per work item
// SPADE_BENCH_FORCE_SPLIT=n: the token-list rows plan n splits per (request, KV head) instead of
// the planner's choice (split-count A/B runs).
const int g_force_split = [] {
  const char* e = std::getenv("SPADE_BENCH_FORCE_SPLIT");
  return e && *e ? std::atoi(e) : 0;
}();


void measure_bw() {
  const size_t n = size_t(1) << 30;
  void *x, *y;
  SPADE_CUDA(cudaMalloc(&x, n));
  SPADE_CUDA(cudaMalloc(&y, n));
  SPADE_CUDA(cudaMemset(x, 1, n));
  const double us = time_calls(1, [&](int) { SPADE_CUDA(cudaMemcpyAsync(y, x, n, cudaMemcpyDeviceToDevice)); });
  g_bw = 2.0 * n / (us * 1e-6);
  std::fprintf(g_out, "{\"kind\":\"hbm\",\"what\":\"cudaMemcpy D2D 1 GiB, read+write\",\"us\":%.2f,\"GBps\":%.1f}\n", us, g_bw * 1e-9);
  std::fprintf(stderr, "D2D copy: %.1f GB/s\n", g_bw * 1e-9);
  cudaFree(x);
  cudaFree(y);
}

void emit(const char* method, int L, int B, int budget, double us, float us_min, double bytes,
          int R, int items, int max_split) {
  const double floor_us = bytes / g_bw * 1e6;
  std::fprintf(g_out,
               "{\"kind\":\"sparse\",\"method\":\"%s\",\"L\":%d,\"B\":%d,\"budget\":%d,\"Hq\":%d,"
               "\"Hkv\":%d,\"D\":%d,\"page\":%d,\"us\":%.3f,\"us_min\":%.3f,\"bytes\":%.0f,"
               "\"GBps\":%.1f,\"floor_us\":%.3f,\"x_floor\":%.3f,\"rotations\":%d,\"items\":%d,"
               "\"max_split\":%d}\n",
               method, L, B, budget, Hq, Hkv, D, P, us, us_min, bytes, bytes / us * 1e-3,
               floor_us, us / floor_us, R, items, max_split);
  std::fflush(g_out);
  std::fprintf(stderr, "%-12s L=%6d B=%2d budget=%5d  %9.2f us  %7.1f GB/s  x_floor %.2f\n", method,
               L, B, budget, us, bytes / us * 1e-3, us / floor_us);
}

// Trace mode: per-CTA phase stamps of the last of 2R back-to-back calls (the calls before it
// make its PDL start realistic), as microseconds from the earliest CTA entry: when the CTAs
// started, got past the PDL wait, had their ring prologue issued, finished the chunk loop
// (warp 0), merged the warps, ended (the combining CTAs after the split combine).
void trace_calls(const char* method, int L, int B, int budget, int R, SparseAttention& sa,
                 const std::function<void(int)>& f, double us_call) {
  const int n = sa.n_items();
  sa.set_trace(g_trace_buf);
  for (int i = 0; i < 2 * R; ++i) f(i % R);
  SPADE_CUDA(cudaDeviceSynchronize());
  sa.set_trace(nullptr);
  std::vector<unsigned long long> t(size_t(8) * n);
  SPADE_CUDA(cudaMemcpy(t.data(), g_trace_buf, 8 * t.size(), cudaMemcpyDeviceToHost));
  unsigned long long t0 = ~0ull;
  for (int i = 0; i < n; ++i) t0 = std::min(t0, t[8 * size_t(i)]);
  auto us = [&](int i, int k) { return double(t[8 * size_t(i) + k] - t0) * 1e-3; };
  const char* names[6] = {"entry", "wait", "issued", "loop", "merged", "end"};
  double mean[6] = {}, mx[6] = {}, mn[6];
  for (int k = 0; k < 6; ++k) mn[k] = 1e30;
  int combined = 0;
  for (int i = 0; i < n; ++i) {
    for (int k = 0; k < 6; ++k) {
      const double v = us(i, k);
      mean[k] += v / n, mx[k] = std::max(mx[k], v), mn[k] = std::min(mn[k], v);
    }
    combined += int(t[8 * size_t(i) + 6] >> 32);
  }
  std::fprintf(g_out, "{\"kind\":\"trace\",\"method\":\"%s\",\"L\":%d,\"B\":%d,\"budget\":%d,"
                      "\"items\":%d,\"combined\":%d,\"us_per_call\":%.3f", method, L, B, budget, n,
               combined, us_call);
  for (int k = 0; k < 6; ++k)
    std::fprintf(g_out, ",\"%s\":[%.3f,%.3f,%.3f]", names[k], mn[k], mean[k], mx[k]);
  std::fprintf(g_out, "}\n");
  std::fflush(g_out);
  std::fprintf(stderr, "  trace %s B=%d budget=%d (%d items, %.2f us/call), us from first entry [min mean max]:\n",
               method, B, budget, n, us_call);
  for (int k = 0; k < 6; ++k)
    std::fprintf(stderr, "    %-7s %7.2f %7.2f %7.2f\n", names[k], mn[k], mean[k], mx[k]);
}

void bench_shape(int L, int B) {
  const int pps = L / P;  // L is a multiple of 16
  const int64_t region_pages = int64_t(B) * pps;
  int R = int(std::max<int64_t>(2, (102400 + region_pages - 1) / region_pages));
  const size_t page_elems = size_t(Hkv) * P * D;
  const size_t meta_page = size_t(Hkv) * 2 * D;
  size_t free_b = 0, total_b = 0;
  SPADE_CUDA(cudaMemGetInfo(&free_b, &total_b));
  const size_t per_region = size_t(region_pages) * (2 * page_elems + meta_page) * 2;
  const size_t sel_need = size_t(B) * L * 4 * (Hkv + Hq + 1) + size_t(B) * Hq * 4096 * 8 * 2;
  while (R > 1 && size_t(R) * per_region + sel_need + (4ull << 30) > free_b) --R;
  if (size_t(R) * per_region + (3ull << 30) > free_b) {
    std::fprintf(stderr, "L=%d B=%d: does not fit, skipped\n", L, B);
    return;
  }
  const int64_t pool_pages = R * region_pages;
  const size_t sel_bytes_all = size_t(B) * L * 4 * (Hkv + Hq + 1) + size_t(B) * Hq * 4096 * 8 +
                               topk_long_scratch_bytes(B * Hq, L, 4096) + (64u << 20);
  DeviceArena arena(size_t(R) * per_region + (1536ull << 20) + sel_bytes_all);
  bf16* K = arena.alloc_n<bf16>(size_t(pool_pages) * page_elems, "K");
  bf16* V = arena.alloc_n<bf16>(size_t(pool_pages) * page_elems, "V");
  bf16* meta = arena.alloc_n<bf16>(size_t(pool_pages) * meta_page, "meta");
  fill_random_bf16(K, int64_t(pool_pages * page_elems), 11 + L + B, 1.f, 0.f, 0);
  fill_random_bf16(V, int64_t(pool_pages * page_elems), 22 + L + B, 1.f, 0.f, 0);
  bf16* q = arena.alloc_n<bf16>(size_t(R) * B * Hq * D, "q");
  bf16* o = arena.alloc_n<bf16>(size_t(B) * Hq * D, "out");
  fill_random_bf16(q, int64_t(R) * B * Hq * D, 33, 1.f, 0.f, 0);
  // Page table (same in every region): a shuffled permutation of the region's pages.
  std::vector<int32_t> perm(region_pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::mt19937 rng(L + B);
  std::shuffle(perm.begin(), perm.end(), rng);
  // Quest metadata of every page of the pool (pool-wide page ids 0..pool_pages-1).
  {
    std::vector<int32_t> ids(pool_pages), nv(pool_pages, P);
    std::iota(ids.begin(), ids.end(), 0);
    int32_t* d = arena.alloc_n<int32_t>(2 * size_t(pool_pages), "meta ids");
    SPADE_CUDA(cudaMemcpy(d, ids.data(), 4 * ids.size(), cudaMemcpyHostToDevice));
    SPADE_CUDA(cudaMemcpy(d + pool_pages, nv.data(), 4 * nv.size(), cudaMemcpyHostToDevice));
    quest_update_meta(K, meta, d, d + pool_pages, int(pool_pages), Hkv, P, D, 0);
    SPADE_CUDA(cudaDeviceSynchronize());
  }
  auto Kr = [&](int r) { return K + size_t(r) * region_pages * page_elems; };
  auto Vr = [&](int r) { return V + size_t(r) * region_pages * page_elems; };
  auto Mr = [&](int r) { return meta + size_t(r) * region_pages * meta_page; };
  auto Qr = [&](int r) { return q + size_t(r) * B * Hq * D; };
  const float scale = 1.f / std::sqrt(float(D));
  const double qo_bytes = 2.0 * B * Hq * D * 2;

  // Scores of the selection layers' attention (kept for the selection rows below).
  g_scores_group = arena.alloc_n<float>(size_t(B) * Hkv * L, "group scores");
  g_scores_head = arena.alloc_n<float>(size_t(B) * Hq * L, "head scores");
  // Full attention (v3 auto).
  {
    AttnLimits lim;
    lim.max_batch = B;
    lim.max_q_tokens = B;
    lim.max_pages = region_pages;
    const size_t mark = arena.used();
    AttentionWorkspace ws(arena, lim, Hq, Hkv, D, P);
    std::vector<AttnSeq> batch(B);
    for (int b = 0; b < B; ++b) batch[b] = {perm.data() + size_t(b) * pps, pps, L, 1};
    ws.plan(batch, 0, 0);
    float mn;
    double us = time_calls(R, [&](int r) { ws.run(Qr(r), Kr(r), Vr(r), o, scale, 0); }, &mn);
    emit("full", L, B, 0, us, mn, double(B) * L * Hkv * D * 2 * 2 + qo_bytes, R, ws.n_items(), ws.n_split());
    // The selection layers' attention: the same with score emission (scores kept for below).
    const DecodeScores dg{g_scores_group, L}, dh{g_scores_head, L, true};
    us = time_calls(R, [&](int r) { ws.run(Qr(r), Kr(r), Vr(r), o, scale, 0, {}, &dg); }, &mn);
    emit("full_emit_group", L, B, 0, us, mn, double(B) * L * Hkv * D * 2 * 2 + qo_bytes + double(B) * Hkv * L * 4, R, ws.n_items(), ws.n_split());
    us = time_calls(R, [&](int r) { ws.run(Qr(r), Kr(r), Vr(r), o, scale, 0, {}, &dh); }, &mn);
    emit("full_emit_head", L, B, 0, us, mn, double(B) * L * Hkv * D * 2 * 2 + qo_bytes + double(B) * Hq * L * 4, R, ws.n_items(), ws.n_split());
    SPADE_CUDA(cudaDeviceSynchronize());
    arena.reset(mark);
  }

  std::vector<SparseSeq> seqs(B);
  for (int b = 0; b < B; ++b) seqs[b] = {perm.data() + size_t(b) * pps, pps, L};
  // SPADE_BENCH_MAX_SPLIT=n: the most splits per (request, head) (the library default, 256,
  // when unset; 64 before the split partials were indexed by work item).
  const char* ms_env = std::getenv("SPADE_BENCH_MAX_SPLIT");
  SparseAttention sa(arena, B, region_pages, Hq, Hkv, D, P, ms_env ? std::atoi(ms_env) : 256);
  unsigned long long* d_skip_counts = arena.alloc_n<unsigned long long>(size_t(2) * Hkv, "skip counts");
  int32_t* d_rown = arena.alloc_n<int32_t>(size_t(B) * Hq + B, "row lengths");
  int32_t* d_strided = arena.alloc_n<int32_t>(size_t(B) * Hq * 4096, "strided top-k");
  int32_t* d_merged = arena.alloc_n<int32_t>(size_t(B) * 4096, "merged top-k");
  float* g_keys = arena.alloc_n<float>(size_t(B) * L, "merge keys");
  int32_t* d_off2 = arena.alloc_n<int32_t>(size_t(B) * Hkv + 1, "next sel_off");
  int32_t* d_idx2 = arena.alloc_n<int32_t>(size_t(B) * Hkv * 4096, "next sel_idx");
  void* d_topk_scratch = arena.alloc_n<unsigned char>(
      std::max<size_t>(256, topk_long_scratch_bytes(B * Hq, L, 4096)), "long top-k scratch");
  const int max_budget = L / 10 > 4096 ? L / 10 : 4096;
  int32_t* d_off = arena.alloc_n<int32_t>(size_t(B) * Hkv + 1, "sel_off");
  int32_t* d_idx = arena.alloc_n<int32_t>(size_t(R) * B * Hkv * max_budget, "sel_idx");
  int32_t* d_qsel = arena.alloc_n<int32_t>(size_t(B) * Hkv * (4096 / 16), "quest sel");
  float* d_scores = arena.alloc_n<float>(size_t(B) * Hkv * pps, "quest scores");
  int32_t* d_qpt = arena.alloc_n<int32_t>(size_t(region_pages) + 2 * B + 2 * B, "quest pt");
  int32_t* d_last = d_qpt + region_pages + 2 * B;  // [B] last page ids, then [B] n_valid
  {
    std::vector<int32_t> h(region_pages + 4 * B);
    std::copy(perm.begin(), perm.end(), h.begin());
    for (int b = 0; b < B; ++b) {
      h[region_pages + b] = b * pps;               // page_off
      h[region_pages + B + b] = L;                 // kv_len
      h[region_pages + 2 * B + b] = perm[size_t(b) * pps + pps - 1];
      h[region_pages + 3 * B + b] = P;
    }
    SPADE_CUDA(cudaMemcpy(d_qpt, h.data(), 4 * h.size(), cudaMemcpyHostToDevice));
  }
  // Uploads R sets of stratified-random lists (n entries of [0, range) per list, n_lists
  // lists), CSR offsets at stride n.
  auto upload_lists = [&](int n_lists, int n, int range) {
    std::vector<int32_t> h(size_t(R) * n_lists * n);
    const double w = double(range) / n;
    for (size_t li = 0; li < size_t(R) * n_lists; ++li)
      for (int j = 0; j < n; ++j) {
        const int lo = int(j * w), hi = std::max(lo + 1, int((j + 1) * w));
        h[li * n + j] = lo + int(rng() % uint32_t(hi - lo));
      }
    SPADE_CUDA(cudaMemcpy(d_idx, h.data(), 4 * h.size(), cudaMemcpyHostToDevice));
    std::vector<int32_t> off(size_t(n_lists) + 1);
    for (int l = 0; l <= n_lists; ++l) off[l] = l * n;
    SPADE_CUDA(cudaMemcpy(d_off, off.data(), 4 * off.size(), cudaMemcpyHostToDevice));
  };
  auto Ir = [&](int r, int n_lists, int n) { return d_idx + size_t(r) * n_lists * n; };

  for (int budget : {1024, 2048, 4096}) {
    const double kv_row = 2.0 * D * 2;  // K + V bytes per row and KV head
    float mn;
    {  // token lists per (request, KV head)
      const int nl = B * Hkv;
      upload_lists(nl, budget, L);
      sa.plan(seqs, SelGran::Token, Hkv, std::vector<int>(nl, budget), nullptr, 0, g_force_split);
      const double us = time_calls(R, [&](int r) { sa.run(Qr(r), Kr(r), Vr(r), d_off, Ir(r, nl, budget), o, scale, 0); }, &mn);
      emit("token", L, B, budget, us, mn, double(nl) * budget * (kv_row + 4) + qo_bytes, R, sa.n_items(), sa.max_split_used());
      if (g_trace)
        trace_calls("token", L, B, budget, R, sa, [&](int r) { sa.run(Qr(r), Kr(r), Vr(r), d_off, Ir(r, nl, budget), o, scale, 0); }, us);
      // BLASST inside the same lists (SelSkip), a lambda sweep on random data: bytes = K and
      // the index of every entry + V of the kept chunks' rows; speed-up vs the plain row above.
      const std::vector<float> sweep = g_trace ? std::vector<float>{} : std::vector<float>{-1000.f, -1.f, -0.5f, -0.25f, 0.f};
      for (float ll : sweep) {
        SelSkip sk;
        sk.log_lambda = ll;
        sk.counts = d_skip_counts;
        SPADE_CUDA(cudaMemset(d_skip_counts, 0, sizeof(unsigned long long) * 2 * Hkv));
        const double us_s = time_calls(R, [&](int r) {
          sa.run(Qr(r), Kr(r), Vr(r), d_off, Ir(r, nl, budget), o, scale, 0, 0, nullptr, 0, sk);
        }, &mn);
        std::vector<unsigned long long> c(size_t(2) * Hkv);
        SPADE_CUDA(cudaMemcpy(c.data(), d_skip_counts, 8 * c.size(), cudaMemcpyDeviceToHost));
        double tiles = 0, skipped = 0;
        for (int h = 0; h < Hkv; ++h) tiles += double(c[size_t(2 * h)]), skipped += double(c[size_t(2 * h + 1)]);
        const double sparsity = tiles > 0 ? skipped / tiles : 0.0;
        const double bytes = double(nl) * budget * (D * 2 + 4) + double(nl) * budget * (1 - sparsity) * D * 2 + qo_bytes;
        char name[40];
        std::snprintf(name, sizeof name, "token_skip_ln%g", double(ll));
        emit(name, L, B, budget, us_s, mn, bytes, R, sa.n_items(), sa.max_split_used());
        std::fprintf(g_out, "{\"kind\":\"selection_skip\",\"L\":%d,\"B\":%d,\"budget\":%d,"
                            "\"ln_lambda\":%g,\"sparsity\":%.4f,\"us\":%.3f,\"us_plain\":%.3f,"
                            "\"speedup_vs_plain\":%.3f}\n", L, B, budget, double(ll), sparsity, us_s, us,
                     us / us_s);
        std::fprintf(stderr, "  skip ln lambda %g: sparsity %.3f, %.2f us vs %.2f plain: %.2fx\n",
                     double(ll), sparsity, us_s, us, us / us_s);
      }
    }
    if (!g_trace) {  // one shared token list per request
      const int nl = B;
      upload_lists(nl, budget, L);
      sa.plan(seqs, SelGran::Token, 1, std::vector<int>(nl, budget), nullptr, 0);
      const double us = time_calls(R, [&](int r) { sa.run(Qr(r), Kr(r), Vr(r), d_off, Ir(r, nl, budget), o, scale, 0); }, &mn);
      emit("shared_token", L, B, budget, us, mn, double(B) * Hkv * budget * kv_row + nl * budget * 4.0 + qo_bytes, R, sa.n_items(), sa.max_split_used());
    }
    const int kp = budget / 16;
    {  // 16-token pages per (request, KV head)
      const int nl = B * Hkv;
      upload_lists(nl, kp, pps);
      sa.plan(seqs, SelGran::Chunk16, Hkv, std::vector<int>(nl, kp), nullptr, 0);
      const double us = time_calls(R, [&](int r) { sa.run(Qr(r), Kr(r), Vr(r), d_off, Ir(r, nl, kp), o, scale, 0); }, &mn);
      emit("page16", L, B, budget, us, mn, double(nl) * kp * (16 * kv_row + 4) + qo_bytes, R, sa.n_items(), sa.max_split_used());
      if (g_trace)
        trace_calls("page16", L, B, budget, R, sa, [&](int r) { sa.run(Qr(r), Kr(r), Vr(r), d_off, Ir(r, nl, kp), o, scale, 0); }, us);
    }
    if (g_trace) continue;
    for (int fast = 0; fast < 2; ++fast) {  // Quest: metadata update (last pages) + scores + top-k (+ attention)
      const int nl = B * Hkv;
      std::vector<int32_t> off(size_t(nl) + 1);
      for (int l = 0; l <= nl; ++l) off[l] = l * kp;
      SPADE_CUDA(cudaMemcpy(d_off, off.data(), 4 * off.size(), cudaMemcpyHostToDevice));
      sa.plan(seqs, SelGran::Chunk16, Hkv, std::vector<int>(nl, kp), nullptr, 0);
      auto qargs = [&](int r) {
        QuestArgs qa{Qr(r), Mr(r), d_qpt, d_qpt + region_pages, d_qpt + region_pages + B,
                     d_scores, d_qsel, B, Hq, Hkv, D, pps, kp};
        qa.fast = fast;
        return qa;
      };
      auto select = [&](int r) {
        quest_update_meta(Kr(r), Mr(r), d_last, d_last + B, B, Hkv, P, D, 0);
        quest_select(qargs(r), 0);
      };
      const double sel_bytes = double(nl) * (pps - 1) * 4 * D      // metadata
                               + double(nl) * (pps - 1) * 4 * 2     // scores written + read
                               + double(nl) * kp * 4                // selection
                               + double(B) * Hkv * (P * D * 2 + 4 * D);  // last-page update
      const double att_bytes = double(nl) * kp * (16 * kv_row + 4) + qo_bytes;
      const std::string tag = fast ? "quest_tc" : "quest";
      double us = time_calls(R, select, &mn);
      emit((tag + "_select").c_str(), L, B, budget, us, mn, sel_bytes, R, 0, 0);
      if (budget == 4096) {  // the two big stages alone (top-k does not depend on the budget much)
        us = time_calls(R, [&](int r) { quest_score(qargs(r), 0); }, &mn);
        emit((tag + "_score").c_str(), L, B, budget, us, mn, double(nl) * (pps - 1) * (4.0 * D + 4), R, 0, 0);
        if (!fast) {
          us = time_calls(R, [&](int r) { quest_topk(qargs(r), 0); }, &mn);
          emit("quest_topk", L, B, budget, us, mn, double(nl) * ((pps - 1) * 4.0 + kp * 4), R, 0, 0);
        }
      }
      us = time_calls(R, [&](int r) {
        select(r);
        sa.run(Qr(r), Kr(r), Vr(r), d_off, d_qsel, o, scale, 0);
      }, &mn);
      emit(tag.c_str(), L, B, budget, us, mn, sel_bytes + att_bytes, R, sa.n_items(), sa.max_split_used());
      // The selection + attention of a model decode step: there the last pages' metadata is
      // written by the KV append (QkvPostArgs::quest_meta), as the K/V rows are for full
      // attention, so no separate quest_update_meta launch.
      us = time_calls(R, [&](int r) {
        quest_select(qargs(r), 0);
        sa.run(Qr(r), Kr(r), Vr(r), d_off, d_qsel, o, scale, 0);
      }, &mn);
      emit((tag + "_step").c_str(), L, B, budget, us, mn,
           sel_bytes - double(B) * Hkv * (P * D * 2 + 4 * D) + att_bytes, R, sa.n_items(),
           sa.max_split_used());
    }
    {  // selections of the scored layers (scores: the emit runs above, region 0's q)
      const int nl = B * Hkv;
      std::vector<int32_t> lens(size_t(B) * Hq, L);
      SPADE_CUDA(cudaMemcpy(d_rown, lens.data(), 4 * lens.size(), cudaMemcpyHostToDevice));
      const bool lng = topk_long_applies(L, budget);
      auto topk = [&](const float* sc, int rows, int k, int32_t* out) {
        if (lng) topk_rows_long(sc, L, d_rown, rows, k, out, d_topk_scratch, 0);
        else topk_rows(sc, L, d_rown, rows, k, out, 0);
      };
      double us = time_calls(1, [&](int) {
        topk(g_scores_group, nl, budget, d_strided);
        token_compact_lists(d_strided, d_qpt + region_pages + B, B, Hkv, budget, d_off, d_idx, 0);
      }, &mn);
      emit("tidal_select", L, B, budget, us, mn, double(nl) * L * 4 + double(nl) * budget * 4 * 3, 1, 0, 0);
      LessIsMoreArgs la;
      const int recent = budget / 4, sinks = 4;
      la.scores = g_scores_head, la.ld = L, la.kv_len = d_qpt + region_pages + B, la.B = B, la.Hq = Hq;
      la.budget = budget, la.n_recent = recent, la.sinks = sinks, la.n_uni = budget - recent - sinks;
      la.row_n = d_rown, la.head_top = d_strided, la.keys = g_keys, la.merged_top = d_merged;
      la.sel_off = d_off, la.sel_idx = d_idx;
      la.topk_scratch = topk_long_applies(L, la.n_uni) ? d_topk_scratch : nullptr;
      us = time_calls(1, [&](int) { lessismore_select(la, 0); }, &mn);
      emit("lessismore_select", L, B, budget, us, mn,
           double(B) * Hq * L * 4 + double(B) * L * 4 * 3 + double(B) * Hq * la.n_uni * 8, 1, 0, 0);
      // LycheeDecode layer: KV head 0 a retrieval head (dense + scores), 7 sparse heads.
      upload_lists(nl, budget, L);
      std::vector<uint8_t> ret = {1, 0, 0, 0, 0, 0, 0, 0};
      sa.plan(seqs, SelGran::Token, Hkv, std::vector<int>(nl, budget), &ret, 0);
      us = time_calls(R, [&](int r) {
        sa.run(Qr(r), Kr(r), Vr(r), d_off, Ir(r, nl, budget), o, scale, 0, 0, g_scores_group, L);
        row_lengths(d_qpt + region_pages + B, B, Hkv, d_rown, 0, 1u);
        topk(g_scores_group, nl, budget, d_strided);
        token_compact_lists(d_strided, d_qpt + region_pages + B, B, Hkv, budget, d_off2, d_idx2, 0);
      }, &mn);
      emit("lycheedecode_layer", L, B, budget, us, mn,
           double(B) * L * (kv_row + 4 * 2) + double(B) * 7 * budget * (kv_row + 4) + qo_bytes, R,
           sa.n_items(), sa.max_split_used());
    }
    if (L >= 131072 && B <= 8) {  // hybrid: 2 dense heads + 6 sparse heads
      const int nl = B * Hkv;
      upload_lists(nl, budget, L);
      std::vector<uint8_t> dense = {1, 1, 0, 0, 0, 0, 0, 0};
      sa.plan(seqs, SelGran::Token, Hkv, std::vector<int>(nl, budget), &dense, 0);
      const double us = time_calls(R, [&](int r) { sa.run(Qr(r), Kr(r), Vr(r), d_off, Ir(r, nl, budget), o, scale, 0); }, &mn);
      const double bytes = double(B) * 2 * L * kv_row + double(B) * 6 * budget * (kv_row + 4) + qo_bytes;
      emit("hybrid_2d", L, B, budget, us, mn, bytes, R, sa.n_items(), sa.max_split_used());
    }
  }
  if (L >= 131072 && !g_trace) {  // all 8 KV heads sparse at 90% sparsity (token lists of L/10)
    const int n = L / 10, nl = B * Hkv;
    upload_lists(nl, n, L);
    sa.plan(seqs, SelGran::Token, Hkv, std::vector<int>(nl, n), nullptr, 0);
    float mn;
    const double us = time_calls(R, [&](int r) { sa.run(Qr(r), Kr(r), Vr(r), d_off, Ir(r, nl, n), o, scale, 0); }, &mn);
    emit("hybrid90", L, B, n, us, mn, double(nl) * n * (2.0 * D * 2 + 4) + qo_bytes, R, sa.n_items(), sa.max_split_used());
  }
  SPADE_CUDA(cudaDeviceSynchronize());
}

}  // namespace

int main(int argc, char** argv) {
  try {
    g_out = argc > 1 ? std::fopen(argv[1], "w") : stdout;
    if (!g_out) return 2;
    if (argc > 2 && std::string(argv[2]) == "none") return 0;  // start-up check
    std::fprintf(stderr, "%s\n", device_summary().c_str());
    measure_bw();
    std::vector<int> Ls = {32768, 131072}, Bs = {1, 8, 32};
    int a0 = 2;  // bench_sparse OUT [trace] [L [B]]
    if (argc > 2 && std::string(argv[2]) == "trace") {
      g_trace = true;
      ++a0;
      SPADE_CUDA(cudaMalloc(&g_trace_buf, sizeof(unsigned long long) * 8 * 65536));
    }
    if (argc > a0) Ls = {std::atoi(argv[a0])};
    if (argc > a0 + 1) Bs = {std::atoi(argv[a0 + 1])};
    for (int L : Ls)
      for (int B : Bs) bench_shape(L, B);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_sparse: %s\n", e.what());
    return 1;
  }
  return 0;
}
