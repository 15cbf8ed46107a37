// CUDA ops vs the CPU backend (backend/cpu/ops.h) over shapes; inputs are rounded to bf16
// on both sides where the GPU op takes bf16, so the tolerances measure the op, not the
// input rounding.
#include <algorithm>
#include <cstring>
#include <numeric>

#include "backend/cpu/ops.h"
#include "backend/cuda/gemm.h"
#include "backend/cuda/ops.h"
#include "backend/cuda/sampling.h"
#include "backend/cuda/sparse_attention.h"
#include "gpu_util.h"

namespace spade::test {
namespace {

using cuda::bf16;

TEST(CudaOps, Embedding) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(1);
  for (int H : {64, 100, 576, 4096}) {  // 100: not whole 16-byte chunks (the scalar path)
    const int vocab = 1000, T = 37;
    auto table = round_bf16(randn(size_t(vocab) * H, rng));
    std::vector<int32_t> ids(T);
    for (auto& i : ids) i = int(rng() % vocab);
    std::vector<float> ref(size_t(T) * H);
    cpu::embedding(table.data(), ids.data(), ref.data(), T, H, vocab);
    DevBuf<bf16> dt(to_bf16(table));
    DevBuf<int32_t> di(ids);
    DevBuf<float> dx(size_t(T) * H);
    dx.poison();
    cuda::embedding(dt.p, di.p, dx.p, T, H, vocab, 0);
    EXPECT_EQ(rel_err(dx.download(), ref), 0.0) << "H=" << H;
  }
}

TEST(CudaOps, RmsNormWithRowGather) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(2);
  for (int H : {48, 576, 4096, 5120, 9000}) {  // 9000: past the 8 cached elements per thread
    const int R = 13;
    auto x = randn(size_t(R) * H, rng, 3.f);
    auto w = randn(size_t(H), rng, 0.1f, 1.f);
    std::vector<int32_t> rows = {12, 0, 5, 5};
    std::vector<float> ref(rows.size() * H), gathered(rows.size() * H);
    for (size_t r = 0; r < rows.size(); ++r)
      std::copy_n(x.begin() + rows[r] * H, H, gathered.begin() + r * H);
    cpu::rmsnorm(gathered.data(), w.data(), 1e-5f, ref.data(), int64_t(rows.size()), H);
    DevBuf<float> dx(x), dw(w);
    DevBuf<int32_t> dr(rows);
    DevBuf<bf16> dy(rows.size() * H);
    dy.poison();
    cuda::rmsnorm(dx.p, dr.p, dw.p, 1e-5f, dy.p, int(rows.size()), H, 0);
    EXPECT_LT(rel_err(from_bf16(dy.download()), ref), kTolBf16Out) << "H=" << H;
  }
}

TEST(CudaOps, SwiGLU) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(3);
  const int T = 5, F = 1536;
  auto gu = randn(size_t(T) * 2 * F, rng, 2.f);
  std::vector<float> g(size_t(T) * F), u(size_t(T) * F), ref(size_t(T) * F);
  for (int t = 0; t < T; ++t)
    for (int i = 0; i < F; ++i) {
      g[t * F + i] = gu[size_t(t) * 2 * F + i];
      u[t * F + i] = gu[size_t(t) * 2 * F + F + i];
    }
  cpu::swiglu(g.data(), u.data(), ref.data(), int64_t(T) * F);
  DevBuf<float> dgu(gu);
  DevBuf<bf16> dout(size_t(T) * F);
  dout.poison();
  cuda::swiglu(dgu.p, dout.p, T, F, 0);
  EXPECT_LT(rel_err(from_bf16(dout.download()), ref), kTolBf16Out);
}

// qkv_post = bias + q/k RMSNorm + RoPE (plain and llama3-scaled) + paged K/V append.
struct QkvCase {
  int D, Hq, Hkv, T, P, first_pos;
  bool bias, qk_norm, llama3;
};

TEST(CudaOps, QkvPostRopeAppend) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(4);
  const QkvCase cases[] = {
      {64, 9, 3, 1, 16, 0, false, false, false},      // SmolLM2 decode, first token
      {64, 9, 3, 37, 16, 5, false, false, false},     // crosses page boundaries
      {128, 32, 8, 3, 16, 131070, false, false, true}, // llama3 scaling, 128K positions
      {128, 16, 8, 20, 7, 13, true, true, false},     // Qwen2 bias + Qwen3 qk-norm, odd page
  };
  for (const QkvCase& c : cases) {
    SCOPED_TRACE(testing::Message() << "D=" << c.D << " T=" << c.T << " P=" << c.P);
    ModelConfig cfg;
    cfg.head_dim = c.D;
    cfg.rope_theta = c.llama3 ? 500000.f : 10000.f;
    if (c.llama3) {
      cfg.rope_scaling.llama3 = true;
      cfg.rope_scaling.factor = 8.f;
      cfg.rope_scaling.low_freq_factor = 1.f;
      cfg.rope_scaling.high_freq_factor = 4.f;
      cfg.rope_scaling.original_max_position = 8192;
    }
    std::vector<float> inv(size_t(c.D / 2));
    cpu::rope_inv_freq(cfg, inv.data());
    const int nh = c.Hq + 2 * c.Hkv, D = c.D;
    auto qkv = randn(size_t(c.T) * nh * D, rng);
    auto bias = randn(size_t(nh) * D, rng, 0.3f);
    auto qn = randn(size_t(D), rng, 0.1f, 1.f), kn = randn(size_t(D), rng, 0.1f, 1.f);
    std::vector<int32_t> pos(c.T), page(c.T);
    const int n_pages = (c.first_pos + c.T) / c.P + 3;
    std::vector<int32_t> perm(n_pages);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int t = 0; t < c.T; ++t) {
      pos[t] = c.first_pos + t;
      page[t] = perm[pos[t] / c.P];
    }
    // CPU reference.
    std::vector<float> q(size_t(c.T) * c.Hq * D), k(size_t(c.T) * c.Hkv * D), v(k.size());
    for (int t = 0; t < c.T; ++t)
      for (int h = 0; h < nh; ++h)
        for (int d = 0; d < D; ++d) {
          float x = qkv[(size_t(t) * nh + h) * D + d] + (c.bias ? bias[size_t(h) * D + d] : 0.f);
          if (h < c.Hq) q[(size_t(t) * c.Hq + h) * D + d] = x;
          else if (h < c.Hq + c.Hkv) k[(size_t(t) * c.Hkv + h - c.Hq) * D + d] = x;
          else v[(size_t(t) * c.Hkv + h - c.Hq - c.Hkv) * D + d] = x;
        }
    if (c.qk_norm) {
      cpu::rmsnorm(q.data(), qn.data(), 1e-6f, q.data(), int64_t(c.T) * c.Hq, D);
      cpu::rmsnorm(k.data(), kn.data(), 1e-6f, k.data(), int64_t(c.T) * c.Hkv, D);
    }
    cpu::rope(q.data(), pos.data(), inv.data(), c.T, c.Hq, D);
    cpu::rope(k.data(), pos.data(), inv.data(), c.T, c.Hkv, D);

    const size_t cache_n = size_t(n_pages) * c.Hkv * c.P * D;
    DevBuf<float> dqkv(qkv), dbias(bias), dqn(qn), dkn(kn), dinv(inv);
    DevBuf<int32_t> dpos(pos), dpage(page);
    DevBuf<bf16> dq(q.size()), dk(cache_n), dv(cache_n);
    dq.poison();
    dk.poison();
    dv.poison();
    cuda::QkvPostArgs a;
    a.qkv = dqkv.p;
    a.bias = c.bias ? dbias.p : nullptr;
    a.q_norm = c.qk_norm ? dqn.p : nullptr;
    a.k_norm = c.qk_norm ? dkn.p : nullptr;
    a.inv_freq = dinv.p;
    a.pos = dpos.p;
    a.page = dpage.p;
    a.q_out = dq.p;
    a.k_cache = dk.p;
    a.v_cache = dv.p;
    a.T = c.T, a.Hq = c.Hq, a.Hkv = c.Hkv, a.D = D, a.P = c.P, a.eps = 1e-6f;
    cuda::qkv_post(a, 0);
    EXPECT_LT(rel_err(from_bf16(dq.download()), q), kTolBf16Out);
    auto kc = from_bf16(dk.download()), vc = from_bf16(dv.download());
    std::vector<float> kg(k.size()), vg(v.size());
    size_t written = 0;
    for (int t = 0; t < c.T; ++t)
      for (int h = 0; h < c.Hkv; ++h) {
        size_t off = ((size_t(page[t]) * c.Hkv + h) * c.P + pos[t] % c.P) * D;
        std::copy_n(kc.begin() + off, D, kg.begin() + (size_t(t) * c.Hkv + h) * D);
        std::copy_n(vc.begin() + off, D, vg.begin() + (size_t(t) * c.Hkv + h) * D);
        written += D;
      }
    EXPECT_LT(rel_err(kg, k), kTolBf16Out);
    EXPECT_LT(rel_err(vg, v), kTolBf16Out);
    // Nothing else in the cache was touched (still the 0xffff poison).
    size_t untouched = 0;
    for (float x : kc) untouched += std::isnan(x);
    EXPECT_EQ(untouched, kc.size() - written);
  }
}

// Quest metadata kept by the KV append (QkvPostArgs::quest_meta, the model's decode steps):
// sequences prefilled by qkv_post + quest_update_meta (recompute), then 40 decode steps of one
// token per sequence with the metadata updated in qkv_post (pages fill up and new ones start,
// one sequence starts empty, one on a page boundary). Every page's min / max must equal
// quest_update_meta's recompute over its rows, bit for bit.
TEST(CudaOps, QkvPostKeepsQuestMetadata) {
  SKIP_WITHOUT_GPU();
  for (int D : {64, 128}) {
    SCOPED_TRACE(testing::Message() << "D=" << D);
    std::mt19937 rng(uint32_t(D) + 11);
    const int Hq = 8, Hkv = 2, P = 16, nh = Hq + 2 * Hkv, steps = 40;
    const std::vector<int> len0 = {0, 5, 16, 37};
    const int B = int(len0.size()), pages_per = (37 + steps) / P + 2, n_pages = B * pages_per;
    std::vector<int32_t> perm(static_cast<size_t>(n_pages));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    auto page_of = [&](int b, int p) { return perm[size_t(b * pages_per + p / P)]; };
    ModelConfig cfg;
    cfg.head_dim = D;
    std::vector<float> inv(size_t(D / 2));
    cpu::rope_inv_freq(cfg, inv.data());
    const size_t cache_n = size_t(n_pages) * Hkv * P * D, meta_n = size_t(n_pages) * Hkv * 2 * D;
    DevBuf<float> dinv(inv);
    DevBuf<bf16> dq(size_t(64) * Hq * D), dk(cache_n), dv(cache_n), dmeta(meta_n), dref(meta_n);
    auto run = [&](const std::vector<int32_t>& pos, const std::vector<int32_t>& page, bf16* meta) {
      const int T = int(pos.size());
      DevBuf<float> dqkv(randn(size_t(T) * nh * D, rng));
      DevBuf<int32_t> dpos(pos), dpage(page);
      cuda::QkvPostArgs a;
      a.qkv = dqkv.p, a.inv_freq = dinv.p, a.pos = dpos.p, a.page = dpage.p;
      a.q_out = dq.p, a.k_cache = dk.p, a.v_cache = dv.p, a.quest_meta = meta;
      a.T = T, a.Hq = Hq, a.Hkv = Hkv, a.D = D, a.P = P;
      cuda::qkv_post(a, 0);
    };
    // The touched pages of every sequence with their valid rows, for the recompute.
    auto recompute = [&](const std::vector<int>& len, bf16* meta) {
      std::vector<int32_t> pids, nv;
      for (int b = 0; b < B; ++b)
        for (int p = 0; p < len[size_t(b)]; p += P) {
          pids.push_back(page_of(b, p));
          nv.push_back(std::min(P, len[size_t(b)] - p));
        }
      DevBuf<int32_t> dp(pids), dn(nv);
      cuda::quest_update_meta(dk.p, meta, dp.p, dn.p, int(pids.size()), Hkv, P, D, 0);
      SPADE_CUDA(cudaDeviceSynchronize());
    };
    {  // prefill: every sequence's first len0 tokens in one launch, metadata recomputed
      std::vector<int32_t> pos, page;
      for (int b = 0; b < B; ++b)
        for (int t = 0; t < len0[size_t(b)]; ++t) pos.push_back(t), page.push_back(page_of(b, t));
      run(pos, page, nullptr);
      recompute(len0, dmeta.p);
    }
    std::vector<int> len(len0);
    for (int s = 0; s < steps; ++s) {  // decode: one token per sequence, metadata in qkv_post
      std::vector<int32_t> pos, page;
      for (int b = 0; b < B; ++b) pos.push_back(len[size_t(b)]), page.push_back(page_of(b, len[size_t(b)]));
      run(pos, page, dmeta.p);
      for (int& l : len) ++l;
    }
    recompute(len, dref.p);
    const auto got = dmeta.download(), want = dref.download();
    int64_t bad = 0, checked = 0;
    for (int b = 0; b < B; ++b)
      for (int p = 0; p < len[size_t(b)]; p += P)
        for (int h = 0; h < Hkv; ++h) {
          const size_t o = (size_t(page_of(b, p)) * Hkv + h) * 2 * D;
          for (int d = 0; d < 2 * D; ++d, ++checked)
            bad += std::memcmp(&got[o + size_t(d)], &want[o + size_t(d)], sizeof(bf16)) != 0;
        }
    EXPECT_EQ(bad, 0) << "of " << checked << " metadata elements differ from the recompute";
    EXPECT_GT(checked, 0);
  }
}

// A random projection problem: bf16-rounded x [M, K] and W [N, K] (scale 1 / sqrt(K)), a
// residual y0 [M, N], the CPU reference x W^T, and their device copies (dy uninitialized).
struct GemmCase {
  std::vector<float> x, w, y0, ref;
  DevBuf<bf16> dx, dw;
  DevBuf<float> dy;
  GemmCase(int M, int N, int K, std::mt19937& rng)
      : x(round_bf16(randn(size_t(M) * K, rng))),
        w(round_bf16(randn(size_t(N) * K, rng, 1.f / std::sqrt(float(K))))),
        y0(randn(size_t(M) * N, rng)),
        ref(size_t(M) * N),
        dx(to_bf16(x)),
        dw(to_bf16(w)),
        dy(size_t(M) * N) {
    cpu::matmul(x.data(), w.data(), nullptr, ref.data(), M, N, K);
  }
  std::vector<float> ref_plus_y0() const {
    std::vector<float> r(ref);
    for (size_t i = 0; i < r.size(); ++i) r[i] += y0[i];
    return r;
  }
};

TEST(CudaOps, GemmBf16MatchesCpuMatmul) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(5);
  cuda::DeviceArena arena(64u << 20);
  cuda::Gemm gemm(arena);
  struct S { int M, N, K; } shapes[] = {{1, 576, 576}, {1, 49152, 576}, {7, 1536, 576},
                                       {64, 192, 576}, {300, 576, 1536}, {3, 4096, 4096}};
  for (auto [M, N, K] : shapes) {
    SCOPED_TRACE(testing::Message() << M << "x" << N << "x" << K);
    GemmCase g(M, N, K, rng);
    DevBuf<bf16> dyb(size_t(M) * N);
    g.dy.poison();
    gemm.run_f32(g.dx.p, g.dw.p, g.dy.p, M, N, K, 0.f, 0);
    EXPECT_LT(rel_err(g.dy.download(), g.ref), kTolGemm);
    // beta = 1: y += x W^T (the fused residual add).
    g.dy.upload(g.y0);
    gemm.run_f32(g.dx.p, g.dw.p, g.dy.p, M, N, K, 1.f, 0);
    EXPECT_LT(rel_err(g.dy.download(), g.ref_plus_y0()), kTolGemm);
    dyb.poison();
    gemm.run_bf16(g.dx.p, g.dw.p, dyb.p, M, N, K, 0);
    EXPECT_LT(rel_err(from_bf16(dyb.download()), g.ref), kTolBf16Out);
  }
}

// The decode GEMV (gemv.cu, Gemm::run_f32 with M <= small_m) against the CPU matmul and
// against cuBLASLt on the same inputs: M = 1..8, odd N, K not a multiple of the 256 elements
// a warp reads per pass, beta 0 / 1; unsupported operands fall back or fail clearly.
TEST(CudaOps, GemvMatchesCpuAndCublas) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(15);
  cuda::DeviceArena arena(64u << 20);
  cuda::Gemm gemm(arena);
  struct S { int N, K; } shapes[] = {{1, 8}, {577, 576}, {3, 5000}, {1536, 14336}, {49152, 64}};
  for (auto [N, K] : shapes)
    for (int M = 1; M <= cuda::kGemvMaxM; ++M) {
      SCOPED_TRACE(testing::Message() << M << "x" << N << "x" << K);
      GemmCase g(M, N, K, rng);
      ASSERT_TRUE(cuda::gemv_supported(g.dx.p, g.dw.p, M, K));
      gemm.set_small_m(cuda::kGemvMaxM);
      g.dy.poison();
      gemm.run_f32(g.dx.p, g.dw.p, g.dy.p, M, N, K, 0.f, 0);
      const auto ours = g.dy.download();
      EXPECT_LT(rel_err(ours, g.ref), kTolGemm);
      gemm.set_small_m(0);  // cuBLASLt on the same inputs
      g.dy.poison();
      gemm.run_f32(g.dx.p, g.dw.p, g.dy.p, M, N, K, 0.f, 0);
      EXPECT_LT(rel_err(ours, g.dy.download()), kTolGemm);
      gemm.set_small_m(cuda::kGemvMaxM);
      g.dy.upload(g.y0);
      gemm.run_f32(g.dx.p, g.dw.p, g.dy.p, M, N, K, 1.f, 0);
      EXPECT_LT(rel_err(g.dy.download(), g.ref_plus_y0()), kTolGemm);
    }
  // K % 8 != 0 or a misaligned x: run_f32 takes cuBLASLt, gemv_f32 refuses.
  const int M = 2, N = 33, K = 12;
  auto x = round_bf16(randn(size_t(M) * K + 1, rng));
  auto w = round_bf16(randn(size_t(N) * K, rng, 0.3f));
  std::vector<float> ref(size_t(M) * N);
  cpu::matmul(x.data() + 1, w.data(), nullptr, ref.data(), M, N, K);
  DevBuf<bf16> dx(to_bf16(x)), dw(to_bf16(w));
  DevBuf<float> dy(size_t(M) * N);
  EXPECT_FALSE(cuda::gemv_supported(dx.p + 1, dw.p, M, K));
  dy.poison();
  gemm.run_f32(dx.p + 1, dw.p, dy.p, M, N, K, 0.f, 0);
  EXPECT_LT(rel_err(dy.download(), ref), kTolGemm);
  EXPECT_THROW(cuda::gemv_f32(dx.p, dw.p, dy.p, M, N, K, 0.f, 0), Error);
  EXPECT_THROW(cuda::gemv_f32(dx.p, dw.p, dy.p, 9, N, 16, 0.f, 0), Error);
}

TEST(CudaOps, SamplingGreedyAndFilters) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(6);
  const int R = 4;
  for (int V : {50000, 50003}) {  // 50003: rows not whole float4s (the scalar path)
    SCOPED_TRACE(V);
    auto logits = randn(size_t(R) * V, rng, 3.f);
    logits[size_t(2) * V + 777] = logits[size_t(2) * V + 123] = 40.f;  // tie: lowest id wins
    // A tie inside one float4, and one between two loads of one thread (ids 4104 and 20488).
    logits[size_t(3) * V + 41] = logits[size_t(3) * V + 40] = 41.f;
    logits[size_t(1) * V + 4 * 1024 + 8] = logits[size_t(1) * V + 4 * 5 * 1024 + 8] = 42.f;
    DevBuf<float> dl(logits);
    DevBuf<int32_t> dout(R);
    cuda::GpuSampling g;
    cuda::sample(dl.p, R, V, g, 0, dout.p, 0);
    auto got = dout.download();
    for (int r = 0; r < R; ++r) {
      auto b = logits.begin() + size_t(r) * V;
      EXPECT_EQ(got[r], int(std::max_element(b, b + V) - b)) << "row " << r;
    }
    // top-k = 1 at any temperature is greedy.
    g.temperature = 1.5f;
    g.top_k = 1;
    cuda::sample(dl.p, R, V, g, 1, dout.p, 0);
    got = dout.download();
    for (int r = 0; r < R; ++r) {
      auto b = logits.begin() + size_t(r) * V;
      EXPECT_EQ(got[r], int(std::max_element(b, b + V) - b));
    }
  }
}

TEST(CudaOps, SamplingDistribution) {
  SKIP_WITHOUT_GPU();
  // 8 tokens with known probabilities at T=1; top-k 6 and top-p 0.9 cut the tail.
  const int V = 8;
  std::vector<float> lg = {2.0f, 1.5f, 1.0f, 0.5f, 0.0f, -0.5f, -1.0f, -9.f};
  std::vector<double> p(V);
  double Z = 0;
  for (int i = 0; i < 6; ++i) Z += std::exp(double(lg[i]));
  for (int i = 0; i < 6; ++i) p[i] = std::exp(double(lg[i])) / Z;
  // top-p 0.9 over the top-6 distribution: smallest prefix with mass >= 0.9.
  double cum = 0;
  int keep = 0;
  while (keep < 6) {
    cum += p[keep++];
    if (cum >= 0.9) break;
  }
  const int N = 20000;
  std::vector<float> rows;
  for (int i = 0; i < N; ++i) rows.insert(rows.end(), lg.begin(), lg.end());
  DevBuf<float> dl(rows);
  DevBuf<int32_t> dout(N);
  cuda::GpuSampling g;
  g.temperature = 1.f;
  g.top_k = 6;
  g.top_p = 0.9f;
  g.seed = 42;
  cuda::sample(dl.p, N, V, g, 7, dout.p, 0);
  auto got = dout.download();
  std::vector<int> cnt(V, 0);
  for (int x : got) {
    ASSERT_GE(x, 0);
    ASSERT_LT(x, keep) << "sampled a token outside top-k/top-p";
    cnt[x]++;
  }
  double mass = 0;
  for (int i = 0; i < keep; ++i) mass += p[i];
  for (int i = 0; i < keep; ++i) {
    double expect = p[i] / mass * N, sd = std::sqrt(expect);
    EXPECT_NEAR(cnt[i], expect, 5 * sd + 1) << "token " << i;
  }
}

TEST(CudaOps, SamplingRowsTakeTheirOwnParameters) {
  SKIP_WITHOUT_GPU();
  // Rows of one batch with different settings: greedy rows give the argmax; a sampled row's
  // draw depends on its (seed, draw) only, not on its position in the batch; the statistics
  // of a row at T = 1 with top-k 3 match its distribution.
  std::mt19937 rng(9);
  const int V = 4096, R = 6;
  auto logits = randn(size_t(R) * V, rng, 3.f);
  DevBuf<float> dl(logits);
  std::vector<cuda::GpuSamplingRow> rows(R);
  for (int r = 0; r < R; r += 2) rows[size_t(r)].p.temperature = 0.f;  // greedy rows
  for (int r = 1; r < R; r += 2) {
    rows[size_t(r)].p.temperature = 1.f;
    rows[size_t(r)].p.seed = 5;
    rows[size_t(r)].draw = 17;
  }
  std::vector<uint8_t> raw(sizeof(cuda::GpuSamplingRow) * R);
  std::memcpy(raw.data(), rows.data(), raw.size());
  DevBuf<uint8_t> drows(raw);
  DevBuf<int32_t> dout(R);
  cuda::sample_rows(dl.p, R, V, reinterpret_cast<const cuda::GpuSamplingRow*>(drows.p), dout.p, 0);
  auto got = dout.download();
  for (int r = 0; r < R; r += 2) {
    auto b = logits.begin() + size_t(r) * V;
    EXPECT_EQ(got[size_t(r)], int(std::max_element(b, b + V) - b)) << "greedy row " << r;
  }
  // The same row contents at another position with the same (seed, draw): the same token.
  std::vector<float> moved(logits.begin() + V, logits.begin() + 2 * V);  // row 1's logits
  DevBuf<float> dm(moved);
  DevBuf<uint8_t> dr1(std::vector<uint8_t>(raw.begin() + sizeof(cuda::GpuSamplingRow),
                                           raw.begin() + 2 * sizeof(cuda::GpuSamplingRow)));
  DevBuf<int32_t> d1(1);
  cuda::sample_rows(dm.p, 1, V, reinterpret_cast<const cuda::GpuSamplingRow*>(dr1.p), d1.p, 0);
  EXPECT_EQ(d1.download()[0], got[1]);
  // Distribution: one 8-token row repeated N times, each with its own draw index.
  const int W = 8, N = 20000;
  std::vector<float> lg = {2.0f, 1.5f, 1.0f, 0.5f, 0.0f, -0.5f, -1.0f, -9.f};
  std::vector<float> many;
  std::vector<cuda::GpuSamplingRow> mr(N);
  for (int i = 0; i < N; ++i) {
    many.insert(many.end(), lg.begin(), lg.end());
    mr[size_t(i)].p.temperature = 1.f;
    mr[size_t(i)].p.top_k = 3;
    mr[size_t(i)].p.seed = 99;
    mr[size_t(i)].draw = uint64_t(i);
  }
  std::vector<uint8_t> mraw(sizeof(cuda::GpuSamplingRow) * N);
  std::memcpy(mraw.data(), mr.data(), mraw.size());
  DevBuf<float> dmany(many);
  DevBuf<uint8_t> dmr(mraw);
  DevBuf<int32_t> dmo(N);
  cuda::sample_rows(dmany.p, N, W, reinterpret_cast<const cuda::GpuSamplingRow*>(dmr.p), dmo.p, 0);
  auto mo = dmo.download();
  double Z = 0;
  for (int i = 0; i < 3; ++i) Z += std::exp(double(lg[size_t(i)]));
  std::vector<int> cnt(W, 0);
  for (int x : mo) {
    ASSERT_GE(x, 0);
    ASSERT_LT(x, 3) << "sampled outside top-k";
    cnt[size_t(x)]++;
  }
  for (int i = 0; i < 3; ++i) {
    const double expect = std::exp(double(lg[size_t(i)])) / Z * N, sd = std::sqrt(expect);
    EXPECT_NEAR(cnt[size_t(i)], expect, 5 * sd + 1) << "token " << i;
  }
}

}  // namespace
}  // namespace spade::test
