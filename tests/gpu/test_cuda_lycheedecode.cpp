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
#include "backend/cuda/rule_select.h"
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

// ---------------------------------------------------------------- rule kernels
// (backend/cuda/rule_select.h: LycheeDecode's topk / ratio / topp / threshold modes on units
// of `block` tokens and oracle-topp's union, issue 37 item 6.)

sparse::LdRule rule_of(int mode, int block) {
  sparse::LdRule r;
  r.mode = mode == 0 ? sparse::LdMode::TopK : mode == 1 ? sparse::LdMode::Ratio
           : mode == 2 ? sparse::LdMode::TopP : sparse::LdMode::Threshold;
  r.budget = 100;
  r.ratio = 0.3;
  r.p = 0.9;
  r.tau = 2e-3;
  r.block = block;
  return r;
}

cuda::RuleParams params_of(const sparse::LdRule& r) {
  cuda::RuleParams p;
  p.mode = r.mode == sparse::LdMode::TopK ? cuda::RuleMode::TopK
           : r.mode == sparse::LdMode::Ratio ? cuda::RuleMode::Ratio
           : r.mode == sparse::LdMode::TopP ? cuda::RuleMode::TopP : cuda::RuleMode::Threshold;
  p.block = r.block;
  p.k_units = (std::max<int64_t>(1, r.budget) + r.block - 1) / r.block;
  p.ratio = r.ratio;
  p.mass = r.p;
  p.tau = r.tau;
  return p;
}

// The CPU's ld_select over unit weights u[0..U) of a context of L tokens: the kept units
// (ascending). Units are ranked as ld_select ranks them (block 1 over u; the unit count of
// topk and ratio as ld_select computes it for `block`).
std::vector<int32_t> cpu_units(const std::vector<float>& u, int64_t L, const sparse::LdRule& r) {
  sparse::LdRule r1 = r;
  r1.block = 1;
  if (r.mode == sparse::LdMode::Ratio) {
    r1.mode = sparse::LdMode::TopK;
    r1.budget = (std::max<int64_t>(1, int64_t(std::ceil(r.ratio * double(L)))) + r.block - 1) / r.block;
  } else if (r.mode == sparse::LdMode::TopK) {
    r1.budget = (std::max<int64_t>(1, r.budget) + r.block - 1) / r.block;
  }
  sparse::SelectScratch sc;
  std::vector<int32_t> out;
  sparse::ld_select(u.data(), int64_t(u.size()), r1, sc, out);
  return out;
}

// Lists of B requests x Hkv heads, each the union of `cpl` criteria rows of random unit
// weights (ties: values on a coarse grid, so that many units tie), through rule_criteria,
// rule_lists and counted_compact_lists: every list must equal the union of the CPU's sets.
void check_rule_lists(int mode, int block, bool ties, bool expand, int cpl, std::mt19937& rng) {
  const sparse::LdRule rule = rule_of(mode, block);
  SCOPED_TRACE(testing::Message() << rule.describe() << " ties=" << ties << " expand=" << expand
                                  << " rows per list=" << cpl);
  const std::vector<int> lens = {1, 50, 300, 4099};
  const int B = int(lens.size()), Hkv = 2, rows = B * Hkv * cpl;
  const int64_t ld = 4099 + 5;
  std::vector<float> u(size_t(rows) * size_t(ld), 0.f);
  std::normal_distribution<float> nd(0.f, 1.5f);
  std::vector<std::vector<float>> rowv(static_cast<size_t>(rows));
  for (int r = 0; r < rows; ++r) {
    const int L = lens[size_t(r / (Hkv * cpl))], U = (L + block - 1) / block;
    std::vector<float>& v = rowv[size_t(r)];
    v.resize(size_t(U));
    double sum = 0;
    for (auto& x : v) {
      x = std::exp(nd(rng));
      if (ties) x = std::round(x * 2.f) / 2.f + 0.5f;
      sum += x;
    }
    for (auto& x : v) x = float(double(x) / sum);
    std::copy(v.begin(), v.end(), u.begin() + int64_t(r) * ld);
  }
  DevBuf<float> du(u);
  DevBuf<int32_t> dlen(std::vector<int32_t>(lens.begin(), lens.end()));
  DevBuf<cuda::RuleCrit> dcrit{static_cast<size_t>(rows)};
  DevBuf<int32_t> dstr(size_t(B * Hkv) * size_t(ld)), dcnt(size_t(B * Hkv)),
      doff(size_t(B * Hkv) + 1), didx(size_t(B * Hkv) * size_t(ld));
  cuda::rule_criteria(du.p, ld, dlen.p, rows, Hkv * cpl, ~0u, params_of(rule), dcrit.p, 0);
  cuda::rule_lists(du.p, ld, dcrit.p, dlen.p, B, Hkv, cpl, ~0u, block, expand, dstr.p, ld, dcnt.p, 0);
  cuda::counted_compact_lists(dstr.p, ld, dcnt.p, B * Hkv, doff.p, didx.p, 0);
  const auto off = doff.download(), idx = didx.download();
  for (int l = 0; l < B * Hkv; ++l) {
    const int L = lens[size_t(l / Hkv)];
    std::vector<int32_t> want;
    for (int g = 0; g < cpl; ++g) {
      const std::vector<int32_t> s = cpu_units(rowv[size_t(l * cpl + g)], L, rule);
      want.insert(want.end(), s.begin(), s.end());
    }
    std::sort(want.begin(), want.end());
    want.erase(std::unique(want.begin(), want.end()), want.end());
    if (expand) {
      std::vector<int32_t> t;
      for (int32_t x : want)
        for (int j = x * block; j < std::min(L, (x + 1) * block); ++j) t.push_back(j);
      want = t;
    }
    const std::vector<int32_t> got(idx.begin() + off[size_t(l)], idx.begin() + off[size_t(l) + 1]);
    EXPECT_EQ(got, want) << "list " << l << " (L " << L << ")";
  }
  // A head mask leaves the other heads' lists alone (LycheeDecode's sparse heads).
  DevBuf<int32_t> dcnt2(std::vector<int32_t>(size_t(B * Hkv), -7));
  cuda::rule_lists(du.p, ld, dcrit.p, dlen.p, B, Hkv, cpl, 1u, block, expand, dstr.p, ld, dcnt2.p, 0);
  const auto cnt2 = dcnt2.download(), cnt = dcnt.download();
  for (int l = 0; l < B * Hkv; ++l)
    EXPECT_EQ(cnt2[size_t(l)], l % Hkv == 0 ? cnt[size_t(l)] : -7) << "list " << l;
}

TEST(CudaLycheeDecode, RuleKernelsMatchTheCpuSelection) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(12);
  for (int block : {1, 7, 16, 64})
    for (int mode = 0; mode < 4; ++mode)
      for (bool ties : {false, true}) {
        check_rule_lists(mode, block, ties, block > 1, 1, rng);
        if (block > 1) check_rule_lists(mode, block, ties, false, 1, rng);
      }
  // oracle-topp group=union: each of G rows' top-p set, unioned per list.
  for (bool ties : {false, true}) check_rule_lists(2, 1, ties, false, 4, rng);
}

// rule_unit_weights: the CPU's ld_group_weights softmax of a row of logits (float exp,
// double sum, float reciprocal) and ld_select's unit sums; rows outside the head mask are
// not written; block 1 in place.
TEST(CudaLycheeDecode, RuleUnitWeightsMatchTheCpuSoftmax) {
  SKIP_WITHOUT_GPU();
  const std::vector<int> lens = {1, 77, 5000};
  const int B = int(lens.size()), Hkv = 2;
  const int64_t ld = 5003;
  std::mt19937 rng(5);
  std::vector<float> sc = randn(size_t(B * Hkv) * size_t(ld), rng, 4.f);
  for (int block : {1, 7, 64})
    for (bool in_place : {false, true}) {
      if (in_place && block != 1) continue;
      SCOPED_TRACE(testing::Message() << "block " << block << (in_place ? " in place" : ""));
      DevBuf<float> dsc(sc), out(sc.size());
      out.poison();
      DevBuf<int32_t> dlen(std::vector<int32_t>(lens.begin(), lens.end()));
      float* dst = in_place ? dsc.p : out.p;
      cuda::rule_unit_weights(dsc.p, ld, dlen.p, B * Hkv, Hkv, 1u, block, dst, 0);
      const auto got = in_place ? dsc.download() : out.download();
      double worst = 0;
      for (int r = 0; r < B * Hkv; ++r) {
        const int L = lens[size_t(r / Hkv)], U = (L + block - 1) / block;
        const float* x = sc.data() + int64_t(r) * ld;
        const float* g = got.data() + int64_t(r) * ld;
        if (r % Hkv != 0) {  // head 1: not in the mask
          for (int i = 0; i < U; ++i) {
            if (in_place) ASSERT_EQ(g[i], x[i]) << "row " << r;
            else ASSERT_TRUE(std::isnan(g[i])) << "row " << r << " written";
          }
          continue;
        }
        float mx = -INFINITY;
        for (int j = 0; j < L; ++j) mx = std::max(mx, x[j]);
        std::vector<float> w(static_cast<size_t>(L));
        double sum = 0;
        for (int j = 0; j < L; ++j) sum += (w[size_t(j)] = std::exp(x[j] - mx));
        const float inv = float(1.0 / sum);
        for (auto& v : w) v *= inv;
        for (int i = 0; i < U; ++i) {
          double s = 0;
          for (int j = i * block; j < std::min(L, (i + 1) * block); ++j) s += w[size_t(j)];
          worst = std::max(worst, std::fabs(g[i] - s) / std::max(1e-30, s));
        }
      }
      EXPECT_LT(worst, 1e-5) << "worst relative error of a unit weight";
    }
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

// The other selection rules (issue 37 item 6): mode topp / threshold / ratio and blocks of
// 64 (Block64 lists), 16 (Chunk16) and 7 tokens (token lists), against the CPU under each
// rule's near-ties (TracingLycheeRule, tracing_lychee.h), then the logits within kTolLogits.
void compare_model_rule(int D, const std::string& spec, int na, int nb, int steps, int sel_rows) {
  SCOPED_TRACE(testing::Message() << "D=" << D << " " << spec);
  const ModelConfig c = tiny_config(Arch::Llama, D, 4, 2048);
  ModelWeights w = random_model(c, 77);
  round_weights_bf16(w);
  const sparse::SparseConfig sc = sparse::SparseConfig::parse_spec(spec);
  const CudaModelOptions opt = small_sparse_options(sc, c);
  ASSERT_EQ(opt.sparse.method, CudaSparse::Method::LycheeDecode);
  ASSERT_TRUE(opt.sparse.ld_rule());
  CudaModel gpu(w, opt);
  CudaModel::QuestTrace trace;
  KVPool kv({c.n_layers, c.n_kv_heads, c.head_dim, 16}, 128);
  CpuModel cpu(w, kv);
  auto method = std::make_shared<TracingLycheeRule>(sparse::make_method(sc, c));
  sparse::SparseSession s0(method, c, kv), s1(method, c, kv);
  const double worst = traced_decode_compare(
      cpu, s0, s1, gpu, trace, na, nb, steps, kTolLogits, 8, [&](const PageTable* pc) {
        method->req_of = {{&pc[0], 0}, {&pc[1], 1}};
        method->gpu = &trace;
      });
  std::printf("[ lycheedecode-rule ] D=%d %s: %d sets, %d identical, %d near-tie, %d bad; "
              "largest unit weight error %.3g; at most %.1f%% of a set swapped; worst decode "
              "logits rel err %.3g over %d steps\n",
              D, spec.c_str(), method->rows, method->identical, method->near_tie, method->bad,
              method->max_err, 100 * method->max_diff_frac, worst, steps);
  EXPECT_EQ(method->bad, 0);
  EXPECT_GT(method->identical, 0);
  // Near-ties swap at most 10% of a set, or one unit (sets of a few blocks).
  EXPECT_TRUE(method->max_diff_frac <= 0.1 || method->max_diff_units <= 1)
      << method->max_diff_frac << " of a set, " << method->max_diff_units << " units";
  EXPECT_EQ(method->rows, steps * 2 * sel_rows);  // 2 requests
}

TEST(CudaLycheeDecode, RuleModesMatchCpuSession) {
  SKIP_WITHOUT_GPU();
  // Roles as ModelMatchesCpuSession: sets made per step in layers 0 (2 heads), 1 (1), 2 (1).
  compare_model_rule(64, "lycheedecode:roles=RR/SR/RS/SS,mode=topp,p=0.9", 200, 90, 8, 4);
  compare_model_rule(64, "lycheedecode:roles=RR/SR/RS/SS,mode=topp,p=0.8,block=64", 300, 150, 8, 4);
  compare_model_rule(64, "lycheedecode:roles=RR/SR/RS/SS,mode=threshold,tau=3e-3", 200, 90, 8, 4);
  compare_model_rule(64, "lycheedecode:roles=RR/SR/RS/SS,mode=ratio,ratio=0.25,block=16", 200, 90, 8, 4);
  compare_model_rule(64, "lycheedecode:roles=RR/SR/RS/SS,budget=64,block=7", 200, 90, 8, 4);
  compare_model_rule(128, "lycheedecode:roles=RR/SS/RS/SS,mode=topp,p=0.9,block=64", 300, 120, 6, 3);
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
      if (mode == 3) {
        EXPECT_EQ(corrections, 0);
      }
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
