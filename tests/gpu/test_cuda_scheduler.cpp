// The continuous-batching scheduler over the GPU runner (CudaStepModel), against the same
// scheduler over the CPU runner with the same (bf16-rounded) random weights: 12 greedy
// requests of different prompt lengths, batch 4, a step budget of 64 tokens (so prompts are
// prefilled in chunks mixed with other requests' decode steps). Checked: every request ends
// with its full length, the GPU's pages all return, and the generated tokens agree with the
// CPU's (agreement = fraction of requests whose 12 tokens are identical; the GPU runs bf16
// activations, so a near-tie may flip: the bar is >= 10 of 12, and every request's first
// token where the CPU's top-2 margin exceeds 0.05).
#include <algorithm>
#include <chrono>
#include <random>

#include "../test_util.h"
#include "engine/sampler.h"
#include "engine/scheduler.h"
#include "gpu_util.h"
#include "model/cpu_model.h"
#include "model/cuda_step_model.h"
#include "sparse/registry.h"

namespace spade::test {
namespace {

using namespace std::chrono_literals;

class IdText : public TokenText {
  struct S : TextStream {
    std::string push(int32_t) override { return "t"; }
    std::string flush() override { return {}; }
  };

 public:
  std::unique_ptr<TextStream> stream(int32_t) const override { return std::make_unique<S>(); }
  std::string piece(int32_t) const override { return "t"; }
};

std::vector<std::vector<int32_t>> run(Scheduler& sched, const std::vector<std::vector<int32_t>>& prompts,
                                      int max_tokens) {
  std::vector<std::shared_ptr<RequestChannel>> chans;
  for (const auto& p : prompts) {
    EngineRequest r;
    r.prompt = p;
    r.max_tokens = max_tokens;
    r.sampling.temperature = 0;
    chans.push_back(sched.submit(std::move(r)));
  }
  std::vector<std::vector<int32_t>> out(prompts.size());
  for (size_t i = 0; i < chans.size(); ++i) {
    RequestDelta d;
    const auto end = std::chrono::steady_clock::now() + 120s;
    while (std::chrono::steady_clock::now() < end) {
      if (!chans[i]->wait_take(d, 20ms)) continue;
      out[i].insert(out[i].end(), d.tokens.begin(), d.tokens.end());
      if (d.finished) break;
    }
    EXPECT_TRUE(d.finished) << i;
    EXPECT_EQ(d.reason, FinishReason::Length) << i << " " << d.error;
  }
  EXPECT_TRUE(sched.wait_idle(10s));
  return out;
}

// n random prompts (seed), prompt i of base + (i * step) % span tokens.
std::vector<std::vector<int32_t>> random_prompts(uint32_t seed, int n, int base, int step, int span,
                                                 int vocab) {
  std::mt19937 rng(seed);
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < n; ++i) {
    std::vector<int32_t> p(size_t(base + (i * step) % span));
    for (auto& t : p) t = int32_t(rng() % uint32_t(vocab));
    prompts.push_back(std::move(p));
  }
  return prompts;
}

// Batch 4, steps of 64 tokens: prompts are prefilled in chunks mixed with decode steps.
SchedulerOptions batch4_options() {
  SchedulerOptions so;
  so.max_batch = 4;
  so.max_step_tokens = 64;
  return so;
}

// The tests' model: 3 layers, 8 query / 2 KV heads of 64, bf16-rounded random weights.
ModelWeights sched_model() {
  ModelConfig c;
  c.arch = Arch::Llama;
  c.n_layers = 3;
  c.hidden = 256;
  c.n_heads = 8;
  c.n_kv_heads = 2;
  c.head_dim = 64;
  c.ffn = 512;
  c.vocab = 1000;
  c.max_context = 4096;
  c.rope_theta = 10000.f;
  c.tie_embeddings = true;
  ModelWeights w = random_model(c, 91);
  for (HostTensor* t : {&w.tok_embeddings, &w.lm_head, &w.final_norm})
    for (auto& x : t->storage) x = round_bf16(x);
  for (auto& L : w.layers)
    for (HostTensor* t : {&L.attn_norm, &L.wq, &L.wk, &L.wv, &L.wo, &L.ffn_norm, &L.w_gate, &L.w_up, &L.w_down})
      for (auto& x : t->storage) x = round_bf16(x);
  return w;
}

TEST(CudaScheduler, BatchedGreedyAgreesWithTheCpuSchedulerAndReturnsEveryPage) {
  SKIP_WITHOUT_GPU();
  const ModelWeights w = sched_model();
  const ModelConfig& c = w.config;
  const auto prompts = random_prompts(5, 12, 5, 37, 150, c.vocab);
  const SchedulerOptions so = batch4_options();
  IdText text;
  const int N = 12;

  KVPool kv({c.n_layers, c.n_kv_heads, c.head_dim, 16}, 128);
  CpuModel cpu(w, kv);
  std::vector<std::vector<int32_t>> want;
  {
    Scheduler s(cpu, text, so);
    want = run(s, prompts, N);
  }
  // The CPU's first-token margins.
  std::vector<float> margin;
  for (const auto& p : prompts) {
    PageTable pt;
    std::vector<int64_t> row;
    const auto& lg = cpu.forward({{&pt, p.data(), int64_t(p.size()), false}}, row);
    std::vector<float> v(lg.begin(), lg.begin() + c.vocab);
    std::nth_element(v.begin(), v.begin() + 1, v.end(), std::greater<float>());
    margin.push_back(v[0] - v[1]);
    kv.release(pt);
  }

  CudaModelOptions opt;
  opt.kv_pages = 128;
  opt.max_batch = so.max_batch;
  opt.max_step_tokens = so.max_step_tokens;
  CudaModel gpu(w, opt);
  CudaStepModel step(gpu);
  std::vector<std::vector<int32_t>> got;
  {
    Scheduler s(step, text, so);
    got = run(s, prompts, N);
    EngineMetrics m = s.metrics();
    EXPECT_EQ(m.kv_pages_used, 0);
    EXPECT_EQ(m.kv_pages_total, 128);
    EXPECT_GT(m.batch_size.sum / double(m.batch_size.count), 1.0) << "requests were batched";
  }
  EXPECT_EQ(gpu.free_pages(), 128);
  int identical = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    ASSERT_EQ(got[i].size(), size_t(N)) << i;
    identical += got[i] == want[i];
    if (margin[i] > 0.05f) {
      EXPECT_EQ(got[i][0], want[i][0]) << "request " << i << " margin " << margin[i];
    }
  }
  std::printf("[ sched ] GPU scheduler vs CPU scheduler: %d of %zu requests identical over %d tokens\n",
              identical, prompts.size(), N);
  EXPECT_GE(identical, 10);
}

// LycheeCluster on the GPU under the scheduler (`spade serve --device cuda --sparse
// lycheecluster`): each admitted request gets the model's request state (token text fed by
// the scheduler, index slots), sequences past sink + budget build indexes and lazily update
// them while other requests prefill in chunks; every request finishes at its full length and
// every page and request slot comes back.
TEST(CudaScheduler, LycheeClusterRequestsRunToTheEndAndReturnTheirSlots) {
  SKIP_WITHOUT_GPU();
  const ModelWeights w = sched_model();
  const ModelConfig& c = w.config;
  const auto prompts = random_prompts(6, 10, 20, 53, 300, c.vocab);
  const SchedulerOptions so = batch4_options();
  IdText text;
  CudaModelOptions opt;
  opt.kv_pages = 160;
  opt.max_batch = so.max_batch;
  opt.max_step_tokens = so.max_step_tokens;
  opt.sparse = cuda_sparse_config(
      sparse::SparseConfig::parse_spec("lycheecluster:budget=32,buffer=16,dense_layers=1"), c, 16);
  CudaModel gpu(w, opt);
  CudaStepModel step(gpu);
  {
    Scheduler s(step, text, so);
    const auto got = run(s, prompts, 40);
    for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i].size(), 40u) << i;
    EXPECT_EQ(s.metrics().kv_pages_used, 0);
  }
  EXPECT_EQ(gpu.free_pages(), 160);
  std::vector<std::unique_ptr<sparse::MethodState>> st;
  for (int i = 0; i < so.max_batch; ++i) st.push_back(gpu.new_request_state());  // all free again
}

}  // namespace
}  // namespace spade::test
