// The NEON GEMV (src/backend/cpu/qgemv_neon.cpp) against dequantize-then-dot, built by
// scripts/check_neon.sh for aarch64 and run under qemu-aarch64: a self-contained test (no
// gtest, no model code) of the qgemv sources with what they need (core/thread_pool,
// io/dequant). The checks are those of tests/test_qgemv.cpp with the same generator, the same
// reference in double and the same tolerances, at every level this CPU runs (aarch64: Scalar
// and Neon): every stored type, odd shapes, sub-ranges of rows; a row's value independent of
// how many x rows run with it (here for every fused type: the NEON kernels promise it for all);
// qmatmul threaded and tiled with a bias; the prefill tiles bit for bit the scalar values; the
// levels this CPU accepts. cblas_sgemm is a plain loop defined here (no BLAS for aarch64 on the
// build machine); the prefill checks compare with that same function. Exit 0: every check
// passed; 1: a failure (each printed).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <cblas.h>

#include "backend/cpu/qgemv.h"
#include "core/error.h"
#include "core/half.h"
#include "io/dequant.h"

using namespace spade;
using namespace spade::cpu;

// C = alpha A B^T + beta C for the row-major, B-transposed calls qgemv.cpp makes.
extern "C" void cblas_sgemm(CBLAS_ORDER order, CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int M,
                            int N, int K, float alpha, const float* A, int lda, const float* B,
                            int ldb, float beta, float* C, int ldc) {
  if (order != CblasRowMajor || ta != CblasNoTrans || tb != CblasTrans) {
    std::fprintf(stderr, "cblas_sgemm stub: only RowMajor, NoTrans, Trans\n");
    std::abort();
  }
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      float s = 0;
      for (int k = 0; k < K; ++k) s += A[m * lda + k] * B[n * ldb + k];
      C[m * ldc + n] = alpha * s + (beta == 0.f ? 0.f : beta * C[m * ldc + n]);
    }
}

namespace {

int g_failures = 0, g_checks = 0;

#define CHECK_OR(cond, ...)                                       \
  do {                                                            \
    ++g_checks;                                                   \
    if (!(cond)) {                                                \
      ++g_failures;                                               \
      std::printf("FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      std::printf(__VA_ARGS__);                                   \
      std::printf("\n");                                          \
      return;                                                     \
    }                                                             \
  } while (0)

// tests/test_qgemv.cpp's generator: random codes, the f16 fields of each block finite (d in
// [0.002, 0.02], mins in [-0.1, 0.1]); f16 / bf16 / f32 values in [-1, 1].
std::vector<uint8_t> random_matrix(DType t, int64_t rows, int64_t cols, std::mt19937& rng) {
  const DTypeInfo& info = dtype_info(t);
  const size_t bytes = dtype_bytes(t, size_t(rows * cols));
  std::vector<uint8_t> out(bytes);
  std::uniform_int_distribution<int> byte(0, 255);
  for (auto& b : out) b = uint8_t(byte(rng));
  std::uniform_real_distribution<float> dd(0.002f, 0.02f), mm(-0.1f, 0.1f), ff(-1.f, 1.f);
  auto put16 = [&](uint8_t* p, uint16_t v) { std::memcpy(p, &v, 2); };
  if (t == DType::F32) {
    for (size_t i = 0; i < bytes / 4; ++i) {
      const float v = ff(rng);
      std::memcpy(out.data() + 4 * i, &v, 4);
    }
    return out;
  }
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
      default: std::printf("no generator for %s\n", dtype_name(t)); std::abort();
    }
  }
  return out;
}

struct Ref {
  std::vector<double> y, tol;  // [M, N]
};

// Dequantize each row, dot in double; tolerance 1e-5 sum|w x| + 1e-5 max|w| sum|x| + 1e-6
// (tests/test_qgemv.cpp says why).
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
  if (detected_simd_level() != SimdLevel::Scalar) l.push_back(detected_simd_level());
  if (detected_simd_level() == SimdLevel::Avx512) l.push_back(SimdLevel::Avx2);
  return l;
}

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
          // A sub-range writes only its rows, the values of the whole range.
          std::vector<float> part(size_t(M * N), -7.f);
          const int64_t n0 = N / 3, n1 = N - N / 4;
          qgemv_rows(x.data(), M, w, n0, n1, part.data(), N, level);
          for (int64_t m = 0; m < M; ++m)
            for (int64_t n = 0; n < N; ++n) {
              const size_t i = size_t(m * N + n);
              CHECK_OR(std::fabs(double(y[i]) - ref.y[i]) <= ref.tol[i],
                       "%s %s M=%lld N=%lld K=%lld at (%lld, %lld): %.9g, want %.9g +- %.3g",
                       dtype_name(t), simd_level_name(level), (long long)M, (long long)N,
                       (long long)K, (long long)m, (long long)n, double(y[i]), ref.y[i],
                       ref.tol[i]);
              if (n >= n0 && n < n1)
                CHECK_OR(part[i] == y[i], "%s %s: sub-range value differs", dtype_name(t),
                         simd_level_name(level));
              else
                CHECK_OR(part[i] == -7.f, "%s %s: row outside the range written",
                         dtype_name(t), simd_level_name(level));
            }
        }
      }
    }
}

// M = 7 (x rows taken 4 + 3) equals seven runs of M = 1 bit for bit, every fused type.
void row_value_independent_of_m() {
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (DType t : {DType::Q8_0, DType::Q4_0, DType::Q4_1, DType::Q4_K, DType::Q5_K, DType::Q6_K,
                  DType::F16, DType::BF16}) {
    const int64_t be = dtype_info(t).block_elems;
    const int64_t K = be == 256 ? 512 : be == 32 ? 352 : 203, N = 13, M = 7;
    std::vector<uint8_t> data = random_matrix(t, N, K, rng);
    const QuantMatrix w{t, data.data(), N, K};
    std::vector<float> x(size_t(M * K));
    for (float& v : x) v = nd(rng);
    for (SimdLevel level : levels()) {
      // The x86 Q8_0 / Q4_0 / Q4_1 kernels take a separate path for M = 1 (no promise there).
      if (be == 32 && level != SimdLevel::Neon) continue;
      std::vector<float> all(static_cast<size_t>(M * N)), one(static_cast<size_t>(N));
      qgemv_rows(x.data(), M, w, 0, N, all.data(), N, level);
      for (int64_t m = 0; m < M; ++m) {
        qgemv_rows(x.data() + m * K, 1, w, 0, N, one.data(), N, level);
        for (int64_t n = 0; n < N; ++n)
          CHECK_OR(all[size_t(m * N + n)] == one[size_t(n)], "%s %s at (%lld, %lld)",
                   dtype_name(t), simd_level_name(level), (long long)m, (long long)n);
      }
    }
  }
}

// qmatmul: the threaded GEMV (M <= kGemvMaxM) and the tiled sgemm (larger M), with a bias,
// against the reference, at every level; f32 (no fused kernel: decode a row, then a dot) too.
void matmul_threaded_and_tiled_with_bias() {
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.f, 1.f);
  const SimdLevel prev = simd_level();
  for (DType t : {DType::Q4_1, DType::Q8_0, DType::Q4_0, DType::Q6_K, DType::Q4_K, DType::Q5_K,
                  DType::F16, DType::BF16, DType::F32}) {
    const int64_t K = dtype_info(t).block_elems == 256 ? 512 : t == DType::F16 ? 579 : 576;
    const int64_t N = 300;
    std::vector<uint8_t> data = random_matrix(t, N, K, rng);
    const QuantMatrix w{t, data.data(), N, K};
    std::vector<float> bias(static_cast<size_t>(N));
    for (float& b : bias) b = nd(rng);
    for (int64_t M : {int64_t(1), int64_t(3), kGemvMaxM, kGemvMaxM + 1}) {
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
            const double want = ref.y[i] + bias[size_t(n)];
            const double tol = ref.tol[i] + 1e-6 * std::fabs(bias[size_t(n)]);
            CHECK_OR(std::fabs(double(y[i]) - want) <= tol,
                     "qmatmul %s %s M=%lld at (%lld, %lld): %.9g, want %.9g +- %.3g",
                     dtype_name(t), simd_level_name(level), (long long)M, (long long)m,
                     (long long)n, double(y[i]), want, tol);
          }
      }
    }
  }
  set_simd_level(prev);
}

// One prefill tile (N = 16 rows) equals dequantize_serial + the same sgemm bit for bit.
void prefill_tiles_dequantize_as_the_scalar_code() {
  std::mt19937 rng(19);
  std::normal_distribution<float> nd(0.f, 1.f);
  const SimdLevel prev = simd_level();
  for (DType t : {DType::Q8_0, DType::Q4_0, DType::Q4_1, DType::Q4_K, DType::Q5_K, DType::Q6_K,
                  DType::F16, DType::BF16}) {
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
      CHECK_OR(std::memcmp(y.data(), want.data(), y.size() * sizeof(float)) == 0, "%s %s",
               dtype_name(t), simd_level_name(level));
    }
  }
  set_simd_level(prev);
}

bool throws(SimdLevel l) {
  try {
    set_simd_level(l);
  } catch (const Error&) {
    return true;
  }
  return false;
}

void levels_accepted() {
  const SimdLevel d = detected_simd_level(), prev = simd_level();
  std::printf("[check_neon] detected SIMD level: %s\n", simd_level_name(d));
#if defined(__aarch64__)
  CHECK_OR(d == SimdLevel::Neon, "aarch64 detects %s, not neon", simd_level_name(d));
  CHECK_OR(throws(SimdLevel::Avx2) && throws(SimdLevel::Avx512), "an x86 level accepted");
#else
  CHECK_OR(throws(SimdLevel::Neon), "neon accepted off aarch64");
#endif
  CHECK_OR(!throws(SimdLevel::Scalar) && simd_level() == SimdLevel::Scalar, "scalar refused");
  CHECK_OR(!throws(d) && simd_level() == d, "the detected level refused");
  set_simd_level(prev);
}

}  // namespace

int main() {
  struct Case {
    const char* name;
    void (*run)();
  };
  const Case cases[] = {
      {"levels", levels_accepted},
      {"q8_0", [] { check_type(DType::Q8_0, {32, 96, 608}, {1, 7, 67}); }},
      {"q4_0", [] { check_type(DType::Q4_0, {32, 96, 608}, {1, 7, 67}); }},
      {"q4_1", [] { check_type(DType::Q4_1, {32, 96, 608}, {1, 7, 67}); }},
      {"q4_k", [] { check_type(DType::Q4_K, {256, 768, 4096}, {1, 5, 33}); }},
      {"q5_k", [] { check_type(DType::Q5_K, {256, 768, 4096}, {1, 5, 33}); }},
      {"q6_k", [] { check_type(DType::Q6_K, {256, 768, 4096}, {1, 5, 33}); }},
      {"f16", [] { check_type(DType::F16, {1, 17, 64, 200, 1003}, {1, 7, 67}); }},
      {"bf16", [] { check_type(DType::BF16, {1, 17, 64, 200, 1003}, {1, 7, 67}); }},
      {"f32 (unfused)", [] { check_type(DType::F32, {1, 7, 200, 1003}, {1, 7, 67}); }},
      {"row value independent of M", row_value_independent_of_m},
      {"qmatmul threaded and tiled with bias", matmul_threaded_and_tiled_with_bias},
      {"prefill tiles bit for bit", prefill_tiles_dequantize_as_the_scalar_code},
  };
  for (const Case& c : cases) {
    const int before = g_failures;
    try {
      c.run();
    } catch (const std::exception& e) {
      ++g_failures;
      std::printf("FAIL %s: exception: %s\n", c.name, e.what());
    }
    std::printf("[check_neon] %-40s %s\n", c.name, g_failures == before ? "ok" : "FAILED");
  }
  std::printf("[check_neon] %d checks, %d failed\n", g_checks, g_failures);
  return g_failures == 0 ? 0 : 1;
}
