// LycheeDecode on the GPU (issue 9): the hybrid-head sparse kernel's score emission for its
// dense (retrieval) heads, several dense-head patterns in one plan, and `--device cuda
// --sparse lycheedecode` inside CudaModel against the CPU's LycheeDecodeMethod.
//
// Agreement measure (model): the GPU ranks tokens by the group-mean score q_bar.k * scale,
// the CPU by its softmax weight (the same order up to rounding), from bf16 keys and
// activations where the CPU has fp32 ones. At every (step, layer with retrieval heads,
// request, retrieval head) the GPU's next-layer set is compared with the CPU's: a differing
// token is accepted only as a near-tie, i.e. when its CPU weight lies within 2 e of the CPU's
// k-th largest weight, e = the row's largest |GPU weight - CPU weight| (GPU weights: softmax
// of the GPU's traced scores). Anything else fails. The CPU then continues with the GPU's sets
// (so one near-tie does not cascade) and the logits must agree within kTolLogits = 5e-2 at
// every step (the dense comparison reaches 0.025). Near-ties may swap at most 10% of a set.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <random>
#include <set>

#include "../test_util.h"
#include "backend/cuda/sparse_attention.h"
#include "gpu_model_util.h"
#include "gpu_util.h"
#include "tracing_lychee.h"
#include "model/cpu_model.h"
#include "model/cuda_model.h"
#include "sparse/cache_correction.h"
#include "sparse/methods/lycheedecode.h"
#include "sparse/registry.h"
#include "sparse/session.h"

namespace spade::test {
namespace {

using cuda::bf16;

// ---------------------------------------------------------------- hybrid-head kernel

void check_hybrid(int Hq, int Hkv, int D, const std::vector<int>& lens,
                  const std::vector<std::vector<uint8_t>>& patterns, uint32_t seed) {
  SCOPED_TRACE(testing::Message() << "Hq=" << Hq << " Hkv=" << Hkv << " D=" << D);
  const int P = 16, G = Hq / Hkv, B = int(lens.size());
  std::mt19937 rng(seed);
  RandomPagedCache cache(Hq, Hkv, D, P, lens, rng);
  const KVPool& kv = cache.kv;
  const std::vector<PageTable>& pts = cache.pts;
  const std::vector<float>&kh = cache.kh, &vh = cache.vh, &q = cache.q;
  // Token lists: a random sorted subset of each (request, head)'s context.
  std::vector<int32_t> off{0}, idx;
  std::vector<int> max_entries;
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < Hkv; ++h) {
      std::vector<int32_t> all(size_t(lens[size_t(b)]));
      for (int j = 0; j < lens[size_t(b)]; ++j) all[size_t(j)] = j;
      std::shuffle(all.begin(), all.end(), rng);
      const int k = std::max(1, lens[size_t(b)] / 5);
      all.resize(size_t(k));
      std::sort(all.begin(), all.end());
      idx.insert(idx.end(), all.begin(), all.end());
      off.push_back(int32_t(idx.size()));
      max_entries.push_back(k);
    }
  std::vector<cuda::SparseSeq> seqs;
  for (int b = 0; b < B; ++b)
    seqs.push_back({pts[size_t(b)].pages.data(), int(pts[size_t(b)].pages.size()), lens[size_t(b)]});
  const int64_t ld = *std::max_element(lens.begin(), lens.end()) + 3;
  cuda::DeviceArena arena(256u << 20);
  const int64_t pages = cache.kv.n_pages();
  cuda::SparseAttention multi(arena, 8, pages, Hq, Hkv, D, P, 64, int(patterns.size()));
  cuda::SparseAttention single(arena, 8, pages, Hq, Hkv, D, P, 64, 1);
  DevBuf<bf16> dk(to_bf16(kh)), dv(to_bf16(vh)), dq(to_bf16(q));
  DevBuf<int32_t> doff(off), didx(idx);
  multi.plan_patterns(seqs, cuda::SelGran::Token, Hkv, max_entries, patterns, 0);
  const float scale = 1.f / std::sqrt(float(D));
  for (size_t p = 0; p < patterns.size(); ++p) {
    SCOPED_TRACE(testing::Message() << "pattern " << p);
    DevBuf<bf16> o_multi(q.size()), o_scores(q.size()), o_single(q.size());
    DevBuf<float> sc(size_t(B * Hkv) * size_t(ld));
    sc.poison();
    multi.run(dq.p, dk.p, dv.p, doff.p, didx.p, o_multi.p, scale, 0, int(p));
    multi.run(dq.p, dk.p, dv.p, doff.p, didx.p, o_scores.p, scale, 0, int(p), sc.p, ld);
    single.plan(seqs, cuda::SelGran::Token, Hkv, max_entries, &patterns[p], 0);
    single.run(dq.p, dk.p, dv.p, doff.p, didx.p, o_single.p, scale, 0);
    // The same work items (a plan made before any launch once used another CTAs/SM count:
    // this test then failed when it ran first in a process).
    EXPECT_EQ(multi.pattern_items()[p], single.pattern_items()[0]) << "work items differ";
    const auto a = o_multi.download(), b2 = o_scores.download(), c = o_single.download();
    EXPECT_EQ(0, std::memcmp(a.data(), b2.data(), a.size() * sizeof(bf16)))
        << "emitting scores changed the attention output";
    EXPECT_EQ(0, std::memcmp(a.data(), c.data(), a.size() * sizeof(bf16)))
        << "pattern of a multi-pattern plan differs from a plan of that pattern alone";
    const auto got = sc.download();
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < Hkv; ++h) {
        const float* row = got.data() + (size_t(b) * Hkv + h) * size_t(ld);
        if (!patterns[p][size_t(h)]) {  // sparse head: no scores
          for (int j = 0; j < lens[size_t(b)]; ++j)
            ASSERT_TRUE(std::isnan(row[j])) << "sparse head " << h << " wrote a score";
          continue;
        }
        double num = 0, den = 0;
        for (int j = 0; j < lens[size_t(b)]; ++j) {
          const float* k = kv.k_row(0, pts[size_t(b)], j, h);
          double s = 0;
          for (int g = 0; g < G; ++g) {
            const float* qg = q.data() + (size_t(b) * Hq + size_t(h) * G + g) * D;
            for (int d = 0; d < D; ++d) s += double(qg[d]) * k[d];
          }
          const double r = s * scale / G;
          ASSERT_TRUE(std::isfinite(row[j])) << "score of token " << j << " not written";
          num += (row[j] - r) * (row[j] - r), den += r * r;
        }
        EXPECT_LT(std::sqrt(num / std::max(den, 1e-30)), 1e-5) << "request " << b << " head " << h;
      }
  }
}

TEST(CudaLycheeDecode, HybridKernelScoresAndPatterns) {
  SKIP_WITHOUT_GPU();
  check_hybrid(32, 8, 128, {3000, 700, 41},
               {{0, 1, 0, 0, 1, 0, 0, 0}, {0, 0, 0, 0, 0, 0, 0, 0}, {1, 1, 1, 1, 1, 1, 1, 0}}, 1);
  check_hybrid(9, 3, 64, {2000, 33}, {{0, 0, 1}, {1, 0, 0}}, 2);  // SmolLM2's heads
}

// ---------------------------------------------------------------- model

constexpr double kTolLogits = 5e-2;

void compare_model(int D, const std::string& spec, int na, int nb, int steps, int sel_rows) {
  SCOPED_TRACE(testing::Message() << "D=" << D << " " << spec);
  const ModelConfig c = tiny_config(Arch::Llama, D, 4, 2048);
  ModelWeights w = random_model(c, 77);  // the TidalDecode test's model (dense prefill within 3e-2)
  round_weights_bf16(w);
  const sparse::SparseConfig sc = sparse::SparseConfig::parse_spec(spec);
  const CudaModelOptions opt = small_sparse_options(sc, c);
  ASSERT_EQ(opt.sparse.method, CudaSparse::Method::LycheeDecode);
  CudaModel gpu(w, opt);
  CudaModel::QuestTrace trace;
  KVPool kv({c.n_layers, c.n_kv_heads, c.head_dim, 16}, 128);
  CpuModel cpu(w, kv);
  auto method = std::make_shared<TracingLychee>(sparse::make_method(sc, c));
  sparse::SparseSession s0(method, c, kv), s1(method, c, kv);
  const double worst = traced_decode_compare(
      cpu, s0, s1, gpu, trace, na, nb, steps, kTolLogits, 8, [&](const PageTable* pc) {
        method->req_of = {{&pc[0], 0}, {&pc[1], 1}};
        method->gpu = &trace;
      });
  std::printf("[ lycheedecode-model ] D=%d %s: %d sets (step, layer, request, retrieval head), "
              "%d identical, %d near-tie, %d bad; largest weight error %.3g; at most %.1f%% of a "
              "set swapped; worst decode logits rel err %.3g over %d steps\n",
              D, spec.c_str(), method->rows, method->identical, method->near_tie, method->bad,
              method->max_err, 100 * method->max_diff_frac, worst, steps);
  EXPECT_EQ(method->bad, 0);
  EXPECT_GT(method->identical, 0);
  EXPECT_LE(method->max_diff_frac, 0.1);
  EXPECT_EQ(method->rows, steps * 2 * sel_rows);  // 2 requests
}

TEST(CudaLycheeDecode, ModelMatchesCpuSession) {
  SKIP_WITHOUT_GPU();
  // Layer 0 all retrieval (dense kernel), then a mix: layer 1 head 1 and layer 2 head 0 are
  // retrieval heads (hybrid launches of two patterns), layer 3 all sparse. Sets made per step:
  // layers 0 (2 heads), 1 (1), 2 (1).
  compare_model(64, "lycheedecode:roles=RR/SR/RS/SS,budget=48", 200, 90, 10, 4);
  compare_model(128, "lycheedecode:roles=RR/SS/RS/SS,budget=64", 300, 120, 8, 3);
}

TEST(CudaLycheeDecode, OptionsMapOrFailClearly) {
  const ModelConfig c = tiny_config(Arch::Llama, 64, 4, 2048);
  const CudaSparse t = cuda_sparse_config(
      sparse::SparseConfig::parse_spec("lycheedecode:roles=RR/SR/RS/SS,budget=256"), c, 16);
  EXPECT_EQ(t.method, CudaSparse::Method::LycheeDecode);
  EXPECT_EQ(t.budget, 256);
  ASSERT_EQ(t.retrieval.size(), 4u);
  EXPECT_EQ(t.retrieval[1], (std::vector<uint8_t>{0, 1}));
  // Every mode and block size maps (issue 37 item 6).
  const CudaSparse tp = cuda_sparse_config(
      sparse::SparseConfig::parse_spec("lycheedecode:roles=RR/SR/RS/SS,mode=topp,p=0.9,block=64"), c, 16);
  EXPECT_EQ(tp.method, CudaSparse::Method::LycheeDecode);
  EXPECT_EQ(tp.ld_mode, 2);
  EXPECT_DOUBLE_EQ(tp.ld_p, 0.9);
  EXPECT_EQ(tp.ld_block, 64);
  EXPECT_TRUE(tp.ld_rule());
  EXPECT_NE(tp.describe().find("mode=topp p=0.9 block=64"), std::string::npos) << tp.describe();
  const CudaSparse th = cuda_sparse_config(
      sparse::SparseConfig::parse_spec("lycheedecode:roles=RR/SR/RS/SS,mode=threshold,tau=1e-3"), c, 16);
  EXPECT_EQ(th.ld_mode, 3);
  EXPECT_DOUBLE_EQ(th.ld_tau, 1e-3);
  EXPECT_EQ(th.ld_block, 1);
  const CudaSparse ra = cuda_sparse_config(
      sparse::SparseConfig::parse_spec("lycheedecode:roles=RR/SR/RS/SS,mode=ratio,ratio=0.25,block=16"), c, 16);
  EXPECT_EQ(ra.ld_mode, 1);
  EXPECT_DOUBLE_EQ(ra.ld_ratio, 0.25);
  EXPECT_EQ(ra.ld_block, 16);
  const CudaSparse tk = cuda_sparse_config(
      sparse::SparseConfig::parse_spec("lycheedecode:roles=RR/SR/RS/SS,budget=100,block=64"), c, 16);
  EXPECT_EQ(tk.ld_mode, 0);
  EXPECT_EQ(tk.budget, 100);
  EXPECT_TRUE(tk.ld_rule());
  EXPECT_FALSE(t.ld_rule());  // topk on tokens: the token top-k path
  // What the GPU still cannot run stays a clear error (the CPU's option checks first).
  expect_cuda_config_error("lycheedecode:roles=RR/SR/RS/SS,mode=topp,p=0", "outside (0, 1]", c);
  // Cache correction maps: the decode loop runs it (sparse/cache_correction.h).
  EXPECT_NO_THROW(cuda_sparse_config(
      sparse::SparseConfig::parse_spec("lycheedecode:roles=RR/SR/RS/SS,correction=1,correction_every=8"), c, 16));
}

// Cache correction on the GPU: after N sparse decode steps, CacheCorrection re-feeds the N
// tokens as one dense chunk through CudaModel::forward. A following two-token chunk (dense
// attention over every cached token, so it reads all N) then sees the cache of a dense prefill
// of the same tokens: its logits equal those of a model that prefilled prompt + N tokens
// densely (within the chunking's bf16 rounding), and differ from the uncorrected run's (whose
// sparse decode steps wrote other K/V in the layers after the first sparse one).
TEST(CudaLycheeDecode, CacheCorrectionRewritesTheDecodedKVDensely) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = tiny_config(Arch::Llama, 64, 4, 2048);
  ModelWeights w = random_model(c, 33);
  round_weights_bf16(w);
  const std::string spec = "lycheedecode:roles=RR/SS/SS/SS,budget=16";
  const int N = 8;
  std::mt19937 rng(4);
  const std::vector<int32_t> prompt = random_tokens(rng, 300, c.vocab), fed = random_tokens(rng, N + 2, c.vocab);
  // 0: sparse decode steps, 1: + correction, 2: a dense prefill of it all, 3: 0 on full attention
  auto logits_after = [&](int mode) {
    CudaModel m(w, small_sparse_options(sparse::SparseConfig::parse_spec(mode == 3 ? "full" : spec), c));
    PageTable pt;
    std::vector<int64_t> rows;
    sparse::CacheCorrection cc(N);
    auto dense = [&](const SeqInput& in) { (void)m.forward({in}, rows); };
    if (mode == 2) {
      std::vector<int32_t> all(prompt);
      all.insert(all.end(), fed.begin(), fed.begin() + N);
      (void)m.forward({{&pt, all.data(), int64_t(all.size()), false}}, rows);
    } else {
      (void)m.forward({{&pt, prompt.data(), int64_t(prompt.size()), false}}, rows);
      int corrections = 0;
      for (int i = 0; i < N; ++i) {
        (void)m.forward({{&pt, &fed[size_t(i)], 1, false}}, rows);
        if (mode == 1) corrections += cc.after_decode(dense, pt, fed[size_t(i)]);
      }
      EXPECT_EQ(corrections, mode == 1 ? 1 : 0);
      if (mode == 3) EXPECT_EQ(corrections, 0);
    }
    EXPECT_EQ(pt.length, int64_t(prompt.size()) + N);
    std::vector<float> lg = m.forward({{&pt, &fed[size_t(N)], 2, false}}, rows);  // dense: reads all
    m.release(pt);
    return lg;
  };
  const std::vector<float> sparse_only = logits_after(0), corrected = logits_after(1),
                           dense_prefill = logits_after(2), full = logits_after(3);
  const double to_dense = rel_err(corrected, dense_prefill), uncorrected = rel_err(sparse_only, dense_prefill);
  const double sparse_vs_full = rel_err(sparse_only, full);
  std::printf("[ correction ] rel. logit error vs a dense prefill: corrected %.3g, uncorrected %.3g; "
              "sparse decode vs full attention %.3g\n", to_dense, uncorrected, sparse_vs_full);
  EXPECT_GT(sparse_vs_full, 1e-3) << "the sparse decode steps wrote full attention's K/V";
  EXPECT_LT(to_dense, 1e-2);
  EXPECT_GT(uncorrected, 2 * to_dense);
}

}  // namespace
}  // namespace spade::test
