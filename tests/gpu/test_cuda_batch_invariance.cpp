// Batch invariance (CudaModelOptions::deterministic): a sequence's logits, bit for bit, do not
// depend on the other sequences of its steps -- how many, how long, which methods they run --
// for full attention and every GPU method. One sequence (a 300-token prompt, then teacher-forced
// decode steps) runs alone on a model whose own method is the one under test, and again on a
// model that keeps every method's page data, in steps with 0 to 7 other sequences of other
// lengths running the other methods. Prefill chunks run in steps of their own on both (the
// rule SchedulerOptions::isolate_prefill applies in a server); decode steps mix freely.
// What makes it hold: the decode GEMV for every projection (rows in groups of 8, per-row
// arithmetic independent of the group), fixed split counts and one kernel variant in the
// attention kernels, and the sparse kernel for every decode row of a selecting method.
#include <cctype>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gpu_model_util.h"
#include "model/cuda_model.h"
#include "sparse/options.h"

namespace spade::test {
namespace {

const std::vector<std::string>& invariance_specs() {
  static const std::vector<std::string> s = {
      "full",
      "streaming:budget=64",
      "quest:budget=64",
      "tidal:budget=64",
      "lessismore:budget=64",
      "lycheedecode:roles=RR/SR/RS/SS,budget=64",
      "oracle-topk:budget=64",
      "twilight:base=quest,budget=128",
      "lycheecluster:budget=64,dense_layers=1",
      "blasst",
      "quest+blasst:budget=64",
  };
  return s;
}

std::string text_of(int32_t id) { return "w" + std::to_string(id % 97) + (id % 7 == 0 ? ".\n" : " "); }

CudaModelOptions invariant_options(const ModelConfig& c, const std::string& own, bool any_method) {
  CudaModelOptions opt;
  opt.max_tokens = 8 * 1024;
  opt.max_batch = 8;
  opt.max_step_tokens = 1024;
  opt.max_logit_rows = 64;
  opt.deterministic = true;
  opt.any_method = any_method;
  opt.sparse = cuda_sparse_config(sparse::SparseConfig::parse_spec(own), c, 16);
  return opt;
}

struct Seq {
  PageTable pt;
  std::unique_ptr<sparse::MethodState> state;
  std::vector<int32_t> tokens;  // prompt, then the decode tokens fed
  int64_t fed = 0;
  void text(int64_t from, int64_t to) {
    if (state && state->wants_token_text())
      for (int64_t i = from; i < to; ++i) state->append_token_text(text_of(tokens[size_t(i)]));
  }
  SeqInput input(int64_t n) {
    text(fed, fed + n);
    SeqInput in{&pt, tokens.data() + fed, n, false, nullptr, state.get()};
    fed += n;
    return in;
  }
};

class CudaBatchInvariance : public testing::TestWithParam<std::string> {};

TEST_P(CudaBatchInvariance, LogitsDoNotDependOnTheBatch) {
  SKIP_WITHOUT_GPU();
  const std::string spec = GetParam();
  const ModelConfig c = tiny_config(Arch::Llama, 64, 4, 2048);
  ModelWeights w = random_model(c, 23);
  round_weights_bf16(w);
  const int kSteps = 12, kOthers = 7;
  std::mt19937 rng(41);
  const std::vector<int32_t> prompt = random_tokens(rng, 300, c.vocab);
  const std::vector<int32_t> fed = random_tokens(rng, kSteps, c.vocab);
  auto make_seq = [&](const std::vector<int32_t>& p, const std::vector<int32_t>& d) {
    auto s = std::make_unique<Seq>();
    s->tokens = p;
    s->tokens.insert(s->tokens.end(), d.begin(), d.end());
    return s;
  };
  const size_t V = size_t(c.vocab);
  std::vector<int64_t> rows;

  // Alone, on a model of its own method.
  std::vector<std::vector<float>> alone;
  {
    CudaModel m(w, invariant_options(c, spec, false));
    auto s = make_seq(prompt, fed);
    s->state = m.new_request_state();
    std::vector<float> lg = m.forward({s->input(int64_t(prompt.size()))}, rows);
    alone.push_back(lg);
    for (int k = 0; k < kSteps; ++k) alone.push_back(m.forward({s->input(1)}, rows));
    m.release(s->pt);
  }

  // In company: the other sequences run the other methods, their prompts prefilled alone first.
  CudaModel m(w, invariant_options(c, "full", true));
  const std::vector<std::string>& specs = invariance_specs();
  auto method_id = [&](const std::string& s) {
    if (s == "full") return 0;
    const sparse::SparseConfig sc = sparse::SparseConfig::parse_spec(s);
    return m.add_method(sc.to_string(), cuda_sparse_config(sc, c, 16));
  };
  std::vector<std::unique_ptr<Seq>> others;
  for (int o = 0; o < kOthers; ++o) {
    const int n = 120 + 97 * o;
    auto s = make_seq(random_tokens(rng, n, c.vocab), random_tokens(rng, kSteps, c.vocab));
    s->state = m.new_request_state(method_id(specs[size_t(o + 1) % specs.size()]));
    (void)m.forward({s->input(n)}, rows);
    others.push_back(std::move(s));
  }
  auto s = make_seq(prompt, fed);
  s->state = m.new_request_state(method_id(spec));
  {
    const std::vector<float>& lg = m.forward({s->input(int64_t(prompt.size()))}, rows);
    ASSERT_EQ(lg.size(), V);
    EXPECT_EQ(std::memcmp(lg.data(), alone[0].data(), V * sizeof(float)), 0) << spec << ": prefill";
  }
  for (int k = 0; k < kSteps; ++k) {
    // Step k: the sequence among k % 8 others, at position k % (n + 1).
    const int n = k % (kOthers + 1);
    std::vector<SeqInput> batch;
    for (int o = 0; o < n; ++o) batch.push_back(others[size_t(o)]->input(1));
    const size_t at = size_t(k % (n + 1));
    batch.insert(batch.begin() + long(at), s->input(1));
    const std::vector<float>& lg = m.forward(batch, rows);
    ASSERT_EQ(lg.size(), V * batch.size());
    EXPECT_EQ(std::memcmp(lg.data() + size_t(rows[at]) * V, alone[size_t(k + 1)].data(), V * sizeof(float)), 0)
        << spec << ": decode step " << k << " among " << n << " others";
  }
  // The others fed fewer tokens than they hold: their page tables still release every page.
  m.release(s->pt);
  for (auto& o : others) m.release(o->pt);
  EXPECT_EQ(m.free_pages(), m.total_pages());
}

INSTANTIATE_TEST_SUITE_P(Methods, CudaBatchInvariance, testing::ValuesIn(invariance_specs()),
                         [](const testing::TestParamInfo<std::string>& i) {
                           std::string n;
                           for (char ch : i.param) n += std::isalnum(static_cast<unsigned char>(ch)) ? ch : '_';
                           return n;
                         });

}  // namespace
}  // namespace spade::test
