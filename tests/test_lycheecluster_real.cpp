// LycheeCluster on the real SmolLM2-135M (skipped when models/ lacks it):
//  - CI test: a ~650-token mixed prompt (tests/fixtures/chunker/mixed_text.txt), teacher-
//    forced decode with lazy updates; every indexed token's q.k stays under its fine and
//    coarse node bounds for the model's own decode queries (and random ones), and recall
//    is sane.
//  - Measurement (SPADE_LC_BENCH=1, not part of CI): recall at budgets 256/512/1024 against
//    quest and the fixed-16 ablation on long real text, index memory and build time as a
//    fraction of prefill; writes docs/results/lycheecluster_recall.{json,md}.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "backend/cpu/attention.h"
#include "model/cpu_model.h"
#include "model/loader.h"
#include "sparse/methods/lycheecluster.h"
#include "sparse/registry.h"
#include "smollm2_model.h"
#include "test_util.h"
#include "tokenizer/tokenizer.h"

using namespace spade;
using namespace spade::sparse;

namespace {

using test::read_text;

struct RunResult {
  std::string spec;
  int64_t steps = 0;
  // Over sparse layers, query heads and steps.
  double mass_recall = 0, topk_recall = 0, tokens_per_head = 0;
  int64_t samples = 0, head_samples = 0;
  LycheeClusterStats lc;
  size_t index_bytes = 0;
  double mean_chunk_len = 0;
  double decode_seconds = 0;
};

// Runs `steps` teacher-forced decode steps (tokens ids[P..P+steps)) of `spec` on a fork of
// the prefilled `prefix`, with the method driven directly (its state receives the token
// text) and recall measured against the true full-attention weights.
struct Runner {
  CpuModel& model;
  KVPool& kv;
  const ModelConfig& cfg;
  RunResult run(const PageTable& prefix, const std::vector<int32_t>& ids,
                const std::vector<std::string>& text, int64_t P, int64_t steps,
                const std::string& spec,
                const std::function<void(const SparseMethod&, MethodState*, const PageTable&,
                                         const std::vector<std::vector<float>>&)>& inspect = {}) {
    RunResult r;
    r.spec = spec;
    r.steps = steps;
    auto m = make_method(SparseConfig::parse_spec(spec), cfg);
    auto state = m->new_state();
    if (auto* lc = lycheecluster_state(state.get())) lc->set_token_text(text);
    PageTable pt = kv.fork(prefix);
    StepContext ctx;
    cpu::AttentionScratch scratch;
    ctx.n_layers = cfg.n_layers;
    ctx.Hq = cfg.n_heads;
    ctx.Hkv = cfg.n_kv_heads;
    ctx.D = cfg.head_dim;
    ctx.G = cfg.n_heads / cfg.n_kv_heads;
    ctx.scale = 1.f / std::sqrt(float(cfg.head_dim));
    ctx.kv = &kv;
    ctx.state = state.get();
    ctx.attention_scratch = &scratch;
    for (int l = 0; l < cfg.n_layers; ++l) {
      ctx.begin_layer(l, pt, nullptr, P);
      m->on_prefill(ctx, 0, P);
    }
    Selection sel;
    std::vector<float> w;
    std::vector<int32_t> idx;
    std::vector<uint8_t> mark;
    std::vector<std::vector<float>> queries(size_t(cfg.n_layers));  // last decode query per layer
    const int Hq = cfg.n_heads, G = ctx.G, D = cfg.head_dim;
    AttentionFn fn = [&](int layer, const PageTable& t, const float* q, int64_t p0, int64_t T, float* out) {
      ASSERT_EQ(T, 1);
      ctx.begin_layer(layer, t, q, p0 + 1);
      m->on_append(ctx);
      m->select(ctx, sel);
      validate(sel, cfg.n_kv_heads, p0 + 1);
      cpu::attention_selected(kv, layer, t, q, Hq, ctx.scale, sel, out, scratch);
      queries[size_t(layer)].assign(q, q + Hq * D);
      if (sel.dense()) return;
      const int64_t L = p0 + 1;
      if (w.size() < size_t(Hq * L)) w.resize(size_t(Hq * L));
      cpu::attention_weights_full(kv, layer, t, q, Hq, ctx.scale, L, w.data(), scratch);
      mark.assign(size_t(L), 0);
      for (int h = 0; h < cfg.n_kv_heads; ++h) {
        const int32_t* pos = sel.head(h);
        const int64_t n = sel.count(h);
        for (int64_t i = 0; i < n; ++i) mark[size_t(pos[i])] = uint8_t(h + 1);
        r.tokens_per_head += double(n);
        r.head_samples++;
        for (int g = 0; g < G; ++g) {
          const float* wr = w.data() + int64_t(h * G + g) * L;
          double mass = 0;
          for (int64_t i = 0; i < n; ++i) mass += wr[pos[i]];
          // Top-k recall (the paper's table 3): share of the true top-n tokens selected.
          idx.resize(size_t(L));
          for (int64_t i = 0; i < L; ++i) idx[size_t(i)] = int32_t(i);
          std::nth_element(idx.begin(), idx.begin() + (n - 1), idx.end(), [&](int32_t a, int32_t b) {
            return wr[a] > wr[b] || (wr[a] == wr[b] && a < b);
          });
          int64_t hit = 0;
          for (int64_t i = 0; i < n; ++i) hit += mark[size_t(idx[size_t(i)])] == uint8_t(h + 1);
          r.mass_recall += mass;
          r.topk_recall += double(hit) / double(n);
          r.samples++;
        }
      }
    };
    std::vector<int64_t> row_of;
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t s = 0; s < steps; ++s) {
      SeqInput in;
      in.pages = &pt;
      in.tokens = &ids[size_t(P + s)];
      in.n_tokens = 1;
      in.attention = &fn;
      model.forward({in}, row_of);
    }
    r.decode_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (r.samples) {
      r.mass_recall /= double(r.samples);
      r.topk_recall /= double(r.samples);
    }
    if (r.head_samples) r.tokens_per_head /= double(r.head_samples);
    if (auto* lc = lycheecluster_state(state.get())) {
      r.lc = lc->stats();
      r.index_bytes = lc->index_bytes();
      const auto& st = lc->chunk_starts();
      if (lc->n_chunks() > 0) r.mean_chunk_len = double(st.back() - st.front()) / double(lc->n_chunks());
    }
    if (inspect) inspect(*m, state.get(), pt, queries);
    kv.release(pt);
    return r;
  }
};

std::vector<std::string> token_texts(const Tokenizer& tok, const std::vector<int32_t>& ids) {
  std::vector<std::string> t;
  for (int32_t id : ids) t.push_back(tok.token_bytes(id));
  return t;
}

double process_cpu() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

// Prefills ids[0, P) densely into `pt`; returns wall seconds (and process CPU seconds).
double prefill(CpuModel& model, PageTable& pt, const std::vector<int32_t>& ids, int64_t P,
               double* cpu = nullptr) {
  std::vector<int64_t> row_of;
  SeqInput in;
  in.pages = &pt;
  in.tokens = ids.data();
  in.n_tokens = P;
  const auto t0 = std::chrono::steady_clock::now();
  const double c0 = process_cpu();
  model.forward({in}, row_of);
  if (cpu) *cpu = process_cpu() - c0;
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

TEST(LycheeClusterReal, BoundsHoldOnRealKeysThroughLazyUpdates) {
  if (!std::filesystem::exists(test::smollm2_path()))
    GTEST_SKIP() << test::kSmolLM2 << " not present; fetch it with `bash scripts/fetch_model.sh`";
  test::SmolLM2& sm = test::smollm2();
  const ModelConfig& cfg = sm.w->config;
  const std::string text = read_text(test::source_dir() + "/tests/fixtures/chunker/mixed_text.txt");
  std::vector<int32_t> ids = sm.tok->encode(text, false);
  ASSERT_GT(ids.size(), 600u);
  ids.resize(360);  // keeps CI time small: 330 prompt tokens, 30 decode steps
  const int64_t steps = 30, P = int64_t(ids.size()) - steps;
  const auto texts = token_texts(*sm.tok, ids);
  KVPool kv({cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 16}, 2 * (int64_t(ids.size()) / 16 + 2));
  CpuModel model(*sm.w, kv);
  PageTable prefix;
  const double pf = prefill(model, prefix, ids, P);
  RecordProperty("prefill_seconds", std::to_string(pf));
  Runner run{model, kv, cfg};

  int64_t checks = 0;
  auto inspect = [&](const SparseMethod&, MethodState* s, const PageTable& pt,
                     const std::vector<std::vector<float>>& queries) {
    auto* st = lycheecluster_state(s);
    ASSERT_NE(st, nullptr);
    const int D = cfg.head_dim, G = cfg.n_heads / cfg.n_kv_heads;
    const auto& starts = st->chunk_starts();
    for (int l = 2; l < cfg.n_layers; ++l)
      for (int h = 0; h < cfg.n_kv_heads; ++h) {
        const ClusterIndex* ix = st->index(l, h);
        ASSERT_NE(ix, nullptr) << l << " " << h;
        // The layer's last real decode queries of this KV head's group, and random ones
        // with the same norms.
        std::vector<std::vector<float>> qs;
        for (int g = 0; g < G; ++g) {
          const float* q = queries[size_t(l)].data() + (h * G + g) * D;
          qs.emplace_back(q, q + D);
          double n = 0;
          for (int d = 0; d < D; ++d) n += double(q[d]) * q[d];
          auto rq = test::random_vec(size_t(D), 100 * l + 10 * h + g, float(std::sqrt(n / D)));
          qs.push_back(rq);
        }
        std::vector<float> c(static_cast<size_t>(D));
        for (const auto& q : qs) {
          double qn = 0;
          for (float x : q) qn += double(x) * x;
          qn = std::sqrt(qn);
          for (int g = 0; g < ix->n_coarse(); ++g) {
            const double bg = ix->bound(ClusterIndex::kCoarse, g, q.data(), float(qn));
            for (int f = ix->fine_begin(g); f < ix->fine_begin(g + 1); ++f) {
              const double bf = ix->bound(ClusterIndex::kFine, f, q.data(), float(qn));
              ix->center(ClusterIndex::kFine, f, c.data());
              double cn = 0;
              for (float x : c) cn += double(x) * x;
              const double tol = 1e-5 * qn * (std::sqrt(cn) + ix->radius(ClusterIndex::kFine, f)) + 1e-5;
              for (int32_t ch = ix->first_chunk(f); ch >= 0; ch = ix->next_chunk(ch))
                for (int32_t p = starts[size_t(ch)]; p < starts[size_t(ch) + 1]; ++p) {
                  const float* k = kv.k_row(l, pt, p, h);
                  double s = 0;
                  for (int d = 0; d < D; ++d) s += double(q[size_t(d)]) * k[d];
                  ASSERT_LE(s, bf + tol) << "layer " << l << " head " << h << " fine " << f << " pos " << p;
                  ASSERT_LE(s, bg + tol) << "layer " << l << " head " << h << " coarse " << g;
                  checks += 2;
                }
            }
          }
        }
      }
    EXPECT_GT(st->stats().inserted_chunks, 0) << "the decode steps must exercise lazy updates";
  };
  // Budget 64 so that ~330 tokens are sparse; buffer 12 so 30 steps flush twice or more.
  auto lc = run.run(prefix, ids, texts, P, steps, "lycheecluster:budget=64,buffer=12", inspect);
  EXPECT_GT(checks, 50000);
  // 16 sink + <= 64 chunk tokens + recent (< 12 + 16).
  EXPECT_LE(lc.tokens_per_head, 16 + 64 + 28);
  EXPECT_GT(lc.mass_recall, 0.5);
  RecordProperty("lc_mass_recall", std::to_string(lc.mass_recall));
  RecordProperty("lc_tokens_per_head", std::to_string(lc.tokens_per_head));
  kv.release(prefix);
}

// Measurement for docs/lycheecluster.md (not CI): SPADE_LC_BENCH=1 ./spade_tests
// --gtest_filter=LycheeClusterBench.*  Optional SPADE_LC_BENCH_STEPS (default 32) and
// SPADE_LC_BENCH_TOKENS (prompt tokens per document, default 4096), SPADE_LC_BENCH_BUDGETS
// ("256,512,1024"), SPADE_LC_BENCH_SPECS ("label=spec;..." with {B} for the budget),
// SPADE_LC_BENCH_DOCS (how many of the documents, default all), SPADE_LC_BENCH_OUT (output
// base name in docs/results, default lycheecluster_recall).
TEST(LycheeClusterBench, RecallVsQuestOnSmolLM2) {
  if (!std::getenv("SPADE_LC_BENCH")) GTEST_SKIP() << "set SPADE_LC_BENCH=1 to run";
  if (!std::filesystem::exists(test::smollm2_path())) GTEST_SKIP() << test::kSmolLM2 << " not present";
  test::SmolLM2& sm = test::smollm2();
  const ModelConfig& cfg = sm.w->config;
  const int64_t steps = std::getenv("SPADE_LC_BENCH_STEPS") ? std::atol(std::getenv("SPADE_LC_BENCH_STEPS")) : 32;
  const int64_t want = std::getenv("SPADE_LC_BENCH_TOKENS") ? std::atol(std::getenv("SPADE_LC_BENCH_TOKENS")) : 4096;
  // Documents: prose (a paper), code (C++ sources), structured (JSON).
  struct Doc {
    std::string name, text;
  };
  std::vector<Doc> docs;
  {
    std::string prose = read_text(test::shared_dir() + "/papers/twilight.md");
    prose += read_text(test::shared_dir() + "/papers/blasst.md");
    docs.push_back({"prose (papers/twilight.md + blasst.md)", prose});
    std::string code;
    for (const char* f : {"src/sparse/methods/lycheecluster.cpp", "src/sparse/cluster_index.cpp",
                          "src/sparse/kmeans.cpp", "src/sparse/chunker.cpp", "src/backend/cpu/attention.cpp",
                          "src/backend/cpu/ops.cpp", "src/kv/kv_pool.cpp", "src/sparse/session.cpp"})
      code += read_text(test::source_dir() + "/" + f);
    docs.push_back({"code (src/sparse, src/backend/cpu, src/kv .cpp)", code});
    if (const char* e = std::getenv("SPADE_LC_BENCH_DOCS")) docs.resize(std::min<size_t>(docs.size(), size_t(std::atoi(e))));
  }
  std::vector<int64_t> budgets = {256, 512, 1024};
  if (const char* e = std::getenv("SPADE_LC_BENCH_BUDGETS")) {
    budgets.clear();
    for (int v : parse_int_list(e, "SPADE_LC_BENCH_BUDGETS")) budgets.push_back(v);
  }
  nlohmann::json out;
  out["model"] = "SmolLM2-135M-Instruct Q4_1 (30 layers, 9 query / 3 KV heads, D 64)";
  out["decode_steps"] = steps;
  out["note"] = "teacher-forced decode of the document's next tokens after a dense prefill; recall over sparse layers (2..29), query heads and steps; mass = true softmax weight on the selection, topk = share of the true top-n tokens selected (n = tokens the head attended)";
  std::string md;
  for (const auto& doc : docs) {
    std::vector<int32_t> ids = sm.tok->encode(doc.text, false);
    ASSERT_GE(int64_t(ids.size()), want + steps) << doc.name;
    ids.resize(size_t(want + steps));
    const auto texts = token_texts(*sm.tok, ids);
    KVPool kv({cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 16}, 2 * (int64_t(ids.size()) / 16 + 4));
    CpuModel model(*sm.w, kv);
    PageTable prefix;
    double prefill_cpu = 0;
    const double prefill_s = prefill(model, prefix, ids, want, &prefill_cpu);
    Runner run{model, kv, cfg};
    nlohmann::json dj;
    dj["document"] = doc.name;
    dj["prompt_tokens"] = want;
    dj["prefill_seconds"] = prefill_s;
    dj["prefill_cpu_seconds"] = prefill_cpu;
    const double kv_bytes = 2.0 * cfg.n_layers * cfg.n_kv_heads * double(want + steps) * cfg.head_dim * sizeof(float);
    char head[256];
    std::snprintf(head, sizeof head, "\n### %s, %lld prompt tokens, prefill %.1f s wall / %.1f s CPU\n\n",
                  doc.name.c_str(), (long long)want, prefill_s, prefill_cpu);
    md += head;
    md += "| budget | method | tokens/head | mass recall | top-k recall | index % of KV | build % of prefill | notes |\n";
    md += "|---|---|---|---|---|---|---|---|\n";
    for (int64_t B : budgets) {
      const std::string b = std::to_string(B);
      std::vector<std::pair<std::string, std::string>> cfgs;
      if (const char* e = std::getenv("SPADE_LC_BENCH_SPECS")) {  // "label=spec;..." with {B}
        std::stringstream ss(e);
        std::string item;
        while (std::getline(ss, item, ';')) {
          const auto eq = item.find('=');
          std::string spec = item.substr(eq + 1);
          for (size_t at; (at = spec.find("{B}")) != std::string::npos;) spec.replace(at, 3, b);
          cfgs.emplace_back(item.substr(0, eq), spec);
        }
      } else cfgs = {
          {"quest", "quest:budget=" + b},
          {"lycheecluster (total)", "lycheecluster:budget_mode=total,budget=" + b},
          {"lycheecluster fixed-16 (total)", "lycheecluster:budget_mode=total,chunking=fixed,budget=" + b},
          {"lycheecluster max-pool (total)", "lycheecluster:budget_mode=total,pooling=max,budget=" + b},
          {"lycheecluster chunk-bound (total)", "lycheecluster:budget_mode=total,bound=chunk,budget=" + b},
          {"lycheecluster rank=center (total)", "lycheecluster:budget_mode=total,rank=center,budget=" + b},
          {"lycheecluster buffer=16 (total)", "lycheecluster:budget_mode=total,buffer=16,budget=" + b},
          {"lycheecluster (paper budget)", "lycheecluster:stability=1,budget=" + b},
          {"oracle-topk", "oracle-topk:budget=" + b},
      };
      for (const auto& [label, spec] : cfgs) {
        RunResult r = run.run(prefix, ids, texts, want, steps, spec);
        nlohmann::json j;
        j["budget"] = B;
        j["method"] = label;
        j["spec"] = spec;
        j["tokens_per_head"] = r.tokens_per_head;
        j["mass_recall"] = r.mass_recall;
        j["topk_recall"] = r.topk_recall;
        j["decode_seconds"] = r.decode_seconds;
        std::string idx = "", build = "", notes = "";
        if (spec.rfind("lycheecluster", 0) == 0) {
          j["index_bytes"] = r.index_bytes;
          j["index_fraction_of_kv"] = double(r.index_bytes) / kv_bytes;
          j["chunk_seconds"] = r.lc.chunk_seconds;
          j["build_seconds"] = r.lc.build_seconds;
          j["build_fraction_of_prefill"] = (r.lc.build_seconds + r.lc.chunk_seconds) / prefill_s;
          j["build_cpu_seconds"] = r.lc.build_cpu_seconds;
          j["build_cpu_fraction_of_prefill_cpu"] = r.lc.build_cpu_seconds / prefill_cpu;
          j["search_cpu_seconds_per_step"] = r.lc.search_cpu_seconds / double(steps);
          j["search_seconds_per_step"] = r.lc.search_seconds / double(steps);
          j["update_seconds"] = r.lc.update_seconds;
          j["mean_chunk_len"] = r.mean_chunk_len;
          if (r.lc.jaccard_n) {
            j["jaccard"] = r.lc.mean_jaccard();
            j["window_hit"] = r.lc.mean_window_hit();
          }
          char t[64];
          std::snprintf(t, sizeof t, "%.2f", 100.0 * double(r.index_bytes) / kv_bytes);
          idx = t;
          std::snprintf(t, sizeof t, "%.2f (CPU time)", 100.0 * r.lc.build_cpu_seconds / prefill_cpu);
          build = t;
          std::snprintf(t, sizeof t, "search %.2f ms CPU/step", 1e3 * r.lc.search_cpu_seconds / double(steps));
          notes = t;
          if (r.lc.inserted_chunks) {
            std::snprintf(t, sizeof t, "; lazy updates %.2f%% of decode", 100.0 * r.lc.update_seconds / r.decode_seconds);
            notes += t;
          }
          if (r.lc.jaccard_n) {
            std::snprintf(t, sizeof t, "; Jaccard %.2f, window hit %.2f", r.lc.mean_jaccard(), r.lc.mean_window_hit());
            notes += t;
          }
          std::snprintf(t, sizeof t, "; mean chunk %.1f", r.mean_chunk_len);
          notes += t;
        }
        dj["runs"].push_back(j);
        char line[1024];
        std::snprintf(line, sizeof line, "| %lld | %s | %.0f | %.3f | %.3f | %s | %s | %s |\n", (long long)B,
                      label.c_str(), r.tokens_per_head, r.mass_recall, r.topk_recall, idx.c_str(), build.c_str(),
                      notes.c_str());
        md += line;
        std::printf("%s", line);
        std::fflush(stdout);
      }
    }
    out["documents"].push_back(dj);
    kv.release(prefix);
  }
  const std::string dir = test::source_dir() + "/docs/results";
  const std::string base = std::getenv("SPADE_LC_BENCH_OUT") ? std::getenv("SPADE_LC_BENCH_OUT") : "lycheecluster_recall";
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/" + base + ".json") << out.dump(1) << "\n";
  std::ofstream(dir + "/" + base + ".md")
      << "# LycheeCluster recall on SmolLM2-135M (generated by LycheeClusterBench.RecallVsQuestOnSmolLM2)\n"
      << md;
}
