// The gate|up GEMV with SwiGLU fused in (gemv.cu, gemv_swiglu) against the launches it replaces
// (gemv_f32 -> swiglu, each checked against the CPU by test_cuda_ops.cpp): bit-identical, so a
// decode step computes the same values with or without the fusion; and the chain against the
// CPU directly, so a fault shared by both paths cannot hide.
#include <cstring>

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

TEST(CudaGemvFused, UnsupportedOperandsAreRefused) {
  SKIP_WITHOUT_GPU();
  DevBuf<bf16> dx(64), dw(size_t(64) * 64 + 8), dh(64);
  EXPECT_THROW(cuda::gemv_swiglu(dx.p, dw.p, dh.p, 1, 4, 12, 0), Error);      // K % 8 != 0
  EXPECT_THROW(cuda::gemv_swiglu(dx.p, dw.p + 1, dh.p, 1, 4, 64, 0), Error);  // misaligned W
  EXPECT_THROW(cuda::gemv_swiglu(dx.p, dw.p, dh.p, 9, 4, 64, 0), Error);      // M > kGemvMaxM
}

}  // namespace
}  // namespace spade::test
