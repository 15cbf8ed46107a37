// Twilight inside CudaModel (--device cuda --sparse twilight, base quest) on bf16-rounded
// random weights (the harness of test_cuda_sparse_model.cpp):
// - p = 1 with a Quest budget >= the context: every token is kept (the top-p threshold ends
//   at 0), so decode logits must match the dense GPU path within the forced-lists tolerance
//   of the sparse tests (1e-2: bf16 attention outputs, another split order). This checks the
//   wiring: INT4 keys written by qkv_post in prefill and decode, Quest lists on every decode
//   step, pruner, attention over the kept Token lists.
// - p = 0.9, Quest budget >= the context (so Quest keeps every page on both sides and the
//   selections cannot differ): GPU vs the CPU session running TwilightMethod, Qwen3 D = 128
//   (flat attention: the CPU keeps ~173 of ~177 tokens). The pruners' inputs differ (INT4 of
//   the GPU's bf16 keys and bf16 q vs the CPU's fp32 keys and q), so kept sets may differ at
//   the p boundary; there the boundary tokens carry ~1/170 of the mass each, so the logits
//   must stay within 5e-2 (the dense comparison's 3e-2 plus those tokens) at every one of 12
//   teacher-forced decode steps. Not a valid measure where attention is peaked: the first
//   device run also had Llama D = 64 (the CPU keeps ~26 of ~177 tokens, a boundary token
//   carries ~4% of a head's mass) and measured 0.075 there, as free-running Quest does
//   (test_cuda_sparse_model.cpp); that case needs the kept sets teacher-forced (not done).
// - Option checks: base other than quest, budget=auto, head_combine=mean are clear errors.
#include <algorithm>
#include <cstdio>
#include <tuple>

#include "../test_util.h"
#include "gpu_model_util.h"
#include "model/cpu_model.h"
#include "model/cuda_model.h"
#include "sparse/methods/twilight.h"
#include "sparse/registry.h"
#include "sparse/session.h"

namespace spade::test {
namespace {

CudaModelOptions tw_opts() {
  CudaModelOptions opt;
  opt.max_tokens = 1024;
  opt.max_batch = 4;
  opt.max_step_tokens = 512;
  opt.max_logit_rows = 64;
  return opt;
}

sparse::SparseConfig tw_spec(double p, int dense_layers) {
  sparse::SparseConfig sc;
  sc.method = "twilight";
  sc.set("base", "quest");
  sc.set("budget", "4096");
  sc.set("p", std::to_string(p));
  sc.set("dense_layers", std::to_string(dense_layers));
  return sc;
}

TEST(CudaTwilightModel, KeepAllEqualsDenseGpu) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = tiny_config(Arch::Llama, 128);
  ModelWeights w = random_model(c, 23);
  round_weights_bf16(w);
  CudaModel dense(w, tw_opts());
  CudaModelOptions os = tw_opts();
  os.sparse = cuda_sparse_config(tw_spec(1.0, 0), c, 16);
  ASSERT_EQ(os.sparse.method, CudaSparse::Method::Twilight);
  CudaModel tw(w, os);
  std::mt19937 rng(4);
  auto a = random_tokens(rng, 90, c.vocab), b = random_tokens(rng, 33, c.vocab);
  PageTable pd[2], ps[2];
  std::vector<int64_t> r1, r2;
  dense.forward({{&pd[0], a.data(), 90, false}, {&pd[1], b.data(), 33, false}}, r1);
  tw.forward({{&ps[0], a.data(), 90, false}, {&ps[1], b.data(), 33, false}}, r2);
  double worst = 0;
  for (int s = 0; s < 8; ++s) {
    int32_t ta = int32_t(rng() % uint32_t(c.vocab)), tb = int32_t(rng() % uint32_t(c.vocab));
    std::vector<float> ld = dense.forward({{&pd[0], &ta, 1, false}, {&pd[1], &tb, 1, false}}, r1);
    const auto& ls = tw.forward({{&ps[0], &ta, 1, false}, {&ps[1], &tb, 1, false}}, r2);
    const double e = rel_err(ls, ld);
    worst = std::max(worst, e);
    EXPECT_LT(e, 1e-2) << "step " << s;
  }
  std::printf("[ twilight-model ] p=1: worst logits rel err vs dense GPU %.3g\n", worst);
}

TEST(CudaTwilightModel, MatchesCpuSession) {
  SKIP_WITHOUT_GPU();
  for (auto [arch, D, dl] : {std::tuple{Arch::Qwen3, 128, 1}}) {
    SCOPED_TRACE(testing::Message() << "twilight " << arch_name(arch) << " D=" << D);
    const ModelConfig c = tiny_config(arch, D);
    ModelWeights w = random_model(c, 17);
    round_weights_bf16(w);
    KVPool kv({c.n_layers, c.n_kv_heads, c.head_dim, 16}, 128);
    CpuModel cpu(w, kv);
    const sparse::SparseConfig sc = tw_spec(0.9, dl);
    auto m = sparse::make_method(sc, c);
    sparse::SparseSession s0(m, c, kv), s1(m, c, kv);
    CudaModelOptions opt = tw_opts();
    opt.sparse = cuda_sparse_config(sc, c, 16);
    CudaModel gpu(w, opt);
    std::mt19937 rng(9);
    const int na = 170, nb = 60;
    auto a = random_tokens(rng, na, c.vocab), b = random_tokens(rng, nb, c.vocab);
    const double worst = compare_decode_with_cpu(cpu, s0, s1, gpu, a, b, 12, 5e-2, rng);
    const auto* st = sparse::twilight_stats(s0.state());
    std::printf("[ twilight-model ] %s D=%d p=0.9 dense_layers=%d: worst logits rel err vs CPU "
                "session %.3g over 12 decode steps (CPU mean kept %.1f of %.1f)\n",
                arch_name(arch), D, dl, worst, st ? st->mean_kept() : -1.0,
                st ? st->mean_base() : -1.0);
  }
}

TEST(CudaTwilightModel, UnsupportedOptionsAreClearErrors) {
  const ModelConfig c = tiny_config(Arch::Llama, 64);
  expect_cuda_config_error("twilight:base=full,budget=1024", "base=quest", c);
  expect_cuda_config_error("twilight", "explicit budget", c);
  expect_cuda_config_error("twilight:budget=1024,head_combine=mean", "head_combine=union", c);
  const CudaSparse t =
      cuda_sparse_config(sparse::SparseConfig::parse_spec("twilight:budget=1024,p=0.8"), c, 16);
  EXPECT_EQ(t.method, CudaSparse::Method::Twilight);
  EXPECT_EQ(t.budget, 1024);
  EXPECT_EQ(t.dense_layers, 2);  // the CPU method's default
  EXPECT_DOUBLE_EQ(t.twilight_p, 0.8);
}

}  // namespace
}  // namespace spade::test
