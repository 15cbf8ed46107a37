// A step that mixes one request's prefill chunk with another's decode (the scheduler's chunked
// prefill): the decoding request of a sparse method attends sparsely, as it would alone and as
// the CPU decides per request. A method group is sparse only when all its rows decode, so the
// model moves the prefill rows to its full-attention method (CudaModel::route_prefill_rows);
// before, the decode row of such a step attended the whole context.
#include <random>

#include "../test_util.h"
#include "gpu_model_util.h"
#include "model/cuda_model.h"
#include "sparse/gpu/method.h"
#include "sparse/registry.h"

namespace spade::test {
namespace {

int64_t attended(const std::unique_ptr<sparse::MethodState>& s) {
  return dynamic_cast<const GpuRequestState&>(*s).attended;
}

void check_routing(const std::string& spec, bool graphs) {
  SCOPED_TRACE(spec + (graphs ? " (graphs)" : " (eager)"));
  const ModelConfig c = tiny_config(Arch::Llama, 64, 4, 2048);
  ModelWeights w = random_model(c, 91);
  round_weights_bf16(w);
  CudaModelOptions opt = small_sparse_options(sparse::SparseConfig::parse_spec(spec), c);
  opt.cuda_graphs = graphs;
  // Twins: m1 decodes request A alone, m2 decodes A while B prefills, at the same length.
  CudaModel m1(w, opt), m2(w, opt);
  std::mt19937 rng(5);
  const int na = 300, nb = 64;
  const auto a = random_tokens(rng, na, c.vocab), b = random_tokens(rng, nb, c.vocab);
  auto s1 = m1.new_request_state(0), s2 = m2.new_request_state(0), sb = m2.new_request_state(0);
  PageTable p1, p2, pb;
  std::vector<int64_t> rows;
  m1.forward({{&p1, a.data(), na, false, nullptr, s1.get()}}, rows);
  m2.forward({{&p2, a.data(), na, false, nullptr, s2.get()}}, rows);
  int32_t ta = 7;
  m1.forward({{&p1, &ta, 1, false, nullptr, s1.get()}}, rows);
  const int64_t alone = attended(s1);
  m2.forward({{&pb, b.data(), nb, false, nullptr, sb.get()}, {&p2, &ta, 1, false, nullptr, s2.get()}},
             rows);
  const int64_t mixed = attended(s2);
  const int64_t dense = int64_t(c.n_layers) * c.n_kv_heads * (na + 1);
  ASSERT_GT(alone, 0);
  ASSERT_LT(alone, dense) << "the method attends densely at this length even alone";
  EXPECT_EQ(mixed, alone) << "the decode row of a step with a prefill chunk attended " << mixed
                          << " rows (alone: " << alone << ", dense: " << dense << ")";
  EXPECT_EQ(attended(sb), 0) << "a prefill chunk counts no decode rows";
  // Then both decode in one step: B, now a decoding request of its own method, attends too.
  int32_t tb = 9;
  m2.forward({{&p2, &ta, 1, false, nullptr, s2.get()}, {&pb, &tb, 1, false, nullptr, sb.get()}}, rows);
  EXPECT_GT(attended(sb), 0);
  for (PageTable* p : {&p1}) m1.release(*p);
  for (PageTable* p : {&p2, &pb}) m2.release(*p);
}

TEST(CudaPrefillRouting, DecodeRowsStaySparseBesidePrefillChunks) {
  SKIP_WITHOUT_GPU();
  for (bool graphs : {false, true}) {
    check_routing("quest:budget=32,dense_layers=0", graphs);
    check_routing("streaming:budget=64", graphs);
    check_routing("tidal:budget=48", graphs);
  }
}

// The logits of the decode row beside the prefill chunk equal those of the same decode step
// run alone on a twin model, up to the projections' batch shape (GEMV vs GEMM): a decode row
// attended densely would differ by far more at this budget.
TEST(CudaPrefillRouting, DecodeLogitsBesidePrefillMatchTheStepAlone) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = tiny_config(Arch::Llama, 64, 4, 2048);
  ModelWeights w = random_model(c, 92);
  round_weights_bf16(w);
  const CudaModelOptions opt = small_sparse_options(sparse::SparseConfig::parse_spec("quest:budget=32,dense_layers=0"), c);
  CudaModel m1(w, opt), m2(w, opt);
  CudaModelOptions dense_opt = opt;
  dense_opt.sparse = cuda_sparse_config(sparse::SparseConfig::parse_spec("full"), c, 16);
  CudaModel md(w, dense_opt);
  std::mt19937 rng(6);
  const int na = 300, nb = 64;
  const auto a = random_tokens(rng, na, c.vocab), b = random_tokens(rng, nb, c.vocab);
  auto s1 = m1.new_request_state(), s2 = m2.new_request_state(), s2b = m2.new_request_state();
  PageTable p1, p2, p2b, pd;
  std::vector<int64_t> r1, r2, rd;
  m1.forward({{&p1, a.data(), na, false, nullptr, s1.get()}}, r1);
  m2.forward({{&p2, a.data(), na, false, nullptr, s2.get()}}, r2);
  md.forward({{&pd, a.data(), na, false, nullptr, nullptr}}, rd);
  int32_t t = 11;
  const std::vector<float> alone = m1.forward({{&p1, &t, 1, false, nullptr, s1.get()}}, r1);
  const std::vector<float> full = md.forward({{&pd, &t, 1, false, nullptr, nullptr}}, rd);
  const std::vector<float>& both = m2.forward(
      {{&p2b, b.data(), nb, false, nullptr, s2b.get()}, {&p2, &t, 1, false, nullptr, s2.get()}}, r2);
  const size_t V = size_t(c.vocab);
  const std::vector<float> mixed(both.begin() + r2[1] * int64_t(V), both.begin() + (r2[1] + 1) * int64_t(V));
  const double e_sparse = rel_err(mixed, alone), e_dense = rel_err(mixed, full),
               e_gap = rel_err(alone, full);
  std::printf("[ prefill-routing ] decode beside a prefill chunk vs alone: rel err %.3g; vs full "
              "attention %.3g (sparse vs full alone: %.3g)\n", e_sparse, e_dense, e_gap);
  EXPECT_LT(e_sparse, 1e-2);
  ASSERT_GT(e_gap, 10 * e_sparse) << "budget 32 of 301 tokens should differ from full attention";
}

}  // namespace
}  // namespace spade::test
