// CPU ops vs naive double-precision loops written here independently.
#include <gtest/gtest.h>

#include <cmath>

#include "backend/cpu/attention.h"
#include "backend/cpu/ops.h"
#include "core/half.h"
#include "test_util.h"

using namespace spade;
using spade::test::random_vec;

static double rel_err(const float* a, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    num += (a[i] - ref[i]) * (a[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

TEST(CpuOps, MatmulMatchesNaive) {
  for (int64_t M : {1, 3, 17}) {
    const int64_t N = 37, K = 70;
    auto x = random_vec(size_t(M * K), 1), w = random_vec(size_t(N * K), 2), b = random_vec(size_t(N), 3);
    std::vector<float> y(size_t(M * N));
    for (bool use_bias : {false, true}) {
      cpu::matmul(x.data(), w.data(), use_bias ? b.data() : nullptr, y.data(), M, N, K);
      std::vector<double> ref(size_t(M * N));
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) {
          double acc = use_bias ? b[size_t(n)] : 0;
          for (int64_t k = 0; k < K; ++k) acc += double(x[size_t(m * K + k)]) * w[size_t(n * K + k)];
          ref[size_t(m * N + n)] = acc;
        }
      EXPECT_LT(rel_err(y.data(), ref), 1e-6) << "M=" << M << " bias=" << use_bias;
    }
  }
}

TEST(CpuOps, RmsNormMatchesNaive) {
  const int64_t rows = 5, n = 33;
  auto x = random_vec(size_t(rows * n), 4, 3.f), w = random_vec(size_t(n), 5);
  std::vector<float> y(x.size());
  cpu::rmsnorm(x.data(), w.data(), 1e-5f, y.data(), rows, n);
  std::vector<double> ref(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < n; ++i) ss += double(x[size_t(r * n + i)]) * x[size_t(r * n + i)];
    double inv = 1 / std::sqrt(ss / n + 1e-5);
    for (int64_t i = 0; i < n; ++i) ref[size_t(r * n + i)] = x[size_t(r * n + i)] * inv * w[size_t(i)];
  }
  EXPECT_LT(rel_err(y.data(), ref), 1e-6);
  // In place gives the same.
  cpu::rmsnorm(x.data(), w.data(), 1e-5f, x.data(), rows, n);
  EXPECT_LT(rel_err(x.data(), ref), 1e-6);
}

TEST(CpuOps, RopeRotatesHalvesAsComplexMultiply) {
  ModelConfig c;
  c.head_dim = 8;
  c.rope_theta = 10000.f;
  std::vector<float> inv(4);
  cpu::rope_inv_freq(c, inv.data());
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(inv[size_t(i)], std::pow(10000.0, -2.0 * i / 8), 1e-7);
  const int64_t T = 3, H = 2, D = 8;
  auto x = random_vec(size_t(T * H * D), 6);
  auto orig = x;
  std::vector<int32_t> pos = {0, 5, 511};
  cpu::rope(x.data(), pos.data(), inv.data(), T, H, D);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < D / 2; ++i) {
        // (a + ib) * e^{i theta}: pairs (i, i + D/2) form a complex number.
        double th = pos[size_t(t)] * double(inv[size_t(i)]);
        double a = orig[size_t((t * H + h) * D + i)], b = orig[size_t((t * H + h) * D + i + D / 2)];
        EXPECT_NEAR(x[size_t((t * H + h) * D + i)], a * std::cos(th) - b * std::sin(th), 2e-4);
        EXPECT_NEAR(x[size_t((t * H + h) * D + i + D / 2)], b * std::cos(th) + a * std::sin(th), 2e-4);
      }
}

TEST(CpuOps, Llama3RopeScaling) {
  // Values computed by hand from transformers' _compute_llama3_parameters formula:
  // theta 500000, D 128, factor 8, low 1, high 4, original 8192.
  ModelConfig c;
  c.head_dim = 128;
  c.rope_theta = 500000.f;
  c.rope_scaling.llama3 = true;
  c.rope_scaling.factor = 8;
  c.rope_scaling.low_freq_factor = 1;
  c.rope_scaling.high_freq_factor = 4;
  c.rope_scaling.original_max_position = 8192;
  std::vector<float> inv(64);
  cpu::rope_inv_freq(c, inv.data());
  const double pi = 3.14159265358979323846;
  for (int i = 0; i < 64; ++i) {
    double f = std::pow(500000.0, -2.0 * i / 128), wl = 2 * pi / f, want;
    if (wl < 8192.0 / 4) want = f;
    else if (wl > 8192.0 / 1) want = f / 8;
    else {
      double sm = (8192.0 / wl - 1) / (4 - 1);
      want = (1 - sm) * f / 8 + sm * f;
    }
    EXPECT_NEAR(inv[size_t(i)], want, 1e-6 * want) << i;
  }
  EXPECT_NEAR(inv[0], 1.0, 1e-7);              // high frequency kept
  EXPECT_NEAR(inv[63], std::pow(500000.0, -126.0 / 128) / 8, 1e-12);  // low frequency / 8
}

TEST(CpuOps, SwigluAndEmbedding) {
  auto g = random_vec(50, 7, 3.f), u = random_vec(50, 8);
  std::vector<float> o(50);
  cpu::swiglu(g.data(), u.data(), o.data(), 50);
  for (size_t i = 0; i < 50; ++i) EXPECT_NEAR(o[i], g[i] / (1 + std::exp(-double(g[i]))) * u[i], 1e-5);
  auto table = random_vec(4 * 3, 9);
  std::vector<int32_t> ids = {3, 0};
  std::vector<float> out(6);
  cpu::embedding(table.data(), ids.data(), out.data(), 2, 3, 4);
  EXPECT_EQ(out[0], table[9]);
  EXPECT_EQ(out[5], table[2]);
  ids[1] = 4;
  EXPECT_THROW(cpu::embedding(table.data(), ids.data(), out.data(), 2, 3, 4), Error);
}

// Dense paged attention vs a naive double implementation over unpaged K/V.
TEST(CpuAttention, DenseCausalMatchesNaive) {
  for (int page : {1, 3, 16}) {
    KVLayout lay{1, 2, 8, page};
    KVPool kv(lay, 64);
    const int Hq = 6, Hkv = 2, D = 8, G = 3;
    const int64_t p0 = 13, T = 7, L = p0 + T;
    auto K = random_vec(size_t(L * Hkv * D), 10), V = random_vec(size_t(L * Hkv * D), 11);
    auto q = random_vec(size_t(T * Hq * D), 12, 2.f);
    PageTable pt;
    kv.reserve(pt, L);
    for (int64_t p = 0; p < L; ++p) kv.write(0, pt, p, &K[size_t(p * Hkv * D)], &V[size_t(p * Hkv * D)]);
    std::vector<float> out(q.size());
    cpu::AttentionScratch sc;
    const float scale = 1 / std::sqrt(8.f);
    cpu::attention_dense(kv, 0, pt, q.data(), p0, T, Hq, scale, out.data(), sc);
    std::vector<double> ref(q.size());
    for (int64_t t = 0; t < T; ++t)
      for (int h = 0; h < Hq; ++h) {
        int kh = h / G;
        int64_t n = p0 + t + 1;
        std::vector<double> s(static_cast<size_t>(n));
        double mx = -1e300, sum = 0;
        for (int64_t j = 0; j < n; ++j) {
          double d = 0;
          for (int e = 0; e < D; ++e) d += double(q[size_t((t * Hq + h) * D + e)]) * K[size_t((j * Hkv + kh) * D + e)];
          s[size_t(j)] = d * scale;
          mx = std::max(mx, s[size_t(j)]);
        }
        for (auto& x : s) sum += (x = std::exp(x - mx));
        for (int e = 0; e < D; ++e) {
          double acc = 0;
          for (int64_t j = 0; j < n; ++j) acc += s[size_t(j)] / sum * V[size_t((j * Hkv + kh) * D + e)];
          ref[size_t((t * Hq + h) * D + e)] = acc;
        }
      }
    EXPECT_LT(rel_err(out.data(), ref), 1e-6) << "page " << page;
  }
}

TEST(Half, F16RoundTripsEveryValue) {
  for (uint32_t h = 0; h < 65536; ++h) {
    float f = f16_to_f32(uint16_t(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(f32_to_f16(f), uint16_t(h)) << h;
  }
  EXPECT_EQ(f16_to_f32(0x3c00), 1.f);
  EXPECT_EQ(f16_to_f32(0x0001), std::ldexp(1.f, -24));
  EXPECT_EQ(f32_to_f16(65520.f), 0x7c00);        // rounds to inf
  EXPECT_EQ(f32_to_f16(std::ldexp(1.f, -25)), 0);  // ties to even -> 0
  EXPECT_EQ(f32_to_f16(std::ldexp(3.f, -26)), 1);  // 0.75 ulp rounds up
}

TEST(Half, Bf16RoundToNearestEven) {
  for (uint32_t h = 0; h < 65536; ++h) {
    float f = bf16_to_f32(uint16_t(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(f32_to_bf16(f), uint16_t(h));
  }
  EXPECT_EQ(f32_to_bf16(1.f + std::ldexp(1.f, -8)), 0x3f80);  // tie -> even (1.0)
  EXPECT_EQ(f32_to_bf16(1.f + std::ldexp(3.f, -9)), 0x3f81);  // 0.75 ulp -> up
}

TEST(CpuOps, RopeFreqFactorsDivideInverseFrequencies) {
  // GGUF Llama-3.1 files carry scaling as a rope_freqs tensor: inv_freq[i] / factor[i].
  ModelConfig c;
  c.head_dim = 8;
  c.rope_theta = 10000.f;
  c.rope_scaling.freq_factors = {1.f, 2.f, 4.f, 8.f};
  std::vector<float> inv(4);
  cpu::rope_inv_freq(c, inv.data());
  for (int i = 0; i < 4; ++i)
    EXPECT_NEAR(inv[size_t(i)], std::pow(10000.0, -2.0 * i / 8) / std::pow(2.0, i), 1e-7);
}
