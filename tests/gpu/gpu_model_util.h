// Helpers of the GPU model tests: bf16-rounded random weights (the CPU runs fp32 on the same
// values the GPU holds), random token ids.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "../test_util.h"
#include "gpu_util.h"
#include "model/config.h"
#include "model/cpu_model.h"
#include "model/cuda_model.h"
#include "model/weights.h"
#include "sparse/options.h"
#include "sparse/session.h"

namespace spade::test {

inline void round_weights_bf16(ModelWeights& w) {
  auto r = [](HostTensor& t) {
    for (auto& x : t.storage) x = round_bf16(x);
  };
  r(w.tok_embeddings);
  r(w.lm_head);
  r(w.final_norm);
  for (auto& L : w.layers)
    for (HostTensor* t : {&L.attn_norm, &L.wq, &L.wk, &L.wv, &L.wo, &L.bq, &L.bk, &L.bv,
                          &L.q_norm, &L.k_norm, &L.ffn_norm, &L.w_gate, &L.w_up, &L.w_down})
      r(*t);
}

// A small random-weights model: hidden 256, 8 query / 2 KV heads of `D`, FFN 512, vocab 1000
// (Qwen2: q/k/v bias, untied; Qwen3: q/k norm).
inline ModelConfig tiny_config(Arch arch, int D, int n_layers = 3, int max_context = 4096) {
  ModelConfig c;
  c.arch = arch;
  c.n_layers = n_layers;
  c.hidden = 256;
  c.n_heads = 8;
  c.n_kv_heads = 2;
  c.head_dim = D;
  c.ffn = 512;
  c.vocab = 1000;
  c.max_context = max_context;
  c.rope_theta = 10000.f;
  c.qkv_bias = arch == Arch::Qwen2;
  c.qk_norm = arch == Arch::Qwen3;
  c.tie_embeddings = arch != Arch::Qwen2;
  return c;
}

// f() must throw spade::Error whose message contains `what`.
inline void expect_error(const std::function<void()>& f, const char* what) {
  try {
    f();
    ADD_FAILURE() << "expected an error containing '" << what << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
  }
}

// cuda_sparse_config(spec) must throw spade::Error whose message contains `what`.
inline void expect_cuda_config_error(const std::string& spec, const char* what,
                                     const ModelConfig& c) {
  try {
    cuda_sparse_config(sparse::SparseConfig::parse_spec(spec), c, 16);
    ADD_FAILURE() << spec << ": expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
  }
}

inline std::vector<int32_t> random_tokens(std::mt19937& rng, int n, int vocab) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = int32_t(rng() % uint32_t(vocab));
  return t;
}

// Requests a and b prefilled together on the CPU (through sessions s0 / s1) and on the GPU,
// then `steps` batched decode steps feeding the same random tokens to both; every step's
// logits must agree within `tol` (rel err). Returns the worst step's error.
inline double compare_decode_with_cpu(CpuModel& cpu, sparse::SparseSession& s0,
                                      sparse::SparseSession& s1, CudaModel& gpu,
                                      const std::vector<int32_t>& a,
                                      const std::vector<int32_t>& b, int steps, double tol,
                                      std::mt19937& rng) {
  const int vocab = cpu.config().vocab;
  const int na = int(a.size()), nb = int(b.size());
  PageTable pc[2], pg[2];
  std::vector<int64_t> rc, rg;
  cpu.forward({{&pc[0], a.data(), na, false, &s0.attention()},
               {&pc[1], b.data(), nb, false, &s1.attention()}}, rc);
  gpu.forward({{&pg[0], a.data(), na, false}, {&pg[1], b.data(), nb, false}}, rg);
  double worst = 0;
  for (int s = 0; s < steps; ++s) {
    int32_t ta = int32_t(rng() % uint32_t(vocab)), tb = int32_t(rng() % uint32_t(vocab));
    const auto& lc = cpu.forward({{&pc[0], &ta, 1, false, &s0.attention()},
                                  {&pc[1], &tb, 1, false, &s1.attention()}}, rc);
    const auto& lg = gpu.forward({{&pg[0], &ta, 1, false}, {&pg[1], &tb, 1, false}}, rg);
    const double e = rel_err(lg, lc);
    worst = std::max(worst, e);
    EXPECT_LT(e, tol) << "decode step " << s;
  }
  return worst;
}

// Options of the selection model tests: a 1024-token pool, 4 sequences, prefill chunks of 512
// tokens, the GPU form of `sc` (pages of 16).
inline CudaModelOptions small_sparse_options(const sparse::SparseConfig& sc, const ModelConfig& c) {
  CudaModelOptions opt;
  opt.max_tokens = 1024;
  opt.max_batch = 4;
  opt.max_step_tokens = 512;
  opt.max_logit_rows = 64;
  opt.sparse = cuda_sparse_config(sc, c, 16);
  return opt;
}

// A paged one-layer cache of random bf16 keys / values for sequences of `lens` tokens (pages
// handed out in order) and random bf16 queries [lens.size(), Hq, D], drawn from rng in the
// order K, V, q.
struct RandomPagedCache {
  KVLayout lay;
  KVPool kv;
  std::vector<PageTable> pts;
  std::vector<float> kh, vh, q;
  static int64_t pages_for(const std::vector<int>& lens, int P) {
    int64_t n = 0;
    for (int L : lens) n += (L + P - 1) / P;
    return n + 2;
  }
  RandomPagedCache(int Hq, int Hkv, int D, int P, const std::vector<int>& lens, std::mt19937& rng)
      : lay{1, Hkv, D, P}, kv(lay, pages_for(lens, P)), pts(lens.size()) {
    for (size_t i = 0; i < lens.size(); ++i) kv.reserve(pts[i], lens[i]), pts[i].length = lens[i];
    const size_t n = size_t(kv.n_pages()) * lay.page_floats();
    kh = round_bf16(randn(n, rng));
    vh = round_bf16(randn(n, rng));
    std::copy(kh.begin(), kh.end(), kv.k_page(0, 0));
    std::copy(vh.begin(), vh.end(), kv.v_page(0, 0));
    q = round_bf16(randn(lens.size() * size_t(Hq) * D, rng));
  }
};

// What a CPU method that checks the GPU's traced sets (and continues with them up to near-ties)
// records: the trace to read, which request a page table is, and the set counts.
struct TracedSets {
  const CudaModel::QuestTrace* gpu = nullptr;
  std::map<const PageTable*, int> req_of;
  mutable int rows = 0, identical = 0, near_tie = 0, bad = 0;
  mutable double max_err = 0, max_diff_frac = 0;
  mutable double swapped_total = 0, set_total = 0;  // near-tie swapped tokens, set tokens (all sets)
};

// Whether the sorted sets g (GPU) and c (CPU) differ only by near-ties of the CPU's values v
// (v over [0, L)): every differing token's value lies within 2 err of the k-th largest value,
// err = the row's largest |GPU - CPU| value, so rounding alone could have swapped it. *frac:
// the share of a k-set swapped.
inline bool differ_by_near_ties(const std::vector<int32_t>& g, const std::vector<int32_t>& c,
                                const std::vector<float>& v, int64_t k, float err, double* frac) {
  std::vector<float> sorted(v);
  std::sort(sorted.begin(), sorted.end(), std::greater<float>());
  const float kth = sorted[size_t(k - 1)];
  std::vector<int32_t> diff;
  std::set_symmetric_difference(g.begin(), g.end(), c.begin(), c.end(), std::back_inserter(diff));
  *frac = double(diff.size()) / 2.0 / double(k);
  for (int32_t t : diff)
    if (t < 0 || t >= int64_t(v.size()) || std::fabs(v[size_t(t)] - kth) > 2.f * err) return false;
  return true;
}

// Top-p sets (the smallest best-first prefix of values v, by value descending and ties by
// the lower position, whose sum reaches a target: the CPU's oracle-topp and LycheeDecode
// topp): before[t] = the CPU's mass ranked before t, so t is in the CPU's set iff
// before[t] < target. A token whose membership differs between the GPU's set and the CPU's
// is a near-tie when before[t] lies within l1 + M(t) + 1e-6 of the target: l1 = the row's
// sum of |GPU value - CPU value| (how far the GPU's running sums can drift), M(t) = the
// mass of the other positions within 2 err of v[t] (err = the row's largest |GPU - CPU|
// value: those may rank on either side of t under rounding).
struct MassRanks {
  std::vector<double> before;
  explicit MassRanks(const std::vector<float>& v) : before(v.size()) {
    std::vector<int32_t> o(v.size());
    for (size_t i = 0; i < o.size(); ++i) o[i] = int32_t(i);
    std::stable_sort(o.begin(), o.end(), [&](int32_t a, int32_t b) { return v[size_t(a)] > v[size_t(b)]; });
    double acc = 0;
    for (int32_t i : o) before[size_t(i)] = acc, acc += v[size_t(i)];
  }
  bool in_set(int32_t t, double target) const { return before[size_t(t)] < target; }
  bool near(const std::vector<float>& v, int32_t t, double target, float err, double l1) const {
    double m = 0;
    for (size_t j = 0; j < v.size(); ++j)
      if (int32_t(j) != t && std::fabs(v[j] - v[size_t(t)]) <= 2.f * err) m += v[j];
    return std::fabs(before[size_t(t)] - target) <= l1 + m + 1e-6;
  }
};

// One row of a top-p union (oracle-topp group=union: one per query head of the KV head; a
// single row otherwise): the CPU's and the GPU's values over the same positions.
struct TopPRow {
  const std::vector<float>* cpu;
  const std::vector<float>* gpu;
};
// Whether the sorted sets g (GPU) and c (CPU), each the union over `rows` of the row's
// top-p set at `target`, differ only by near-ties (MassRanks): a token only the GPU keeps is
// a near-tie in some row; one only the CPU keeps, in every row whose CPU set holds it.
// *frac: the differing tokens / 2 over the CPU set's size; *max_err: the largest |GPU - CPU|.
inline bool topp_sets_near_ties(const std::vector<int32_t>& g, const std::vector<int32_t>& c,
                                const std::vector<TopPRow>& rows, double target, double* frac,
                                double* max_err) {
  std::vector<MassRanks> ranks;
  std::vector<float> err(rows.size(), 0.f);
  std::vector<double> l1(rows.size(), 0.0);
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto &a = *rows[i].cpu, &b = *rows[i].gpu;
    if (a.size() != b.size()) return false;
    for (size_t j = 0; j < a.size(); ++j) {
      const float e = std::fabs(a[j] - b[j]);
      err[i] = std::max(err[i], e);
      l1[i] += e;
    }
    *max_err = std::max(*max_err, double(err[i]));
    ranks.emplace_back(a);
  }
  std::vector<int32_t> only_g, only_c;
  std::set_difference(g.begin(), g.end(), c.begin(), c.end(), std::back_inserter(only_g));
  std::set_difference(c.begin(), c.end(), g.begin(), g.end(), std::back_inserter(only_c));
  *frac = double(only_g.size() + only_c.size()) / 2.0 / double(std::max<size_t>(1, c.size()));
  const int64_t L = rows.empty() ? 0 : int64_t(rows[0].cpu->size());
  for (int32_t t : only_g) {
    if (t < 0 || t >= L) return false;
    bool ok = false;
    for (size_t i = 0; i < rows.size() && !ok; ++i)
      ok = ranks[i].near(*rows[i].cpu, t, target, err[i], l1[i]);
    if (!ok) return false;
  }
  for (int32_t t : only_c)
    for (size_t i = 0; i < rows.size(); ++i)
      if (ranks[i].in_set(t, target) && !ranks[i].near(*rows[i].cpu, t, target, err[i], l1[i]))
        return false;
  return true;
}

// The selection model tests' run (TidalDecode, LessIsMore, LycheeDecode, oracle-topk): two
// requests of na / nb random tokens (rng seeded with `seed`) prefilled together on the CPU,
// through sessions s0 / s1 of a tracing method, and on `gpu` (tracing into `trace`); the dense
// prefill logits must agree within 3e-2 (test_cuda_model.cpp). Then `started(pc)` (the CPU
// page tables of the two requests: the method maps them to request indexes and starts
// comparing) and `steps` batched decode steps feeding both the same random tokens, the trace
// cleared before each; every step's logits must agree within `tol`. Returns the worst step's
// rel err.
inline double traced_decode_compare(CpuModel& cpu, sparse::SparseSession& s0,
                                    sparse::SparseSession& s1, CudaModel& gpu,
                                    CudaModel::QuestTrace& trace, int na, int nb, int steps,
                                    double tol, uint32_t seed,
                                    const std::function<void(const PageTable* pc)>& started) {
  const int vocab = cpu.config().vocab;
  gpu.quest_trace = &trace;
  PageTable pc[2], pg[2];
  std::mt19937 rng(seed);
  auto a = random_tokens(rng, na, vocab), b = random_tokens(rng, nb, vocab);
  std::vector<int64_t> rc, rg;
  {
    const auto& lc = cpu.forward({{&pc[0], a.data(), na, false, &s0.attention()},
                                  {&pc[1], b.data(), nb, false, &s1.attention()}}, rc);
    const auto& lg = gpu.forward({{&pg[0], a.data(), na, false}, {&pg[1], b.data(), nb, false}}, rg);
    EXPECT_LT(rel_err(lg, lc), 3e-2) << "prefill";
  }
  started(pc);
  double worst = 0;
  for (int s = 0; s < steps; ++s) {
    trace.sel.clear();
    trace.scores.clear();
    trace.kept.clear();
    trace.logits.clear();
    int32_t ta = int32_t(rng() % uint32_t(vocab)), tb = int32_t(rng() % uint32_t(vocab));
    std::vector<float> lg = gpu.forward({{&pg[0], &ta, 1, false}, {&pg[1], &tb, 1, false}}, rg);
    const auto& lc = cpu.forward({{&pc[0], &ta, 1, false, &s0.attention()},
                                  {&pc[1], &tb, 1, false, &s1.attention()}}, rc);
    const double e = rel_err(lg, lc);
    worst = std::max(worst, e);
    EXPECT_LT(e, tol) << "decode step " << s;
  }
  return worst;
}

// The real-model GPU tests' inputs: SmolLM2-135M-Instruct (SPADE_MODEL or the file `make run`
// fetches) and a ~1300-token prompt, the three texts of python/prompts/ in a row.
inline std::string smollm2_model_file() {
  if (const char* p = std::getenv("SPADE_MODEL")) return p;
  return source_dir() + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
}

inline std::string smollm2_prompt_text() {
  std::string text;
  for (const char* f : {"kjv_genesis1.txt", "story_lighthouse.txt", "technical_kv_cache.txt"}) {
    std::ifstream in(source_dir() + "/python/prompts/" + f);
    std::stringstream ss;
    ss << in.rdbuf();
    text += ss.str() + "\n\n";
  }
  return text + "Summarize the three texts above in one sentence each.\n";
}

}  // namespace spade::test
