// The paged KV pool's per-page key min/max (Quest metadata) and prefix forking, against
// brute force over the rows actually stored.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "kv/kv_pool.h"
#include "test_util.h"

using namespace spade;

namespace {

// Brute-force min/max of the written rows of one page: every slot of `pt` that holds a
// token (position < length) and lives in that page.
void brute_minmax(const KVPool& kv, int layer, const PageTable& pt, size_t page_index, int head,
                  std::vector<float>& mn, std::vector<float>& mx) {
  const int D = kv.layout().head_dim, P = kv.layout().page_size;
  mn.assign(size_t(D), INFINITY);
  mx.assign(size_t(D), -INFINITY);
  for (int64_t pos = int64_t(page_index) * P; pos < std::min<int64_t>(pt.length, (page_index + 1) * P); ++pos) {
    const float* k = kv.k_row(layer, pt, pos, head);
    for (int d = 0; d < D; ++d) {
      mn[size_t(d)] = std::min(mn[size_t(d)], k[d]);
      mx[size_t(d)] = std::max(mx[size_t(d)], k[d]);
    }
  }
}

void append(KVPool& kv, PageTable& pt, int64_t n, std::mt19937& rng) {
  const KVLayout& l = kv.layout();
  kv.reserve(pt, pt.length + n);
  std::vector<float> k(size_t(l.n_kv_heads * l.head_dim)), v(k.size());
  for (int64_t t = 0; t < n; ++t) {
    for (int layer = 0; layer < l.n_layers; ++layer) {
      test::fill_random(k.data(), k.size(), rng);
      test::fill_random(v.data(), v.size(), rng);
      kv.write(layer, pt, pt.length, k.data(), v.data());
    }
    ++pt.length;
  }
}

void expect_meta_exact(const KVPool& kv, const PageTable& pt, const std::string& what) {
  const KVLayout& l = kv.layout();
  std::vector<float> mn, mx;
  const size_t used = size_t((pt.length + l.page_size - 1) / l.page_size);
  for (int layer = 0; layer < l.n_layers; ++layer)
    for (size_t i = 0; i < used; ++i)
      for (int h = 0; h < l.n_kv_heads; ++h) {
        brute_minmax(kv, layer, pt, i, h, mn, mx);
        const float* a = kv.page_kmin(layer, pt.pages[i], h);
        const float* b = kv.page_kmax(layer, pt.pages[i], h);
        for (int d = 0; d < l.head_dim; ++d) {
          // Exact: min/max select stored values, no arithmetic.
          ASSERT_EQ(a[d], mn[size_t(d)]) << what << " layer " << layer << " page " << i << " head " << h;
          ASSERT_EQ(b[d], mx[size_t(d)]) << what << " layer " << layer << " page " << i << " head " << h;
        }
      }
}

}  // namespace

TEST(KVPoolMeta, MinMaxMatchesBruteForceThroughAppendsAndPageReuse) {
  KVPool kv({2, 3, 8, 5}, 40);
  std::mt19937 rng(7);
  PageTable a, b;
  // Interleaved appends of odd sizes (pages of both sequences alternate in the pool).
  for (int round = 0; round < 6; ++round) {
    append(kv, a, 1 + round * 3, rng);
    append(kv, b, 7 - round % 4, rng);
  }
  expect_meta_exact(kv, a, "a");
  expect_meta_exact(kv, b, "b");
  // Free a, then a new sequence takes a's old pages: their metadata must start fresh.
  kv.release(a);
  PageTable c;
  append(kv, c, 23, rng);
  expect_meta_exact(kv, c, "c (reused pages)");
  expect_meta_exact(kv, b, "b");
  // A reserved but unwritten page reads as empty: min +inf, max -inf.
  kv.reserve(c, c.length + 6);
  const int32_t fresh = c.pages.back();
  EXPECT_EQ(kv.page_kmin(1, fresh, 2)[0], INFINITY);
  EXPECT_EQ(kv.page_kmax(1, fresh, 2)[0], -INFINITY);
}

TEST(KVPoolFork, SharesFullPagesAndCopiesThePartialLastPage) {
  KVPool kv({2, 2, 4, 4}, 16);
  std::mt19937 rng(3);
  PageTable src;
  append(kv, src, 10, rng);  // pages 0,1 full, page 2 holds 2 tokens
  const int64_t used_before = kv.used_pages();
  PageTable f = kv.fork(src);
  EXPECT_EQ(f.length, 10);
  ASSERT_EQ(f.pages.size(), 3u);
  EXPECT_EQ(f.pages[0], src.pages[0]);
  EXPECT_EQ(f.pages[1], src.pages[1]);
  EXPECT_NE(f.pages[2], src.pages[2]);
  EXPECT_EQ(kv.refcount(src.pages[0]), 2);
  EXPECT_EQ(kv.refcount(f.pages[2]), 1);
  EXPECT_EQ(kv.used_pages(), used_before + 1);
  for (int layer = 0; layer < 2; ++layer)
    for (int64_t pos = 0; pos < 10; ++pos)
      for (int h = 0; h < 2; ++h)
        for (int d = 0; d < 4; ++d) {
          ASSERT_EQ(kv.k_row(layer, f, pos, h)[d], kv.k_row(layer, src, pos, h)[d]);
          ASSERT_EQ(kv.v_row(layer, f, pos, h)[d], kv.v_row(layer, src, pos, h)[d]);
        }
  expect_meta_exact(kv, f, "fork");
  // Both can append independently; the copies diverge, the shared prefix does not change.
  append(kv, f, 5, rng);
  append(kv, src, 3, rng);
  expect_meta_exact(kv, f, "fork after append");
  expect_meta_exact(kv, src, "source after append");
  EXPECT_NE(kv.k_row(0, f, 10, 0)[0], kv.k_row(0, src, 10, 0)[0]);
  // Writing into a shared page is refused.
  std::vector<float> row(8, 1.f);
  EXPECT_THROW(kv.write(0, f, 3, row.data(), row.data()), Error);
  kv.release(f);
  EXPECT_EQ(kv.refcount(src.pages[0]), 1);
  kv.release(src);
  EXPECT_EQ(kv.free_pages(), kv.n_pages());
}

TEST(KVPoolFork, PageAlignedForkSharesEveryPage) {
  KVPool kv({1, 1, 4, 4}, 8);
  std::mt19937 rng(5);
  PageTable src;
  append(kv, src, 8, rng);
  PageTable f = kv.fork(src);
  EXPECT_EQ(f.pages, src.pages);
  EXPECT_EQ(kv.used_pages(), 2);
  append(kv, f, 1, rng);  // goes to a new page
  EXPECT_EQ(kv.used_pages(), 3);
  kv.release(src);
  kv.release(f);
  EXPECT_EQ(kv.free_pages(), kv.n_pages());
}

TEST(KVPoolFork, NoFreePageForThePartialCopyIsAnError) {
  KVPool kv({1, 1, 4, 4}, 2);
  std::mt19937 rng(5);
  PageTable src;
  append(kv, src, 6, rng);
  EXPECT_THROW(kv.fork(src), Error);
  EXPECT_EQ(kv.used_pages(), 2);
}
