// GPU method conformance: one suite parameterized over every row of the GPU registry
// (sparse/gpu/registry.h) and the stacks the GPU runs (quest+blasst; Twilight over every GPU
// selector: quest, full, tidal, lessismore, lycheecluster). A new GPU
// method without a spec here fails (GpuRegistryRowsHaveASpec). For each method, on a small
// random model (bf16-rounded weights: the CPU runs fp32 on the values the GPU holds):
//   - the CPU method and the GPU method build from the same spec, and the GPU description
//     names the method;
//   - two requests prefill together; the prefill is dense for every method, so its logits
//     agree with CpuModel's dense attention within 3e-2 (test_cuda_model.cpp's bound);
//   - N teacher-forced decode steps (the same random tokens on both), the GPU traced: every
//     traced selection list (every selector but streaming, whose lists the device writes from
//     the lengths) is well formed (strictly ascending, inside the context: token
//     positions < L, or Quest pages < ceil(L / 16)) and no longer than the method's budget;
//     for the methods whose selection is a function of the length alone (full, streaming;
//     not under Twilight, whose top-p sets depend on the data), the decode logits agree with
//     the CPU method's within 3e-2 at every step;
//   - the request states count the decode rows (positive, and NL * Hkv * L per step for full);
//   - every KV page returns to the pool.
// The CPU agreement of the data-dependent selections under each method's near-tie rule (which
// needs that method's own scores: Quest's page bounds, Tidal's group means, LycheeDecode's
// weights, Twilight's INT4 logits, ...) stays in the per-method tests (test_cuda_sparse_model,
// test_cuda_tidal, test_cuda_lessismore, test_cuda_lycheedecode, test_cuda_oracle,
// test_cuda_twilight_model, test_cuda_lycheecluster_model, test_cuda_blasst_model); batch
// invariance and the per-request path of every method: test_cuda_batch_invariance and
// test_cuda_mixed_methods; graph replays: test_cuda_sparse_graphs.
#include <algorithm>
#include <cctype>
#include <cstdio>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "../test_util.h"
#include "gpu_model_util.h"
#include "model/cpu_model.h"
#include "model/cuda_methods.h"
#include "model/cuda_model.h"
#include "sparse/gpu/registry.h"
#include "sparse/methods/twilight.h"  // split_stack
#include "sparse/registry.h"
#include "sparse/session.h"

namespace spade::test {
namespace {

constexpr double kTolDense = 3e-2;
constexpr int kSteps = 8;

// The conformance spec of each GPU registry row (small budgets: the 300-token prompts are
// sparse for every method), and the stacks.
const std::map<std::string, std::string>& conformance_specs() {
  static const std::map<std::string, std::string> s = {
      {"full", "full"},
      {"streaming", "streaming:budget=64,sinks=4"},
      {"quest", "quest:budget=64,dense_layers=1"},
      {"tidal", "tidal:budget=64"},
      {"lessismore", "lessismore:budget=64"},
      {"lycheedecode", "lycheedecode:roles=RR/SR/RS,budget=64"},
      {"oracle-topk", "oracle-topk:budget=64"},
      {"blasst", "blasst"},
      {"twilight", "twilight:base=quest,budget=128"},
      {"lycheecluster", "lycheecluster:budget=64,dense_layers=1"},
      {"quest+blasst", "quest+blasst:budget=64"},
      {"quest+twilight", "quest+twilight:budget=128"},
      // Twilight over the other GPU selectors (layer 2, and 1 where dense_layers=1, pruned).
      {"full+twilight", "full+twilight:dense_layers=1"},
      {"tidal+twilight", "tidal+twilight:budget=64,dense_layers=1,selection_layers=1"},
      {"lessismore+twilight", "twilight:base=lessismore,budget=64,dense_layers=1,selection_layers=1"},
      {"lycheecluster+twilight", "lycheecluster+twilight:budget=64,dense_layers=1"},
      {"oracle-topp", "oracle-topp:p=0.9"},
      // LycheeDecode's other selection modes and block sizes (issue 37 item 6).
      {"lycheedecode/topp", "lycheedecode:roles=RR/SR/RS,mode=topp,p=0.9,block=64"},
      {"lycheedecode/threshold", "lycheedecode:roles=RR/SR/RS,mode=threshold,tau=0.002"},
      {"lycheedecode/ratio", "lycheedecode:roles=RR/SR/RS,mode=ratio,ratio=0.2,block=16"},
  };
  return s;
}

std::vector<std::string> conformance_names() {
  std::vector<std::string> n;
  for (const GpuMethodRow& r : gpu_methods()) n.push_back(r.name);
  for (const char* s : {"quest+blasst", "quest+twilight", "full+twilight", "tidal+twilight",
                        "lessismore+twilight", "lycheecluster+twilight", "lycheedecode/topp",
                        "lycheedecode/threshold", "lycheedecode/ratio"})
    n.push_back(s);
  return n;
}

TEST(CudaMethodConformance, GpuRegistryRowsHaveASpec) {
  for (const GpuMethodRow& r : gpu_methods()) {
    EXPECT_TRUE(conformance_specs().count(r.name))
        << "GPU method '" << r.name << "' has no conformance spec";
    EXPECT_NO_THROW(sparse::find_method(r.name)) << r.name << ": not a CPU registry name";
    EXPECT_TRUE(has_cuda_path(r.name));
  }
}

std::string text_of(int32_t id) { return "w" + std::to_string(id % 97) + (id % 7 == 0 ? ".\n" : " "); }

class CudaMethodConformance : public testing::TestWithParam<std::string> {};

TEST_P(CudaMethodConformance, AgreesWithTheCpuAndReturnsItsPages) {
  SKIP_WITHOUT_GPU();
  const std::string name = GetParam();
  ASSERT_TRUE(conformance_specs().count(name)) << name;
  const std::string spec = conformance_specs().at(name);
  SCOPED_TRACE(spec);
  const ModelConfig c = tiny_config(Arch::Llama, 64);  // 3 layers, as test_cuda_sparse_model
  ModelWeights w = random_model(c, 91);
  round_weights_bf16(w);
  const sparse::SparseConfig sc = sparse::SparseConfig::parse_spec(spec);

  // The CPU: dense (prefill reference) and the method itself (the same spec).
  KVPool kv({c.n_layers, c.n_kv_heads, c.head_dim, 16}, 256);
  CpuModel cpu(w, kv);
  std::shared_ptr<const sparse::SparseMethod> method = sparse::make_method(sc, c);
  ASSERT_NE(method, nullptr);
  sparse::SparseSession s0(method, c, kv), s1(method, c, kv);

  // The GPU: a model built with the method (its own, method 0).
  CudaModelOptions opt;
  opt.max_tokens = 2048;
  opt.max_batch = 4;
  opt.max_step_tokens = 1024;
  opt.max_logit_rows = 64;
  opt.sparse = cuda_sparse_config(sc, c, 16);
  const std::string desc = opt.sparse.describe();
  EXPECT_FALSE(desc.empty());
  const std::string base = sparse::split_stack(sc.method).front();
  const bool twilight = spec.find("twilight") != std::string::npos;
  EXPECT_TRUE(desc.rfind(base, 0) == 0 || desc.rfind("blasst over [" + base, 0) == 0 ||
              (twilight && desc.rfind("twilight", 0) == 0))
      << desc;
  if (twilight) {
    EXPECT_TRUE(opt.sparse.twilight_any() && opt.sparse.needs_int4_keys()) << desc;
    const std::string over = spec.rfind("twilight:base=", 0) == 0
                                 ? spec.substr(14, spec.find(',') - 14)
                                 : base;
    EXPECT_NE(desc.find("over [" + over), std::string::npos) << desc;
  }
  CudaModel gpu(w, opt);
  const int64_t total = gpu.free_pages();
  CudaModel::QuestTrace trace;
  gpu.quest_trace = &trace;
  std::unique_ptr<sparse::MethodState> st[2] = {gpu.new_request_state(0), gpu.new_request_state(0)};

  std::mt19937 rng(41);
  const int n[2] = {300, 237};
  std::vector<int32_t> prompt[2] = {random_tokens(rng, n[0], c.vocab), random_tokens(rng, n[1], c.vocab)};
  auto text = [&](int r, const int32_t* ids, int64_t k) {
    if (st[r] && st[r]->wants_token_text())
      for (int64_t i = 0; i < k; ++i) st[r]->append_token_text(text_of(ids[i]));
  };
  // The CPU method runs where its selection is a function of the length alone (Twilight's
  // kept sets are not: test_cuda_twilight_model compares them with the CPU's).
  const bool length_only = (base == "full" || base == "streaming") && !twilight;
  PageTable pd[2], pc[2], pg[2];
  std::vector<int64_t> rd, rc, rg;
  {
    text(0, prompt[0].data(), n[0]);
    text(1, prompt[1].data(), n[1]);
    const std::vector<float> ld = cpu.forward({{&pd[0], prompt[0].data(), n[0], false},
                                              {&pd[1], prompt[1].data(), n[1], false}}, rd);
    if (length_only)
      cpu.forward({{&pc[0], prompt[0].data(), n[0], false, &s0.attention()},
                   {&pc[1], prompt[1].data(), n[1], false, &s1.attention()}}, rc);
    const std::vector<float> lg =
        gpu.forward({{&pg[0], prompt[0].data(), n[0], false, nullptr, st[0].get()},
                     {&pg[1], prompt[1].data(), n[1], false, nullptr, st[1].get()}}, rg);
    EXPECT_LT(rel_err(lg, ld), kTolDense) << "prefill vs the CPU's dense attention";
  }
  const int64_t budget = opt.sparse.budget;
  const bool pages = opt.sparse.quest_base();
  int64_t lists_seen = 0;
  double worst = 0;
  for (int s = 0; s < kSteps; ++s) {
    trace = {};
    int32_t t[2] = {int32_t(rng() % uint32_t(c.vocab)), int32_t(rng() % uint32_t(c.vocab))};
    text(0, &t[0], 1);
    text(1, &t[1], 1);
    const std::vector<float> lg = gpu.forward(
        {{&pg[0], &t[0], 1, false, nullptr, st[0].get()}, {&pg[1], &t[1], 1, false, nullptr, st[1].get()}},
        rg);
    if (length_only) {
      const std::vector<float> lc = cpu.forward(
          {{&pc[0], &t[0], 1, false, &s0.attention()}, {&pc[1], &t[1], 1, false, &s1.attention()}},
          rc);
      const double e = rel_err(lg, lc);
      worst = std::max(worst, e);
      EXPECT_LT(e, kTolDense) << "decode step " << s;
    }
    // Every traced list: strictly ascending, inside its request's context, within the budget.
    for (size_t l = 0; l < trace.sel.size(); ++l) {
      const auto& rows = trace.sel[l];
      if (rows.empty()) continue;
      ASSERT_EQ(rows.size() % 2, 0u) << "layer " << l;
      const size_t per_req = rows.size() / 2;
      for (size_t i = 0; i < rows.size(); ++i) {
        const int64_t L = pg[i / per_req].length;  // after the step: the context it read
        const int64_t bound = pages ? (L + 15) / 16 : L;
        const auto& v = rows[i];
        ++lists_seen;
        for (size_t j = 0; j < v.size(); ++j) {
          ASSERT_GE(v[j], 0) << "layer " << l << " list " << i;
          ASSERT_LT(v[j], bound) << "layer " << l << " list " << i;
          if (j) {
            ASSERT_LT(v[j - 1], v[j]) << "layer " << l << " list " << i << ": not ascending";
          }
        }
        if (budget > 0 && base != "lycheecluster") {  // lycheecluster adds its un-indexed tail
          EXPECT_LE(int64_t(v.size()), pages ? budget / 16 : budget) << "layer " << l << " list " << i;
        }
      }
    }
  }
  if (opt.sparse.selects() && !length_only) {
    EXPECT_GT(lists_seen, 0) << "no selection traced";
  }
  // Decode rows counted per request: full reads NL * Hkv * L per step.
  for (int r = 0; r < 2; ++r) {
    ASSERT_NE(st[r], nullptr);
    EXPECT_GT(st[r]->attended_rows(), 0);
    if (base == "full" && !opt.sparse.blasst_any()) {
      int64_t want = 0;
      for (int s = 0; s < kSteps; ++s) want += int64_t(c.n_layers) * c.n_kv_heads * (n[r] + s + 1);
      EXPECT_EQ(st[r]->attended_rows(), want);
    }
  }
  if (length_only)
    std::printf("[ conformance ] %-28s worst decode logits rel err %.3g over %d steps\n",
                spec.c_str(), worst, kSteps);
  else
    std::printf("[ conformance ] %-28s %lld traced lists well formed\n", spec.c_str(),
                static_cast<long long>(lists_seen));
  for (int r = 0; r < 2; ++r) {
    gpu.release(pg[r]);
    kv.release(pd[r]);
    kv.release(pc[r]);
  }
  EXPECT_EQ(gpu.free_pages(), total);
}

INSTANTIATE_TEST_SUITE_P(EveryGpuMethod, CudaMethodConformance,
                         testing::ValuesIn(conformance_names()),
                         [](const testing::TestParamInfo<std::string>& i) {
                           std::string s;
                           for (char ch : i.param) s += std::isalnum(static_cast<unsigned char>(ch)) ? ch : '_';
                           return s;
                         });

}  // namespace
}  // namespace spade::test
