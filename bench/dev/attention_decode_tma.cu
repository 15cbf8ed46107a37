// Development kernel, kept for A/B runs only (as llm.c keeps dev/cuda): the v4 paged decode
// attention, the v3 kernel of src/backend/cuda/attention_decode.cu with its K/V chunks moved by
// TMA instead of cp.async. Never faster than v3 (5-7% slower on an H200, docs/cuda.md), so the
// engine does not carry it; this file has the kernel (static chunk schedule; no BLASST, score
// emission or drawn chunks) and a benchmark that runs it against the engine's v3 twin
// (AttentionWorkspace, the same variant and split count) on the same inputs: the largest
// output difference, then each one's median time per call.
//
// v4: lane 0 of each warp moves a chunk with 2*D/64 bulk tensor copies (box 64 columns x 16 rows,
// 128-byte swizzle, completion on a per-stage mbarrier with expect_tx) instead of TK*D*2*2/512
// cp.async per lane; the tile is then [D/64 halves][TK rows][128 B]. Rows past the sequence end
// are copied too (the page exists) and zeroed in V before use (0 * NaN = NaN). Needs P % 16 == 0
// and compute capability 9.0+.
//
// Build (CMake target bench_decode_tma, built with the CUDA backend), or by hand:
//   nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -Isrc bench/dev/attention_decode_tma.cu
//     build/libspade_cuda.a -lcublasLt -lcublas -o bench_decode_tma
// Run:  bench_decode_tma [L,B ...]   (default 8192,1 32768,1 32768,8 131072,1); JSON lines on
// stdout.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/attention.h"
#include "backend/cuda/attention_common.cuh"
#include "backend/cuda/ops.h"
#include "backend/cuda/pdl.cuh"

namespace spade::cuda::dev {
using namespace attn_detail;

template <int D, int W, int S, int TK>
struct Cfg {
  static constexpr int kThreads = W * 32;
  static constexpr int CH = D / 8;     // 16-byte chunks per row
  static constexpr int kTile = TK * D;
  static constexpr int kStage = 2 * kTile;  // K then V
  static constexpr size_t kQ = 4096;
  static constexpr size_t kRing = size_t(W) * S * kStage * sizeof(bf16);
  static constexpr size_t kMerge = size_t(W) * 16 * (D + 2) * sizeof(float);
  static constexpr size_t kSmem = 1024 + ((kQ + kRing) > kMerge ? (kQ + kRing) : kMerge);
  static_assert(TK == 16, "one TMA box of 16 rows per chunk");
};

__device__ __forceinline__ void mbar_init1(uint32_t bar) {
  SPADE_SM90_ONLY(asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar) : "memory"));
}

// Byte offset of (row r, column col % 8 == 0) in a TMA tile (128-byte swizzle): [D/64][TK][64],
// 16-byte chunk c of a 128-byte row at c ^ (r & 7).
template <int TK>
__device__ __forceinline__ uint32_t tma_off(int r, int col) {
  return (col >> 6) * (TK * 128) + r * 128 + ((((col >> 3) & 7) ^ (r & 7)) << 4);
}

template <int D, int W, int S, int TK>
__global__ void __launch_bounds__(W * 32)
    decode_v4_kernel(const AttnArgs a, const __grid_constant__ CUtensorMap tmk,
                     const __grid_constant__ CUtensorMap tmv) {
  pdl_begin();
  using C = Cfg<D, W, S, TK>;
  constexpr int CH = C::CH, NT = C::kThreads;
  extern __shared__ __align__(1024) unsigned char smem_dyn[];
  __shared__ int s_last;
  __shared__ __align__(8) uint64_t s_bar[W * S];
  unsigned char* smem_raw = smem_dyn + ((1024 - (smem_u32(smem_dyn) & 1023)) & 1023);
  bf16* sQ = reinterpret_cast<bf16*>(smem_raw);
  bf16* ring = reinterpret_cast<bf16*>(smem_raw + C::kQ);

  const int4 item = a.items[blockIdx.y];
  const int seq = item.x, split = item.z;
  const int kvh = blockIdx.x;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int G = a.G, P = a.P;
  const int q0 = a.q_off[seq];
  const int L = a.kv_len[seq];
  const int* pt = a.page_table + a.page_off[seq];
  const int n_ch = (L + TK - 1) / TK;
  const int per = (n_ch + a.nsplit - 1) / a.nsplit;
  const int cb = split * per;
  const int n_cta = max(0, min(n_ch, cb + per) - cb);
  const int n_my = n_cta > warp ? (n_cta - warp + W - 1) / W : 0;
  const int p_shift = (P & (P - 1)) == 0 ? __ffs(P) - 1 : -1;
  auto pdiv = [&](int j) { return p_shift >= 0 ? j >> p_shift : j / P; };
  auto pmod = [&](int j) { return p_shift >= 0 ? j & (P - 1) : j % P; };
  auto chunk_j0 = [&](int k) { return (cb + warp + k * W) * TK; };
  auto bar_of = [&](int st) { return smem_u32(&s_bar[warp * S + st]); };
  auto issue = [&](int k, int st, int pid) {
    if (lane != 0) return;
    bf16* dK = ring + (warp * S + st) * C::kStage;
    bf16* dV = dK + C::kTile;
    const int row0 = (pid * a.Hkv + kvh) * P + pmod(chunk_j0(k));
    const uint32_t bar = bar_of(st);
    mbar_expect_tx(bar, C::kStage * 2);
#pragma unroll
    for (int h = 0; h < D / 64; ++h) {
      tma_load_2d(smem_u32(dK) + h * TK * 128, &tmk, h * 64, row0, bar);
      tma_load_2d(smem_u32(dV) + h * TK * 128, &tmv, h * 64, row0, bar);
    }
  };
  if (lane == 0) {
    for (int st = 0; st < S; ++st) mbar_init1(bar_of(st));
    SPADE_SM90_ONLY(asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"));
  }
  __syncwarp();
  for (int idx = tid; idx < 16 * CH; idx += NT) {
    const int r = idx / CH, c = idx % CH;
    const bool valid = r < G;
    const bf16* src = a.q + (int64_t(q0) * a.Hq + kvh * G + r) * D + c * 8;
    cp_async16(sQ + swz<D>(r, c * 8), valid ? src : a.q, valid);
  }
  cp_async_commit();
#pragma unroll
  for (int s = 0; s < S - 1; ++s)
    if (s < n_my) issue(s, s, pt[pdiv(chunk_j0(s))]);
  int pid_next = S - 1 < n_my ? pt[pdiv(chunk_j0(S - 1))] : 0;
  cp_async_wait<0>();
  __syncthreads();

  uint32_t qa[D / 16][4];
  const int mi = lane >> 3;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const int r = (lane & 7) + ((mi & 1) ? 8 : 0);
    const int col = kk * 16 + ((mi & 2) ? 8 : 0);
    ldsm_x4(qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], sQ + swz<D>(r, col));
  }
  const bool hi_rows = G > 8;
  float o[D / 8][4];
#pragma unroll
  for (int nd = 0; nd < D / 8; ++nd)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[nd][e] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const float sl2 = a.scale_log2;

  int st_issue = S - 1, st_use = 0, phase = 0;
  for (int k = 0; k < n_my; ++k) {
    __syncwarp();  // every lane is done reading the stage about to be overwritten
    const int kn = k + S - 1;
    if (kn < n_my) issue(kn, st_issue, pid_next);
    if (kn + 1 < n_my) pid_next = pt[pdiv(chunk_j0(kn + 1))];
    const unsigned char* tK = reinterpret_cast<const unsigned char*>(ring + (warp * S + st_use) * C::kStage);
    unsigned char* tV = const_cast<unsigned char*>(tK) + C::kTile * sizeof(bf16);
    const int j0 = chunk_j0(k);
    mbar_wait(bar_of(st_use), phase);
    if (j0 + TK > L) {  // rows past the end hold whatever the page held: zero them in V
      for (int idx = lane; idx < TK * CH; idx += 32) {
        const int r = idx / CH, c = idx % CH;
        if (j0 + r >= L) *reinterpret_cast<uint4*>(tV + tma_off<TK>(r, c * 8)) = make_uint4(0, 0, 0, 0);
      }
      __syncwarp();
    }
    // S = Q K^T (two accumulator chains), scale + mask + row max, online softmax, O += P V.
    float sc[TK / 8][4], sc2[TK / 8][4], mx[2];
#pragma unroll
    for (int nb = 0; nb < TK / 8; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) sc[nb][e] = 0.f, sc2[nb][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const int r = (lane & 7) + ((mi & 2) ? 8 : 0);
      const int col = kk * 16 + ((mi & 1) ? 8 : 0);
      uint32_t b0, b1, b2, b3;
      ldsm_x4(b0, b1, b2, b3, tK + tma_off<TK>(r, col));
      if (kk & 1) {
        mma16816(sc2[0], qa[kk], b0, b1);
        mma16816(sc2[1], qa[kk], b2, b3);
      } else {
        mma16816(sc[0], qa[kk], b0, b1);
        mma16816(sc[1], qa[kk], b2, b3);
      }
    }
    scale_mask_chunk<TK>(sc, sc2, L - j0, sl2, hi_rows, mx);
    online_softmax_chunk<D, TK>(sc, mx, m, l, o, hi_rows);
    uint32_t pa[4] = {pack_bf16(sc[0][0], sc[0][1]), pack_bf16(sc[0][2], sc[0][3]),
                      pack_bf16(sc[1][0], sc[1][1]), pack_bf16(sc[1][2], sc[1][3])};
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
      const int r = (lane & 7) + ((mi & 1) ? 8 : 0);
      const int col = dp * 16 + ((mi & 2) ? 8 : 0);
      uint32_t b0, b1, b2, b3;
      ldsm_x4_t(b0, b1, b2, b3, tV + tma_off<TK>(r, col));
      mma16816(o[2 * dp], pa, b0, b1);
      mma16816(o[2 * dp + 1], pa, b2, b3);
    }
    st_issue = st_issue + 1 == S ? 0 : st_issue + 1;
    if (++st_use == S) st_use = 0, phase ^= 1;
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
  }
  const int64_t row_base = int64_t(q0) * a.Hq + kvh * G;
  merge_warps_store<D, W>(o, m, l, smem_raw, G, row_base, split, a.nsplit, a.total_rows, a.out,
                          a.part_o, a.part_lse);
  if (a.nsplit == 1) return;
  if (!last_split_cta(a.counters + seq * a.Hkv + kvh, a.nsplit, s_last)) return;
  combine_splits<D, NT>(a.part_o, a.part_lse, a.total_rows, row_base, a.nsplit, G, a.out, smem_raw,
                        a.counters + seq * a.Hkv + kvh);
}

template <int W>
void launch_v4(const AttnArgs& a, dim3 grid, cudaStream_t s, const CUtensorMap& tmk,
               const CUtensorMap& tmv) {
  using C = Cfg<128, W, 3, 16>;
  static bool prepared = false;
  if (!prepared) set_max_dynamic_smem(decode_v4_kernel<128, W, 3, 16>, C::kSmem), prepared = true;
  launch_pdl(decode_v4_kernel<128, W, 3, 16>, grid, C::kThreads, C::kSmem, s, a, tmk, tmv);
  SPADE_CUDA_LAUNCH();
}

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median microseconds per call of f(i) over 30 batches of `calls` calls.
template <typename F>
float time_us(int calls, F&& f) {
  cudaEvent_t e0, e1;
  SPADE_CUDA(cudaEventCreate(&e0));
  SPADE_CUDA(cudaEventCreate(&e1));
  for (int i = 0; i < calls; ++i) f(i);
  std::vector<float> per;
  for (int rep = 0; rep < 30; ++rep) {
    SPADE_CUDA(cudaEventRecord(e0));
    for (int i = 0; i < calls; ++i) f(i);
    SPADE_CUDA(cudaEventRecord(e1));
    SPADE_CUDA(cudaEventSynchronize(e1));
    float ms = 0;
    SPADE_CUDA(cudaEventElapsedTime(&ms, e0, e1));
    per.push_back(ms * 1000.f / calls);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return median(per);
}

float max_abs_diff(const bf16* x, const bf16* y, size_t n) {
  std::vector<bf16> hx(n), hy(n);
  SPADE_CUDA(cudaMemcpy(hx.data(), x, n * sizeof(bf16), cudaMemcpyDeviceToHost));
  SPADE_CUDA(cudaMemcpy(hy.data(), y, n * sizeof(bf16), cudaMemcpyDeviceToHost));
  float d = 0;
  for (size_t i = 0; i < n; ++i) d = std::max(d, std::fabs(float(hx[i]) - float(hy[i])));
  return d;
}

// Llama-3-8B attention shapes, pages of 16 tokens shuffled, caches in rotation past L2.
void run(int L, int B) {
  constexpr int Hq = 32, Hkv = 8, D = 128, P = 16;
  const size_t page_elems = size_t(Hkv) * P * D;
  const int64_t pages_per_seq = (L + P - 1) / P, n_pages = B * pages_per_seq;
  const size_t cache_bytes = size_t(n_pages) * page_elems * 2 * 2;
  const int nbuf = int(std::max<size_t>(1, std::min<size_t>((400ull << 20) / cache_bytes + 1, 8)));
  DeviceArena arena(size_t(nbuf) * cache_bytes + (512ull << 20));
  std::vector<bf16*> kb(nbuf), vb(nbuf);
  std::vector<CUtensorMap> tk(nbuf), tv(nbuf);
  for (int i = 0; i < nbuf; ++i) {
    kb[i] = arena.alloc_n<bf16>(size_t(n_pages) * page_elems, "K");
    vb[i] = arena.alloc_n<bf16>(size_t(n_pages) * page_elems, "V");
    fill_random_bf16(kb[i], int64_t(n_pages * page_elems), 100 + i, 1.f, 0.f, 0);
    fill_random_bf16(vb[i], int64_t(n_pages * page_elems), 200 + i, 1.f, 0.f, 0);
    SPADE_CHECK(encode_kv_tensor_map(&tk[i], kb[i], D) && encode_kv_tensor_map(&tv[i], vb[i], D),
                "no tensor maps (driver without cuTensorMapEncodeTiled)");
  }
  bf16* q = arena.alloc_n<bf16>(size_t(B) * Hq * D, "q");
  bf16* o_ref = arena.alloc_n<bf16>(size_t(B) * Hq * D, "out v3");
  bf16* o_dev = arena.alloc_n<bf16>(size_t(B) * Hq * D, "out v4");
  fill_random_bf16(q, int64_t(B) * Hq * D, 7, 1.f, 0.f, 0);
  std::vector<int32_t> perm(n_pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::mt19937 rng(1);
  std::shuffle(perm.begin(), perm.end(), rng);
  AttnLimits lim;
  lim.max_batch = B;
  lim.max_q_tokens = B;
  lim.max_pages = n_pages;
  AttentionWorkspace ws(arena, lim, Hq, Hkv, D, P);
  std::vector<AttnSeq> batch(B);
  for (int b = 0; b < B; ++b) batch[b] = {perm.data() + b * pages_per_seq, int(pages_per_seq), L, 1};
  const float scale = 1.f / std::sqrt(float(D));

  // The v4 kernel's own metadata, as AttentionWorkspace::plan lays it out for a decode.
  const int max_split = lim.max_split;
  std::vector<int32_t> page_off(B), kv_len(B, L), q_off(B + 1);
  for (int b = 0; b < B; ++b) page_off[b] = int32_t(b * pages_per_seq), q_off[b] = b;
  q_off[B] = B;
  int32_t* d_pt = arena.alloc_n<int32_t>(size_t(n_pages), "page table");
  int32_t* d_off = arena.alloc_n<int32_t>(size_t(B), "page offsets");
  int32_t* d_len = arena.alloc_n<int32_t>(size_t(B), "lengths");
  int32_t* d_qoff = arena.alloc_n<int32_t>(size_t(B) + 1, "q offsets");
  int4* d_items = reinterpret_cast<int4*>(arena.alloc_n<int32_t>(size_t(4) * B * max_split, "items"));
  float* part_o = arena.alloc_n<float>(size_t(max_split) * B * Hq * D, "partials");
  float* part_lse = arena.alloc_n<float>(size_t(max_split) * B * Hq, "lse");
  int* counters = arena.alloc_n<int>(size_t(B) * Hkv, "counters");
  SPADE_CUDA(cudaMemcpy(d_pt, perm.data(), sizeof(int32_t) * n_pages, cudaMemcpyHostToDevice));
  SPADE_CUDA(cudaMemcpy(d_off, page_off.data(), sizeof(int32_t) * B, cudaMemcpyHostToDevice));
  SPADE_CUDA(cudaMemcpy(d_len, kv_len.data(), sizeof(int32_t) * B, cudaMemcpyHostToDevice));
  SPADE_CUDA(cudaMemcpy(d_qoff, q_off.data(), sizeof(int32_t) * (B + 1), cudaMemcpyHostToDevice));
  SPADE_CUDA(cudaMemset(counters, 0, sizeof(int) * B * Hkv));

  for (const int W : {4, 8}) {
    // The engine's static v3 twin of this variant (2 = v3_w4s3, 3 = v3_w8s3), its split count.
    const int kern = W == 4 ? 2 : 3;
    if (!AttentionWorkspace::decode_kernel_fits(kern, D)) continue;
    ws.set_decode_kernel(kern);  // a static chunk schedule, as v4's
    ws.plan(batch, 0, 0);
    const int ns = ws.n_split();
    std::vector<int4> items;
    for (int sp = 0; sp < ns; ++sp)
      for (int b = 0; b < B; ++b) items.push_back(make_int4(b, 0, sp, 0));
    SPADE_CUDA(cudaMemcpy(d_items, items.data(), sizeof(int4) * items.size(), cudaMemcpyHostToDevice));
    AttnArgs a{};
    a.q = q;
    a.out = o_dev;
    a.page_table = d_pt;
    a.page_off = d_off;
    a.kv_len = d_len;
    a.q_off = d_qoff;
    a.items = d_items;
    a.part_o = part_o;
    a.part_lse = part_lse;
    a.counters = counters;
    a.Hq = Hq;
    a.Hkv = Hkv;
    a.G = Hq / Hkv;
    a.P = P;
    a.nsplit = ns;
    a.total_rows = int64_t(B) * Hq;
    a.scale_log2 = scale * 1.4426950408889634f;
    const dim3 grid(Hkv, unsigned(items.size()));
    auto v4 = [&](int i) {
      a.k = kb[i % nbuf];
      a.v = vb[i % nbuf];
      if (W == 4) launch_v4<4>(a, grid, 0, tk[i % nbuf], tv[i % nbuf]);
      else launch_v4<8>(a, grid, 0, tk[i % nbuf], tv[i % nbuf]);
    };
    auto v3 = [&](int i) { ws.run(q, kb[i % nbuf], vb[i % nbuf], o_ref, scale, 0); };
    v3(0);
    v4(0);
    SPADE_CUDA(cudaDeviceSynchronize());
    const float diff = max_abs_diff(o_ref, o_dev, size_t(B) * Hq * D);
    const int calls = std::max(nbuf, 8) / nbuf * nbuf;
    const float us3 = time_us(calls, v3), us4 = time_us(calls, v4);
    const double bytes = double(B) * L * Hkv * D * 2 * 2;
    std::printf("{\"L\":%d,\"B\":%d,\"warps\":%d,\"splits\":%d,\"v3_us\":%.3f,\"v4_us\":%.3f,"
                "\"v4_vs_v3\":%.4f,\"v3_GBps\":%.1f,\"v4_GBps\":%.1f,\"max_abs_diff\":%.3g}\n",
                L, B, W, ns, us3, us4, us4 / us3, bytes / us3 * 1e-3, bytes / us4 * 1e-3, diff);
    std::fflush(stdout);
  }
}

}  // namespace spade::cuda::dev

int main(int argc, char** argv) {
  try {
    SPADE_CHECK(spade::cuda::cc_major() >= 9, "the v4 kernel needs compute capability 9.0+ (TMA)");
    std::vector<std::pair<int, int>> shapes = {{8192, 1}, {32768, 1}, {32768, 8}, {131072, 1}};
    if (argc > 1) shapes.clear();
    for (int i = 1; i < argc; ++i) {
      const std::string s = argv[i];
      const size_t c = s.find(',');
      SPADE_CHECK(c != std::string::npos, "shape '", s, "': expected L,B");
      shapes.push_back({std::stoi(s.substr(0, c)), std::stoi(s.substr(c + 1))});
    }
    for (auto [L, B] : shapes) spade::cuda::dev::run(L, B);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_decode_tma: %s\n", e.what());
    return 1;
  }
  return 0;
}
