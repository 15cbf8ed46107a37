// Tensor parallelism on the GPU (issue 39): CudaModel shards (dist::shard_weights) whose
// o-proj / down-proj partials are all-reduced over NCCL (CudaModelOptions::tp), against one
// CudaModel of the whole model. Ranks are threads of this process, rank r on GPU r, each with
// its own TcpCommunicator (the rendezvous, as the CLI's ranks) and NcclCommunicator.
//   CudaTp.TinyLlamaTp2MatchesTp1   prefill (two sequences in one step) + 8 decode steps,
//                                   graphs off and on (decode steps replay captured graphs)
//   CudaTp.RunnerProtocolTp2        TpStepModel on rank 0 (make_tp_runner, device cuda) and
//                                   run_follower_rank on rank 1: logits and device sampling
//   CudaTp.SmolLM2Tp3MatchesTp1     the real model (Q4_1 file, dequantized) at TP=3
//   CudaTp.SparseMethodsTp2MatchTp1 every GPU method (and the stacks) as the ranks' own method:
//                                   selections per (step, layer, request, KV head) against
//                                   TP=1's (traced, eager; near-tie swaps <= 15% of lists),
//                                   logits graphs off and on up to the first swap
//   CudaTp.SparseMethodsPerRequestTp2  TpStepModel with per-request methods (the plan names
//                                   each request's method; followers add it) vs TP=1
// (The TPOT probe at TP = 1, 2, ... is in test_cuda_tp_speed.cpp.)
// Each test skips with a message when fewer GPUs are visible than it needs, or when the build
// has no NCCL. All passed on two H200s (2026-11-29, bench/run_gpu_tp.sh).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../test_util.h"
#include "../tp_test_util.h"
#include "dist/shard.h"
#include "dist/tcp_communicator.h"
#include "dist/tp_runner.h"
#include "engine/runner.h"
#include "gpu_model_util.h"
#include "model/cuda_model.h"
#include "model/loader.h"
#include "sparse/gpu/cuda_sparse.h"
#include "sparse/options.h"
#if defined(SPADE_HAVE_NCCL)
#include "dist/nccl_communicator.h"
#endif

using namespace spade;
using namespace spade::dist;
using namespace spade::test;

namespace {

int visible_gpus() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

#if defined(SPADE_HAVE_NCCL)
#define SKIP_WITHOUT_NCCL() \
  do {                      \
  } while (0)
#else
#define SKIP_WITHOUT_NCCL() GTEST_SKIP() << "this build has no NCCL (SPADE_HAVE_NCCL)"
#endif

#define SKIP_UNLESS_GPUS(n)                                                              \
  do {                                                                                   \
    SKIP_WITHOUT_GPU();                                                                  \
    SKIP_WITHOUT_NCCL();                                                                 \
    if (visible_gpus() < (n))                                                            \
      GTEST_SKIP() << "needs " << (n) << " GPUs, " << visible_gpus() << " visible";      \
  } while (0)

#if defined(SPADE_HAVE_NCCL)
// GPU ranks: a minute to meet (NCCL's init), two between messages.
std::vector<std::exception_ptr> run_gpu_ranks(int n, const std::function<void(Communicator&)>& fn) {
  return test::run_ranks(n, fn, tp_quick(std::chrono::seconds(60), std::chrono::seconds(120)));
}

// The steps every run feeds: two sequences prefilled in one step (lengths na, nb), then
// `decode` steps of one fixed token each (the same on every rank: no sampling needed).
struct Script {
  std::vector<int32_t> a, b;  // prompts
  std::vector<std::vector<int32_t>> dec;  // per step: the token of a, of b
};

Script make_script(int vocab, int na, int nb, int decode, uint32_t seed) {
  std::mt19937 rng(seed);
  Script s;
  s.a = random_tokens(rng, na, vocab);
  s.b = random_tokens(rng, nb, vocab);
  for (int i = 0; i < decode; ++i) s.dec.push_back(random_tokens(rng, 2, vocab));
  return s;
}

// Runs the script on `m`; returns the logits of every step ([steps][2 * V]) when the model
// computes them (empty rows on followers). `pages` gets each sequence's final page table.
std::vector<std::vector<float>> run_script(CudaModel& m, const Script& s,
                                           std::vector<std::vector<int32_t>>* pages = nullptr) {
  PageTable pa, pb;
  std::vector<std::vector<float>> out;
  std::vector<int64_t> row_of;
  auto step = [&](const int32_t* ta, int64_t na, const int32_t* tb, int64_t nb) {
    std::vector<SeqInput> batch(2);
    batch[0].pages = &pa, batch[0].tokens = ta, batch[0].n_tokens = na;
    batch[1].pages = &pb, batch[1].tokens = tb, batch[1].n_tokens = nb;
    out.push_back(m.forward(batch, row_of));
  };
  step(s.a.data(), int64_t(s.a.size()), s.b.data(), int64_t(s.b.size()));
  for (const auto& d : s.dec) step(&d[0], 1, &d[1], 1);
  if (pages) *pages = {pa.pages, pb.pages};
  m.release(pa);
  m.release(pb);
  return out;
}

CudaModelOptions small_options(bool graphs) {
  CudaModelOptions o;
  o.kv_pages = 64;
  o.max_batch = 4;
  o.max_step_tokens = 512;
  o.cuda_graphs = graphs;
  return o;
}

// The script at TP=n: rank r on GPU r, its shard of `w`; returns rank 0's logits. Checks
// that every rank's page tables equal rank 0's and (graphs) that decode steps replayed.
std::vector<std::vector<float>> run_tp(const ModelWeights& w, int n, const Script& s,
                                       bool graphs) {
  std::vector<std::vector<float>> logits;
  std::vector<std::vector<std::vector<int32_t>>> pages(static_cast<size_t>(n));
  std::vector<uint64_t> replays(static_cast<size_t>(n), 0);
  auto err = run_gpu_ranks(n, [&](Communicator& tcp) {
    const int r = tcp.rank();
    SPADE_CUDA(cudaSetDevice(r));
    ModelWeights shard = shard_weights(w, r, n);
    NcclCommunicator nccl(tcp, r);
    CudaModelOptions o = small_options(graphs);
    o.tp = &nccl;
    o.logits = r == 0;
    CudaModel m(shard, o);
    auto lg = run_script(m, s, &pages[size_t(r)]);
    replays[size_t(r)] = m.graph_counters().replays.load();
    if (r == 0) logits = std::move(lg);
    else
      for (const auto& row : lg) EXPECT_TRUE(row.empty()) << "rank " << r << " computed logits";
    nccl.barrier();
  });
  expect_ok(err);
  for (int r = 1; r < n; ++r) EXPECT_EQ(pages[size_t(r)], pages[0]) << "rank " << r << "'s pages";
  for (int r = 0; r < n; ++r) {
    if (graphs)
      EXPECT_GE(replays[size_t(r)], s.dec.size() - 2) << "rank " << r << ": decode graphs";
    else
      EXPECT_EQ(replays[size_t(r)], 0u) << "rank " << r;
  }
  return logits;
}

std::vector<std::vector<float>> run_tp1(const ModelWeights& w, const Script& s, bool graphs) {
  SPADE_CUDA(cudaSetDevice(0));
  CudaModel m(w, small_options(graphs));
  return run_script(m, s);
}

// Step by step: rel_err (the GPU model tests' measure) within `tol`; returns the worst.
double compare_steps(const std::vector<std::vector<float>>& got,
                     const std::vector<std::vector<float>>& want, double tol, const char* what) {
  EXPECT_EQ(got.size(), want.size()) << what;
  double worst = 0;
  for (size_t i = 0; i < std::min(got.size(), want.size()); ++i) {
    const double e = rel_err(got[i], want[i]);
    worst = std::max(worst, e);
    EXPECT_LT(e, tol) << what << ": step " << i;
  }
  return worst;
}

constexpr double kTolLogits = 3e-2;  // test_cuda_model.cpp's GPU-vs-CPU bar (rel_err)

// ---- sparse methods

// One spec per GPU method and stack (budgets below the script's 300 / 200-token prompts), for
// sparse_tp_config's 4 KV heads: two per rank at TP=2 (LycheeDecode's roles RRRR/SRRS/RSSR
// slice to RR/SR/RS and RR/RS/SR).
std::vector<std::string> gpu_tp_specs() {
  return {"streaming:budget=64,sinks=4",
          "quest:budget=64,dense_layers=1",
          "tidal:budget=64",
          "lessismore:budget=64",
          "lycheedecode:roles=RRRR/SRRS/RSSR,budget=64",
          "lycheedecode:roles=RRRR/SRRS/RSSR,mode=topp,p=0.9,block=16",
          "oracle-topk:budget=64",
          "oracle-topp:p=0.9",
          "oracle-topp:p=0.9,group=mean",
          "blasst",
          "twilight:base=quest,budget=128",
          "lycheecluster:budget=64,dense_layers=1,chunking=fixed",
          "quest+blasst:budget=64",
          "tidal+twilight:budget=64,dense_layers=1,selection_layers=1",
          "twilight:base=lessismore,budget=64,dense_layers=1,selection_layers=1"};
}

// Per decode step, layer, list: the positions (GpuSelectionTrace::sel of each step).
using GpuSel = std::vector<std::vector<std::vector<std::vector<int32_t>>>>;

// The script with the model's own method: each sequence with its request state (LycheeCluster
// keeps one); with `sel`, every decode step's selections (traced: eager steps).
std::vector<std::vector<float>> run_sparse_script(CudaModel& m, const Script& s, GpuSel* sel) {
  CudaModel::QuestTrace tr;
  if (sel) m.quest_trace = &tr;
  auto sa = m.new_request_state(), sb = m.new_request_state();
  PageTable pa, pb;
  std::vector<std::vector<float>> out;
  std::vector<int64_t> row_of;
  auto step = [&](const int32_t* ta, int64_t na, const int32_t* tb, int64_t nb) {
    std::vector<SeqInput> batch(2);
    batch[0].pages = &pa, batch[0].tokens = ta, batch[0].n_tokens = na;
    batch[1].pages = &pb, batch[1].tokens = tb, batch[1].n_tokens = nb;
    batch[0].device_state = sa.get(), batch[1].device_state = sb.get();
    tr.sel.clear(), tr.scores.clear(), tr.kept.clear(), tr.logits.clear();
    out.push_back(m.forward(batch, row_of));
  };
  step(s.a.data(), int64_t(s.a.size()), s.b.data(), int64_t(s.b.size()));
  for (const auto& d : s.dec) {
    step(&d[0], 1, &d[1], 1);
    if (sel) sel->push_back(tr.sel);
  }
  m.quest_trace = nullptr;
  m.release(pa);
  m.release(pb);
  return out;
}

// Rank r's selections against TP=1's: per-KV-head lists (B * Hkv at TP=1) are rank r's heads
// [r * Hkv / n, ...); one list per request (LessIsMore, streaming: B lists) is every rank's.
// Returns the lists compared, counts in `differ` those not identical and lowers `first_diff`
// to the first decode step with one. A differing list may differ in at most a quarter of its
// entries + 2 (one page or chunk swapped): near-ties of scores that the ranks' all-reduce order
// moved by an ulp (random keys give Quest's page bounds many), never a wrong head. `unit`
// raises that bound to 2 x unit entries where a method swaps larger units: LycheeCluster
// chooses whole clusters of chunks (up to its budget), and the H200 saw lists of ~100 entries
// differ by 32-96 (2-6 chunks) there.
int64_t compare_sel(const GpuSel& one, const GpuSel& mine, int r, int n, int B, int Hkv,
                    int64_t* differ, size_t* first_diff, const std::string& what, int64_t unit = 0) {
  int64_t compared = 0;
  EXPECT_EQ(mine.size(), one.size()) << what << ": rank " << r << " decode steps";
  for (size_t st = 0; st < std::min(one.size(), mine.size()); ++st) {
    EXPECT_EQ(mine[st].size(), one[st].size()) << what << ": step " << st << " layers";
    for (size_t l = 0; l < std::min(one[st].size(), mine[st].size()); ++l) {
      const auto& a = one[st][l];
      const auto& b = mine[st][l];
      if (a.empty() && b.empty()) continue;  // a dense layer
      const bool shared = int64_t(a.size()) == B;
      const int hl = Hkv / n;
      EXPECT_EQ(int64_t(b.size()), shared ? B : int64_t(B) * hl) << what << ": step " << st
                                                                  << " layer " << l;
      if (int64_t(b.size()) != (shared ? B : int64_t(B) * hl)) continue;
      for (size_t i = 0; i < b.size(); ++i) {
        const size_t j = shared ? i : size_t(i / hl) * size_t(Hkv) + size_t(r * hl) + i % hl;
        ++compared;
        if (b[i] == a[j]) continue;
        ++*differ;
        *first_diff = std::min(*first_diff, st);
        std::vector<int32_t> x = a[j], y = b[i], d;
        std::sort(x.begin(), x.end()), std::sort(y.begin(), y.end());
        std::set_symmetric_difference(x.begin(), x.end(), y.begin(), y.end(), std::back_inserter(d));
        EXPECT_LE(double(d.size()), std::max(0.25 * double(a[j].size()) + 2, 2.0 * double(unit)))
            << what << ": rank " << r << " step " << st << " layer " << l << " list " << i
            << ": " << y.size() << " positions vs " << x.size() << " at TP=1";
      }
    }
  }
  return compared;
}

// tiny_config with 4 KV heads (G = 2): two KV heads per rank at TP=2.
ModelConfig sparse_tp_config() {
  ModelConfig c = tiny_config(Arch::Llama, 128, 3, 4096);  // Hq 8, D 128, ffn 512
  c.n_kv_heads = 4;
  return c;
}

CudaModelOptions sparse_rank_options(bool graphs, const sparse::SparseConfig& sc,
                                     const ModelConfig& full) {
  CudaModelOptions o = small_options(graphs);
  // The same bits on every run (static decode schedule): the graphs-on run repeats the traced
  // eager run, so its selections diverge from TP=1's at the same step.
  o.deterministic = true;
  o.sparse = cuda_sparse_config(sc, full, o.page_size);
  return o;
}
#endif  // SPADE_HAVE_NCCL

}  // namespace

TEST(CudaTp, TinyLlamaTp2MatchesTp1) {
  SKIP_UNLESS_GPUS(2);
#if defined(SPADE_HAVE_NCCL)
  ModelConfig c = tiny_config(Arch::Llama, 128, 3, 4096);  // Hq 8, Hkv 2, D 128, ffn 512
  ModelWeights w = random_model(c, 91);
  round_weights_bf16(w);
  const Script s = make_script(c.vocab, 37, 20, 8, 5);
  for (bool graphs : {false, true}) {
    const auto want = run_tp1(w, s, graphs);
    const auto got = run_tp(w, 2, s, graphs);
    const double worst = compare_steps(got, want, kTolLogits, graphs ? "graphs on" : "graphs off");
    std::printf("[cuda tp] tiny Llama TP=2 vs TP=1 (graphs %s): worst rel err %.3g over %zu steps\n",
                graphs ? "on" : "off", worst, got.size());
  }
#endif
}

TEST(CudaTp, RunnerProtocolTp2) {
  SKIP_UNLESS_GPUS(2);
#if defined(SPADE_HAVE_NCCL)
  ModelConfig c = tiny_config(Arch::Qwen2, 128, 2, 4096);  // biases, untied LM head
  ModelWeights w = random_model(c, 17);
  round_weights_bf16(w);
  const Script s = make_script(c.vocab, 29, 11, 6, 8);
  // TP=1 reference: logits of every step.
  const auto want = run_tp1(w, s, true);
  RunnerOptions ro;
  ro.device = "cuda";
  ro.kv_pages = 64;
  ro.max_batch = 4;
  ro.max_step_tokens = 512;
  ro.tp = 2;
  auto listener = std::make_shared<TcpListener>("127.0.0.1:0");
  const std::string addr = "127.0.0.1:" + std::to_string(listener->port());
  ro.dist_init = addr;
  ro.dist_listener = listener;
  std::exception_ptr follower_err;
  std::thread follower([&] {
    try {
      run_follower_rank(w, addr, 1, 2);  // GPU cuda_device_of_rank(1) = 1
    } catch (...) {
      follower_err = std::current_exception();
    }
  });
  std::vector<std::vector<float>> got;
  std::vector<int32_t> sampled;
  try {
    SPADE_CUDA(cudaSetDevice(0));
    Runner run = make_tp_runner(w, ro);
    StepModel& m = *run.model;
    EXPECT_NE(m.device().find("--tp 2"), std::string::npos) << m.device();
    ASSERT_TRUE(m.samples_on_device());
    PageTable pa, pb;
    std::vector<int64_t> row_of;
    auto batch_of = [&](const int32_t* ta, int64_t na, const int32_t* tb, int64_t nb) {
      std::vector<SeqInput> b(2);
      b[0].pages = &pa, b[0].tokens = ta, b[0].n_tokens = na;
      b[1].pages = &pb, b[1].tokens = tb, b[1].n_tokens = nb;
      return b;
    };
    got.push_back(m.forward(batch_of(s.a.data(), int64_t(s.a.size()), s.b.data(),
                                     int64_t(s.b.size())), row_of));
    for (size_t i = 0; i < s.dec.size(); ++i) {
      const auto& d = s.dec[i];
      if (i % 2 == 0) {
        got.push_back(m.forward(batch_of(&d[0], 1, &d[1], 1), row_of));
      } else {  // greedy on rank 0's GPU, launch / wait (the scheduler's path)
        std::vector<StepModel::RowSampling> rows(2);
        m.forward_sample_launch(batch_of(&d[0], 1, &d[1], 1), rows);
        const std::vector<int32_t> t = m.forward_sample_wait();
        ASSERT_EQ(t.size(), 2u);
        sampled.insert(sampled.end(), t.begin(), t.end());
        got.emplace_back();  // no logits this step
      }
    }
    m.release(pa);
    m.release(pb);
    EXPECT_EQ(m.free_pages(), m.total_pages());
  } catch (const std::exception& e) {
    ADD_FAILURE() << "rank 0: " << e.what();
  }
  follower.join();
  if (follower_err) expect_ok({nullptr, follower_err});
  ASSERT_EQ(got.size(), want.size());
  const int V = c.vocab;
  size_t k = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!got[i].empty()) {
      EXPECT_LT(rel_err(got[i], want[i]), kTolLogits) << "step " << i;
      continue;
    }
    for (int q = 0; q < 2 && k < sampled.size(); ++q, ++k) {  // greedy: TP=1's argmax or a near-tie
      const float* row = want[i].data() + size_t(q) * size_t(V);
      const float best = *std::max_element(row, row + V);
      ASSERT_GE(sampled[k], 0);
      ASSERT_LT(sampled[k], V);
      EXPECT_GE(row[sampled[k]], best - 2e-2f * std::max(1.f, std::fabs(best)))
          << "step " << i << " seq " << q << ": token " << sampled[k];
    }
  }
  EXPECT_EQ(k, sampled.size());
#endif
}

TEST(CudaTp, SmolLM2Tp3MatchesTp1) {
  SKIP_UNLESS_GPUS(3);
#if defined(SPADE_HAVE_NCCL)
  const std::string path = smollm2_model_file();
  if (!std::ifstream(path).good()) GTEST_SKIP() << "model not found: " << path;
  auto w = load_model(path);
  round_weights_bf16(*w);
  const Script s = make_script(w->config.vocab, 200, 64, 8, 3);
  for (bool graphs : {false, true}) {
    const auto want = run_tp1(*w, s, graphs);
    const auto got = run_tp(*w, 3, s, graphs);
    const double worst = compare_steps(got, want, kTolLogits, graphs ? "graphs on" : "graphs off");
    std::printf("[cuda tp] SmolLM2 TP=3 vs TP=1 (graphs %s): worst rel err %.3g over %zu steps\n",
                graphs ? "on" : "off", worst, got.size());
  }
#endif
}


// Every GPU method as the ranks' own method (parsed for the whole model, its per-head tables
// sliced: CudaModelOptions::tp_model / tp_kv0), TP=2 vs TP=1: traced eager steps give each
// decode step's selections (per KV head: the rank's heads; one list per request: every
// rank's), then logits with graphs off and on (the LessIsMore gather inside the graph).
TEST(CudaTp, SparseMethodsTp2MatchTp1) {
  SKIP_UNLESS_GPUS(2);
#if defined(SPADE_HAVE_NCCL)
  const ModelConfig c = sparse_tp_config();  // Hq 8, Hkv 4, D 128
  ModelWeights w = random_model(c, 93);
  round_weights_bf16(w);
  const Script s = make_script(c.vocab, 300, 200, 10, 7);
  const int n = 2;
  const std::vector<std::string> specs = gpu_tp_specs();
  // Runs k = 2 * spec + graphs: TP=1 first (GPU 0), then every run on the ranks, which join
  // NCCL once.
  const size_t runs = specs.size() * 2;
  std::vector<std::vector<std::vector<float>>> want(runs), got(runs);
  std::vector<GpuSel> one_sel(runs);
  std::vector<std::vector<GpuSel>> sel(runs, std::vector<GpuSel>(static_cast<size_t>(n)));
  for (size_t k = 0; k < runs; ++k) {
    const bool graphs = k % 2 == 1;
    SPADE_CUDA(cudaSetDevice(0));
    CudaModel m(w, sparse_rank_options(graphs, sparse::SparseConfig::parse_spec(specs[k / 2]), c));
    want[k] = run_sparse_script(m, s, graphs ? nullptr : &one_sel[k]);
  }
  auto err = run_gpu_ranks(n, [&](Communicator& tcp) {
    const int r = tcp.rank();
    SPADE_CUDA(cudaSetDevice(r));
    ModelWeights shard = shard_weights(w, r, n);
    NcclCommunicator nccl(tcp, r);
    for (size_t k = 0; k < runs; ++k) {
      const bool graphs = k % 2 == 1;
      CudaModelOptions o =
          sparse_rank_options(graphs, sparse::SparseConfig::parse_spec(specs[k / 2]), c);
      o.tp = &nccl;
      o.logits = r == 0;
      o.tp_model = c;
      o.tp_kv0 = r * shard.config.n_kv_heads;
      CudaModel m(shard, o);
      auto lg = run_sparse_script(m, s, graphs ? nullptr : &sel[k][size_t(r)]);
      if (r == 0) got[k] = std::move(lg);
      nccl.barrier();
    }
  });
  expect_ok(err);
  int64_t all_compared = 0, all_differ = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    const std::string& spec = specs[i];
    SCOPED_TRACE(spec);
    // Selections (the traced run, graphs off): the first decode step where one differs.
    const size_t off = 2 * i, on = 2 * i + 1;
    int64_t compared = 0, differ = 0;
    size_t first_diff = s.dec.size();
    // LycheeCluster's unit of choice is a cluster: at most its budget of tokens.
    const CudaSparse cs = cuda_sparse_config(sparse::SparseConfig::parse_spec(spec), c, 16);
    const int64_t unit = cs.method == CudaSparse::Method::LycheeCluster ? int64_t(cs.budget) : 0;
    for (int r = 0; r < n; ++r)
      compared += compare_sel(one_sel[off], sel[off][size_t(r)], r, n, 2, c.n_kv_heads, &differ,
                              &first_diff, spec, unit);
    all_compared += compared, all_differ += differ;
    // Logits up to that step (after a near-tie swap the paths part: a swapped page or chunk
    // moves a random model's logits by more than bf16's tolerance): the prefill and the decode
    // steps before it, graphs off and on (the deterministic runs repeat each other's bits).
    const size_t keep = 1 + first_diff;
    for (size_t k : {off, on}) {
      ASSERT_EQ(got[k].size(), want[k].size());
      const std::vector<std::vector<float>> g(got[k].begin(), got[k].begin() + keep),
          wt(want[k].begin(), want[k].begin() + keep);
      const double worst = compare_steps(g, wt, kTolLogits, k == on ? "graphs on" : "graphs off");
      std::printf("[cuda tp] %s TP=2 vs TP=1 (graphs %s): worst rel err %.3g over %zu of %zu "
                  "steps; selections: %lld lists compared, %lld differ (first at decode step "
                  "%zu of %zu)\n", spec.c_str(), k == on ? "on" : "off", worst, keep,
                  want[k].size(), (long long)compared, (long long)differ, first_diff,
                  s.dec.size());
    }
  }
  // Near-tie swaps only: most lists are TP=1's exactly (the ranks' residual is TP=1's up to the
  // all-reduce's fp32 summation order, so a bf16 element may round the other way; an H200 run
  // of the first version saw 55 of 880 lists differ).
  std::printf("[cuda tp] selections: %lld of %lld lists differ from TP=1's (%.2f%%)\n",
              (long long)all_differ, (long long)all_compared,
              all_compared ? 100.0 * double(all_differ) / double(all_compared) : 0.0);
  EXPECT_LE(double(all_differ), 0.15 * double(all_compared))
      << all_differ << " of " << all_compared << " selection lists differ from TP=1's";
  EXPECT_GT(all_compared, 0);
#endif
}

// The runner: TpStepModel on GPU 0 (make_tp_runner, device cuda) and run_follower_rank on GPU 1;
// the two requests run different methods (new_request_state per request: the plan names each
// request's method on its first step, the follower adds it to its CudaModel), against one
// CudaModel running the same methods per request.
TEST(CudaTp, SparseMethodsPerRequestTp2) {
  SKIP_UNLESS_GPUS(2);
#if defined(SPADE_HAVE_NCCL)
  const ModelConfig c = sparse_tp_config();
  ModelWeights w = random_model(c, 94);
  round_weights_bf16(w);
  const Script s = make_script(c.vocab, 300, 200, 8, 9);
  const std::vector<std::pair<std::string, std::string>> pairs = {
      {"lessismore:budget=64", "quest:budget=64,dense_layers=1"},
      {"lycheedecode:roles=RRRR/SRRS/RSSR,budget=64", "tidal:budget=64"},
      {"oracle-topk:budget=64", "twilight:base=quest,budget=128"}};
  for (const auto& [ma, mb] : pairs) {
    SCOPED_TRACE(ma + " | " + mb);
    const auto ca = sparse::SparseConfig::parse_spec(ma), cb = sparse::SparseConfig::parse_spec(mb);
    // Both runs feed the same steps through a StepModel with per-request methods.
    auto drive = [&](StepModel& m) {
      auto sa = m.new_request_state(&ca), sb = m.new_request_state(&cb);
      PageTable pa, pb;
      std::vector<std::vector<float>> out;
      std::vector<int64_t> row_of;
      auto step = [&](const int32_t* ta, int64_t na, const int32_t* tb, int64_t nb) {
        std::vector<SeqInput> b(2);
        b[0].pages = &pa, b[0].tokens = ta, b[0].n_tokens = na, b[0].device_state = sa.get();
        b[1].pages = &pb, b[1].tokens = tb, b[1].n_tokens = nb, b[1].device_state = sb.get();
        out.push_back(m.forward(b, row_of));
      };
      step(s.a.data(), int64_t(s.a.size()), s.b.data(), int64_t(s.b.size()));
      for (const auto& d : s.dec) step(&d[0], 1, &d[1], 1);
      m.release(pa);
      m.release(pb);
      return out;
    };
    RunnerOptions ro;
    ro.device = "cuda";
    ro.kv_pages = 64;
    ro.max_batch = 4;
    ro.max_step_tokens = 512;
    std::vector<std::vector<float>> want;
    {
      SPADE_CUDA(cudaSetDevice(0));
      Runner one = make_runner(w, ro);  // per_request_methods: any method per request
      want = drive(*one.model);
    }
    ro.tp = 2;
    auto listener = std::make_shared<TcpListener>("127.0.0.1:0");
    const std::string addr = "127.0.0.1:" + std::to_string(listener->port());
    ro.dist_init = addr;
    ro.dist_listener = listener;
    std::exception_ptr follower_err;
    std::thread follower([&] {
      try {
        run_follower_rank(w, addr, 1, 2);
      } catch (...) {
        follower_err = std::current_exception();
      }
    });
    std::vector<std::vector<float>> got;
    try {
      SPADE_CUDA(cudaSetDevice(0));
      Runner run = make_tp_runner(w, ro);
      EXPECT_TRUE(run.model->runs_methods());
      got = drive(*run.model);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "rank 0: " << e.what();
    }
    follower.join();
    if (follower_err) expect_ok({nullptr, follower_err});
    const double worst = compare_steps(got, want, kTolLogits, "per-request methods");
    std::printf("[cuda tp] per request %s | %s TP=2 vs TP=1: worst rel err %.3g\n", ma.c_str(),
                mb.c_str(), worst);
  }
#endif
}
