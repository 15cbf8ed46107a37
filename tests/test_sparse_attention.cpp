// CPU attention over a sparse Selection: exact softmax over exactly the selected rows,
// against a naive double-precision computation written here.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "backend/cpu/attention.h"
#include "backend/cpu/qgemv.h"
#include "test_util.h"

using namespace spade;
using sparse::Selection;

namespace {

struct Cache {
  KVPool kv;
  PageTable pt;
  std::vector<float> K, V;  // [layer][pos][h][d] as written
  int layers, H, D;
  Cache(int layers_, int H_, int D_, int page, int64_t L, uint32_t seed)
      : kv({layers_, H_, D_, page}, (L + page - 1) / page + 2), layers(layers_), H(H_), D(D_) {
    std::mt19937 rng(seed);
    kv.reserve(pt, L);
    K.resize(size_t(layers * L * H * D));
    V.resize(K.size());
    test::fill_random(K.data(), K.size(), rng);
    test::fill_random(V.data(), V.size(), rng);
    for (int l = 0; l < layers; ++l)
      for (int64_t p = 0; p < L; ++p)
        kv.write(l, pt, p, &K[size_t(((l * L) + p) * H * D)], &V[size_t(((l * L) + p) * H * D)]);
    pt.length = L;
  }
  const float* k(int l, int64_t p, int h) const { return &K[size_t(((l * pt.length + p) * H + h) * D)]; }
  const float* v(int l, int64_t p, int h) const { return &V[size_t(((l * pt.length + p) * H + h) * D)]; }
};

// Naive attention of one query head over the listed positions.
std::vector<double> naive(const Cache& c, int layer, int h, const float* q, const std::vector<int32_t>& pos,
                          std::vector<double>* logits = nullptr) {
  const int D = c.D;
  std::vector<double> s(pos.size());
  double mx = -1e300;
  for (size_t i = 0; i < pos.size(); ++i) {
    double d = 0;
    for (int e = 0; e < D; ++e) d += double(q[e]) * c.k(layer, pos[i], h)[e];
    s[i] = d / std::sqrt(double(D));
    mx = std::max(mx, s[i]);
  }
  if (logits) *logits = s;
  double sum = 0;
  for (auto& x : s) sum += (x = std::exp(x - mx));
  std::vector<double> o(size_t(D), 0.0);
  for (size_t i = 0; i < pos.size(); ++i)
    for (int e = 0; e < D; ++e) o[size_t(e)] += s[i] / sum * c.v(layer, pos[i], h)[e];
  return o;
}

std::vector<int32_t> random_subset(int64_t L, int64_t n, std::mt19937& rng) {
  std::vector<int32_t> all(static_cast<size_t>(L));
  for (int64_t i = 0; i < L; ++i) all[size_t(i)] = int32_t(i);
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(size_t(n));
  std::sort(all.begin(), all.end());
  return all;
}

}  // namespace

TEST(SparseAttention, PerHeadAndSharedSelectionsEqualNaiveSoftmaxOverTheSelectedRows) {
  const int Hkv = 2, G = 3, Hq = Hkv * G, D = 16;
  const int64_t L = 157;
  Cache c(2, Hkv, D, 16, L, 11);
  std::mt19937 rng(12);
  auto q = test::random_vec(size_t(Hq * D), 13);
  cpu::AttentionScratch sc;
  std::vector<float> out(size_t(Hq * D)), logits;
  for (int trial = 0; trial < 4; ++trial) {
    const int layer = trial % 2;
    std::vector<std::vector<int32_t>> per(Hkv);
    Selection sel;
    if (trial < 2) {
      sel.begin_per_head(Hkv, L);
      for (int h = 0; h < Hkv; ++h) {
        // Head 0: random scattered rows; head 1: page-aligned runs (exercise run gathering).
        per[size_t(h)] = h == 0 ? random_subset(L, 1 + trial * 40, rng)
                                : std::vector<int32_t>{0, 1, 2, 3, 16, 17, 31, 32, 33, 100, 156};
        for (int32_t p : per[size_t(h)]) sel.push(p);
        sel.close_head();
      }
    } else {
      sel.begin_shared(Hkv, L);
      per[0] = random_subset(L, 20 + trial * 30, rng);
      for (int32_t p : per[0]) sel.push(p);
      sel.close_head();
      per[1] = per[0];
      logits.assign(size_t(Hq) * per[0].size(), 0.f);
    }
    sparse::validate(sel, Hkv, L);
    cpu::attention_selected(c.kv, layer, c.pt, q.data(), Hq, 1.f / std::sqrt(float(D)), sel,
                            out.data(), sc, trial >= 2 ? logits.data() : nullptr);
    for (int hq = 0; hq < Hq; ++hq) {
      const int h = hq / G;
      std::vector<double> lg;
      auto ref = naive(c, layer, h, q.data() + hq * D, per[size_t(h)], &lg);
      for (int e = 0; e < D; ++e)
        EXPECT_NEAR(out[size_t(hq * D + e)], ref[size_t(e)], 2e-5) << "trial " << trial << " head " << hq;
      if (trial >= 2) {
        for (size_t j = 0; j < lg.size(); ++j)
          EXPECT_NEAR(logits[hq * per[0].size() + j], lg[j], 2e-5);
      }
    }
  }
}

TEST(SparseAttention, DenseSelectionIsBitIdenticalToDenseDecodeAttention) {
  const int Hkv = 3, Hq = 9, D = 64;  // G = 3
  for (int64_t L : {1, 15, 16, 17, 300}) {
    Cache c(1, Hkv, D, 16, L, uint32_t(20 + L));
    auto q = test::random_vec(size_t(Hq * D), 21);
    cpu::AttentionScratch s1, s2;
    std::vector<float> a(size_t(Hq * D)), b(size_t(Hq * D));
    Selection sel;
    sel.set_dense(Hkv, L);
    const float scale = 1.f / 8.f;
    cpu::attention_selected(c.kv, 0, c.pt, q.data(), Hq, scale, sel, a.data(), s1);
    cpu::attention_dense(c.kv, 0, c.pt, q.data(), L - 1, 1, Hq, scale, b.data(), s2);
    EXPECT_EQ(a, b) << "L " << L;
    // Selecting every position explicitly gathers the same rows: also identical.
    Selection all;
    all.begin_shared(Hkv, L);
    for (int64_t p = 0; p < L; ++p) all.push(int32_t(p));
    all.close_head();
    cpu::attention_selected(c.kv, 0, c.pt, q.data(), Hq, scale, all, a.data(), s1);
    EXPECT_EQ(a, b) << "L " << L;
  }
}

TEST(SparseAttention, FullWeightsAreTheTrueSoftmax) {
  const int Hkv = 2, G = 2, Hq = 4, D = 8;
  const int64_t L = 70;
  Cache c(1, Hkv, D, 4, L, 31);
  auto q = test::random_vec(size_t(Hq * D), 32, 2.f);
  cpu::AttentionScratch sc;
  std::vector<float> w(size_t(Hq * L));
  cpu::attention_weights_full(c.kv, 0, c.pt, q.data(), Hq, 0.5f, L, w.data(), sc);
  for (int hq = 0; hq < Hq; ++hq) {
    std::vector<double> s(static_cast<size_t>(L));
    double mx = -1e300, sum = 0;
    for (int64_t j = 0; j < L; ++j) {
      double d = 0;
      for (int e = 0; e < D; ++e) d += double(q[size_t(hq * D + e)]) * c.k(0, j, hq / G)[e];
      mx = std::max(mx, s[size_t(j)] = 0.5 * d);
    }
    for (auto& x : s) sum += (x = std::exp(x - mx));
    for (int64_t j = 0; j < L; ++j) EXPECT_NEAR(w[size_t(hq * L + j)], s[size_t(j)] / sum, 1e-6);
  }
}

TEST(SparseAttention, RunGatherEqualsRowGather) {
  Cache c(1, 2, 8, 4, 50, 41);
  std::vector<int32_t> pos = {0, 1, 2, 3, 4, 5, 9, 10, 11, 12, 13, 30, 49};
  std::vector<float> k1(pos.size() * 8), v1(k1.size()), k2(k1.size()), v2(k1.size());
  for (int h = 0; h < 2; ++h) {
    cpu::gather_kv(c.kv, 0, c.pt, h, pos.data(), int64_t(pos.size()), k1.data(), v1.data());
    cpu::gather_kv_runs(c.kv, 0, c.pt, h, pos.data(), int64_t(pos.size()), k2.data(), v2.data());
    EXPECT_EQ(k1, k2);
    EXPECT_EQ(v1, v2);
  }
}

TEST(SparseAttention, MalformedSelectionsAreRejected) {
  Selection s;
  s.begin_per_head(2, 10);
  s.push(3);
  s.push(3);
  s.close_head();
  s.push(1);
  s.close_head();
  EXPECT_THROW(sparse::validate(s, 2, 10), Error);
  s.begin_shared(2, 10);
  s.push(10);
  s.close_head();
  EXPECT_THROW(sparse::validate(s, 2, 10), Error);
  s.begin_per_head(2, 10);
  s.push(0);
  s.close_head();
  EXPECT_THROW(sparse::validate(s, 2, 10), Error);  // one head missing
}

// Decode attention reads the paged cache in place in fixed chunks of kDecodeChunk rows that
// merge in order: long histories (many chunks, a partial last one, several pages per chunk,
// the chunks spread over the thread pool) still give the naive softmax, dense and listed
// selections alike, on both the AVX2 and the scalar kernel; a dense selection stays
// bit-identical to listing every position; D not a multiple of 8 takes the scalar kernel.
TEST(SparseAttention, LongHistoriesMergeChunksExactly) {
  for (int D : {64, 20}) {
    const int Hkv = 3, G = 3, Hq = Hkv * G;
    const int64_t L = 5 * cpu::kDecodeChunk + 37;
    Cache c(1, Hkv, D, 16, L, uint32_t(91 + D));
    std::mt19937 rng(92);
    std::vector<float> q(size_t(Hq * D));
    test::fill_random(q.data(), q.size(), rng);
    // Large scores: the chunks' maxima differ widely, so the merge's rescaling matters.
    for (float& x : q) x *= 4.f;
    const float scale = 1.f / std::sqrt(float(D));
    Selection dense;
    dense.set_dense(Hkv, L);
    Selection all;
    all.begin_shared(Hkv, L);
    for (int64_t p = 0; p < L; ++p) all.push(int32_t(p));
    all.close_head();
    Selection some;  // every third position
    std::vector<int32_t> thirds;
    for (int64_t p = 0; p < L; p += 3) thirds.push_back(int32_t(p));
    some.begin_shared(Hkv, L);
    for (int32_t p : thirds) some.push(p);
    some.close_head();
    std::vector<int32_t> every(static_cast<size_t>(L));
    for (int64_t p = 0; p < L; ++p) every[size_t(p)] = int32_t(p);
    cpu::AttentionScratch sc;
    std::vector<float> a(q.size()), b(q.size()), s(q.size());
    cpu::attention_selected(c.kv, 0, c.pt, q.data(), Hq, scale, dense, a.data(), sc);
    cpu::attention_selected(c.kv, 0, c.pt, q.data(), Hq, scale, all, b.data(), sc);
    EXPECT_EQ(a, b) << "D " << D;
    cpu::attention_selected(c.kv, 0, c.pt, q.data(), Hq, scale, some, s.data(), sc);
    for (int hq = 0; hq < Hq; ++hq) {
      const auto ref = naive(c, 0, hq / G, q.data() + hq * D, every);
      const auto ref3 = naive(c, 0, hq / G, q.data() + hq * D, thirds);
      for (int e = 0; e < D; ++e) {
        ASSERT_NEAR(a[size_t(hq * D + e)], ref[size_t(e)], 2e-5) << "D " << D << " head " << hq;
        ASSERT_NEAR(s[size_t(hq * D + e)], ref3[size_t(e)], 2e-5) << "D " << D << " head " << hq;
      }
    }
    // The scalar kernel (no AVX2) agrees with the naive result too.
    const cpu::SimdLevel prev = cpu::set_simd_level(cpu::SimdLevel::Scalar);
    std::vector<float> sa(q.size());
    cpu::attention_selected(c.kv, 0, c.pt, q.data(), Hq, scale, dense, sa.data(), sc);
    cpu::set_simd_level(prev);
    for (int hq = 0; hq < Hq; ++hq) {
      const auto ref = naive(c, 0, hq / G, q.data() + hq * D, every);
      for (int e = 0; e < D; ++e)
        ASSERT_NEAR(sa[size_t(hq * D + e)], ref[size_t(e)], 2e-5) << "scalar, D " << D;
    }
  }
}
