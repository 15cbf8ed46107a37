#include "backend/cpu/ops.h"

#include <cblas.h>

#include <cmath>
#include <vector>

#include "core/error.h"
#include "core/thread_pool.h"

namespace spade::cpu {

void matmul(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t N,
            int64_t K) {
  if (M > 1) {
    // Output columns split over the pool (BLAS itself runs single-threaded).
    ThreadPool::global().parallel_for(N, 64, [&](int64_t n0, int64_t n1) {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(M), int(n1 - n0), int(K), 1.f, x,
                  int(K), w + n0 * K, int(K), 0.f, y + n0, int(N));
    });
    if (bias)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) y[m * N + n] += bias[n];
    return;
  }
  // Decode GEMV: memory-bound on W; split output rows across threads, 4 rows at a time.
  ThreadPool::global().parallel_for(N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const float* wr = w + n * K;
      float acc0 = 0, acc1 = 0, acc2 = 0, acc3 = 0;
      int64_t k = 0;
      for (; k + 4 <= K; k += 4) {
        acc0 += wr[k] * x[k];
        acc1 += wr[k + 1] * x[k + 1];
        acc2 += wr[k + 2] * x[k + 2];
        acc3 += wr[k + 3] * x[k + 3];
      }
      for (; k < K; ++k) acc0 += wr[k] * x[k];
      y[n] = (acc0 + acc1) + (acc2 + acc3) + (bias ? bias[n] : 0.f);
    }
  });
}

void rmsnorm(const float* x, const float* w, float eps, float* y, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    double ss = 0;
    for (int64_t i = 0; i < n; ++i) ss += double(xr[i]) * xr[i];
    float scale = float(1.0 / std::sqrt(ss / double(n) + double(eps)));
    float* yr = y + r * n;
    for (int64_t i = 0; i < n; ++i) yr[i] = xr[i] * scale * w[i];
  }
}

void rope_inv_freq(const ModelConfig& cfg, float* inv_freq) {
  const int D = cfg.head_dim;
  const double pi = 3.14159265358979323846;
  for (int i = 0; i < D / 2; ++i) {
    double f = 1.0 / std::pow(double(cfg.rope_theta), double(2 * i) / double(D));
    const RopeScaling& s = cfg.rope_scaling;
    if (s.llama3) {
      // Hugging Face _compute_llama3_parameters: long wavelengths divided by factor,
      // short ones kept, a smooth blend between.
      double low_wavelen = s.original_max_position / s.low_freq_factor;
      double high_wavelen = s.original_max_position / s.high_freq_factor;
      double wavelen = 2 * pi / f;
      if (wavelen > low_wavelen) {
        f = f / s.factor;
      } else if (wavelen >= high_wavelen) {
        double smooth = (s.original_max_position / wavelen - s.low_freq_factor) /
                        (s.high_freq_factor - s.low_freq_factor);
        f = (1 - smooth) * f / s.factor + smooth * f;
      }
    } else if (s.linear) {
      f = f / s.factor;
    }
    // llama.cpp's GGUF stores Llama-3.1 scaling as per-frequency divisors (rope_freqs).
    if (!s.freq_factors.empty()) f /= double(s.freq_factors[size_t(i)]);
    inv_freq[i] = float(f);
  }
}

void rope(float* x, const int32_t* pos, const float* inv_freq, int64_t T, int64_t H, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      // Angle in fp32 as transformers computes it (inv_freq fp32 * position fp32).
      float ang = float(pos[t]) * inv_freq[i];
      float c = std::cos(ang), s = std::sin(ang);
      for (int64_t h = 0; h < H; ++h) {
        float* v = x + (t * H + h) * D;
        float a = v[i], b = v[i + half];
        v[i] = a * c - b * s;
        v[i + half] = b * c + a * s;
      }
    }
  }
}

void swiglu(const float* gate, const float* up, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    float g = gate[i];
    out[i] = g / (1.f + std::exp(-g)) * up[i];
  }
}

void add_inplace(float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] += y[i];
}

void embedding(const float* table, const int32_t* ids, float* out, int64_t T, int64_t hidden,
               int64_t vocab) {
  for (int64_t t = 0; t < T; ++t) {
    SPADE_CHECK(ids[t] >= 0 && ids[t] < vocab, "token id ", ids[t], " outside the vocabulary (",
                vocab, " tokens)");
    const float* src = table + int64_t(ids[t]) * hidden;
    std::copy(src, src + hidden, out + t * hidden);
  }
}

}  // namespace spade::cpu
