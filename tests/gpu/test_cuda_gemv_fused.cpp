// The decode GEMVs with the next op fused in (gemv.cu: gemv_swiglu, gemv_qkv_post) against the
// launches they replace (gemv_f32 -> swiglu / qkv_post, each checked against the CPU by
// test_cuda_ops.cpp): bit-identical, so a decode step computes the same values with or without
// the fusion; and the SwiGLU chain against the CPU directly, so a fault shared by both paths
// cannot hide.
#include <cmath>
#include <cstring>
#include <string>

#include "backend/cpu/ops.h"
#include "backend/cuda/gemm.h"
#include "backend/cuda/ops.h"
#include "gpu_util.h"

namespace spade::test {
namespace {

using cuda::bf16;

template <typename T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), sizeof(T) * a.size()) == 0;
}
// Index of the first differing bf16 element and how many differ (failure messages).
std::string first_diff(const std::vector<bf16>& a, const std::vector<bf16>& b) {
  size_t first = a.size(), n = 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(bf16)) != 0) {
      if (first == a.size()) first = i;
      ++n;
    }
  if (n == 0) return "none";
  return "first at " + std::to_string(first) + " (" + std::to_string(__bfloat162float(a[first])) +
         " vs " + std::to_string(__bfloat162float(b[first])) + "), " + std::to_string(n) + " differ";
}

// F not a multiple of the 4 columns a CTA writes, K not a multiple of the 256 elements a warp
// reads per pass, M = 1..8, Llama-3.1-8B's gate|up shape.
TEST(CudaGemvFused, SwigluMatchesSeparateLaunches) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(32);
  struct S { int M, F, K; } shapes[] = {{1, 7, 64},   {2, 1536, 576}, {3, 1001, 1000},
                                        {8, 300, 576}, {1, 14336, 4096}, {2, 14336, 4096}};
  for (auto [M, F, K] : shapes) {
    SCOPED_TRACE(testing::Message() << M << "x" << F << "x" << K);
    const auto x = round_bf16(randn(size_t(M) * K, rng));
    const auto w = round_bf16(randn(size_t(2 * F) * K, rng, 0.05f));
    DevBuf<bf16> dx(to_bf16(x)), dw(to_bf16(w)), dh_ref(size_t(M) * F), dh(size_t(M) * F);
    DevBuf<float> dgu(size_t(M) * 2 * F);
    cuda::gemv_f32(dx.p, dw.p, dgu.p, M, 2 * F, K, 0.f, 0);
    cuda::swiglu(dgu.p, dh_ref.p, M, F, 0);
    dh.poison();
    cuda::gemv_swiglu(dx.p, dw.p, dh.p, M, F, K, 0);
    const auto ref = dh_ref.download(), got = dh.download();
    EXPECT_TRUE(same_bits(ref, got)) << "rel err " << rel_err(from_bf16(got), from_bf16(ref));
  }
}

TEST(CudaGemvFused, SwigluMatchesCpu) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(33);
  const int M = 2, F = 1536, K = 576;
  const auto x = round_bf16(randn(size_t(M) * K, rng));
  const auto w = round_bf16(randn(size_t(2 * F) * K, rng, 0.05f));
  std::vector<float> gu(size_t(M) * 2 * F), g(size_t(M) * F), u(size_t(M) * F), ref(size_t(M) * F);
  cpu::matmul(x.data(), w.data(), nullptr, gu.data(), M, 2 * F, K);
  for (int m = 0; m < M; ++m)
    for (int i = 0; i < F; ++i) {
      g[size_t(m) * F + i] = gu[size_t(m) * 2 * F + i];
      u[size_t(m) * F + i] = gu[size_t(m) * 2 * F + F + i];
    }
  cpu::swiglu(g.data(), u.data(), ref.data(), int64_t(M) * F);
  DevBuf<bf16> dx(to_bf16(x)), dw(to_bf16(w)), dh(size_t(M) * F);
  dh.poison();
  cuda::gemv_swiglu(dx.p, dw.p, dh.p, M, F, K, 0);
  EXPECT_LT(rel_err(from_bf16(dh.download()), ref), kTolBf16Out);
}

// qkv + qkv_post: q rows, the K / V cache rows and the Quest page metadata, every byte, for
// D = 64 / 128, GQA 3 and 4, with and without the qkv bias, tokens at a page's first row and
// mid-page, one and two tokens (two sequences), with and without the metadata.
TEST(CudaGemvFused, QkvPostMatchesSeparateLaunches) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(34);
  struct S { int M, D, Hq, Hkv, K; bool bias, meta; } cases[] = {
      {1, 128, 32, 8, 4096, false, true}, {2, 128, 32, 8, 4096, false, true},
      {1, 64, 9, 3, 576, true, false},    {2, 64, 9, 3, 576, false, true},
      {2, 128, 4, 1, 256, true, true}};
  const int P = 16, n_pages = 8;
  for (const auto& c : cases) {
    SCOPED_TRACE(testing::Message() << "M=" << c.M << " D=" << c.D << " Hq=" << c.Hq << " Hkv="
                                    << c.Hkv << " bias=" << c.bias << " meta=" << c.meta);
    const int nh = c.Hq + 2 * c.Hkv, N = nh * c.D;
    const auto x = round_bf16(randn(size_t(c.M) * c.K, rng));
    const auto w = round_bf16(randn(size_t(N) * c.K, rng, 0.05f));
    const auto bias = randn(size_t(N), rng, 0.1f);
    std::vector<float> inv_freq(size_t(c.D / 2));
    for (int i = 0; i < c.D / 2; ++i) inv_freq[size_t(i)] = std::pow(10000.f, -2.f * i / c.D);
    // Token m: sequence m's page 3 + 2m; m = 0 at the page's first row, m = 1 mid-page.
    const std::vector<int32_t> pos = {3 * P, 5 * P + 7}, page = {3, 5};
    const size_t cache = size_t(n_pages) * c.Hkv * P * c.D, meta = size_t(n_pages) * c.Hkv * 2 * c.D;
    const auto k0 = round_bf16(randn(cache, rng)), v0 = round_bf16(randn(cache, rng));
    const auto m0 = round_bf16(randn(meta, rng));
    DevBuf<bf16> dx(to_bf16(x)), dw(to_bf16(w));
    DevBuf<float> dbias(bias), dfreq(inv_freq), dqkv(size_t(c.M) * N);
    DevBuf<int32_t> dpos(pos), dpage(page);
    struct Out {
      DevBuf<bf16> q, k, v, meta;
    };
    auto make = [&](Out& o) {
      o.q.poison();
      o.k.upload(to_bf16(k0)), o.v.upload(to_bf16(v0)), o.meta.upload(to_bf16(m0));
    };
    Out ref{DevBuf<bf16>(size_t(c.M) * c.Hq * c.D), DevBuf<bf16>(cache), DevBuf<bf16>(cache),
            DevBuf<bf16>(meta)};
    Out got{DevBuf<bf16>(size_t(c.M) * c.Hq * c.D), DevBuf<bf16>(cache), DevBuf<bf16>(cache),
            DevBuf<bf16>(meta)};
    make(ref), make(got);
    auto args = [&](Out& o) {
      cuda::QkvPostArgs a;
      a.qkv = dqkv.p, a.bias = c.bias ? dbias.p : nullptr, a.inv_freq = dfreq.p;
      a.pos = dpos.p, a.page = dpage.p, a.q_out = o.q.p, a.k_cache = o.k.p, a.v_cache = o.v.p;
      a.quest_meta = c.meta ? o.meta.p : nullptr;
      a.T = c.M, a.Hq = c.Hq, a.Hkv = c.Hkv, a.D = c.D, a.P = P;
      return a;
    };
    cuda::gemv_f32(dx.p, dw.p, dqkv.p, c.M, N, c.K, 0.f, 0);
    cuda::qkv_post(args(ref), 0);
    const cuda::QkvPostArgs a = args(got);
    ASSERT_TRUE(cuda::gemv_qkv_post_supported(dx.p, dw.p, a, c.M, c.K));
    cuda::gemv_qkv_post(dx.p, dw.p, a, c.M, c.K, 0);
    const char* what[] = {"q", "K cache", "V cache", "Quest metadata"};
    Out* outs[] = {&ref, &got};
    for (int k = 0; k < 4; ++k) {
      auto pick = [&](Out& o) -> DevBuf<bf16>& { return k == 0 ? o.q : k == 1 ? o.k : k == 2 ? o.v : o.meta; };
      const auto r = pick(*outs[0]).download(), g = pick(*outs[1]).download();
      EXPECT_TRUE(same_bits(r, g)) << what[k] << ": " << first_diff(r, g);
    }
  }
}

TEST(CudaGemvFused, UnsupportedOperandsAreRefused) {
  SKIP_WITHOUT_GPU();
  DevBuf<bf16> dx(64), dw(size_t(64) * 64 + 8), dh(64);
  EXPECT_THROW(cuda::gemv_swiglu(dx.p, dw.p, dh.p, 1, 4, 12, 0), Error);      // K % 8 != 0
  EXPECT_THROW(cuda::gemv_swiglu(dx.p, dw.p + 1, dh.p, 1, 4, 64, 0), Error);  // misaligned W
  EXPECT_THROW(cuda::gemv_swiglu(dx.p, dw.p, dh.p, 9, 4, 64, 0), Error);      // M > kGemvMaxM
  // qkv_post parts the fused epilogue cannot do (whole-row q/k norm, INT4 keys): refused.
  DevBuf<float> dn(64);
  cuda::QkvPostArgs a;
  a.T = 1, a.Hq = 1, a.Hkv = 1, a.D = 16, a.P = 16;
  EXPECT_TRUE(cuda::gemv_qkv_post_supported(dx.p, dw.p, a, 1, 64));
  a.k_norm = dn.p;
  EXPECT_FALSE(cuda::gemv_qkv_post_supported(dx.p, dw.p, a, 1, 64));
  EXPECT_THROW(cuda::gemv_qkv_post(dx.p, dw.p, a, 1, 64, 0), Error);
  a.k_norm = nullptr, a.T = 2;  // T must be M
  EXPECT_FALSE(cuda::gemv_qkv_post_supported(dx.p, dw.p, a, 1, 64));
}

}  // namespace
}  // namespace spade::test
