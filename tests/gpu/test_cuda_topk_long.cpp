// topk_rows_long (two-stage top-k for rows longer than topk_rows' shared-memory cache, 128K
// contexts) against a CPU reference: the k best of each row by score, ties to the lower
// position, ascending; rows with n <= k give all of [0, n). Heavy ties (coarse scores) test the
// tie rule across chunk boundaries.
#include <algorithm>
#include <numeric>

#include "../test_util.h"
#include "backend/cuda/sparse_attention.h"
#include "gpu_util.h"

namespace spade::test {
namespace {

std::vector<int32_t> cpu_topk(const float* x, int n, int k) {
  std::vector<int32_t> idx(static_cast<size_t>(n));
  std::iota(idx.begin(), idx.end(), 0);
  if (n <= k) return idx;
  std::stable_sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) { return x[a] > x[b]; });
  idx.resize(size_t(k));
  std::sort(idx.begin(), idx.end());
  return idx;
}

void check_long(const std::vector<int>& lens, int64_t ld, int k, float quantum, uint32_t seed) {
  SCOPED_TRACE(testing::Message() << "ld=" << ld << " k=" << k << " quantum=" << quantum);
  ASSERT_TRUE(cuda::topk_long_applies(ld, k));
  const int rows = int(lens.size());
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  std::vector<float> sc(size_t(rows) * size_t(ld), NAN);
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < lens[size_t(r)]; ++j) {
      float v = nd(rng) * 3.f;
      if (quantum > 0) v = std::round(v / quantum) * quantum;
      sc[size_t(r) * size_t(ld) + size_t(j)] = v;
    }
  DevBuf<float> d(sc);
  DevBuf<int32_t> n(std::vector<int32_t>(lens.begin(), lens.end())), out(size_t(rows) * size_t(k));
  DevBuf<unsigned char> scratch(cuda::topk_long_scratch_bytes(rows, ld, k));
  out.poison();
  cuda::topk_rows_long(d.p, ld, n.p, rows, k, out.p, scratch.p, 0);
  const auto got = out.download();
  for (int r = 0; r < rows; ++r) {
    const auto want = cpu_topk(sc.data() + size_t(r) * size_t(ld), lens[size_t(r)], k);
    const std::vector<int32_t> g(got.begin() + int64_t(r) * k, got.begin() + int64_t(r) * k + int64_t(want.size()));
    EXPECT_EQ(g, want) << "row " << r << " n=" << lens[size_t(r)];
  }
}

TEST(CudaTopkLong, MatchesCpuAcrossChunks) {
  SKIP_WITHOUT_GPU();
  const int64_t ld = 131088;  // Llama-3.1-8B: (131072 / 16 + 1) pages of 16
  check_long({131072, 50000, 30000, 100, 32769}, ld, 2048, 0.f, 1);
  check_long({131072, 65536, 2048}, ld, 2048, 0.25f, 2);  // ties across chunk boundaries
  check_long({131000, 40000}, ld, 64, 1.f, 3);            // few distinct values
  check_long({131072, 9000}, ld, 8192, 0.f, 4);           // 5 chunks x 8192 = 40960 candidates
  check_long({70000, 1}, 70001, 4096, 0.5f, 5);
}

}  // namespace
}  // namespace spade::test
