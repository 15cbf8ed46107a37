// `spade eval` pieces without a model: task generators are deterministic, fit their target
// length and hold their answers; scoring gives 1 to a perfect answer and 0 to a wrong one on
// every task; the method list expands over budgets; results files resume; reports render.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>

#include "core/error.h"
#include "eval/methods.h"
#include "eval/report.h"
#include "eval/results.h"
#include "eval/rng.h"
#include "eval/scoring.h"
#include "eval/tasks.h"

using namespace spade::eval;

namespace {

std::vector<std::string> haystack() {
  std::vector<std::string> h;
  for (int i = 0; i < 300; ++i)
    h.push_back("And the " + std::to_string(i) + "th verse of this long text goes on and on.");
  return h;
}

// About four characters per token, like English BPE.
int64_t fake_count(const std::string& user, const std::string& prefix) {
  return int64_t(user.size() + prefix.size() + 40) / 4;
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
  return s;
}

}  // namespace

TEST(EvalTasks, GeneratorsAreDeterministicAndFitTheirLength) {
  const auto hay = haystack();
  for (const auto& t : all_tasks())
    for (int64_t L : {600, 2000}) {
      const TaskSample a = make_task(t.name, L, mix_seed(1, t.name, L, 0), hay, fake_count);
      const TaskSample b = make_task(t.name, L, mix_seed(1, t.name, L, 0), hay, fake_count);
      const TaskSample c = make_task(t.name, L, mix_seed(1, t.name, L, 1), hay, fake_count);
      EXPECT_EQ(a.user, b.user) << t.name;
      EXPECT_EQ(a.answer_prefix, b.answer_prefix) << t.name;
      EXPECT_EQ(a.answers, b.answers) << t.name;
      EXPECT_NE(a.user, c.user) << t.name << ": another sample draws another task";
      EXPECT_LE(fake_count(a.user, a.answer_prefix), L) << t.name;
      EXPECT_GT(fake_count(a.user, a.answer_prefix), L * 8 / 10) << t.name << " fills its length";
      EXPECT_GT(a.filler, 0) << t.name;
      ASSERT_FALSE(a.answers.empty()) << t.name;
      for (const auto& ans : a.answers)
        EXPECT_NE(a.user.find(ans), std::string::npos) << t.name << ": answer " << ans << " in the context";
    }
}

TEST(EvalTasks, SeedsAreStableAcrossRuns) {
  // The content of a task must not depend on the platform: pin one draw.
  Rng r(42);
  EXPECT_EQ(r.next(), Rng(42).next());
  EXPECT_NE(mix_seed(1, "a", 2048, 0), mix_seed(1, "a", 2048, 1));
  EXPECT_NE(mix_seed(1, "a", 2048, 0), mix_seed(1, "b", 2048, 0));
  EXPECT_NE(mix_seed(1, "a", 2048, 0), mix_seed(1, "a", 4096, 0));
}

TEST(EvalTasks, PerfectAnswerScoresOneWrongScoresZero) {
  const auto hay = haystack();
  for (const auto& t : all_tasks())
    for (int k = 0; k < 3; ++k) {
      const TaskSample s = make_task(t.name, 1200, mix_seed(5, t.name, 1200, k), hay, fake_count);
      EXPECT_EQ(score_answer(s, " " + join(s.answers) + "."), 1.0) << t.name;
      // Case does not matter.
      std::string upper = join(s.answers);
      for (auto& c : upper) c = char(std::toupper((unsigned char)c));
      EXPECT_EQ(score_answer(s, upper), 1.0) << t.name;
      EXPECT_EQ(score_answer(s, " I do not know the answer."), 0.0) << t.name;
      EXPECT_EQ(score_answer(s, ""), 0.0) << t.name;
      EXPECT_EQ(score_answer(s, " 0000000, XXXXX, qqqqqqqq"), 0.0) << t.name;
      if (s.answers.size() > 1) {
        const double part = score_answer(s, s.answers[0]);
        EXPECT_GT(part, 0.0) << t.name;
        EXPECT_LT(part, 1.0) << t.name;
      }
    }
}

TEST(EvalTasks, FrequentWordsAnswersAreTheTopThree) {
  const TaskSample s = make_task("frequent_words", 3000, 9, {}, fake_count);
  std::map<std::string, int> n;
  std::stringstream ss(s.user.substr(s.user.find("words. ") + 7));
  std::string w;
  while (ss >> w)
    if (w != "....") ++n[w];
  std::vector<std::pair<int, std::string>> by;
  for (const auto& [k, v] : n) by.push_back({v, k});
  std::sort(by.rbegin(), by.rend());
  ASSERT_GE(by.size(), 4u);
  EXPECT_EQ(by[0].second, s.answers[0]);
  EXPECT_EQ(by[1].second, s.answers[1]);
  EXPECT_EQ(by[2].second, s.answers[2]);
  EXPECT_GT(by[2].first, by[3].first);
}

TEST(EvalTasks, VariableTrackingChainResolvesToTheAnswers) {
  const TaskSample s = make_task("variable_tracking", 1500, 3, haystack(), fake_count);
  std::map<std::string, std::string> assign;
  std::regex re("VAR ([A-Z]{5}) = (VAR )?([A-Z0-9]+)");
  for (std::sregex_iterator it(s.user.begin(), s.user.end(), re), end; it != end; ++it)
    assign[(*it)[1]] = (*it)[3];
  ASSERT_EQ(assign.size(), s.answers.size());
  for (const auto& name : s.answers) {
    std::string v = name;
    while (assign.count(v)) v = assign[v];
    EXPECT_NE(s.user.find("assigned the value " + v), std::string::npos) << name;
  }
}

TEST(EvalTasks, UnknownTaskAndTooShortLengthAreErrors) {
  EXPECT_THROW(parse_task_list("niah_single_number,nope"), spade::Error);
  EXPECT_EQ(parse_task_list("all").size(), all_tasks().size());
  EXPECT_THROW(make_task("json_lookup", 10, 1, {}, fake_count), spade::Error);
  EXPECT_THROW(make_task("niah_single_word", 1000, 1, {}, fake_count), spade::Error);
}

TEST(EvalMethods, BudgetsExpandOnlyMethodsThatTakeOne) {
  const auto r = expand_methods("full;quest;tidal:dense_layers=3;oracle-topp;streaming:budget=64;blasst",
                                {128, 512});
  std::vector<std::string> labels;
  for (const auto& m : r) labels.push_back(m.label);
  EXPECT_EQ(labels, (std::vector<std::string>{"full", "quest:budget=128", "quest:budget=512",
                                              "tidal:dense_layers=3,budget=128",
                                              "tidal:dense_layers=3,budget=512", "oracle-topp",
                                              "streaming:budget=64", "blasst"}));
  EXPECT_EQ(r[1].budget, 128);
  EXPECT_EQ(r[0].budget, -1);
  EXPECT_EQ(r[6].budget, 64);
  EXPECT_EQ(r[4].config.options.at("budget"), "512");
  EXPECT_THROW(expand_methods("full;nosuch", {1}), spade::Error);
  EXPECT_THROW(expand_methods("quest;quest", {1}), spade::Error);
}

// Twilight is configured as the paper configures it (issue 37 item 4): over a conservative
// base (budget=auto = max(8192, L/4), or an explicit budget >= 8192), run once rather than
// crossed with the small budgets of the other methods; the sweep script's default list does so.
TEST(EvalMethods, TwilightRunsOnceOverTheConservativeBase) {
  const auto r = expand_methods("twilight:budget=auto;twilight:base=tidal,budget=8192;quest",
                                {128, 512});
  ASSERT_EQ(r.size(), 4u);
  EXPECT_EQ(r[0].label, "twilight:budget=auto");
  EXPECT_EQ(r[0].budget, -1);
  EXPECT_EQ(r[0].config.options.at("budget"), "auto");
  EXPECT_EQ(r[1].label, "twilight:base=tidal,budget=8192");
  EXPECT_EQ(r[1].budget, 8192);
  EXPECT_EQ(r[2].label, "quest:budget=128");
  // scripts/eval_sweep.sh's default methods, at its default budgets.
  std::ifstream in(std::string(SPADE_SOURCE_DIR) + "/scripts/eval_sweep.sh");
  ASSERT_TRUE(in) << "scripts/eval_sweep.sh";
  std::string line, list;
  const std::string key = "methods=${METHODS:-";
  while (std::getline(in, line))
    if (line.rfind(key, 0) == 0) list = line.substr(key.size(), line.rfind('}') - key.size());
  ASSERT_FALSE(list.empty());
  int twilight = 0;
  for (const auto& m : expand_methods(list, {128, 512})) {
    if (m.name != "twilight") continue;
    ++twilight;
    EXPECT_TRUE(m.budget < 0 || m.budget >= 8192) << m.label << ": Twilight over a small base";
    EXPECT_TRUE(m.budget >= 0 || m.config.options.count("budget") == 0 ||
                m.config.options.at("budget") == "auto")
        << m.label;
  }
  EXPECT_EQ(twilight, 1) << list;
}

// Twilight's kept fraction is in the reports: the agree report shows the density (it had
// none) and every report the sparse layers' density (Twilight's kept fraction where it prunes).
TEST(EvalResults, ReportsShowTheKeptFraction) {
  const std::string path = testing::TempDir() + "spade_eval_density_test.json";
  std::remove(path.c_str());
  ResultFile f(path, "agree", {{"model", "m"}}, "spade eval agree x");
  f.add({{"key", "k1"}, {"task", "niah_single_number"}, {"length", 2048}, {"method", "full"},
         {"first_divergence", 16}, {"kl_mean", 0.0}, {"density", 1.0}, {"sparse_density", 1.0}});
  f.add({{"key", "k2"}, {"task", "niah_single_number"}, {"length", 2048},
         {"method", "twilight:budget=8192"}, {"first_divergence", 9}, {"kl_mean", 0.01},
         {"density", 0.4321}, {"sparse_density", 0.2468}});
  const std::string md = markdown_report(f.doc());
  EXPECT_NE(md.find("## Density (attended / context"), std::string::npos) << md;
  EXPECT_NE(md.find("| twilight:budget=8192 | 0.432 |"), std::string::npos) << md;
  EXPECT_NE(md.find("Twilight: the fraction its top-p keeps"), std::string::npos) << md;
  EXPECT_NE(md.find("| twilight:budget=8192 | 0.247 |"), std::string::npos) << md;
  std::remove(path.c_str());
}

TEST(EvalResults, ResumeSkipsRecordedKeysAndReportRenders) {
  const std::string path = testing::TempDir() + "spade_eval_results_test.json";
  std::remove(path.c_str());
  {
    ResultFile f(path, "tasks", {{"model", "m"}}, "spade eval tasks x");
    EXPECT_FALSE(f.has("k1"));
    f.add({{"key", "k1"}, {"task", "niah_single_number"}, {"length", 2048}, {"method", "full"},
           {"score", 0.0}, {"density", 1.0}});
    f.add({{"key", "k2"}, {"task", "niah_single_number"}, {"length", 2048},
           {"method", "quest:budget=256"}, {"score", 1.0}, {"density", 0.2}});
    EXPECT_THROW(f.add({{"key", "k1"}}), spade::Error);
    f.save();
  }
  ResultFile g(path, "tasks", {{"model", "other"}}, "spade eval tasks y");
  EXPECT_EQ(g.loaded(), 2u);
  EXPECT_TRUE(g.has("k1"));
  EXPECT_TRUE(g.has("k2"));
  EXPECT_EQ(g.doc()["meta"]["model"], "m");
  EXPECT_EQ(g.doc()["commands"].size(), 2u);
  EXPECT_THROW(ResultFile(path, "ppl", {}, "z"), spade::Error);
  const std::string md = markdown_report(g.doc());
  EXPECT_NE(md.find("| quest:budget=256 |"), std::string::npos) << md;
  EXPECT_NE(md.find("Tasks full attention does not solve"), std::string::npos);
  EXPECT_NE(md.find("| niah_single_number | 2048 | 0.00 |"), std::string::npos) << md;
  std::remove(path.c_str());
}

// A sweep resumed with other settings (SAMPLES=2, then 3, then a CPU-only method with 1):
// the header states the samples the records hold and each command's placement and date, not
// the first command's.
TEST(EvalResults, ResumedReportHeaderStatesWhatTheRecordsHold) {
  const std::string path = testing::TempDir() + "spade_eval_results_resume_test.json";
  std::remove(path.c_str());
  auto meta = [](int samples, const std::string& placement, const std::string& date) {
    return nlohmann::json{{"model", "m"}, {"backend", "cuda"}, {"samples", samples},
                          {"placement", placement}, {"date", date}};
  };
  // `samples` samples per (task, length) of `method`, the keys already held skipped.
  auto sweep = [](ResultFile& f, const std::string& method, const std::string& backend,
                  int samples) {
    for (const std::string task : {"niah_single_number", "json_lookup"})
      for (int L : {2048, 4096})
        for (int k = 0; k < samples; ++k) {
          const std::string key = "tasks|" + task + "|" + std::to_string(L) + "|" +
                                  std::to_string(k) + "|" + method;
          if (f.has(key)) continue;
          f.add({{"key", key}, {"task", task}, {"length", L}, {"sample", k}, {"method", method},
                 {"score", 1.0}, {"backend", backend}});
        }
    f.save();
  };
  {
    ResultFile f(path, "tasks", meta(2, "GPU: full", "2026-11-22"), "spade eval tasks --samples 2");
    sweep(f, "full", "cuda", 2);
  }
  {
    ResultFile f(path, "tasks", meta(3, "GPU: full", "2026-11-22"), "spade eval tasks --samples 3");
    EXPECT_EQ(f.loaded(), 8u);
    sweep(f, "full", "cuda", 3);
  }
  ResultFile f(path, "tasks", meta(1, "GPU: none; CPU: lycheecluster (no GPU path)", "2026-11-23"),
               "spade eval tasks --methods lycheecluster --samples 1");
  sweep(f, "lycheecluster", "cpu", 1);
  const nlohmann::json& doc = f.doc();
  EXPECT_EQ(doc["meta"]["samples"], 2);  // "meta" stays the first command's (compatibility)
  ASSERT_EQ(doc["runs"].size(), 3u);
  EXPECT_EQ(doc["runs"][0]["records"], 8);
  EXPECT_EQ(doc["runs"][1]["records"], 4);
  EXPECT_EQ(doc["runs"][2]["records"], 4);
  EXPECT_EQ(doc["runs"][1]["meta"]["samples"], 3);

  const std::string md = markdown_report(doc);
  EXPECT_EQ(md.find("- samples: 2"), std::string::npos) << md;
  EXPECT_NE(md.find("- samples per cell: 3 (full); 1 (lycheecluster)\n"), std::string::npos) << md;
  EXPECT_NE(md.find("- placement:\n  - commands 1-2: GPU: full\n"
                    "  - command 3: GPU: none; CPU: lycheecluster (no GPU path)\n"),
            std::string::npos) << md;
  EXPECT_NE(md.find("- date:\n  - commands 1-2: 2026-11-22\n  - command 3: 2026-11-23\n"),
            std::string::npos) << md;
  EXPECT_NE(md.find("- model: m\n"), std::string::npos) << md;  // the same in every command
  EXPECT_NE(md.find("- records: 16\n"), std::string::npos) << md;
  EXPECT_NE(md.find("# command 1: 8 records\nspade eval tasks --samples 2\n"
                    "# command 2: 4 records\nspade eval tasks --samples 3\n"
                    "# command 3: 4 records\nspade eval tasks --methods lycheecluster --samples 1\n"),
            std::string::npos) << md;
  EXPECT_NE(md.find("| lycheecluster | cpu |"), std::string::npos) << md;

  // A cell short of samples (an interrupted command) shows as a range.
  nlohmann::json cut = doc;
  auto& rs = cut["results"];
  rs.erase(std::remove_if(rs.begin(), rs.end(), [](const nlohmann::json& r) {
             return r["key"] == "tasks|json_lookup|4096|2|full";
           }),
           rs.end());
  EXPECT_NE(markdown_report(cut).find("- samples per cell: 2-3 (full); 1 (lycheecluster)\n"),
            std::string::npos);

  // A file written before "runs" (every command's meta but the first's unknown): the header
  // says so, samples still come from the records.
  nlohmann::json old = doc;
  old.erase("runs");
  const std::string omd = markdown_report(old);
  EXPECT_NE(omd.find("- placement: GPU: full\n"), std::string::npos) << omd;
  EXPECT_NE(omd.find("- samples per cell: 3 (full); 1 (lycheecluster)\n"), std::string::npos) << omd;
  EXPECT_NE(omd.find("- settings of commands 2-3: not recorded"), std::string::npos) << omd;
  // ... and resuming it records the new command's settings beside the first's.
  old["results"] = nlohmann::json::array();
  {
    std::ofstream o(path);
    o << old.dump();
  }
  ResultFile g(path, "tasks", meta(1, "GPU: full", "2026-11-24"), "spade eval tasks again");
  ASSERT_EQ(g.doc()["runs"].size(), 4u);
  EXPECT_EQ(g.doc()["runs"][0]["meta"], g.doc()["meta"]);
  EXPECT_TRUE(g.doc()["runs"][1]["meta"].is_null());
  EXPECT_EQ(g.doc()["runs"][3]["meta"]["date"], "2026-11-24");
  const std::string gmd = markdown_report(g.doc());
  EXPECT_NE(gmd.find("- date:\n  - command 1: 2026-11-22\n  - command 4: 2026-11-24\n"),
            std::string::npos) << gmd;
  EXPECT_NE(gmd.find("- settings of commands 2-3: not recorded"), std::string::npos) << gmd;
  std::remove(path.c_str());
}
