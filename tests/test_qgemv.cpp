// The CPU products over weights as stored (backend/cpu/qgemv.h) against dequantize-then-dot
// in double, on random blocks of every stored type, odd shapes, at every SIMD level this CPU
// runs (scalar always; AVX2 and AVX-512 where present); and the native CPU path on the real
// SmolLM2-135M-Instruct Q4_1 (skipped when models/ lacks it): greedy tokens equal those of the
// fp32 reference except at a near-tie, and the loader keeps no fp32 copy of stored weights;
// `spade generate` prints the same text with --cpu-weights native (the default) and f32. The
// same two on K-quant / f16 / bf16 requantizations of that file when models/ has them.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <vector>

#include "backend/cpu/qgemv.h"

#include <cblas.h>
#include "core/half.h"
#include "engine/sampler.h"
#include "io/dequant.h"
#include "model/cpu_model.h"
#include "model/loader.h"
#include "smollm2_model.h"
#include "test_util.h"

using namespace spade;
using namespace spade::cpu;

namespace {

// Random [rows, cols] data of type t with sane scales: the f16 fields of each block are set to
// finite values (d in [0.002, 0.02], mins in [-0.1, 0.1]); the codes are random bytes.
std::vector<uint8_t> random_matrix(DType t, int64_t rows, int64_t cols, std::mt19937& rng) {
  const DTypeInfo& info = dtype_info(t);
  const size_t bytes = dtype_bytes(t, size_t(rows * cols));
  std::vector<uint8_t> out(bytes);
  std::uniform_int_distribution<int> byte(0, 255);
  for (auto& b : out) b = uint8_t(byte(rng));
  std::uniform_real_distribution<float> dd(0.002f, 0.02f), mm(-0.1f, 0.1f), ff(-1.f, 1.f);
  auto put16 = [&](uint8_t* p, uint16_t v) { std::memcpy(p, &v, 2); };
  if (t == DType::F16 || t == DType::BF16) {
    for (size_t i = 0; i < bytes / 2; ++i)
      put16(out.data() + 2 * i, t == DType::F16 ? f32_to_f16(ff(rng)) : f32_to_bf16(ff(rng)));
    return out;
  }
  for (size_t b = 0; b < bytes / size_t(info.block_bytes); ++b) {
    uint8_t* blk = out.data() + b * size_t(info.block_bytes);
    switch (t) {
      case DType::Q8_0:
      case DType::Q4_0: put16(blk, f32_to_f16(dd(rng) * (byte(rng) & 1 ? 1 : -1))); break;
      case DType::Q4_1:
      case DType::Q4_K:
      case DType::Q5_K:
        put16(blk, f32_to_f16(dd(rng)));
        put16(blk + 2, f32_to_f16(t == DType::Q4_1 ? mm(rng) : dd(rng)));
        break;
      case DType::Q6_K: put16(blk + 208, f32_to_f16(dd(rng))); break;
      default: ADD_FAILURE() << "no generator for " << dtype_name(t);
    }
  }
  return out;
}

struct Ref {
  std::vector<double> y;    // [M, N]
  std::vector<double> tol;  // [M, N]
};

// Dequantize each row, dot in double. Tolerance: 1e-5 of sum |w x| plus 1e-5 of
// max|w| * sum |x| (the offset term of Q4_0 / Q4_1 / K-quants cancels inside w), + 1e-6.
// Why these: every kernel multiplies fp32 x by exact weight values (codes, or the dequantized
// values of f16 / bf16 / Q6_K) and sums in fp32; its rounding error is that of a sum of K
// products split over 8-32 independent lanes and accumulators (chains of at most K / 4 + 8
// additions, the scalar dot's), with the scale d applied per block in the fused kernels (one
// more rounding of a block's partial sum). For terms of random sign the error grows as
// sqrt(chain) * 2^-24 * sum |w x|: at most ~32 * 6e-8 = 2e-6 of sum |w x| at K = 4096, the
// largest K here, 5x under 1e-5. The factored kernels (Q4_0 / Q4_1 / Q4_K / Q5_K: d * sum(code
// x) + offset * sum(x)) add the offset term's rounding, bounded by the offset (<= max|w|) times
// sum |x| times the same factor: the second term. A kernel reading a wrong code, scale or sign
// is off by about a weight times x: >= 1e-3 of sum |w x| for these random rows, 100x the bound.
Ref reference(const QuantMatrix& w, const std::vector<float>& x, int64_t M) {
  const int64_t N = w.rows, K = w.cols;
  Ref r{std::vector<double>(size_t(M * N)), std::vector<double>(size_t(M * N))};
  std::vector<float> row(static_cast<size_t>(K));
  for (int64_t n = 0; n < N; ++n) {
    dequantize_serial(w.dtype, w.row(n), row.data(), K);
    double amax = 0;
    for (float v : row) amax = std::max(amax, double(std::fabs(v)));
    for (int64_t m = 0; m < M; ++m) {
      double s = 0, sa = 0, sx = 0;
      for (int64_t k = 0; k < K; ++k) {
        const double xv = x[size_t(m * K + k)];
        s += double(row[size_t(k)]) * xv;
        sa += std::fabs(double(row[size_t(k)]) * xv);
        sx += std::fabs(xv);
      }
      r.y[size_t(m * N + n)] = s;
      r.tol[size_t(m * N + n)] = 1e-5 * sa + 1e-5 * amax * sx + 1e-6;
    }
  }
  return r;
}

std::vector<SimdLevel> levels() {
  std::vector<SimdLevel> l = {SimdLevel::Scalar};
  if (int(detected_simd_level()) >= int(SimdLevel::Avx2)) l.push_back(SimdLevel::Avx2);
  if (int(detected_simd_level()) >= int(SimdLevel::Avx512)) l.push_back(SimdLevel::Avx512);
  return l;
}

// Restores the detected level when a test ends.
struct LevelGuard {
  SimdLevel prev = simd_level();
  ~LevelGuard() { set_simd_level(prev); }
};

void check_type(DType t, const std::vector<int64_t>& Ks, const std::vector<int64_t>& Ns) {
  std::mt19937 rng(1234 + int(t));
  std::normal_distribution<float> nd(0.f, 1.f);
  for (int64_t K : Ks)
    for (int64_t N : Ns) {
      std::vector<uint8_t> data = random_matrix(t, N, K, rng);
      const QuantMatrix w{t, data.data(), N, K};
      for (int64_t M : {1, 2, 3, 4, 5, 8}) {
        std::vector<float> x(size_t(M * K));
        for (float& v : x) v = nd(rng);
        const Ref ref = reference(w, x, M);
        for (SimdLevel level : levels()) {
          std::vector<float> y(size_t(M * N), NAN);
          qgemv_rows(x.data(), M, w, 0, N, y.data(), N, level);
          // A sub-range writes only its rows.
          std::vector<float> part(size_t(M * N), -7.f);
          const int64_t n0 = N / 3, n1 = N - N / 4;
          qgemv_rows(x.data(), M, w, n0, n1, part.data(), N, level);
          for (int64_t m = 0; m < M; ++m)
            for (int64_t n = 0; n < N; ++n) {
              const size_t i = size_t(m * N + n);
              ASSERT_NEAR(y[i], ref.y[i], ref.tol[i])
                  << dtype_name(t) << " " << simd_level_name(level) << " M=" << M << " N=" << N
                  << " K=" << K << " at (" << m << ", " << n << ")";
              if (n >= n0 && n < n1)
                ASSERT_EQ(part[i], y[i]) << dtype_name(t) << " " << simd_level_name(level);
              else
                ASSERT_EQ(part[i], -7.f) << "row outside the range written";
            }
        }
      }
    }
}

}  // namespace

TEST(QGemv, Q8_0) { check_type(DType::Q8_0, {32, 96, 608}, {1, 7, 67}); }
TEST(QGemv, Q4_0) { check_type(DType::Q4_0, {32, 96, 608}, {1, 7, 67}); }
TEST(QGemv, Q4_1) { check_type(DType::Q4_1, {32, 96, 608}, {1, 7, 67}); }
// K-quants: one super-block (256), three, and sixteen (4096); rows not a multiple of anything
// (1, 5, 33); x rows 1-5 and 8 (the kernels take x rows four at a time: every tail of 1-3).
TEST(QGemv, Q4_K) { check_type(DType::Q4_K, {256, 768, 4096}, {1, 5, 33}); }
TEST(QGemv, Q5_K) { check_type(DType::Q5_K, {256, 768, 4096}, {1, 5, 33}); }
TEST(QGemv, Q6_K) { check_type(DType::Q6_K, {256, 768, 4096}, {1, 5, 33}); }
// f16 / bf16: K under one vector (1, 17), exactly one AVX-512 step (64), with the AVX2 kernel's
// 8-wide step (200), and many steps with a masked / scalar tail (1003).
TEST(QGemv, F16) { check_type(DType::F16, {1, 17, 64, 200, 1003}, {1, 7, 67}); }
TEST(QGemv, BF16) { check_type(DType::BF16, {1, 17, 64, 200, 1003}, {1, 7, 67}); }

// A weight row's value for an x row does not depend on how many x rows run with it (decode of
// one sequence and of a batch give the same logits): M = 7 (x rows taken 4 + 3) equals seven
// runs of M = 1, bit for bit, for the types whose kernels promise it, at every level.
TEST(QGemv, RowValueIndependentOfM) {
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (DType t : {DType::Q4_K, DType::Q5_K, DType::Q6_K, DType::F16, DType::BF16}) {
    const bool k = dtype_info(t).block_elems == 256;
    const int64_t K = k ? 512 : 203, N = 13, M = 7;
    std::vector<uint8_t> data = random_matrix(t, N, K, rng);
    const QuantMatrix w{t, data.data(), N, K};
    std::vector<float> x(size_t(M * K));
    for (float& v : x) v = nd(rng);
    for (SimdLevel level : levels()) {
      std::vector<float> all(static_cast<size_t>(M * N)), one(static_cast<size_t>(N));
      qgemv_rows(x.data(), M, w, 0, N, all.data(), N, level);
      for (int64_t m = 0; m < M; ++m) {
        qgemv_rows(x.data() + m * K, 1, w, 0, N, one.data(), N, level);
        for (int64_t n = 0; n < N; ++n)
          ASSERT_EQ(all[size_t(m * N + n)], one[size_t(n)])
              << dtype_name(t) << " " << simd_level_name(level) << " at (" << m << ", " << n << ")";
      }
    }
  }
}

// qmatmul: the threaded GEMV (M <= kGemvMaxM) at every level and the tiled sgemm (larger M),
// with a bias, against the reference; levels agree with each other to the same tolerance.
TEST(QGemv, MatmulThreadedAndTiledWithBias) {
  LevelGuard guard;
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (DType t : {DType::Q4_1, DType::Q8_0, DType::Q4_0, DType::Q6_K, DType::Q4_K, DType::Q5_K,
                 DType::F16, DType::BF16}) {
    // several GEMV chunks and tiles
    const int64_t K = dtype_info(t).block_elems == 256 ? 512 : t == DType::F16 ? 579 : 576;
    const int64_t N = 1100;
    std::vector<uint8_t> data = random_matrix(t, N, K, rng);
    const QuantMatrix w{t, data.data(), N, K};
    std::vector<float> bias(static_cast<size_t>(N));
    for (float& b : bias) b = nd(rng);
    for (int64_t M : {int64_t(1), int64_t(3), kGemvMaxM, kGemvMaxM + 1, int64_t(37)}) {
      std::vector<float> x(size_t(M * K));
      for (float& v : x) v = nd(rng);
      const Ref ref = reference(w, x, M);
      for (SimdLevel level : levels()) {
        set_simd_level(level);
        std::vector<float> y(size_t(M * N), NAN);
        qmatmul(x.data(), w, bias.data(), y.data(), M);
        for (int64_t m = 0; m < M; ++m)
          for (int64_t n = 0; n < N; ++n) {
            const size_t i = size_t(m * N + n);
            // sgemm's own summation order: its error bound is the same form.
            ASSERT_NEAR(y[i], ref.y[i] + bias[size_t(n)], ref.tol[i] + 1e-6 * std::fabs(bias[size_t(n)]))
                << dtype_name(t) << " " << simd_level_name(level) << " M=" << M << " at (" << m
                << ", " << n << ")";
          }
      }
    }
  }
}

// The prefill path's SIMD tile dequantization gives the scalar dequantize's values: with one
// tile (N <= 16 rows: one thread, one sgemm call) qmatmul equals dequantize_serial + the same
// cblas_sgemm bit for bit, at every level.
TEST(QGemv, PrefillTilesDequantizeAsTheScalarCode) {
  LevelGuard guard;
  std::mt19937 rng(19);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (DType t : {DType::Q8_0, DType::Q4_0, DType::Q4_1, DType::Q4_K, DType::Q5_K, DType::Q6_K,
                 DType::F16, DType::BF16}) {
    // K-quants: three super-blocks; f16 / bf16: rows of an odd length (the tail after 8s).
    const bool half = t == DType::F16 || t == DType::BF16;
    const int64_t K = dtype_info(t).block_elems == 256 ? 768 : half ? 203 : 576;
    const int64_t N = 16, M = 37;
    std::vector<uint8_t> data = random_matrix(t, N, K, rng);
    const QuantMatrix w{t, data.data(), N, K};
    std::vector<float> x(size_t(M * K)), wf(size_t(N * K)), want(size_t(M * N));
    for (float& v : x) v = nd(rng);
    dequantize_serial(t, data.data(), wf.data(), N * K);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(M), int(N), int(K), 1.f, x.data(),
                int(K), wf.data(), int(K), 0.f, want.data(), int(N));
    for (SimdLevel level : levels()) {
      set_simd_level(level);
      std::vector<float> y(size_t(M * N), NAN);
      qmatmul(x.data(), w, nullptr, y.data(), M);
      EXPECT_EQ(std::memcmp(y.data(), want.data(), y.size() * sizeof(float)), 0)
          << dtype_name(t) << " " << simd_level_name(level);
    }
  }
}

TEST(QGemv, LevelsAndRows) {
  LevelGuard guard;
  EXPECT_EQ(set_simd_level(SimdLevel::Scalar), detected_simd_level());
  EXPECT_EQ(simd_level(), SimdLevel::Scalar);
  if (detected_simd_level() != SimdLevel::Avx512) {
    EXPECT_THROW(set_simd_level(SimdLevel::Avx512), Error);
  }
  std::printf("[qgemv] detected SIMD level: %s\n", simd_level_name(detected_simd_level()));
  // dequantize_row is dequantize of that row.
  std::mt19937 rng(3);
  std::vector<uint8_t> data = random_matrix(DType::Q8_0, 9, 64, rng);
  const QuantMatrix w{DType::Q8_0, data.data(), 9, 64};
  std::vector<float> a(64), b(64);
  dequantize_row(w, 5, a.data());
  dequantize_serial(DType::Q8_0, data.data() + 5 * 68, b.data(), 64);
  EXPECT_EQ(a, b);
  EXPECT_THROW(dequantize_row(w, 9, a.data()), Error);
  const QuantMatrix bad{DType::Q4_0, data.data(), 2, 48};
  EXPECT_THROW(qmatmul(a.data(), bad, nullptr, b.data(), 1), Error);
}

namespace {

std::vector<float> last_logits(CpuModel& m, PageTable& pt, const std::vector<int32_t>& toks) {
  std::vector<int64_t> row_of;
  std::vector<SeqInput> b = {{&pt, toks.data(), int64_t(toks.size()), false, nullptr}};
  const auto& lg = m.forward(b, row_of);
  return {lg.begin(), lg.begin() + m.config().vocab};
}

// Top-1 minus top-2 logit.
float top2_gap(const std::vector<float>& l) {
  float a = -INFINITY, b = -INFINITY;
  for (float v : l) {
    if (v > a) b = a, a = v;
    else if (v > b) b = v;
  }
  return a - b;
}

// Greedy decoding of three prompts, 40 steps each, natively and on the fp32 copy: the same
// tokens, or they part at a near-tie of the fp32 logits (top-2 gap under 0.05, reported); logits
// close. Returns the steps whose tokens were equal.
int greedy_native_vs_f32(const std::string& path, const ModelWeights& f32, const ModelWeights& nat) {
  auto tok = Tokenizer::load(path);
  const ModelConfig& c = f32.config;
  const int n = 40;
  int compared = 0;
  for (const std::string text :
       {"The capital of France is", "Once upon a time, in a small village by the sea,",
        "def fibonacci(n):"}) {
    std::vector<int32_t> prompt = tok->encode(text, true, true);
    KVPool kv_f({c.n_layers, c.n_kv_heads, c.head_dim, 16}, 16);
    KVPool kv_n({c.n_layers, c.n_kv_heads, c.head_dim, 16}, 16);
    CpuModel mf(f32, kv_f), mn(nat, kv_n);
    PageTable pf, pn;
    std::vector<float> lf = last_logits(mf, pf, prompt), ln = last_logits(mn, pn, prompt);
    for (int i = 0; i < n; ++i) {
      float max_diff = 0, max_abs = 0;
      for (int64_t v = 0; v < c.vocab; ++v) {
        max_diff = std::max(max_diff, std::fabs(lf[size_t(v)] - ln[size_t(v)]));
        max_abs = std::max(max_abs, std::fabs(lf[size_t(v)]));
      }
      EXPECT_LT(max_diff, 2e-3f * std::max(1.f, max_abs)) << "'" << text << "' step " << i;
      const int32_t tf = argmax(lf.data(), c.vocab), tn = argmax(ln.data(), c.vocab);
      if (tf != tn) {
        const float gap = top2_gap(lf);
        std::printf("[qgemv] '%s': tokens part at step %d (f32 %d, native %d), f32 top-2 gap %.5f\n",
                    text.c_str(), i, tf, tn, gap);
        EXPECT_LT(gap, 0.05f) << "native and f32 differ at step " << i << " of '" << text
                              << "' with a top-2 gap of " << gap;
        break;
      }
      ++compared;
      lf = last_logits(mf, pf, {tf});
      ln = last_logits(mn, pn, {tn});
    }
  }
  return compared;
}

}  // namespace

// Greedy decoding on SmolLM2 Q4_1 natively and on the fp32 copy: the same tokens, or they
// part at a near-tie of the fp32 logits (top-2 gap under 0.05, reported); logits close.
TEST(QGemvModel, SmolLM2NativeGreedyEqualsF32) {
  if (!std::ifstream(test::smollm2_path()).good())
    GTEST_SKIP() << test::kSmolLM2 << " not present; fetch it with `bash scripts/fetch_model.sh`";
  auto f32 = load_model(test::smollm2_path(), CpuWeights::F32);
  auto nat = load_model(test::smollm2_path(), CpuWeights::Auto);
  ASSERT_TRUE(nat->native());
  ASSERT_FALSE(f32->native());
  // No fp32 copy of a stored weight; the parameter count is the same.
  EXPECT_EQ(nat->tok_embeddings.numel(), 0);
  EXPECT_TRUE(nat->q_tok_embeddings);
  for (const LayerWeights& L : nat->layers) {
    EXPECT_EQ(L.wq.numel() + L.wk.numel() + L.wv.numel() + L.wo.numel() + L.w_gate.numel() +
                  L.w_up.numel() + L.w_down.numel(),
              0);
    EXPECT_EQ(L.qwq.dtype, DType::Q4_1);
  }
  EXPECT_EQ(nat->parameter_count(), f32->parameter_count());

  const int compared = greedy_native_vs_f32(test::smollm2_path(), *f32, *nat);
  std::printf("[qgemv] %d greedy tokens equal\n", compared);
  EXPECT_GE(compared, 3 * 40 / 2);
}

// The same on SmolLM2 GGUFs with K-quant, f16 and bf16 weights (llama-quantize
// --allow-requantize of the Q4_1 file; docs/results.md says how they were made), each skipped
// when models/ lacks it. Native is asked for (an f16 / bf16 file loads as fp32 by default); no
// layer weight keeps an fp32 copy, and ffn_down is stored in the types the test names.
TEST(QGemvModel, KQuantAndHalfGgufsNativeGreedyEqualsF32) {
  struct File {
    const char* name;
    std::vector<DType> down;  // the types ffn_down is stored in
  };
  const File files[] = {{"SmolLM2-135M-Instruct.Q4_K_M-q4_1.gguf", {DType::Q4_K, DType::Q6_K}},
                        {"SmolLM2-135M-Instruct.Q5_K_M-q4_1.gguf", {DType::Q5_K, DType::Q6_K}},
                        {"SmolLM2-135M-Instruct.Q6_K.gguf", {DType::Q6_K}},
                        {"SmolLM2-135M-Instruct.F16.gguf", {DType::F16}},
                        {"SmolLM2-135M-Instruct.BF16.gguf", {DType::BF16}}};
  int present = 0;
  for (const File& f : files) {
    const std::string path = test::source_dir() + "/models/" + f.name;
    if (!std::ifstream(path).good()) continue;
    ++present;
    auto f32 = load_model(path, CpuWeights::F32);
    auto nat = load_model(path, CpuWeights::Native);
    ASSERT_TRUE(nat->native()) << f.name;
    std::vector<DType> seen;
    for (const LayerWeights& L : nat->layers) {
      EXPECT_EQ(L.wq.numel() + L.wk.numel() + L.wv.numel() + L.wo.numel() + L.w_gate.numel() +
                    L.w_up.numel() + L.w_down.numel(),
                0)
          << f.name;
      if (std::find(seen.begin(), seen.end(), L.qw_down.dtype) == seen.end())
        seen.push_back(L.qw_down.dtype);
    }
    std::sort(seen.begin(), seen.end());
    std::vector<DType> want = f.down;
    std::sort(want.begin(), want.end());
    EXPECT_EQ(seen, want) << f.name;
    const int compared = greedy_native_vs_f32(path, *f32, *nat);
    std::printf("[qgemv] %s: %d greedy tokens equal\n", f.name, compared);
    EXPECT_GE(compared, 3 * 40 / 2) << f.name;
  }
  if (present == 0) GTEST_SKIP() << "no K-quant / f16 / bf16 SmolLM2 GGUF in models/";
}

namespace {

// stdout of a command (stderr dropped).
std::string run_stdout(const std::string& cmd) {
  std::string out;
  FILE* p = popen((cmd + " 2>/dev/null").c_str(), "r");
  if (!p) return out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  EXPECT_EQ(pclose(p), 0) << cmd;
  return out;
}

}  // namespace

// `spade generate` (next to this test binary) greedy on SmolLM2 Q4_1: the default (native)
// and --cpu-weights native print the text of --cpu-weights f32.
TEST(QGemvCli, GenerateNativeEqualsF32) {
  if (!std::ifstream(test::smollm2_path()).good())
    GTEST_SKIP() << test::kSmolLM2 << " not present; fetch it with `bash scripts/fetch_model.sh`";
  char self[4096] = {};
  const ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
  ASSERT_GT(len, 0);
  std::string dir(self, size_t(len));
  const std::string spade = dir.substr(0, dir.rfind('/')) + "/spade";
  if (!std::ifstream(spade).good()) GTEST_SKIP() << spade << " not built";
  for (const char* prompt : {"The capital of France is", "Write a haiku about the sea."}) {
    const std::string base = spade + " generate --model " + test::smollm2_path() +
                             " --chat --threads 1 -n 48 --prompt '" + prompt + "'";
    const std::string f32 = run_stdout(base + " --cpu-weights f32");
    ASSERT_FALSE(f32.empty());
    EXPECT_EQ(run_stdout(base + " --cpu-weights native"), f32) << prompt;
    EXPECT_EQ(run_stdout(base), f32) << prompt;
  }
}

// `spade generate` greedy on the K-quant / f16 / bf16 SmolLM2 GGUFs (each skipped when models/
// lacks it): --cpu-weights native prints the text of --cpu-weights f32.
TEST(QGemvCli, GenerateNativeEqualsF32OnKQuantAndHalfGgufs) {
  char self[4096] = {};
  const ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
  ASSERT_GT(len, 0);
  std::string dir(self, size_t(len));
  const std::string spade = dir.substr(0, dir.rfind('/')) + "/spade";
  if (!std::ifstream(spade).good()) GTEST_SKIP() << spade << " not built";
  int present = 0;
  for (const char* name :
       {"SmolLM2-135M-Instruct.Q4_K_M-q4_1.gguf", "SmolLM2-135M-Instruct.Q5_K_M-q4_1.gguf",
        "SmolLM2-135M-Instruct.Q6_K.gguf", "SmolLM2-135M-Instruct.F16.gguf",
        "SmolLM2-135M-Instruct.BF16.gguf"}) {
    const std::string path = test::source_dir() + "/models/" + name;
    if (!std::ifstream(path).good()) continue;
    ++present;
    for (const char* prompt : {"The capital of France is", "Write a haiku about the sea."}) {
      const std::string base = spade + " generate --model " + path +
                               " --chat --threads 1 -n 48 --prompt '" + prompt + "'";
      const std::string f32 = run_stdout(base + " --cpu-weights f32");
      ASSERT_FALSE(f32.empty()) << name;
      EXPECT_EQ(run_stdout(base + " --cpu-weights native"), f32) << name << ": " << prompt;
    }
  }
  if (present == 0) GTEST_SKIP() << "no K-quant / f16 / bf16 SmolLM2 GGUF in models/";
}
