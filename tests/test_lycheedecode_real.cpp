// LycheeDecode on the real SmolLM2-135M-Instruct with the trained head roles
// (configs/head_roles/smollm2-135m-instruct.json; skipped when models/ lacks the GGUF):
//  - CI test: a ~900-token real prompt, teacher-forced decode; budget >= L reproduces full
//    attention's logits bit for bit, a small budget reads fewer tokens with high recall.
//  - Measurement (SPADE_LD_BENCH=1, not part of CI): per-layer attention recall and density
//    and agreement with full attention's greedy output, against tidal and quest (and the
//    oracle) at equal budgets, on long real text; writes docs/results/lycheedecode_eval.{json,md}.
//    Env: SPADE_LD_BENCH_TOKENS (4096), SPADE_LD_BENCH_STEPS (32), SPADE_LD_BENCH_BUDGETS
//    (256,1024), SPADE_LD_KJV (.stage/filler/kjv_eval.txt from python/lycheedecode/make_filler.sh).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "engine/sampler.h"
#include "model/cpu_model.h"
#include "model/loader.h"
#include "sparse/head_roles.h"
#include "sparse/methods/lycheedecode.h"
#include "sparse/registry.h"
#include "sparse/session.h"
#include "smollm2_model.h"
#include "test_util.h"
#include "tokenizer/tokenizer.h"

using namespace spade;
using namespace spade::sparse;

namespace {

using test::read_text;

// What one method did over a decode, teacher-forced on full attention's greedy tokens (recall,
// density, per-step top-1 agreement) and free-running (greedy output vs full's).
struct MethodRun {
  std::string label, spec, describe;
  int64_t budget = 0;
  std::vector<double> layer_recall, layer_density, layer_sparse_recall;
  double recall = 0, sparse_recall = 0, density = 0, tf_agree = 0, free_match = 0;
  int first_divergence = -1;
  std::string output;
  std::vector<int32_t> tokens;
};

class Bench {
 public:
  Bench(const std::vector<int32_t>& prompt, int steps) : prompt_(prompt), steps_(steps) {
    const ModelConfig& c = test::smollm2().w->config;
    const int64_t P = 16;
    kv_ = std::make_unique<KVPool>(KVLayout{c.n_layers, c.n_kv_heads, c.head_dim, int(P)},
                                   (int64_t(prompt.size()) + P - 1) / P + 2 * ((steps + P) / P + 2));
    model_ = std::make_unique<CpuModel>(*test::smollm2().w, *kv_);
    std::vector<int64_t> row_of;
    for (size_t off = 0; off < prompt.size(); off += 1024) {
      std::vector<SeqInput> b = {{&base_, prompt.data() + off,
                                  std::min<int64_t>(1024, int64_t(prompt.size() - off)), false, nullptr}};
      const auto& lg = model_->forward(b, row_of);
      last_.assign(lg.begin() + row_of[0] * c.vocab, lg.begin() + (row_of[0] + 1) * c.vocab);
    }
    full_ = greedy(nullptr, nullptr);
  }
  ~Bench() { kv_->release(base_); }
  const std::vector<int32_t>& full_tokens() const { return full_; }

  // Free-running greedy decode from the shared prefill; logits of each step in `logits`.
  std::vector<int32_t> greedy(SparseSession* s, std::vector<std::vector<float>>* logits) {
    const ModelConfig& c = test::smollm2().w->config;
    PageTable pt = kv_->fork(base_);
    std::vector<int32_t> out = {argmax(last_.data(), c.vocab)};
    std::vector<int64_t> row_of;
    for (int i = 1; i < steps_; ++i) {
      std::vector<SeqInput> b = {{&pt, &out.back(), 1, false, s ? &s->attention() : nullptr}};
      const auto& lg = model_->forward(b, row_of);
      if (logits) logits->emplace_back(lg.begin(), lg.begin() + c.vocab);
      out.push_back(argmax(lg.data() + row_of[0] * c.vocab, c.vocab));
    }
    kv_->release(pt);
    return out;
  }

  MethodRun run(const std::string& label, const std::string& spec, int64_t budget) {
    const ModelConfig& c = test::smollm2().w->config;
    auto m = make_method(SparseConfig::parse_spec(spec), c);
    MethodRun r;
    r.label = label;
    r.spec = spec;
    r.budget = budget;
    r.describe = m->describe();
    const int Lr = c.n_layers, Hkv = c.n_kv_heads, Hq = c.n_heads, G = Hq / Hkv;
    std::vector<double> rec(size_t(Lr), 0), den(size_t(Lr), 0), srec(size_t(Lr), 0), sn(size_t(Lr), 0);
    int64_t n_steps = 0, agree = 0;
    double sr_sum = 0, sr_n = 0;
    {  // teacher-forced on full's greedy tokens, with recall
      SparseSession s(m, c, *kv_, {true, false});
      s.on_step = [&](const StepStats& st) {
        ++n_steps;
        for (int l = 0; l < Lr; ++l)
          for (int h = 0; h < Hkv; ++h) {
            const int64_t a = st.attended[size_t(l * Hkv + h)];
            den[size_t(l)] += double(a) / double(st.length) / Hkv;
            for (int g = 0; g < G; ++g) {
              const double x = st.recall[size_t(l * Hq + h * G + g)];
              rec[size_t(l)] += x / Hq;
              if (a < st.length) {
                srec[size_t(l)] += x;
                sn[size_t(l)] += 1;
                sr_sum += x;
                sr_n += 1;
              }
            }
          }
      };
      PageTable pt = kv_->fork(base_);
      std::vector<int64_t> row_of;
      for (int i = 0; i + 1 < steps_; ++i) {
        std::vector<SeqInput> b = {{&pt, &full_[size_t(i)], 1, false, &s.attention()}};
        const auto& lg = model_->forward(b, row_of);
        agree += argmax(lg.data() + row_of[0] * c.vocab, c.vocab) == full_[size_t(i) + 1];
      }
      kv_->release(pt);
    }
    for (int l = 0; l < Lr; ++l) {
      r.layer_recall.push_back(rec[size_t(l)] / double(n_steps));
      r.layer_density.push_back(den[size_t(l)] / double(n_steps));
      r.layer_sparse_recall.push_back(sn[size_t(l)] ? srec[size_t(l)] / sn[size_t(l)] : 1.0);
      r.recall += r.layer_recall.back() / Lr;
      r.density += r.layer_density.back() / Lr;
    }
    r.sparse_recall = sr_n ? sr_sum / sr_n : 1.0;
    r.tf_agree = double(agree) / double(std::max<int64_t>(1, n_steps));
    {  // free-running greedy
      SparseSession s(m, c, *kv_, {false, false});
      r.tokens = greedy(&s, nullptr);
      int same = 0;
      for (size_t i = 0; i < r.tokens.size(); ++i) {
        same += r.tokens[i] == full_[i];
        if (r.first_divergence < 0 && r.tokens[i] != full_[i]) r.first_divergence = int(i);
      }
      r.free_match = double(same) / double(r.tokens.size());
    }
    r.output = test::smollm2().tok->decode(r.tokens, true);
    return r;
  }

 private:
  std::vector<int32_t> prompt_;
  int steps_;
  std::unique_ptr<KVPool> kv_;
  std::unique_ptr<CpuModel> model_;
  PageTable base_;
  std::vector<float> last_;
  std::vector<int32_t> full_;
};

bool have_model() { return std::filesystem::exists(test::smollm2_path()); }

}  // namespace

TEST(LycheeDecodeReal, TrainedRolesOnSmolLM2ReadFewTokensWithHighRecall) {
  if (!have_model()) GTEST_SKIP() << test::kSmolLM2 << " missing (scripts/fetch_model.sh)";
  test::SmolLM2& sm = test::smollm2();
  const ModelConfig& c = sm.w->config;
  std::string text = read_text(test::source_dir() + "/python/prompts/kjv_genesis1.txt") + "\n\n" +
                     read_text(test::source_dir() + "/tests/fixtures/chunker/mixed_text.txt");
  std::vector<int32_t> ids = sm.tok->encode(text, false);
  ASSERT_GT(ids.size(), 700u);
  const int64_t P = int64_t(ids.size()) - 8;
  std::vector<int32_t> prompt(ids.begin(), ids.begin() + P);
  // One dense prefill (the prefill path of every method is dense), forked per method;
  // teacher-forced logits of 8 decode steps.
  KVPool kv({c.n_layers, c.n_kv_heads, c.head_dim, 16}, int64_t(ids.size()) / 16 + 8);
  CpuModel model(*sm.w, kv);
  PageTable base;
  std::vector<int64_t> row_of;
  std::vector<SeqInput> pre = {{&base, ids.data(), P, false, nullptr}};
  model.forward(pre, row_of);
  auto decode = [&](const std::string& spec, double* density, double* recall) {
    std::unique_ptr<SparseSession> s;
    if (!spec.empty())
      s = std::make_unique<SparseSession>(make_method(SparseConfig::parse_spec(spec), c), c, kv,
                                          SessionOptions{true, true});
    const AttentionFn* fn = s ? &s->attention() : nullptr;
    PageTable pt = kv.fork(base);
    std::vector<std::vector<float>> out;
    for (int64_t i = P; i < int64_t(ids.size()); ++i) {
      std::vector<SeqInput> b = {{&pt, ids.data() + i, 1, false, fn}};
      const auto& lg = model.forward(b, row_of);
      out.emplace_back(lg.begin(), lg.begin() + c.vocab);
    }
    kv.release(pt);
    if (s) {
      *density = s->totals().mean_density();
      *recall = s->totals().mean_recall();
    }
    return out;
  };
  double d = 0, r = 0;
  auto full = decode("", nullptr, nullptr);
  auto same = decode("lycheedecode:budget=100000", &d, &r);
  for (size_t i = 0; i < full.size(); ++i) EXPECT_EQ(same[i], full[i]) << "step " << i;
  EXPECT_EQ(d, 1.0);
  auto top1_agree = [&](const std::vector<std::vector<float>>& x) {
    int n = 0;
    for (size_t i = 0; i < full.size(); ++i)
      n += std::max_element(full[i].begin(), full[i].end()) - full[i].begin() ==
           std::max_element(x[i].begin(), x[i].end()) - x[i].begin();
    return n;
  };
  // The same budget (128 tokens per sparse head of L ~ 900) for lycheedecode, tidal and quest.
  struct Res {
    double density = 0, recall = 0;
    int agree = 0;
  };
  std::map<std::string, Res> res;
  for (const char* m : {"lycheedecode", "tidal", "quest"}) {
    Res& x = res[m];
    auto out = decode(std::string(m) + ":budget=128", &x.density, &x.recall);
    x.agree = top1_agree(out);
    std::printf("%-13s budget 128: density %.4f recall %.4f top-1 agreement %d/8\n", m, x.density,
                x.recall, x.agree);
  }
  const HeadRoles roles = resolve_head_roles("auto", c);
  const double heads = double(c.n_layers * c.n_kv_heads), nr = roles.count_retrieval();
  ASSERT_EQ(roles.model, "SmolLM2-135M-Instruct");
  // Retrieval heads read L, sparse heads 128 of L ~ 900.
  EXPECT_NEAR(res["lycheedecode"].density, (nr + (heads - nr) * 128.0 / double(P + 4)) / heads, 0.01);
  // Measured with the trained roles (layer 0 + 6 of 87 gated KV heads, docs/lycheedecode.md),
  // this prompt, 8 steps: lycheedecode density 0.192, recall 0.653, top-1 6/8; tidal 0.222,
  // 0.841, 7/8; quest 0.154, 0.715, 7/8. LycheeDecode is worse than both here: its 6 gated
  // retrieval heads re-select less often than tidal's dense re-selection layer, and quest's
  // per-head page scores beat inherited sets. Asserted as measured, with margins: density below
  // tidal's, recall above 0.55, within 0.25 of tidal's and 0.1 of quest's.
  EXPECT_LT(res["lycheedecode"].density, res["tidal"].density);
  EXPECT_GT(res["lycheedecode"].recall, 0.55) << "mean attention recall";
  EXPECT_GT(res["lycheedecode"].recall, res["tidal"].recall - 0.25);
  EXPECT_GT(res["lycheedecode"].recall, res["quest"].recall - 0.1);
  EXPECT_GE(res["lycheedecode"].agree, 6) << "teacher-forced top-1 agreement with full attention over 8 steps";
}

TEST(LycheeDecodeReal, Measurement) {
  if (!std::getenv("SPADE_LD_BENCH")) GTEST_SKIP() << "set SPADE_LD_BENCH=1 to run";
  if (!have_model()) GTEST_SKIP() << test::kSmolLM2 << " missing";
  test::SmolLM2& sm = test::smollm2();
  const ModelConfig& c = sm.w->config;
  auto env = [](const char* k, const char* d) {
    const char* v = std::getenv(k);
    return std::string(v ? v : d);
  };
  const int64_t want = std::stol(env("SPADE_LD_BENCH_TOKENS", "4096"));
  const int steps = std::stoi(env("SPADE_LD_BENCH_STEPS", "32"));
  std::vector<int64_t> budgets;
  {
    std::stringstream ss(env("SPADE_LD_BENCH_BUDGETS", "256,1024"));
    std::string x;
    while (std::getline(ss, x, ',')) budgets.push_back(std::stol(x));
  }
  const std::string kjv_path = env("SPADE_LD_KJV", (test::source_dir() + "/.stage/filler/kjv_eval.txt").c_str());
  const std::string kjv = read_text(kjv_path);
  ASSERT_GT(kjv.size(), 100000u) << "run python/lycheedecode/make_filler.sh .stage/filler";
  const std::string roles_dir = test::source_dir() + "/configs/head_roles/";
  const std::string direct_roles = roles_dir + "smollm2-135m-instruct.direct.json";
  const std::string top9_roles = roles_dir + "smollm2-135m-instruct.top9.json";

  struct Doc {
    std::string name, how;
    std::vector<int32_t> ids;
    std::string expect;
  };
  std::vector<Doc> docs;
  auto cut = [&](const std::string& text, int64_t n) {
    std::vector<int32_t> ids = sm.tok->encode(text, false);
    if (int64_t(ids.size()) > n) ids.resize(size_t(n));
    return ids;
  };
  // Passkey retrieval: one 32-word passkey at 40% depth of held-out KJV text, chat template.
  {
    const std::string key = "orchard lantern copper meadow violet anchor harbor pepper silver "
                            "thunder marble falcon ribbon candle willow garden pebble summit "
                            "cobalt saddle meadow lantern glacier walnut crimson ember hollow "
                            "timber velvet orbit prism beacon";
    std::vector<int32_t> body = sm.tok->encode(kjv.substr(20000, 200000), false);
    auto render = [&](size_t n) {
      std::string hay = sm.tok->decode(std::vector<int32_t>(body.begin(), body.begin() + long(n)), true);
      const size_t at = hay.find(' ', hay.size() * 2 / 5);
      hay.insert(at, " The passkey to the vault is: " + key + ". Remember it.");
      return sm.tok->chat_template()->render(
          {{"user", hay + "\n\nWhat is the passkey to the vault? Repeat it exactly."}}, true);
    };
    size_t n = size_t(want) - 120;
    std::vector<int32_t> ids = sm.tok->encode(render(n), false, true);
    while (int64_t(ids.size()) > want) ids = sm.tok->encode(render(n -= 16), false, true);
    docs.push_back({"passkey", "32-word passkey at 40% depth of KJV Job-Psalms text, chat template", ids,
                    "orchard lantern copper meadow"});
  }
  docs.push_back({"kjv", "KJV Job-Psalms text (held out from training), raw continuation",
                  cut(kjv.substr(150000), want), ""});
  docs.push_back({"paper", "../shared/papers/twilight.md, raw continuation",
                  cut(read_text(test::shared_dir() + "/papers/twilight.md"), want), ""});

  nlohmann::json out;
  out["model"] = test::kSmolLM2;
  for (const auto& [k, f] : {std::pair<std::string, std::string>{"auto", "auto"},
                              {"top9", top9_roles}, {"direct", direct_roles}}) {
    const HeadRoles r = resolve_head_roles(f, c);
    out["roles"][k] = {{"pattern", r.pattern()}, {"retrieval_kv_heads", r.count_retrieval()}};
  }
  out["steps"] = steps;
  out["command"] = "SPADE_LD_BENCH=1 SPADE_LD_BENCH_TOKENS=" + std::to_string(want) +
                   " SPADE_LD_BENCH_STEPS=" + std::to_string(steps) +
                   " build/spade_tests --gtest_filter=LycheeDecodeReal.Measurement";
  std::string md = "| doc | method | budget | density | recall | sparse-head recall | TF top-1 agree | free greedy match | first divergence |\n|---|---|---|---|---|---|---|---|---|\n";
  for (const Doc& d : docs) {
    auto t0 = std::chrono::steady_clock::now();
    Bench bench(d.ids, steps);
    nlohmann::json jd;
    jd["how"] = d.how;
    jd["prompt_tokens"] = d.ids.size();
    jd["full_output"] = sm.tok->decode(bench.full_tokens(), true);
    std::vector<std::tuple<std::string, std::string, int64_t>> specs;
    for (int64_t K : budgets) {
      const std::string k = std::to_string(K);
      specs.emplace_back("lycheedecode", "lycheedecode:budget=" + k, K);
      specs.emplace_back("lycheedecode top9 roles", "lycheedecode:budget=" + k + ",roles=" + top9_roles, K);
      specs.emplace_back("lycheedecode direct roles", "lycheedecode:budget=" + k + ",roles=" + direct_roles, K);
      specs.emplace_back("lycheedecode block=64", "lycheedecode:budget=" + k + ",block=64", K);
      specs.emplace_back("tidal", "tidal:budget=" + k, K);
      specs.emplace_back("quest", "quest:budget=" + k, K);
      specs.emplace_back("oracle-topk", "oracle-topk:budget=" + k, K);
    }
    specs.emplace_back("lycheedecode topp", "lycheedecode:mode=topp,p=0.99", 0);
    specs.emplace_back("lycheedecode threshold", "lycheedecode:mode=threshold,tau=1e-4", 0);
    specs.emplace_back("lycheedecode ratio", "lycheedecode:mode=ratio,ratio=0.1", 0);
    for (const auto& [label, spec, K] : specs) {
      MethodRun r = bench.run(label, spec, K);
      nlohmann::json j = {{"label", r.label}, {"spec", r.spec}, {"describe", r.describe}, {"budget", K},
                          {"density", r.density}, {"recall", r.recall}, {"sparse_head_recall", r.sparse_recall},
                          {"tf_top1_agreement", r.tf_agree}, {"free_greedy_match", r.free_match},
                          {"first_divergence", r.first_divergence}, {"output", r.output},
                          {"layer_recall", r.layer_recall}, {"layer_density", r.layer_density},
                          {"layer_sparse_head_recall", r.layer_sparse_recall}};
      if (!d.expect.empty()) j["passkey_found"] = r.output.find(d.expect) != std::string::npos;
      jd["methods"].push_back(j);
      char line[512];
      std::snprintf(line, sizeof line, "| %s | %s | %s | %.3f | %.4f | %.4f | %.3f | %.3f | %d |\n",
                    d.name.c_str(), label.c_str(), K ? std::to_string(K).c_str() : spec.substr(13).c_str(),
                    r.density, r.recall, r.sparse_recall, r.tf_agree, r.free_match, r.first_divergence);
      md += line;
      std::printf("%s", line);
      std::fflush(stdout);
    }
    if (!d.expect.empty())
      jd["full_passkey_found"] = jd["full_output"].get<std::string>().find(d.expect) != std::string::npos;
    jd["seconds"] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    out["docs"][d.name] = jd;
  }
  const std::string dir = test::source_dir() + "/docs/results";
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/lycheedecode_eval.json") << out.dump(1) << "\n";
  std::ofstream(dir + "/lycheedecode_eval.md") << "# LycheeDecode on SmolLM2-135M-Instruct (CPU, " << want
                                               << "-token prompts, " << steps << " decode steps)\n\n"
                                               << md;
}
