// topk_rows_long (two-stage top-k for rows longer than topk_rows' shared-memory cache, 128K
// contexts) against a CPU reference: the k best of each row by score, ties to the lower
// position, ascending; rows with n <= k give all of [0, n). Heavy ties (coarse scores) test the
// tie rule across chunk boundaries. The two-stage path applies where the chunks' candidates fit
// the second stage's shared-memory cache (topk_long_applies): every shape below on Hopper (227 KB
// per block); with less (A100 163 KB: chunks of ~32K, not k = 8192 at 128K; sm_86 / 89 99 KB:
// chunks of ~16K, k up to ~1.7K at 128K) the selectors take topk_rows over the whole row (keys
// past its cache read from global memory) where it does not apply, and the same shape then
// checks that; the shapes marked must_apply take the two-stage path on every supported GPU.
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

// must_apply: the two-stage path must take this shape on every supported GPU (its candidates
// fit the 99 KB of sm_86 / 89); else on Hopper only, and where it does not apply topk_rows, the
// selectors' fallback, is checked instead.
void check_long(const std::vector<int>& lens, int64_t ld, int k, float quantum, uint32_t seed,
                bool must_apply) {
  const bool two_stage = cuda::topk_long_applies(ld, k);
  SCOPED_TRACE(testing::Message() << "ld=" << ld << " k=" << k << " quantum=" << quantum
                                  << (two_stage ? " (two-stage)" : " (topk_rows)"));
  if (must_apply || cuda::smem_optin_bytes() >= (size_t(200) << 10)) {
    ASSERT_TRUE(two_stage);
  }
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
  out.poison();
  if (two_stage) {
    DevBuf<unsigned char> scratch(cuda::topk_long_scratch_bytes(rows, ld, k));
    cuda::topk_rows_long(d.p, ld, n.p, rows, k, out.p, scratch.p, 0);
    SPADE_CUDA(cudaDeviceSynchronize());
  } else {
    cuda::topk_rows(d.p, ld, n.p, rows, k, out.p, 0);
  }
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
  check_long({131072, 50000, 30000, 100, 32769}, ld, 2048, 0.f, 1, false);
  check_long({131072, 65536, 2048}, ld, 2048, 0.25f, 2, false);  // ties across chunk boundaries
  check_long({131000, 40000}, ld, 64, 1.f, 3, true);             // few distinct values
  check_long({131072, 9000}, ld, 8192, 0.f, 4, false);           // 5 chunks x 8192 = 40960 candidates
  // Ties across chunk boundaries, two-stage on every GPU: 5 chunks x 1024 (Hopper, A100) or 9.
  check_long({131072, 65537, 9000}, ld, 1024, 0.25f, 6, true);
  check_long({70000, 1}, 70001, 4096, 0.5f, 5, false);
}

}  // namespace
}  // namespace spade::test
