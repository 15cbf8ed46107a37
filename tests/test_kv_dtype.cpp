// The KV cache's element type (--kv-dtype, kv/kv_dtype.h; issue 43): names and errors, a bf16 /
// f16 pool stores rounded values in half the bytes, every CPU reader (dense decode and prefill,
// every sparse method, Quest's page bounds, Twilight's keys, LycheeCluster's index, BLASST)
// sees a bf16 / f16 cache exactly as an f32 cache holding the same values, the decode kernels of
// every SIMD level agree, and a model on a bf16 / f16 cache stays within a stated tolerance of
// the f32 reference (and does differ from it: the option is in effect).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/attention.h"
#include "backend/cpu/qgemv.h"
#include "core/error.h"
#include "core/half.h"
#include "engine/runner.h"
#include "kv/kv_dtype.h"
#include "kv/kv_pool.h"
#include "model/cpu_model.h"
#include "sparse/registry.h"
#include "sparse/session.h"
#include "kv_cache_test_util.h"
#include "test_util.h"

using namespace spade;

namespace {

// Values exactly representable in `t` (so an f32 pool can hold the same cache).
std::vector<float> representable(KvDtype t, size_t n, std::mt19937& rng) {
  std::normal_distribution<float> nd;
  std::vector<float> x(n), r(n);
  for (auto& v : x) v = nd(rng);
  std::vector<uint8_t> buf(n * kv_dtype_bytes(t));
  kv_from_f32(t, x.data(), int64_t(n), buf.data());
  kv_to_f32(t, buf.data(), int64_t(n), r.data());
  return r;
}
}  // namespace

TEST(KvDtype, ParsesItsNamesAndRefusesOthersClearly) {
  EXPECT_EQ(parse_kv_dtype("f32"), KvDtype::F32);
  EXPECT_EQ(parse_kv_dtype("fp32"), KvDtype::F32);
  EXPECT_EQ(parse_kv_dtype("bf16"), KvDtype::BF16);
  EXPECT_EQ(parse_kv_dtype("bfloat16"), KvDtype::BF16);
  EXPECT_EQ(parse_kv_dtype("f16"), KvDtype::F16);
  EXPECT_EQ(parse_kv_dtype("fp16"), KvDtype::F16);
  EXPECT_STREQ(kv_dtype_name(KvDtype::BF16), "bf16");
  EXPECT_EQ(kv_dtype_bytes(KvDtype::F32), 4u);
  EXPECT_EQ(kv_dtype_bytes(KvDtype::BF16), 2u);
  EXPECT_EQ(kv_dtype_bytes(KvDtype::F16), 2u);
  EXPECT_EQ(parse_kv_dtype("fp8"), KvDtype::FP8);
  EXPECT_EQ(parse_kv_dtype("fp8_e4m3"), KvDtype::FP8);
  EXPECT_EQ(kv_dtype_bytes(KvDtype::FP8), 1u);
  for (const char* bad : {"", "q8", "BF16", "fp9", "e5m2", "int4"}) {
    try {
      parse_kv_dtype(bad);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("--kv-dtype"), std::string::npos) << m;
      EXPECT_NE(m.find("f32|bf16|f16|fp8"), std::string::npos) << m;
      EXPECT_NE(m.find(std::string("'") + bad + "'"), std::string::npos) << m;
    }
  }
}

TEST(KvDtype, PoolStoresRoundedValuesInHalfTheBytes) {
  ModelConfig c = test::tiny_config();
  const int P = 4;
  KVPool f32(test::kv_layout(c, P, KvDtype::F32), 8);
  for (KvDtype t : {KvDtype::BF16, KvDtype::F16}) {
    KVPool kv(test::kv_layout(c, P, t), 8);
    EXPECT_EQ(kv.dtype(), t);
    // K/V bytes halve; the fp32 page bounds stay.
    const size_t meta = size_t(c.n_layers) * 8 * c.n_kv_heads * c.head_dim * 2 * sizeof(float);
    EXPECT_EQ(kv.bytes() - meta, (f32.bytes() - meta) / 2);
    PageTable pt;
    kv.reserve(pt, 10);
    std::mt19937 rng(3);
    const int HD = c.n_kv_heads * c.head_dim;
    std::vector<std::vector<float>> ks, vs;
    for (int64_t p = 0; p < 10; ++p) {
      ks.push_back(test::random_vec(size_t(HD), uint32_t(10 + p)));
      vs.push_back(test::random_vec(size_t(HD), uint32_t(50 + p)));
      kv.write(1, pt, p, ks.back().data(), vs.back().data());
    }
    auto round = [&](float x) {
      return t == KvDtype::BF16 ? bf16_to_f32(f32_to_bf16(x)) : f16_to_f32(f32_to_f16(x));
    };
    std::vector<float> row(size_t(10 * c.head_dim));
    for (int h = 0; h < c.n_kv_heads; ++h) {
      kv.load_k(1, pt, 0, h, 10, row.data());  // crosses pages
      for (int64_t p = 0; p < 10; ++p)
        for (int d = 0; d < c.head_dim; ++d)
          ASSERT_EQ(row[size_t(p * c.head_dim + d)], round(ks[size_t(p)][size_t(h * c.head_dim + d)]));
      kv.load_v(1, pt, 3, h, 1, row.data());
      for (int d = 0; d < c.head_dim; ++d) ASSERT_EQ(row[size_t(d)], round(vs[3][size_t(h * c.head_dim + d)]));
      // Quest's bounds are those of the stored keys.
      for (int d = 0; d < c.head_dim; ++d) {
        float mn = INFINITY, mx = -INFINITY;
        for (int64_t p = 0; p < P; ++p) {
          mn = std::min(mn, round(ks[size_t(p)][size_t(h * c.head_dim + d)]));
          mx = std::max(mx, round(ks[size_t(p)][size_t(h * c.head_dim + d)]));
        }
        EXPECT_EQ(kv.page_kmin(1, pt.pages[0], h)[d], mn);
        EXPECT_EQ(kv.page_kmax(1, pt.pages[0], h)[d], mx);
      }
    }
    // fp32 views are refused on a 16-bit pool.
    EXPECT_THROW(kv.k_row(1, pt, 0, 0), Error);
    // A fork copies the partial last page as stored.
    pt.length = 10;
    PageTable fk = kv.fork(pt);
    std::vector<float> a(size_t(c.head_dim)), b(size_t(c.head_dim));
    for (int64_t p = 0; p < 10; ++p) {
      kv.load_k(1, pt, p, 1, 1, a.data());
      kv.load_k(1, fk, p, 1, 1, b.data());
      ASSERT_EQ(a, b);
    }
    kv.release(fk);
    kv.release(pt);
  }
}

// Every CPU method over a bf16 / f16 cache gives the outputs (bit for bit) it gives over an
// f32 cache holding the same values: each reader widens exactly and then runs the f32
// arithmetic. Prefill (dense, BLASST's), then three decode steps, every layer.
TEST(KvDtype, EveryCpuMethodReadsA16BitCacheAsTheF32CacheOfItsValues) {
  ModelConfig c = test::tiny_config();
  c.n_layers = 4;
  c.head_dim = 64;  // the decode kernels' fast paths (and G = 3)
  c.hidden = c.n_heads * c.head_dim;
  const int64_t L0 = 300, steps = 3;
  const std::vector<std::string> specs = test::twin_method_specs({"quest+twilight+blasst"});
  const int Hq = c.n_heads, D = c.head_dim, HD = c.n_kv_heads * D;
  for (KvDtype t : {KvDtype::BF16, KvDtype::F16}) {
    std::mt19937 rng(11);
    const int64_t total = L0 + steps;
    std::vector<float> K = representable(t, size_t(c.n_layers * total * HD), rng);
    std::vector<float> V = representable(t, size_t(c.n_layers * total * HD), rng);
    std::vector<float> Q = test::random_vec(size_t(c.n_layers * total * Hq * D), 5);
    for (const std::string& spec : specs) {
      SCOPED_TRACE(std::string(kv_dtype_name(t)) + " " + spec);
      test::TwinCaches tw(c, spec, t, L0);
      // Both caches get the same rows and queries; the outputs are equal bit for bit.
      auto write = [&](int l, int64_t p) {
        const size_t o = size_t((l * total + p) * HD);
        tw.a.write(l, tw.pa, p, K.data() + o, V.data() + o);
        tw.b.write(l, tw.pb, p, K.data() + o, V.data() + o);
      };
      auto queries = [&](int l, int64_t p, int64_t) {
        const float* q = Q.data() + size_t((l * total + p) * Hq * D);
        return std::pair{q, q};
      };
      auto same = [](const std::vector<float>& x, const std::vector<float>& y, int64_t n) {
        return std::equal(x.begin(), x.begin() + n, y.begin());
      };
      ASSERT_NO_FATAL_FAILURE(
          test::run_twin_caches(tw, c.n_layers, L0, steps, Hq * D, write, queries, same));
    }
  }
}

// The dense decode kernel on a 16-bit cache: every SIMD level this CPU has (scalar, AVX2,
// AVX-512) gives the same attention within fp32 rounding, and it matches the naive softmax
// over the widened rows.
TEST(KvDtype, DecodeKernelsOfEverySimdLevelAgreeOnA16BitCache) {
  for (int D : {64, 48}) {
    ModelConfig c = test::tiny_config();
    c.head_dim = D;
    c.n_layers = 1;
    const int Hq = c.n_heads, G = c.n_heads / c.n_kv_heads;
    for (KvDtype t : {KvDtype::BF16, KvDtype::F16}) {
      const int64_t L = 700;  // several chunks, a partial last one
      KVPool kv(test::kv_layout(c, 16, t), 64);
      PageTable pt;
      kv.reserve(pt, L);
      std::mt19937 rng(4);
      for (int64_t p = 0; p < L; ++p) {
        auto k = test::random_vec(size_t(c.n_kv_heads * D), uint32_t(p));
        auto v = test::random_vec(size_t(c.n_kv_heads * D), uint32_t(p + 9999));
        kv.write(0, pt, p, k.data(), v.data());
      }
      pt.length = L;
      auto q = test::random_vec(size_t(Hq * D), 77);
      const float scale = 1.f / std::sqrt(float(D));
      // Naive reference over the widened cache.
      std::vector<float> ref(size_t(Hq * D));
      std::vector<float> kr(size_t(L * D)), vr(size_t(L * D));
      for (int h = 0; h < c.n_kv_heads; ++h) {
        kv.load_k(0, pt, 0, h, L, kr.data());
        kv.load_v(0, pt, 0, h, L, vr.data());
        for (int g = 0; g < G; ++g) {
          const float* qq = q.data() + (h * G + g) * D;
          std::vector<double> w(static_cast<size_t>(L));
          double mx = -1e300, den = 0;
          for (int64_t j = 0; j < L; ++j) {
            double s = 0;
            for (int d = 0; d < D; ++d) s += double(qq[d]) * kr[size_t(j * D + d)];
            w[size_t(j)] = s * scale;
            mx = std::max(mx, w[size_t(j)]);
          }
          for (auto& x : w) den += (x = std::exp(x - mx));
          for (int d = 0; d < D; ++d) {
            double o = 0;
            for (int64_t j = 0; j < L; ++j) o += w[size_t(j)] * vr[size_t(j * D + d)];
            ref[size_t((h * G + g) * D + d)] = float(o / den);
          }
        }
      }
      for (cpu::SimdLevel lv : test::simd_levels()) {
        const cpu::SimdLevel prev = cpu::set_simd_level(lv);
        std::vector<float> out(size_t(Hq * D));
        cpu::AttentionScratch sc;
        cpu::attention_dense(kv, 0, pt, q.data(), L - 1, 1, Hq, scale, out.data(), sc);
        cpu::set_simd_level(prev);
        for (size_t i = 0; i < out.size(); ++i)
          ASSERT_NEAR(out[i], ref[i], 2e-5f + 2e-5f * std::abs(ref[i]))
              << kv_dtype_name(t) << " D " << D << " level " << cpu::simd_level_name(lv) << " at " << i;
      }
    }
  }
}

// A model decoding on a bf16 / f16 cache stays close to the f32 reference: the logits of
// every step (prefill 100 tokens, 12 teacher-forced decode steps, dense attention) within 2%
// (bf16: 8 bits of mantissa) / 0.4% (f16: 11 bits) of the largest |logit| of f32's (random
// weights, 4 layers: measured 1.0% / 0.16%); and they differ from f32's (the cache is what the
// option says).
TEST(KvDtype, ModelLogitsOnA16BitCacheStayWithinToleranceOfF32) {
  ModelConfig c = test::tiny_config();
  c.n_layers = 4;
  ModelWeights w = test::random_model(c, 21);
  std::mt19937 rng(8);
  std::vector<int32_t> seq(112);
  for (auto& x : seq) x = int32_t(rng() % uint32_t(c.vocab));
  auto run = [&](KvDtype t) {
    KVPool kv(test::kv_layout(c, 16, t), 16);
    CpuModel model(w, kv);
    PageTable pt;
    std::vector<int64_t> row_of;
    std::vector<SeqInput> b = {{&pt, seq.data(), 100, false, nullptr}};
    model.forward(b, row_of);
    std::vector<float> all;
    for (int i = 0; i < 12; ++i) {
      b = {{&pt, seq.data() + 100 + i, 1, false, nullptr}};
      const auto& lg = model.forward(b, row_of);
      all.insert(all.end(), lg.begin(), lg.begin() + c.vocab);
    }
    return all;
  };
  const auto ref = run(KvDtype::F32);
  double peak = 0;
  for (float x : ref) peak = std::max(peak, double(std::abs(x)));
  for (auto [t, rel] : {std::pair{KvDtype::BF16, 2e-2}, std::pair{KvDtype::F16, 4e-3}}) {
    const double tol = rel * peak;
    const auto got = run(t);
    double diff = 0;
    for (size_t i = 0; i < ref.size(); ++i) diff = std::max(diff, double(std::abs(got[i] - ref[i])));
    EXPECT_LT(diff, tol) << kv_dtype_name(t) << " (largest |logit| " << peak << ")";
    EXPECT_GT(diff, 0.0) << kv_dtype_name(t) << ": the same logits as the f32 cache";
  }
}

// The runner builds the host cache of the type asked for (front ends pass --kv-dtype; bf16
// halves the K/V bytes).
TEST(KvDtype, RunnerBuildsTheCacheOfTheTypeAsked) {
  ModelWeights w = test::random_model(test::tiny_config(), 2);
  RunnerOptions o;
  o.kv_pages = 64;
  o.kv_dtype = KvDtype::F32;
  Runner f = make_runner(w, o);
  o.kv_dtype = KvDtype::BF16;
  Runner b = make_runner(w, o);
  ASSERT_NE(b.host_pool, nullptr);
  EXPECT_EQ(b.host_pool->dtype(), KvDtype::BF16);
  EXPECT_EQ(f.host_pool->dtype(), KvDtype::F32);
  EXPECT_LT(b.kv_mib, f.kv_mib * 0.75);
}

// `spade generate --kv-dtype X`: an unknown X is an error naming the option and the choices;
// f32, bf16 and f16 run.
TEST(KvDtypeCli, GenerateTakesKvDtypeAndRefusesUnknownTypes) {
  const std::string spade = test::spade_binary();
  ASSERT_FALSE(spade.empty());  // /proc/self/exe read
  if (!std::ifstream(spade).good()) GTEST_SKIP() << spade << " not built";
  auto run = [&](const std::string& extra, int* rc) { return test::run_generate(spade, extra, rc); };
  int rc = 0;
  std::string out = run("--kv-dtype q8", &rc);
  EXPECT_NE(rc, 0) << out;
  EXPECT_NE(out.find("--kv-dtype: unknown KV cache type 'q8' (expected one of f32|bf16|f16|fp8)"),
            std::string::npos)
      << out;
  for (const char* t : {"f32", "bf16", "f16"}) {
    out = run(std::string("--kv-dtype ") + t, &rc);
    EXPECT_EQ(rc, 0) << t << ": " << out;
  }
}
