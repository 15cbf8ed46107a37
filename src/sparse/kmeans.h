// Spherical k-means (Hornik et al. 2012) as LycheeCluster uses it (appendix A): points and
// centroids on the unit sphere, similarity = inner product, a fixed number of Lloyd
// iterations, deterministic seeding. docs/lycheecluster.md.
//
//   assign:  a_i = argmax_k x_i . c_k          (ties: the lowest k)
//   update:  c_k = normalize(sum_{a_i = k} x_i)
//   empty cluster after an update: re-seeded with the point that fits its own centroid
//     worst (lowest x_i . c_{a_i}; ties: the lowest i), each point at most once per round.
// Iterations stop early when no assignment changes (the result is then the same as running
// all of them). The assignment step is one sgemm per block of points.
#pragma once
#include <cstdint>
#include <vector>

namespace spade::sparse {

enum class KMeansSeeding {
  Stride,    // centroid k = point floor((k + 0.5) * N / K): spread over the sequence order
  PlusPlus,  // k-means++ on 1 - x.c with a fixed-seed splitmix64 stream (`seed`)
};

struct KMeansOptions {
  int iterations = 10;  // paper appendix A: 10
  KMeansSeeding seeding = KMeansSeeding::Stride;
  uint64_t seed = 0x5eed;  // PlusPlus only
};

struct KMeansResult {
  int K = 0;                       // clusters returned (the empty ones are dropped)
  std::vector<float> centroids;    // [K, D], unit norm (a zero sum stays zero)
  std::vector<int32_t> assign;     // [N] in [0, K)
  std::vector<int32_t> size;       // [K] points per cluster, each >= 1
  int iterations_run = 0;
};

// x: N unit-norm rows of D floats. K is clamped to [1, N]. N == 0 gives K == 0.
KMeansResult spherical_kmeans(const float* x, int64_t N, int D, int K, const KMeansOptions& opt);

// L2-normalizes v[0..D) in place; returns the original norm (a zero vector is left zero).
float l2_normalize(float* v, int D);

}  // namespace spade::sparse
