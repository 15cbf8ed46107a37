// TidalDecode on the GPU (issue 9): the dense decode kernel's group-mean score emission
// (attention.h DecodeScores) vs the CPU, and `--device cuda --sparse tidal` inside CudaModel
// vs the CPU's TidalMethod in a SparseSession.
//
// Agreement measure (model): the GPU ranks tokens by scores from bf16 keys and bf16
// activations, the CPU from fp32 ones, so sets may differ where two tokens' group-mean scores
// nearly tie at the k-th place. At every selection layer, request and KV head the GPU's set is
// compared with the CPU's: a differing token is accepted only as a near-tie, i.e. when its CPU
// score lies within 2 e of the CPU's k-th best score, e = the row's largest |GPU score - CPU
// score| (the GPU's scores come back through the trace): only then can the score error alone
// swap it across the boundary. Anything else fails. Where a layer differs only by near-ties,
// the CPU continues with the GPU's set (teacher-forced selection, so one near-tie does not
// cascade); the logits must then agree within kTolLogits = 5e-2 at every step (the dense
// random-model comparison reaches 0.025, test_cuda_model.cpp; attending 48-64 tokens per head
// in 3 of 4 layers measured up to 0.046). The rule is only meaningful while the score error is
// small: it must stay below 10% of the row's largest |score| (measured 4.9-5.5%), and
// near-ties may swap at most 10% of a set (measured 3.1-4.2%; 44-74% of the selections
// identical, the rest near-ties).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <set>

#include "../test_util.h"
#include "backend/cuda/attention.h"
#include "gpu_model_util.h"
#include "tracing_tidal.h"
#include "model/cpu_model.h"
#include "model/cuda_model.h"
#include "sparse/methods/tidal.h"
#include "sparse/registry.h"
#include "sparse/session.h"

namespace spade::test {
namespace {

using cuda::bf16;

// ---------------------------------------------------------------- score emission

void check_scores(int Hq, int Hkv, int D, int P, const std::vector<int>& lens, int kernel,
                  int force_split, uint32_t seed) {
  SCOPED_TRACE(testing::Message() << "Hq=" << Hq << " Hkv=" << Hkv << " D=" << D << " P=" << P
                                  << " kernel=" << kernel << " split=" << force_split);
  std::mt19937 rng(seed);
  RandomPagedCache cache(Hq, Hkv, D, P, lens, rng);
  const KVPool& kv = cache.kv;
  const std::vector<PageTable>& pts = cache.pts;
  const std::vector<float>&kh = cache.kh, &vh = cache.vh, &q = cache.q;
  const float scale = 1.f / std::sqrt(float(D));
  const int G = Hq / Hkv;
  int64_t ld = 0;
  for (int L : lens) ld = std::max<int64_t>(ld, L);
  ld += 5;  // a stride that is not the length
  cuda::DeviceArena arena(128u << 20);
  cuda::AttnLimits lim;
  lim.max_batch = 8;
  lim.max_q_tokens = 64;
  lim.max_pages = 1 << 15;
  cuda::AttentionWorkspace ws(arena, lim, Hq, Hkv, D, P);
  DevBuf<bf16> dk(to_bf16(kh)), dv(to_bf16(vh)), dq(to_bf16(q)), o1(q.size()), o2(q.size());
  DevBuf<float> sc(size_t(lens.size() * Hkv) * size_t(ld));
  SPADE_CUDA(cudaMemset(sc.p, 0xff, sizeof(float) * sc.n));  // NaN: unwritten slots show
  std::vector<cuda::AttnSeq> batch;
  for (size_t i = 0; i < lens.size(); ++i)
    batch.push_back({pts[i].pages.data(), int(pts[i].pages.size()), lens[i], 1});
  ws.set_decode_kernel(kernel);
  ws.plan(batch, 0, force_split);
  ws.run(dq.p, dk.p, dv.p, o1.p, scale, 0);
  const cuda::DecodeScores ds{sc.p, ld};
  ws.run(dq.p, dk.p, dv.p, o2.p, scale, 0, {}, &ds);
  expect_same_decode_output(o1.download(), o2.download(), ws.draws_chunks(),
                            "emitting scores changed the attention output");
  const auto got = sc.download();
  double worst = 0;
  for (size_t b = 0; b < lens.size(); ++b)
    for (int h = 0; h < Hkv; ++h) {
      std::vector<float> ref(size_t(lens[b]));
      double num = 0, den = 0;
      for (int j = 0; j < lens[b]; ++j) {
        const float* k = kv.k_row(0, pts[b], j, h);
        double s = 0;
        for (int g = 0; g < G; ++g) {
          const float* qg = q.data() + (b * Hq + size_t(h) * G + g) * D;
          double dot = 0;
          for (int d = 0; d < D; ++d) dot += double(qg[d]) * k[d];
          s += dot;
        }
        const double r = s * scale / G, x = got[(b * Hkv + h) * size_t(ld) + size_t(j)];
        ASSERT_TRUE(std::isfinite(x)) << "score of token " << j << " not written";
        num += (x - r) * (x - r), den += r * r;
      }
      const double e = std::sqrt(num / std::max(den, 1e-30));
      worst = std::max(worst, e);
      EXPECT_LT(e, 1e-5) << "sequence " << b << " head " << h;  // fp32 sums in another order
    }
  std::printf("[ tidal scores ] Hq=%d Hkv=%d D=%d kernel=%d splits=%d: worst rel err %.2g\n", Hq,
              Hkv, D, kernel, ws.n_split(), worst);
}

TEST(CudaTidal, DecodeScoresMatchCpu) {
  SKIP_WITHOUT_GPU();
  for (int kern = 1; kern < cuda::AttentionWorkspace::decode_kernel_count(); ++kern)
    if (cuda::AttentionWorkspace::decode_kernel_fits(kern, 128))
      check_scores(32, 8, 128, 16, {1, 17, 1000, 5000}, kern, 0, 1);
  check_scores(32, 8, 128, 16, {3000, 40},  // forced splits, a 4-warp ring that fits
               cuda::AttentionWorkspace::decode_kernel_fits(2, 128) ? 2 : 6, 9, 2);
  check_scores(16, 1, 128, 32, {700}, 1, 0, 3);       // G = 16
  check_scores(9, 3, 64, 7, {450, 33}, 1, 0, 4);      // SmolLM2's heads, odd pages
}

// ---------------------------------------------------------------- model

ModelConfig tidal_cfg(int D) { return tiny_config(Arch::Llama, D, 4, 2048); }

constexpr double kTolLogits = 5e-2;

void compare_tidal(int D, int budget, int na, int nb, int steps) {
  SCOPED_TRACE(testing::Message() << "tidal D=" << D << " budget=" << budget);
  const ModelConfig c = tidal_cfg(D);
  ModelWeights w = random_model(c, 77);
  round_weights_bf16(w);
  sparse::SparseConfig sc;
  sc.method = "tidal";
  sc.set("budget", std::to_string(budget));
  sc.set("dense_layers", "1");
  sc.set("selection_layers", "1,3");  // select at 1, reuse at 2, re-select at 3
  const CudaModelOptions opt = small_sparse_options(sc, c);
  ASSERT_EQ(opt.sparse.method, CudaSparse::Method::Tidal);
  CudaModel gpu(w, opt);
  CudaModel::QuestTrace trace;
  KVPool kv({c.n_layers, c.n_kv_heads, c.head_dim, 16}, 128);
  CpuModel cpu(w, kv);
  auto method = std::make_shared<TracingTidal>(budget, opt.sparse.schedule);
  sparse::SparseSession s0(method, c, kv), s1(method, c, kv);
  const double worst = traced_decode_compare(
      cpu, s0, s1, gpu, trace, na, nb, steps, kTolLogits, 6, [&](const PageTable* pc) {
        method->req_of = {{&pc[0], 0}, {&pc[1], 1}};
        method->gpu = &trace;
      });
  std::printf("[ tidal-model ] D=%d budget=%d: %d selections (step, selection layer, request, KV "
              "head), %d identical, %d near-tie, %d bad; largest score error %.3g (%.3g of the "
              "row's max |score|); at most %.1f%% of a set swapped; worst decode logits rel err "
              "%.3g over %d steps\n",
              D, budget, method->rows, method->identical, method->near_tie, method->bad,
              method->max_err, method->max_rel_err, 100 * method->max_diff_frac, worst, steps);
  EXPECT_EQ(method->bad, 0);
  EXPECT_GT(method->identical, 0);
  // The near-tie rule is only as strong as the score error is small. By the selection layers
  // the hidden states already differ like the dense comparison's logits (~2.5%), and q.k sums
  // cancel, so the error is bounded against the row's largest |score| (measured 4.9-5.5%);
  // near-ties may swap only a few boundary tokens of a set (measured at most 4.2%).
  EXPECT_LT(method->max_rel_err, 0.1);
  EXPECT_LE(method->max_diff_frac, 0.1);
  EXPECT_EQ(method->rows, steps * 2 * 2 * c.n_kv_heads);  // 2 selection layers, 2 requests
}

TEST(CudaTidal, ModelMatchesCpuSession) {
  SKIP_WITHOUT_GPU();
  compare_tidal(64, 48, 200, 90, 10);
  compare_tidal(128, 64, 300, 120, 8);
}

TEST(CudaTidal, OptionsMapOrFailClearly) {
  const ModelConfig c = tidal_cfg(64);
  const CudaSparse t = cuda_sparse_config(sparse::SparseConfig::parse_spec("tidal:budget=256"), c, 16);
  EXPECT_EQ(t.method, CudaSparse::Method::Tidal);
  EXPECT_EQ(t.budget, 256);
  EXPECT_FALSE(t.schedule.selection_layers.empty());
  expect_cuda_config_error("tidal:dense_layers=1,selection_layers=3",
                           "no selection layer at or above dense_layers=1 comes before", c);
}

}  // namespace
}  // namespace spade::test
