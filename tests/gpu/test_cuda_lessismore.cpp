// LessIsMore on the GPU (issue 9): per-query-head score emission of the dense decode kernel
// (DecodeScores::per_head), the selector (lessismore_select: per-head top-k, rank merge,
// sinks, recency window) against the CPU's LessIsMoreMethod::on_scores on the same scores,
// and `--device cuda --sparse lessismore` inside CudaModel against the CPU session.
//
// Agreement measure (model): the selector must reproduce the CPU method exactly on the same
// scores, so at every selection layer the CPU method is run on the GPU's own per-head scores
// (returned through the trace) and its set must EQUAL the GPU's list; the CPU then attends
// over that set. The scores themselves are checked against the CPU's (largest |GPU - CPU|
// below 10% of the row's largest |score|, as in the TidalDecode test), and the logits must
// agree within kTolLogits = 5e-2 at every step (the dense comparison reaches 0.025).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>

#include "../test_util.h"
#include "backend/cuda/attention.h"
#include "backend/cuda/sparse_attention.h"
#include "gpu_model_util.h"
#include "gpu_util.h"
#include "tracing_lessismore.h"
#include "model/cpu_model.h"
#include "model/cuda_model.h"
#include "sparse/methods/lessismore.h"
#include "sparse/registry.h"
#include "sparse/session.h"

namespace spade::test {
namespace {

using cuda::bf16;

// The CPU method's set for one request from scores [Hq][L] (all of [0, L) when L <= budget,
// as select_scheduled makes it dense).
std::vector<int32_t> cpu_set(const sparse::LessIsMoreMethod& m, int64_t budget, int Hq, int Hkv,
                             int64_t L, const float* scores) {
  std::vector<int32_t> out;
  if (L <= budget) {
    for (int32_t j = 0; j < L; ++j) out.push_back(j);
    return out;
  }
  sparse::StepContext c;
  c.Hq = Hq, c.Hkv = Hkv, c.G = Hq / Hkv, c.L = L, c.step = 0;
  auto state = m.new_state();
  c.state = state.get();
  sparse::Selection unused;
  m.on_scores(c, unused, scores);
  const auto& set = static_cast<sparse::ScheduledSet&>(*state).set;
  EXPECT_EQ(set.kind, sparse::SelKind::Shared);
  out.assign(set.head(0), set.head(0) + set.count(0));
  return out;
}

// ---------------------------------------------------------------- selector

void check_selector(int Hq, int64_t budget, double ratio, int sinks, const std::vector<int>& lens,
                    float quantum, uint32_t seed) {
  SCOPED_TRACE(testing::Message() << "Hq=" << Hq << " budget=" << budget << " ratio=" << ratio
                                  << " sinks=" << sinks << " quantum=" << quantum);
  const int Hkv = 1, B = int(lens.size());
  sparse::LayerSchedule sched;
  const sparse::LessIsMoreMethod m(budget, ratio, sinks, sched);
  const int64_t n_recent = m.n_recent(), n_uni = budget - n_recent - sinks;
  int64_t ld = *std::max_element(lens.begin(), lens.end()) + 3;
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  // Coarse scores (multiples of `quantum`) make many exact ties: they must break by position
  // within a head and by head index in the merge, as on the CPU.
  std::vector<float> sc(size_t(B * Hq) * size_t(ld), NAN);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < Hq; ++h)
      for (int j = 0; j < lens[size_t(b)]; ++j) {
        float x = nd(rng) * 3.f;
        if (quantum > 0) x = std::round(x / quantum) * quantum;
        sc[(size_t(b) * Hq + h) * size_t(ld) + size_t(j)] = x;
      }
  DevBuf<float> dsc(sc), keys(size_t(B) * size_t(ld));
  DevBuf<int32_t> len(std::vector<int32_t>(lens.begin(), lens.end()));
  DevBuf<int32_t> row_n(size_t(B * Hq + B)), head_top(size_t(B * Hq) * size_t(n_uni)),
      merged(size_t(B) * size_t(n_uni)), off(size_t(B + 1)), idx(size_t(B) * size_t(budget));
  idx.poison();
  cuda::LessIsMoreArgs a;
  a.scores = dsc.p, a.ld = ld, a.kv_len = len.p, a.B = B, a.Hq = Hq;
  a.budget = int(budget), a.n_recent = int(n_recent), a.sinks = sinks, a.n_uni = int(n_uni);
  a.row_n = row_n.p, a.head_top = head_top.p, a.keys = keys.p, a.merged_top = merged.p;
  a.sel_off = off.p, a.sel_idx = idx.p;
  // Rows beyond topk_rows' cache take the two-stage top-k (128K contexts), as in CudaModel.
  const bool long_rows = cuda::topk_long_applies(ld, int(n_uni));
  DevBuf<unsigned char> scratch(long_rows ? cuda::topk_long_scratch_bytes(B * Hq, ld, int(n_uni)) : 1);
  if (long_rows) a.topk_scratch = scratch.p;
  cuda::lessismore_select(a, 0);
  const auto o = off.download(), ix = idx.download();
  for (int b = 0; b < B; ++b) {
    // on_scores reads [Hq][L] contiguous.
    std::vector<float> rows(size_t(Hq) * size_t(lens[size_t(b)]));
    for (int h = 0; h < Hq; ++h)
      std::copy_n(sc.data() + (size_t(b) * Hq + h) * size_t(ld), lens[size_t(b)],
                  rows.data() + size_t(h) * size_t(lens[size_t(b)]));
    const auto want = cpu_set(m, budget, Hq, Hkv, lens[size_t(b)], rows.data());
    std::vector<int32_t> got(ix.begin() + o[size_t(b)], ix.begin() + o[size_t(b) + 1]);
    EXPECT_EQ(got, want) << "request " << b << " L=" << lens[size_t(b)];
  }
}

TEST(CudaLessIsMore, SelectorMatchesCpuMethod) {
  SKIP_WITHOUT_GPU();
  check_selector(9, 64, 0.25, 4, {40, 64, 65, 300, 1000}, 0.f, 1);   // SmolLM2's 9 heads
  check_selector(9, 64, 0.25, 4, {500, 2000}, 0.5f, 2);              // heavy ties
  check_selector(32, 1024, 0.25, 4, {5000, 1025, 700}, 0.25f, 3);    // Llama-3's 32 heads
  check_selector(32, 4096, 0.25, 4, {40000, 9000}, 0.f, 4);          // n_uni 3068
  check_selector(4, 300, 0.f, 0, {301, 2000}, 1.f, 5);               // no window, no sinks
  check_selector(16, 8192 + 10, 0.f, 10, {30000}, 0.f, 6);           // n_uni = 8192 (limit)
  check_selector(8, 2048, 0.25, 4, {131000, 50000, 3000}, 0.25f, 7); // 128K rows: two-stage top-k
}

// ---------------------------------------------------------------- score emission

void check_head_scores(int Hq, int Hkv, int D, int P, const std::vector<int>& lens, int kernel,
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
  const int64_t ld = *std::max_element(lens.begin(), lens.end()) + 7;
  cuda::DeviceArena arena(128u << 20);
  cuda::AttnLimits lim;
  lim.max_batch = 8;
  lim.max_q_tokens = 64;
  lim.max_pages = 1 << 15;
  cuda::AttentionWorkspace ws(arena, lim, Hq, Hkv, D, P);
  DevBuf<bf16> dk(to_bf16(kh)), dv(to_bf16(vh)), dq(to_bf16(q)), o1(q.size()), o2(q.size());
  DevBuf<float> sc(size_t(lens.size() * Hq) * size_t(ld));
  sc.poison();
  std::vector<cuda::AttnSeq> batch;
  for (size_t i = 0; i < lens.size(); ++i)
    batch.push_back({pts[i].pages.data(), int(pts[i].pages.size()), lens[i], 1});
  ws.set_decode_kernel(kernel);
  ws.plan(batch, 0, force_split);
  ws.run(dq.p, dk.p, dv.p, o1.p, scale, 0);
  const cuda::DecodeScores ds{sc.p, ld, true};
  ws.run(dq.p, dk.p, dv.p, o2.p, scale, 0, {}, &ds);
  expect_same_decode_output(o1.download(), o2.download(), ws.draws_chunks(),
                            "emitting scores changed the attention output");
  const auto got = sc.download();
  for (size_t b = 0; b < lens.size(); ++b)
    for (int hq = 0; hq < Hq; ++hq) {
      double num = 0, den = 0;
      const float* qh = q.data() + (b * Hq + size_t(hq)) * D;
      for (int j = 0; j < lens[b]; ++j) {
        const float* k = kv.k_row(0, pts[b], j, hq / G);
        double dot = 0;
        for (int d = 0; d < D; ++d) dot += double(qh[d]) * k[d];
        const double r = dot * scale, x = got[(b * Hq + size_t(hq)) * size_t(ld) + size_t(j)];
        ASSERT_TRUE(std::isfinite(x)) << "score of token " << j << " head " << hq << " not written";
        num += (x - r) * (x - r), den += r * r;
      }
      EXPECT_LT(std::sqrt(num / std::max(den, 1e-30)), 1e-5) << "sequence " << b << " head " << hq;
    }
}

TEST(CudaLessIsMore, PerHeadScoresMatchCpu) {
  SKIP_WITHOUT_GPU();
  for (int kern = 1; kern < cuda::AttentionWorkspace::decode_kernel_count(); ++kern)
    if (cuda::AttentionWorkspace::decode_kernel_fits(kern, 128))
      check_head_scores(32, 8, 128, 16, {1, 17, 1000, 5000}, kern, 0, 1);
  check_head_scores(32, 8, 128, 16, {3000, 40},  // forced splits, a 4-warp ring that fits
                    cuda::AttentionWorkspace::decode_kernel_fits(2, 128) ? 2 : 6, 9, 2);
  check_head_scores(16, 1, 128, 32, {700}, 1, 0, 3);       // G = 16 (rows 8..15 too)
  check_head_scores(9, 3, 64, 7, {450, 33}, 1, 0, 4);      // SmolLM2's heads, odd pages
}

// ---------------------------------------------------------------- model

constexpr double kTolLogits = 5e-2;

void compare_model(int D, const std::string& spec, int na, int nb, int steps, int n_select) {
  SCOPED_TRACE(testing::Message() << "D=" << D << " " << spec);
  const ModelConfig c = tiny_config(Arch::Llama, D, 4, 2048);
  ModelWeights w = random_model(c, 78);
  round_weights_bf16(w);
  const sparse::SparseConfig sc = sparse::SparseConfig::parse_spec(spec);
  const CudaModelOptions opt = small_sparse_options(sc, c);
  ASSERT_EQ(opt.sparse.method, CudaSparse::Method::LessIsMore);
  CudaModel gpu(w, opt);
  CudaModel::QuestTrace trace;
  KVPool kv({c.n_layers, c.n_kv_heads, c.head_dim, 16}, 128);
  CpuModel cpu(w, kv);
  auto method = std::make_shared<TracingLessIsMore>(sparse::make_method(sc, c));
  sparse::SparseSession s0(method, c, kv), s1(method, c, kv);
  const double worst = traced_decode_compare(
      cpu, s0, s1, gpu, trace, na, nb, steps, kTolLogits, 7, [&](const PageTable* pc) {
        method->req_of = {{&pc[0], 0}, {&pc[1], 1}};
        method->gpu = &trace;
      });
  std::printf("[ lessismore-model ] D=%d %s: %d sets (step, selection layer, request), %d "
              "identical; largest score error %.3g of the row's max |score|; worst decode logits "
              "rel err %.3g over %d steps\n",
              D, spec.c_str(), method->sets, method->identical, method->max_rel_err, worst, steps);
  EXPECT_EQ(method->sets, steps * 2 * n_select);  // both requests sparse at every step
  EXPECT_EQ(method->identical, method->sets);
  EXPECT_LT(method->max_rel_err, 0.1);
}

TEST(CudaLessIsMore, ModelMatchesCpuSession) {
  SKIP_WITHOUT_GPU();
  compare_model(64, "lessismore:budget=48,dense_layers=1,selection_layers=1,3", 200, 90, 10, 2);
  compare_model(128, "lessismore:budget=64,recent_ratio=0.5,sinks=2,dense_layers=1,"
                     "selection_layers=1", 300, 120, 8, 1);
}

TEST(CudaLessIsMore, OptionsMapOrFailClearly) {
  const ModelConfig c = tiny_config(Arch::Llama, 64, 4, 2048);
  const CudaSparse t =
      cuda_sparse_config(sparse::SparseConfig::parse_spec("lessismore:budget=256"), c, 16);
  EXPECT_EQ(t.method, CudaSparse::Method::LessIsMore);
  EXPECT_EQ(t.budget, 256);
  EXPECT_EQ(t.recent, 64);
  EXPECT_EQ(t.sinks, 4);
  expect_cuda_config_error("lessismore:budget=40000,recent_ratio=0.1", "the GPU merge supports", c);
}

}  // namespace
}  // namespace spade::test
