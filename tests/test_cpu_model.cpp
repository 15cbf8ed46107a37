// The CPU layer loop (paged KV, chunked prefill, decode, mixed batches) against a naive
// full-recompute forward pass written here in double precision without any cache.
#include <gtest/gtest.h>

#include <cmath>

#include "backend/cpu/ops.h"
#include "model/cpu_model.h"
#include "test_util.h"

using namespace spade;

namespace {

// Naive forward over the whole sequence; returns logits of every position [n, vocab].
std::vector<double> naive_forward(const ModelWeights& w, const std::vector<int32_t>& ids) {
  const ModelConfig& c = w.config;
  const int64_t n = int64_t(ids.size()), H = c.hidden, D = c.head_dim, Hq = c.n_heads,
                Hkv = c.n_kv_heads, G = Hq / Hkv, F = c.ffn;
  std::vector<float> inv(size_t(D / 2));
  cpu::rope_inv_freq(c, inv.data());
  auto lin = [](const std::vector<double>& x, const HostTensor& W, const HostTensor& b,
                int64_t rows, int64_t out, int64_t in) {
    std::vector<double> y(size_t(rows * out));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t o = 0; o < out; ++o) {
        double acc = b.numel() ? b.data()[o] : 0;
        for (int64_t i = 0; i < in; ++i) acc += x[size_t(r * in + i)] * W.data()[o * in + i];
        y[size_t(r * out + o)] = acc;
      }
    return y;
  };
  auto norm = [&](std::vector<double> x, const HostTensor& wt, int64_t rows, int64_t dim) {
    for (int64_t r = 0; r < rows; ++r) {
      double ss = 0;
      for (int64_t i = 0; i < dim; ++i) ss += x[size_t(r * dim + i)] * x[size_t(r * dim + i)];
      double s = 1 / std::sqrt(ss / dim + c.rms_eps);
      for (int64_t i = 0; i < dim; ++i) x[size_t(r * dim + i)] *= s * wt.data()[i];
    }
    return x;
  };
  auto rope = [&](std::vector<double>& x, int64_t heads) {
    for (int64_t t = 0; t < n; ++t)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t i = 0; i < D / 2; ++i) {
          double th = double(float(t) * inv[size_t(i)]);
          double& a = x[size_t((t * heads + h) * D + i)];
          double& b = x[size_t((t * heads + h) * D + i + D / 2)];
          double na = a * std::cos(th) - b * std::sin(th), nb = b * std::cos(th) + a * std::sin(th);
          a = na;
          b = nb;
        }
  };
  HostTensor none;
  std::vector<double> x(size_t(n * H));
  for (int64_t t = 0; t < n; ++t)
    for (int64_t i = 0; i < H; ++i) x[size_t(t * H + i)] = w.tok_embeddings.data()[ids[size_t(t)] * H + i];
  for (const LayerWeights& L : w.layers) {
    auto xn = norm(x, L.attn_norm, n, H);
    auto q = lin(xn, L.wq, L.bq, n, Hq * D, H), k = lin(xn, L.wk, L.bk, n, Hkv * D, H),
         v = lin(xn, L.wv, L.bv, n, Hkv * D, H);
    if (c.qk_norm) {
      q = norm(q, L.q_norm, n * Hq, D);
      k = norm(k, L.k_norm, n * Hkv, D);
    }
    rope(q, Hq);
    rope(k, Hkv);
    std::vector<double> att(size_t(n * Hq * D), 0.0);
    for (int64_t t = 0; t < n; ++t)
      for (int64_t h = 0; h < Hq; ++h) {
        std::vector<double> s(size_t(t + 1));
        double mx = -1e300, sum = 0;
        for (int64_t j = 0; j <= t; ++j) {
          double d = 0;
          for (int64_t e = 0; e < D; ++e) d += q[size_t((t * Hq + h) * D + e)] * k[size_t((j * Hkv + h / G) * D + e)];
          s[size_t(j)] = d / std::sqrt(double(D));
          mx = std::max(mx, s[size_t(j)]);
        }
        for (auto& e : s) sum += (e = std::exp(e - mx));
        for (int64_t j = 0; j <= t; ++j)
          for (int64_t e = 0; e < D; ++e)
            att[size_t((t * Hq + h) * D + e)] += s[size_t(j)] / sum * v[size_t((j * Hkv + h / G) * D + e)];
      }
    auto o = lin(att, L.wo, none, n, H, Hq * D);
    for (size_t i = 0; i < x.size(); ++i) x[i] += o[i];
    xn = norm(x, L.ffn_norm, n, H);
    auto g = lin(xn, L.w_gate, none, n, F, H), u = lin(xn, L.w_up, none, n, F, H);
    for (size_t i = 0; i < g.size(); ++i) g[i] = g[i] / (1 + std::exp(-g[i])) * u[i];
    auto dn = lin(g, L.w_down, none, n, H, F);
    for (size_t i = 0; i < x.size(); ++i) x[i] += dn[i];
  }
  x = norm(x, w.final_norm, n, H);
  return lin(x, w.output_weight(), none, n, c.vocab, H);
}

std::vector<int32_t> random_ids(int n, int vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (auto& x : v) x = int32_t(rng() % uint32_t(vocab));
  return v;
}

double max_abs_diff(const float* a, const double* b, int64_t n) {
  double m = 0;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

}  // namespace

class CpuModelArch : public ::testing::TestWithParam<Arch> {};

// Three sequences of different lengths: prefill in uneven chunks, then decode steps in one
// batch (mixing a prefill chunk of a late sequence with decodes of the others).
TEST_P(CpuModelArch, PagedMixedBatchEqualsFullRecompute) {
  ModelConfig c = test::tiny_config(GetParam());
  ModelWeights w = test::random_model(c, 42);
  const std::vector<int> prompt_len = {5, 23, 40};
  const int decode_steps = 6;
  std::vector<std::vector<int32_t>> seqs;
  for (int i = 0; i < 3; ++i) seqs.push_back(random_ids(prompt_len[size_t(i)] + decode_steps, c.vocab, 100 + i));

  for (int page : {1, 5, 16}) {
    KVPool kv({c.n_layers, c.n_kv_heads, c.head_dim, page}, 64 / page * 10);
    CpuModel model(w, kv);
    std::vector<PageTable> pts(3);
    std::vector<int64_t> row_of;
    // Sequence 0 and 1 prefill together (seq 1 in two chunks); seq 2 joins later.
    std::vector<SeqInput> b = {{&pts[0], seqs[0].data(), 5, true, nullptr},
                               {&pts[1], seqs[1].data(), 10, true, nullptr}};
    auto logits = model.forward(b, row_of);
    auto ref0 = naive_forward(w, std::vector<int32_t>(seqs[0].begin(), seqs[0].begin() + 5));
    EXPECT_LT(max_abs_diff(logits.data(), ref0.data(), 5 * c.vocab), 2e-4) << "page " << page;
    b = {{&pts[1], seqs[1].data() + 10, 13, false, nullptr},
         {&pts[2], seqs[2].data(), 40, false, nullptr}};
    logits = model.forward(b, row_of);
    for (int step = 0; step < decode_steps; ++step) {
      std::vector<SeqInput> d;
      for (int i = 0; i < 3; ++i)
        d.push_back({&pts[size_t(i)], seqs[size_t(i)].data() + pts[size_t(i)].length, 1, false, nullptr});
      logits = model.forward(d, row_of);
      for (int i = 0; i < 3; ++i) {
        int64_t n = pts[size_t(i)].length;
        auto ref = naive_forward(w, std::vector<int32_t>(seqs[size_t(i)].begin(), seqs[size_t(i)].begin() + n));
        EXPECT_LT(max_abs_diff(logits.data() + row_of[size_t(i)] * c.vocab,
                               ref.data() + (n - 1) * c.vocab, c.vocab), 2e-4)
            << "page " << page << " seq " << i << " step " << step;
      }
    }
    for (auto& pt : pts) kv.release(pt);
    EXPECT_EQ(kv.free_pages(), kv.n_pages());
  }
}

INSTANTIATE_TEST_SUITE_P(Archs, CpuModelArch,
                         ::testing::Values(Arch::Llama, Arch::Qwen2, Arch::Qwen3),
                         [](const auto& info) { return std::string(arch_name(info.param)); });

TEST(CpuModel, PoolExhaustionThrowsAndChangesNothing) {
  ModelConfig c = test::tiny_config();
  ModelWeights w = test::random_model(c, 1);
  KVPool kv({c.n_layers, c.n_kv_heads, c.head_dim, 16}, 3);
  CpuModel model(w, kv);
  auto ids = random_ids(60, c.vocab, 3);
  PageTable a, b;
  std::vector<int64_t> row_of;
  std::vector<SeqInput> batch = {{&a, ids.data(), 20, false, nullptr}, {&b, ids.data(), 20, false, nullptr}};
  EXPECT_THROW(model.forward(batch, row_of), Error);
  EXPECT_EQ(kv.free_pages(), 3);
  EXPECT_EQ(a.length, 0);
  EXPECT_TRUE(a.pages.empty() && b.pages.empty());
}

TEST(CpuModel, ContextOverflowIsAnError) {
  ModelConfig c = test::tiny_config();
  c.max_context = 16;
  ModelWeights w = test::random_model(c, 1);
  KVPool kv({c.n_layers, c.n_kv_heads, c.head_dim, 16}, 4);
  CpuModel model(w, kv);
  auto ids = random_ids(17, c.vocab, 3);
  PageTable a;
  std::vector<int64_t> row_of;
  std::vector<SeqInput> batch = {{&a, ids.data(), 17, false, nullptr}};
  try {
    model.forward(batch, row_of);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("context of 16"), std::string::npos) << e.what();
  }
}
