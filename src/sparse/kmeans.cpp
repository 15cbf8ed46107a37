#include "sparse/kmeans.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace spade::sparse {

namespace {

uint64_t splitmix64(uint64_t& s) {
  uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
double uniform01(uint64_t& s) { return double(splitmix64(s) >> 11) * (1.0 / 9007199254740992.0); }

float dot(const float* a, const float* b, int D) {
  float s = 0.f;
  for (int d = 0; d < D; ++d) s += a[d] * b[d];
  return s;
}

constexpr int64_t kBlock = 512;  // points per sgemm block

}  // namespace

float l2_normalize(float* v, int D) {
  double s = 0;
  for (int d = 0; d < D; ++d) s += double(v[d]) * v[d];
  const double n = std::sqrt(s);
  if (n > 0) {
    const float inv = float(1.0 / n);
    for (int d = 0; d < D; ++d) v[d] *= inv;
  }
  return float(n);
}

KMeansResult spherical_kmeans(const float* x, int64_t N, int D, int K, const KMeansOptions& opt) {
  KMeansResult r;
  if (N <= 0) return r;
  SPADE_CHECK(D > 0, "spherical_kmeans: D must be positive");
  K = int(std::clamp<int64_t>(K, 1, N));
  std::vector<float> C(size_t(K) * size_t(D));
  // Seeding.
  if (opt.seeding == KMeansSeeding::Stride) {
    for (int k = 0; k < K; ++k) {
      const int64_t i = int64_t((double(k) + 0.5) * double(N) / double(K));
      std::copy_n(x + std::min(i, N - 1) * D, D, C.data() + size_t(k) * D);
    }
  } else {
    uint64_t st = opt.seed;
    std::vector<double> dist(size_t(N), 2.0);  // 1 - max similarity to a chosen seed
    int64_t first = int64_t(splitmix64(st) % uint64_t(N));
    std::copy_n(x + first * D, D, C.data());
    for (int k = 1; k < K; ++k) {
      const float* c = C.data() + size_t(k - 1) * D;
      double total = 0;
      for (int64_t i = 0; i < N; ++i) {
        dist[size_t(i)] = std::min(dist[size_t(i)], std::max(0.0, 1.0 - double(dot(x + i * D, c, D))));
        total += dist[size_t(i)];
      }
      int64_t pick = 0;
      if (total > 0) {
        double u = uniform01(st) * total;
        for (pick = 0; pick < N - 1; ++pick) {
          u -= dist[size_t(pick)];
          if (u < 0) break;
        }
      } else {
        pick = int64_t(splitmix64(st) % uint64_t(N));
      }
      std::copy_n(x + pick * D, D, C.data() + size_t(k) * D);
    }
  }

  r.assign.assign(size_t(N), -1);
  std::vector<float> best_sim(static_cast<size_t>(N));
  std::vector<float> S(size_t(std::min(N, kBlock)) * size_t(K));
  std::vector<double> sum(size_t(K) * size_t(D));
  std::vector<int32_t> cnt(static_cast<size_t>(K));
  std::vector<uint8_t> used(static_cast<size_t>(N));
  auto assign_all = [&]() -> bool {
    bool changed = false;
    for (int64_t b0 = 0; b0 < N; b0 += kBlock) {
      const int64_t nb = std::min(kBlock, N - b0);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(nb), K, D, 1.f, x + b0 * D, D,
                  C.data(), D, 0.f, S.data(), K);
      for (int64_t i = 0; i < nb; ++i) {
        const float* row = S.data() + i * K;
        int best = 0;
        for (int k = 1; k < K; ++k)
          if (row[k] > row[best]) best = k;
        const size_t gi = size_t(b0 + i);
        if (r.assign[gi] != best) {
          r.assign[gi] = best;
          changed = true;
        }
        best_sim[gi] = row[best];
      }
    }
    return changed;
  };
  auto update = [&]() {
    std::fill(sum.begin(), sum.end(), 0.0);
    std::fill(cnt.begin(), cnt.end(), 0);
    for (int64_t i = 0; i < N; ++i) {
      const int a = r.assign[size_t(i)];
      ++cnt[size_t(a)];
      double* s = sum.data() + size_t(a) * D;
      const float* p = x + i * D;
      for (int d = 0; d < D; ++d) s[d] += p[d];
    }
    std::fill(used.begin(), used.end(), 0);
    for (int k = 0; k < K; ++k) {
      float* c = C.data() + size_t(k) * D;
      if (cnt[size_t(k)] > 0) {
        const double* s = sum.data() + size_t(k) * D;
        for (int d = 0; d < D; ++d) c[d] = float(s[d]);
        l2_normalize(c, D);
        continue;
      }
      // Empty: take the worst-fitting point not re-used yet in this round.
      int64_t worst = -1;
      for (int64_t i = 0; i < N; ++i)
        if (!used[size_t(i)] && (worst < 0 || best_sim[size_t(i)] < best_sim[size_t(worst)])) worst = i;
      if (worst < 0) continue;
      used[size_t(worst)] = 1;
      std::copy_n(x + worst * D, D, c);
    }
  };

  assign_all();
  int it = 0;
  for (; it < opt.iterations; ++it) {
    update();
    if (!assign_all()) {
      ++it;
      break;
    }
  }
  r.iterations_run = it;

  // Final centroids of the final assignment; drop empty clusters.
  std::fill(sum.begin(), sum.end(), 0.0);
  std::fill(cnt.begin(), cnt.end(), 0);
  for (int64_t i = 0; i < N; ++i) {
    const int a = r.assign[size_t(i)];
    ++cnt[size_t(a)];
    double* s = sum.data() + size_t(a) * D;
    for (int d = 0; d < D; ++d) s[d] += x[i * D + d];
  }
  std::vector<int32_t> remap(size_t(K), -1);
  for (int k = 0; k < K; ++k)
    if (cnt[size_t(k)] > 0) remap[size_t(k)] = r.K++;
  r.centroids.assign(size_t(r.K) * size_t(D), 0.f);
  r.size.assign(size_t(r.K), 0);
  for (int k = 0; k < K; ++k) {
    const int nk = remap[size_t(k)];
    if (nk < 0) continue;
    float* c = r.centroids.data() + size_t(nk) * D;
    for (int d = 0; d < D; ++d) c[d] = float(sum[size_t(k) * D + d]);
    l2_normalize(c, D);
    r.size[size_t(nk)] = cnt[size_t(k)];
  }
  for (auto& a : r.assign) a = remap[size_t(a)];
  return r;
}

}  // namespace spade::sparse
