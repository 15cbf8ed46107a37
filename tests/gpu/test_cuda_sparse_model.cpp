// Sparse decode inside CudaModel (issue 9) vs CpuModel + sparse::SparseSession with the same
// method, on bf16-rounded random weights (the harness of test_cuda_model.cpp: the CPU runs fp32
// on the same bf16 weights, the GPU bf16 activations / KV cache with fp32 accumulation).
//
// Agreement measures:
// - streaming: the selection is a function of the length only, so every decode step's logits
//   must agree within the dense comparison's tolerance (rel err ||gpu - cpu|| / ||cpu|| < 3e-2).
// - quest: the GPU scores pages from bf16 keys (exact min/max of the bf16 cache) with the
//   CPU's summation order; the CPU from its fp32 keys and fp32 activations. Each decode step
//   runs on the GPU first (its selections traced); then, for every sparse layer, request and
//   KV head, the CPU's QuestMethod selection is compared with the GPU's: a differing page is
//   accepted only as a near-tie (its CPU score within kTie = 2% of the row's largest |score|
//   of the CPU's k-th best score); any other difference fails. Where a layer's heads differ
//   only by near-ties, the CPU then attends over the GPU's pages (teacher-forced selection),
//   so one near-tie does not cascade into later layers and steps; the logits must then agree
//   within the dense tolerance (< 3e-2) at EVERY step, and at least 75% of the (step, layer,
//   request, head) selections must be identical. (First device run without the substitution:
//   86-95% identical, all differences near-ties or cascades of one in an earlier layer; a
//   single near-tie moves a random model's logits by 0.1-0.5 relative, so free-running
//   logits are no measure here.)
// - budget >= context with lists forced (every list = the whole context, through the sparse
//   kernel): logits vs the dense GPU path within 1e-2 (bf16 attention outputs, another split
//   order); without forcing, such steps route to the dense kernel (bit-identical).
#include <algorithm>
#include <cstdio>
#include <map>
#include <set>
#include <tuple>

#include "../test_util.h"
#include "gpu_model_util.h"
#include "tracing_quest.h"
#include "model/cpu_model.h"
#include "model/cuda_methods.h"
#include "model/cuda_model.h"
#include "sparse/methods/quest.h"
#include "sparse/registry.h"
#include "sparse/session.h"

namespace spade::test {
namespace {

ModelConfig cfg_of(Arch arch, int D) { return tiny_config(arch, D); }

CudaModelOptions small_opts() {
  CudaModelOptions opt;
  opt.max_tokens = 1024;
  opt.max_batch = 4;
  opt.max_step_tokens = 512;
  opt.max_logit_rows = 64;
  return opt;
}

// Two requests (prompts na, nb tokens) prefilled together, then `steps` teacher-forced decode
// steps batched together, CPU (sessions) and GPU side by side.

void compare_quest(Arch arch, int D, int budget, int dense_layers, int na, int nb,
                         int steps) {
  SCOPED_TRACE(testing::Message() << "quest " << arch_name(arch) << " D=" << D
                                  << " budget=" << budget << " dense_layers=" << dense_layers);
  const ModelConfig c = cfg_of(arch, D);
  ModelWeights w = random_model(c, 91);
  round_weights_bf16(w);
  KVPool kv({c.n_layers, c.n_kv_heads, c.head_dim, 16}, 128);
  CpuModel cpu(w, kv);
  auto method = std::make_shared<TracingQuest>(budget, dense_layers);
  sparse::SparseSession s0(method, c, kv), s1(method, c, kv);
  sparse::SparseConfig sc;
  sc.method = "quest";
  sc.set("budget", std::to_string(budget));
  sc.set("dense_layers", std::to_string(dense_layers));
  CudaModelOptions opt = small_opts();
  opt.sparse = cuda_sparse_config(sc, c, 16);
  CudaModel gpu(w, opt);
  CudaModel::QuestTrace trace;
  gpu.quest_trace = &trace;
  PageTable pc[2], pg[2];
  method->req_of = {{&pc[0], 0}, {&pc[1], 1}};
  std::mt19937 rng(5);
  std::vector<int32_t> a = random_tokens(rng, na, c.vocab), b = random_tokens(rng, nb, c.vocab);
  std::vector<int64_t> rc, rg;
  {
    const auto& lc = cpu.forward({{&pc[0], a.data(), na, false, &s0.attention()},
                                  {&pc[1], b.data(), nb, false, &s1.attention()}}, rc);
    const auto& lg = gpu.forward({{&pg[0], a.data(), na, false}, {&pg[1], b.data(), nb, false}}, rg);
    EXPECT_LT(rel_err(lg, lc), 3e-2) << "prefill";
  }
  method->gpu = &trace;
  double worst = 0;
  for (int s = 0; s < steps; ++s) {
    trace.sel.clear();
    method->scores.clear();
    int32_t ta = int32_t(rng() % uint32_t(c.vocab)), tb = int32_t(rng() % uint32_t(c.vocab));
    std::vector<float> lg = gpu.forward({{&pg[0], &ta, 1, false}, {&pg[1], &tb, 1, false}}, rg);
    const auto& lc = cpu.forward({{&pc[0], &ta, 1, false, &s0.attention()},
                                  {&pc[1], &tb, 1, false, &s1.attention()}}, rc);
    ASSERT_EQ(lc.size(), lg.size());
    const double e = rel_err(lg, lc);
    worst = std::max(worst, e);
    EXPECT_LT(e, 3e-2) << "decode step " << s;
  }
  std::printf("[ quest-model ] %s D=%d budget=%d dense_layers=%d: %d selections (step, sparse "
              "layer, request, KV head), %d identical, %d near-tie, %d bad; worst decode logits "
              "rel err %.3g over %d steps\n",
              arch_name(arch), D, budget, dense_layers, method->rows, method->identical,
              method->near_tie, method->bad, worst, steps);
  EXPECT_EQ(method->bad, 0);
  EXPECT_GE(method->identical, int(0.75 * method->rows));
  EXPECT_GT(method->rows, 0);
}

TEST(CudaSparseModel, QuestMatchesCpuSession) {
  SKIP_WITHOUT_GPU();
  compare_quest(Arch::Llama, 64, 64, 1, 200, 120, 16);
  compare_quest(Arch::Qwen3, 128, 96, 0, 300, 70, 12);
  compare_quest(Arch::Qwen2, 64, 32, 2, 150, 40, 10);
}

TEST(CudaSparseModel, StreamingMatchesCpuSession) {
  SKIP_WITHOUT_GPU();
  for (auto [arch, D, budget, sinks, dl] :
       {std::tuple{Arch::Llama, 64, 64, 4, 0}, std::tuple{Arch::Qwen3, 128, 48, 2, 1}}) {
    SCOPED_TRACE(testing::Message() << "streaming " << arch_name(arch) << " D=" << D);
    const ModelConfig c = cfg_of(arch, D);
    ModelWeights w = random_model(c, 17);
    round_weights_bf16(w);
    KVPool kv({c.n_layers, c.n_kv_heads, c.head_dim, 16}, 128);
    CpuModel cpu(w, kv);
    sparse::SparseConfig sc;
    sc.method = "streaming";
    sc.set("budget", std::to_string(budget));
    sc.set("sinks", std::to_string(sinks));
    sc.set("dense_layers", std::to_string(dl));
    auto m = sparse::make_method(sc, c);
    sparse::SparseSession s0(m, c, kv), s1(m, c, kv);
    CudaModelOptions opt = small_opts();
    opt.sparse = cuda_sparse_config(sc, c, 16);
    CudaModel gpu(w, opt);
    std::mt19937 rng(9);
    // b starts below the budget and crosses it during decode (mixed dense / sparse lists).
    const int na = 170, nb = budget - 6;
    auto a = random_tokens(rng, na, c.vocab), b = random_tokens(rng, nb, c.vocab);
    const double worst = compare_decode_with_cpu(cpu, s0, s1, gpu, a, b, 14, 3e-2, rng);
    std::printf("[ streaming-model ] %s D=%d budget=%d sinks=%d dense_layers=%d: worst logits "
                "rel err %.3g over 14 decode steps\n",
                arch_name(arch), D, budget, sinks, dl, worst);
  }
}

// Budget >= context: every list is the whole context. Forced through the sparse kernel it
// matches the dense GPU path; unforced, the step takes the dense kernel (identical bits).
TEST(CudaSparseModel, FullBudgetEqualsDenseGpu) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = cfg_of(Arch::Llama, 128);
  ModelWeights w = random_model(c, 23);
  round_weights_bf16(w);
  for (const char* method : {"quest", "streaming"})
    for (bool force : {true, false}) {
      SCOPED_TRACE(testing::Message() << method << " force_lists=" << force);
      CudaModelOptions od = small_opts();
      CudaModel dense(w, od);
      sparse::SparseConfig sc;
      sc.method = method;
      sc.set("budget", "4096");
      sc.set("dense_layers", "0");
      CudaModelOptions os = small_opts();
      os.sparse = cuda_sparse_config(sc, c, 16);
      os.sparse.force_lists = force;
      CudaModel sp(w, os);
      std::mt19937 rng(4);
      auto a = random_tokens(rng, 90, c.vocab), b = random_tokens(rng, 33, c.vocab);
      PageTable pd[2], ps[2];
      std::vector<int64_t> r1, r2;
      dense.forward({{&pd[0], a.data(), 90, false}, {&pd[1], b.data(), 33, false}}, r1);
      sp.forward({{&ps[0], a.data(), 90, false}, {&ps[1], b.data(), 33, false}}, r2);
      double worst = 0;
      for (int s = 0; s < 8; ++s) {
        int32_t ta = int32_t(rng() % uint32_t(c.vocab)), tb = int32_t(rng() % uint32_t(c.vocab));
        std::vector<float> ld = dense.forward({{&pd[0], &ta, 1, false}, {&pd[1], &tb, 1, false}}, r1);
        const auto& ls = sp.forward({{&ps[0], &ta, 1, false}, {&ps[1], &tb, 1, false}}, r2);
        const double e = rel_err(ls, ld);
        worst = std::max(worst, e);
        if (force) EXPECT_LT(e, 1e-2) << "step " << s;
        else EXPECT_EQ(e, 0.0) << "step " << s;
      }
      std::printf("[ full-budget ] %s force_lists=%d: worst logits rel err vs dense GPU %.3g\n",
                  method, int(force), worst);
    }
}

TEST(CudaSparseModel, MethodsWithoutGpuPathAreClearErrors) {
  const ModelConfig c = cfg_of(Arch::Llama, 64);
  auto expect_error = [&](const std::string& spec, const char* what) {
    expect_cuda_config_error(spec, what, c);
  };
  // Every CPU method has a GPU path (oracle-topp since issue 37 item 6); the GPU refuses
  // options it cannot run, with the reason.
  EXPECT_EQ(cuda_sparse_config(sparse::SparseConfig::parse_spec("oracle-topp"), c, 16).method,
            CudaSparse::Method::OracleTopP);
  EXPECT_NE(cuda_method_list().find("oracle-topp"), std::string::npos);
  expect_error("quest:group=sum", "group=max");
  expect_error("quest:page_size=32", "page_size 16");
  expect_error("quest:budget=8", "budget");
  EXPECT_EQ(cuda_sparse_config(sparse::SparseConfig::parse_spec("full"), c, 16).method,
            CudaSparse::Method::None);
  const CudaSparse q = cuda_sparse_config(sparse::SparseConfig::parse_spec("quest"), c, 16);
  EXPECT_EQ(q.method, CudaSparse::Method::Quest);
  EXPECT_EQ(q.budget, 2048);  // the CPU method's defaults
  EXPECT_EQ(q.dense_layers, 2);
}

}  // namespace
}  // namespace spade::test
