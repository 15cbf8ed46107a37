// Every CPU sparse method under tensor parallelism (issue 39; src/dist/tp_runner.h): rank 0's
// TpStepModel runs each request's method as a SparseSession on every rank over the rank's KV
// heads (the plan names the method on the request's first step). Against one rank (CpuModel
// over the whole pool, one SparseSession per request): every decode layer's selection equals
// the one-rank selection head by head (LessIsMore's one set for all heads gathered across the
// ranks, LycheeDecode's roles read at the rank's heads), and the logits agree within the dense
// TP tests' tolerance (1e-5 of the largest logit: only the all-reduce's summation order
// differs). Ranks are threads of this process on 127.0.0.1.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "dist/tcp_communicator.h"
#include "dist/tp_runner.h"
#include "engine/runner.h"
#include "model/cpu_model.h"
#include "sparse/head_roles.h"
#include "sparse/methods/lycheedecode.h"
#include "sparse/registry.h"
#include "sparse/session.h"
#include "test_util.h"

using namespace spade;
using namespace spade::dist;

namespace {

// 4 layers, 12 query heads over 6 KV heads: splits over 2 and 3 ranks.
ModelConfig sparse_tp_config() {
  ModelConfig c = test::tiny_config(Arch::Llama);
  c.n_layers = 4;
  c.hidden = 64;
  c.n_heads = 12;
  c.n_kv_heads = 6;
  c.head_dim = 16;
  c.ffn = 96;
  return c;
}

constexpr int kPage = 4;

// One spec per registry method (and a stack, a structure-aware chunking fed token text).
std::vector<std::string> specs() {
  return {
      "full",
      "streaming:budget=48",
      "quest:budget=64",
      "tidal:budget=48,dense_layers=1,selection_layers=1,3",
      "lessismore:budget=64,dense_layers=1,selection_layers=1,3",
      "oracle-topk:budget=40",
      "oracle-topp:p=0.5",
      "oracle-topp:p=0.6,group=mean",
      "lycheecluster:budget=64,chunking=fixed",
      "lycheecluster:budget=64",
      "lycheedecode:roles=RRRRRR/SRSSRS/RSRSSR/SSRRSS,budget=48",
      "twilight:budget=64",
      "blasst:lambda=0.9,tile=8,prefill_tile=8,q_block=16",
      "blasst:lambda=0.9,tile=8,prefill_tile=8,q_block=16,base=lessismore,budget=64,dense_layers=1,selection_layers=1,3",
  };
}

std::string piece(int32_t id) {  // token text for the methods that read it
  static const char* words[] = {"int ", "x", " = ", "1;\n", "{", "}\n", "return ", "(", ")", ", "};
  return words[size_t(id) % 10];
}

// Per (sequence, decode step, layer): each KV head's positions.
using Trace = std::map<std::tuple<int, int64_t, int>, std::vector<std::vector<int32_t>>>;

std::vector<int32_t> head_positions(const sparse::Selection& s, int h) {
  const int64_t n = s.count(h);
  const int32_t* p = s.head(h);
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[size_t(i)] = p ? p[i] : int32_t(i);
  return v;
}

// The schedule: `n_seq` sequences, each prefilled in two chunks (the second sequence starts a
// step later, so prefill and decode mix), then decoded one token per step; tokens are fixed
// (teacher-forced), so both runs see the same inputs.
struct RankRun {
  std::vector<std::vector<float>> logits;  // per step, rows of every sequence
  Trace trace;
};

std::vector<int32_t> tokens_of(int seq, int64_t n, int vocab) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) t[size_t(i)] = int32_t((seq * 37 + i * 13 + (i * i) % 7) % vocab);
  return t;
}

constexpr int64_t kPrompt = 100, kDecode = 24;

// Drives `model` through the schedule; `attn[i]` / `state[i]` is sequence i's method (one of
// them), `text[i]` feeds token text.
RankRun drive(StepModel& model, int n_seq, const std::vector<const AttentionFn*>& attn,
          const std::vector<sparse::MethodState*>& state,
          const std::vector<std::function<void(std::string_view)>>& text) {
  const int vocab = model.config().vocab;
  std::vector<PageTable> pts(static_cast<size_t>(n_seq));
  std::vector<std::vector<int32_t>> toks;
  for (int i = 0; i < n_seq; ++i) toks.push_back(tokens_of(i, kPrompt + kDecode, vocab));
  std::vector<int64_t> fed(size_t(n_seq), 0);
  RankRun out;
  for (int step = 0;; ++step) {
    std::vector<SeqInput> batch;
    std::vector<int> who;
    for (int i = 0; i < n_seq; ++i) {
      if (step < i) continue;  // sequence i starts at step i
      const int64_t at = fed[size_t(i)];
      if (at >= kPrompt + kDecode) continue;
      const int64_t n = at == 0 ? 60 : at < kPrompt ? kPrompt - at : 1;
      for (int64_t t = at; t < at + n; ++t)
        if (text[size_t(i)]) text[size_t(i)](piece(toks[size_t(i)][size_t(t)]));
      SeqInput in;
      in.pages = &pts[size_t(i)];
      in.tokens = toks[size_t(i)].data() + at;
      in.n_tokens = n;
      in.attention = attn[size_t(i)];
      in.device_state = state[size_t(i)];
      batch.push_back(in);
      who.push_back(i);
      fed[size_t(i)] += n;
    }
    if (batch.empty()) break;
    std::vector<int64_t> row_of;
    out.logits.push_back(model.forward(batch, row_of));
  }
  for (PageTable& pt : pts) model.release(pt);
  return out;
}

// One rank: CpuModel over the whole pool, a SparseSession per sequence.
RankRun one_rank(const ModelWeights& w, const std::vector<std::string>& seq_specs) {
  const ModelConfig& c = w.config;
  KVPool kv({c.n_layers, c.n_kv_heads, c.head_dim, kPage}, 1024);
  CpuModel m(w, kv);
  CpuStepModel step(m);
  const int n = int(seq_specs.size());
  std::vector<std::unique_ptr<sparse::SparseSession>> ss;
  std::vector<const AttentionFn*> attn;
  std::vector<std::function<void(std::string_view)>> text;
  Trace trace;
  std::vector<int64_t> steps(size_t(n), -1);
  for (int i = 0; i < n; ++i) {
    auto cfg = sparse::SparseConfig::parse_spec(seq_specs[size_t(i)]);
    if (cfg.method == "full" && cfg.options.empty()) {  // the dense path, as the TP runner's
      attn.push_back(nullptr);
      text.push_back(nullptr);
      continue;
    }
    ss.push_back(std::make_unique<sparse::SparseSession>(sparse::make_method(cfg, c), c, kv));
    sparse::SparseSession* s = ss.back().get();
    s->on_select = [&trace, &steps, i, c](int layer, const sparse::Selection& sel) {
      if (layer == 0) ++steps[size_t(i)];
      std::vector<std::vector<int32_t>> heads;
      for (int h = 0; h < c.n_kv_heads; ++h) heads.push_back(head_positions(sel, h));
      trace[{i, steps[size_t(i)], layer}] = std::move(heads);
    };
    attn.push_back(&s->attention());
    text.push_back([s](std::string_view p) {
      if (s->wants_token_text()) s->append_token_text(p);
    });
  }
  RankRun r = drive(step, n, attn, std::vector<sparse::MethodState*>(size_t(n), nullptr), text);
  r.trace = std::move(trace);
  return r;
}

// `tp` ranks: rank 0's runner (make_runner) with each sequence's method added per request,
// followers as threads; the selections of every rank traced.
RankRun tp_ranks(const ModelWeights& w, const std::vector<std::string>& seq_specs, int tp) {
  const ModelConfig& c = w.config;
  const int hkv = c.n_kv_heads / tp;
  std::mutex mu;
  Trace trace;
  std::map<std::pair<int, uint64_t>, int64_t> steps;  // (rank, plan id) -> decode step
  std::map<uint64_t, int> seq_of_id;                   // plan ids are given in first-step order
  std::vector<uint64_t> ids_seen;
  set_tp_select_trace([&](int rank, uint64_t id, int layer, const sparse::Selection& sel) {
    std::lock_guard<std::mutex> lk(mu);
    int64_t& s = steps.try_emplace({rank, id}, -1).first->second;
    if (layer == 0) ++s;
    auto& heads = trace[{int(id), s, layer}];
    heads.resize(size_t(c.n_kv_heads));
    for (int h = 0; h < hkv; ++h) heads[size_t(rank * hkv + h)] = head_positions(sel, h);
  });
  auto listener = std::make_shared<TcpListener>("127.0.0.1:0");
  const std::string addr = "127.0.0.1:" + std::to_string(listener->port());
  std::vector<std::string> err(static_cast<size_t>(tp));
  std::vector<std::thread> th;
  for (int r = 1; r < tp; ++r)
    th.emplace_back([&, r] {
      try {
        run_follower_rank(w, addr, r, tp);
      } catch (const std::exception& e) {
        err[size_t(r)] = e.what();
      }
    });
  RankRun out;
  try {
    RunnerOptions ro;
    ro.kv_pages = 1024;
    ro.page_size = kPage;
    ro.tp = tp;
    ro.dist_listener = listener;
    Runner runner = make_runner(w, ro);
    const int n = int(seq_specs.size());
    std::vector<std::unique_ptr<sparse::MethodState>> st;
    std::vector<sparse::MethodState*> sp;
    std::vector<std::function<void(std::string_view)>> text;
    for (int i = 0; i < n; ++i) {
      const auto cfg = sparse::SparseConfig::parse_spec(seq_specs[size_t(i)]);
      runner.check_method(cfg);
      st.push_back(runner.model->new_request_state(&cfg));
      sparse::MethodState* s = st.back().get();
      sp.push_back(s);
      text.push_back([s](std::string_view p) {
        if (s && s->wants_token_text()) s->append_token_text(p);
      });
    }
    out = drive(*runner.model, n, std::vector<const AttentionFn*>(size_t(n), nullptr), sp, text);
  } catch (const std::exception& e) {
    err[0] = e.what();
  }
  for (auto& t : th) t.join();
  set_tp_select_trace(nullptr);
  for (int r = 0; r < tp; ++r) EXPECT_EQ(err[size_t(r)], "") << "rank " << r;
  // Plan ids start at 1 in the order of the sequences' first steps (sequence i starts at step i).
  for (auto& [k, heads] : trace) {
    auto [id, s, layer] = k;
    out.trace[{id - 1, s, layer}] = heads;
  }
  return out;
}

void expect_same(const RankRun& ref, const RankRun& got, const std::string& what) {
  ASSERT_EQ(got.logits.size(), ref.logits.size()) << what;
  for (size_t s = 0; s < ref.logits.size(); ++s) {
    ASSERT_EQ(got.logits[s].size(), ref.logits[s].size()) << what << " step " << s;
    double max_abs = 0, max_ref = 1;
    for (size_t i = 0; i < ref.logits[s].size(); ++i) {
      max_abs = std::max(max_abs, double(std::abs(got.logits[s][i] - ref.logits[s][i])));
      max_ref = std::max(max_ref, double(std::abs(ref.logits[s][i])));
    }
    EXPECT_LT(max_abs, 1e-5 * max_ref) << what << " step " << s;
  }
  ASSERT_EQ(got.trace.size(), ref.trace.size()) << what;
  int64_t diff = 0;
  for (const auto& [k, heads] : ref.trace) {
    auto it = got.trace.find(k);
    ASSERT_NE(it, got.trace.end()) << what;
    for (size_t h = 0; h < heads.size(); ++h)
      if (it->second[h] != heads[h] && ++diff <= 3)
        ADD_FAILURE() << what << ": sequence " << std::get<0>(k) << " step " << std::get<1>(k)
                      << " layer " << std::get<2>(k) << " head " << h << ": " << it->second[h].size()
                      << " positions vs " << heads[h].size() << " on one rank";
  }
  EXPECT_EQ(diff, 0) << what << ": selections that differ from one rank's";
}

}  // namespace

TEST(TpSparse, SpecsCoverEveryMethod) {
  std::set<std::string> covered;
  for (const std::string& s : specs()) covered.insert(sparse::SparseConfig::parse_spec(s).method);
  for (const auto& m : sparse::all_methods()) EXPECT_TRUE(covered.count(m.name)) << m.name;
}

class TpSparseRanks : public ::testing::TestWithParam<int> {};

// Each method alone (a second, dense sequence in the same steps), then all methods at once,
// one per sequence (the plan carries each sequence's own method).
TEST_P(TpSparseRanks, SelectionsAndLogitsEqualOneRank) {
  const int tp = GetParam();
  const ModelWeights w = test::random_model(sparse_tp_config(), 21);
  for (const std::string& spec : specs()) {
    SCOPED_TRACE(spec);
    const std::vector<std::string> seqs = {spec, "full"};
    const RankRun ref = one_rank(w, seqs);
    // The reference selects sparsely (decode step s has L = kPrompt + 1 + s tokens), except
    // full attention (no session) and BLASST over it (its skipping is inside the attention).
    int64_t sparse_heads = 0;
    for (const auto& [k, heads] : ref.trace)
      for (const auto& h : heads) sparse_heads += int64_t(h.size()) < kPrompt + 1 + std::get<1>(k);
    if (spec == "full") {
      EXPECT_TRUE(ref.trace.empty());
    } else if (spec.rfind("blasst:", 0) != 0 || spec.find("base=") != std::string::npos) {
      EXPECT_GT(sparse_heads, 0) << "the reference never selected sparsely";
    }
    const RankRun got = tp_ranks(w, seqs, tp);
    expect_same(ref, got, spec + " --tp " + std::to_string(tp));
  }
}

TEST_P(TpSparseRanks, EveryMethodPerRequestInOneBatch) {
  const int tp = GetParam();
  const ModelWeights w = test::random_model(sparse_tp_config(), 22);
  const std::vector<std::string> seqs = specs();
  const RankRun ref = one_rank(w, seqs);
  const RankRun got = tp_ranks(w, seqs, tp);
  expect_same(ref, got, "every method --tp " + std::to_string(tp));
}

INSTANTIATE_TEST_SUITE_P(Tp, TpSparseRanks, ::testing::Values(2, 3));

TEST(TpSparse, WhatCannotRunIsRefusedWithTheReason) {
  const ModelWeights w = test::random_model(sparse_tp_config(), 23);
  RunnerOptions ro;
  ro.kv_pages = 16;
  ro.tp = 2;
  ro.dist_init = "127.0.0.1:1";  // never reached: refused first
  ro.sparse.method = "quest";
  ro.sparse.measure_recall = true;
  std::string e;
  try {
    (void)make_runner(w, ro);
  } catch (const std::exception& x) {
    e = x.what();
  }
  EXPECT_NE(e.find("each rank holds only its own heads"), std::string::npos) << e;
}

// LycheeDecode's token sets flow to the same original head of the next layer: with roles in a
// reordered head order (appendix F) a set could cross ranks, so a split session refuses them.
TEST(TpSparse, LycheeDecodeRefusesReorderedRolesOnASplitShard) {
  sparse::HeadRoles roles = sparse::HeadRoles::parse_pattern("RRRRRR/SRSSRS/RSRSSR/SSRRSS");
  for (size_t l = 1; l < roles.origin.size(); ++l) std::swap(roles.origin[l][0], roles.origin[l][5]);
  sparse::LdRule rule;
  rule.budget = 48;
  const sparse::LycheeDecodeMethod m(roles, rule, false, 32);
  auto st = m.new_state();
  sparse::StepContext c;
  c.n_layers = 4;
  c.Hq = 6, c.Hkv = 3, c.G = 2, c.D = 16;
  c.L = 40;
  c.state = st.get();
  c.shard.Hq_all = 12, c.shard.Hkv_all = 6;
  c.shard.all_reduce_sum = [](float*, int64_t) {};
  sparse::Selection sel;
  std::string e;
  try {
    m.select(c, sel);
  } catch (const std::exception& x) {
    e = x.what();
  }
  EXPECT_NE(e.find("reordered head roles"), std::string::npos) << e;
}
