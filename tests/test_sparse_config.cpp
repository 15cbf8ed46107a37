// Sparse configuration: key=value lists, JSON files, precedence, per-model defaults.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>

#include "sparse/layer_schedule.h"
#include "sparse/model_defaults.h"
#include "sparse/registry.h"
#include "sparse/session.h"
#include "test_util.h"

using namespace spade;
using namespace spade::sparse;

namespace {
ModelConfig cfg(Arch a, int layers, int hidden, int hkv) {
  ModelConfig c;
  c.arch = a;
  c.n_layers = layers;
  c.hidden = hidden;
  c.n_kv_heads = hkv;
  c.n_heads = hkv * 3;
  c.head_dim = 64;
  c.max_context = 8192;
  return c;
}
}  // namespace

TEST(SparseConfig, KeyValueListsAndContinuedValues) {
  SparseConfig c = SparseConfig::parse_spec("tidal:budget=512,selection_layers=2,12, dense_layers=2");
  EXPECT_EQ(c.method, "tidal");
  EXPECT_EQ(c.options.at("budget"), "512");
  EXPECT_EQ(c.options.at("selection_layers"), "2,12");
  EXPECT_EQ(c.options.at("dense_layers"), "2");
  c.set_options("budget=64");
  EXPECT_EQ(c.options.at("budget"), "64");
  EXPECT_THROW(c.set_options("7,budget=3"), Error);  // a bare value with nothing to continue
  EXPECT_EQ(SparseConfig::parse_spec("full").options.size(), 0u);
}

TEST(SparseConfig, JsonFlatKeysOptionsObjectArraysAndRecall) {
  SparseConfig c;
  c.merge_json(R"({"method": "lessismore", "budget": 1024, "recall": true,
                   "options": {"recent_ratio": 0.5, "selection_layers": [2, 9]}})");
  EXPECT_EQ(c.method, "lessismore");
  EXPECT_TRUE(c.measure_recall);
  EXPECT_EQ(c.options.at("budget"), "1024");
  EXPECT_EQ(c.options.at("selection_layers"), "2,9");
  EXPECT_DOUBLE_EQ(parse_float(c.options.at("recent_ratio"), "x"), 0.5);
  auto m = make_method(c, cfg(Arch::Llama, 30, 576, 3));
  EXPECT_NE(m->describe().find("select 2,9"), std::string::npos) << m->describe();
  EXPECT_NE(m->describe().find("(512 recent)"), std::string::npos) << m->describe();
  EXPECT_THROW(c.merge_json("[1,2]"), Error);
  EXPECT_THROW(c.merge_json("{\"method\": 3}"), Error);
  EXPECT_THROW(c.merge_json("{\"budget\": [1.5]}"), Error);
  EXPECT_THROW(c.merge_json("{not json"), Error);
  // A file, then flags override it (the CLI's order).
  const std::string path = ::testing::TempDir() + "/spade_sparse_cfg.json";
  std::ofstream(path) << R"({"method": "quest", "budget": 2048, "page_size": 32})";
  SparseConfig f;
  f.merge_json_file(path);
  f.set("budget", "256");
  auto q = make_method(f, cfg(Arch::Llama, 30, 576, 3));
  EXPECT_EQ(q->describe(), "quest budget=256 page_size=32 pages=8 dense_layers=2 group=max");
  std::remove(path.c_str());
  EXPECT_THROW(f.merge_json_file("/nonexistent/x.json"), Error);
}

TEST(SparseConfig, PaperDefaults) {
  ModelConfig smol = cfg(Arch::Llama, 30, 576, 3);
  EXPECT_EQ(make_method(SparseConfig::parse_spec("quest"), smol)->describe(),
            "quest budget=2048 page_size=16 pages=128 dense_layers=2 group=max");
  EXPECT_EQ(make_method(SparseConfig::parse_spec("streaming"), smol)->describe(),
            "streaming budget=2048 sinks=4 dense_layers=0");
  EXPECT_EQ(make_method(SparseConfig::parse_spec("lessismore"), smol)->describe(),
            "lessismore budget=2048 recent_ratio=0.25 (512 recent) sinks=4 (dense 0-1, select 2,14)");
  EXPECT_EQ(make_method(SparseConfig::parse_spec("tidal"), smol)->describe(),
            "tidal budget=2048 (dense 0-1, select 2,14)");
  EXPECT_EQ(make_method(SparseConfig::parse_spec("oracle-topp"), smol)->describe(),
            "oracle-topp p=0.95 group=union dense_layers=0");
}

TEST(SparseModelDefaults, TableByArchitectureAndDepthWithFallback) {
  auto sel = [](const ModelConfig& c) { return layer_defaults(c).selection_layers; };
  EXPECT_EQ(sel(cfg(Arch::Llama, 32, 4096, 8)), (std::vector<int>{2, 13}));   // Llama-3-8B
  EXPECT_EQ(sel(cfg(Arch::Llama, 32, 4096, 32)), (std::vector<int>{2, 7}));   // LongChat-7B
  EXPECT_EQ(sel(cfg(Arch::Qwen3, 36, 4096, 8)), (std::vector<int>{2, 12}));   // Qwen3-8B
  EXPECT_EQ(sel(cfg(Arch::Qwen3, 36, 2560, 8)), (std::vector<int>{2, 20}));   // Qwen3-4B
  EXPECT_EQ(sel(cfg(Arch::Qwen3, 40, 5120, 8)), (std::vector<int>{2, 12}));   // Qwen3-14B
  EXPECT_EQ(sel(cfg(Arch::Llama, 30, 576, 3)), (std::vector<int>{2, 14}));    // SmolLM2-135M
  EXPECT_EQ(sel(cfg(Arch::Llama, 30, 960, 3)), (std::vector<int>{2, 12}));    // same depth: 13/32
  EXPECT_EQ(sel(cfg(Arch::Qwen2, 28, 3584, 4)), (std::vector<int>{2, 11}));   // fallback 13/32
  EXPECT_EQ(layer_defaults(cfg(Arch::Llama, 30, 576, 3)).dense_layers, 2);
  // Overrides.
  auto m = make_method(SparseConfig::parse_spec("tidal:dense_layers=3,selection_layers=3,20"),
                       cfg(Arch::Llama, 32, 4096, 8));
  EXPECT_EQ(m->describe(), "tidal budget=2048 (dense 0-2, select 3,20)");
}

// ---------------------------------------------------------------- option ranges (issue 44)

namespace {
const ModelConfig kSmol = cfg(Arch::Llama, 30, 576, 3);    // SmolLM2-135M: 30 layers, 3 KV heads
const ModelConfig kLlama = cfg(Arch::Llama, 32, 4096, 8);  // Llama-3-8B: 32 layers, 8 KV heads

// The spade::Error message of building `c` for `m`, "" when it builds. Any other exception
// type fails the test.
std::string build_error(const SparseConfig& c, const ModelConfig& m = kSmol) {
  try {
    make_method(c, m);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}
std::string spec_error(const std::string& spec, const ModelConfig& m = kSmol) {
  return build_error(SparseConfig::parse_spec(spec), m);
}
std::string json_error(const std::string& json, const ModelConfig& m = kSmol) {
  SparseConfig c;
  c.merge_json(json);
  return build_error(c, m);
}
#define EXPECT_BUILDS(err) EXPECT_EQ(err, "")
#define EXPECT_REJECTS(err, fragment)                                      \
  do {                                                                     \
    const std::string e_ = (err);                                          \
    EXPECT_NE(e_.find(fragment), std::string::npos) << "error: '" << e_ << "'"; \
  } while (0)

// An inline LycheeDecode role pattern for `layers` x `heads` (layer 0 all retrieval).
std::string roles_pattern(int layers, int heads) {
  std::string s;
  for (int l = 0; l < layers; ++l) {
    s += l ? "/" : "";
    for (int h = 0; h < heads; ++h) s += l == 0 || h == 1 ? 'R' : 'S';
  }
  return s;
}
}  // namespace

TEST(SparseOptionRanges, Issue44Reproductions) {
  const std::string huge = "288230376151711744";
  EXPECT_REJECTS(json_error(R"({"method": "blasst", "tile": 288230376151711744})"),
                 "blasst option 'tile' = 288230376151711744 outside [1, 65536]");
  EXPECT_REJECTS(json_error(R"({"method": "blasst", "tile": 2147483648})"),
                 "blasst option 'tile' = 2147483648 outside [1, 65536]");
  EXPECT_REJECTS(spec_error("blasst:tile=" + huge), "blasst option 'tile' = " + huge);
  EXPECT_REJECTS(json_error(R"({"method": "quest+twilight+blasst", "tile": 288230376151711744})"),
                 "blasst option 'tile' = 288230376151711744 outside [1, 65536]");
  EXPECT_REJECTS(json_error(R"({"method": "quest", "budget": -5})"),
                 "quest option 'budget' = -5 outside [1, 2147483647]");
  EXPECT_REJECTS(json_error(R"({"method": "oracle-topp", "p": "nan"})"),
                 "oracle-topp option 'p' expects a finite number, got 'nan'");
  // Layer schedules that used to throw mid-step ("layer 2 has no token set from this step").
  EXPECT_REJECTS(json_error(R"({"method": "tidal", "selection_layers": 1})"),
                 "tidal: layer 2 would reuse a token set but no selection layer at or above "
                 "dense_layers=2 comes before it (dense 0-1, select 1;");
  EXPECT_REJECTS(json_error(R"({"method": "lessismore", "selection_layers": 0})"),
                 "lessismore: layer 2 would reuse a token set");
  EXPECT_REJECTS(json_error(R"({"method": "lessismore", "selection_layers": 1})"),
                 "lessismore: layer 2 would reuse a token set");
  EXPECT_REJECTS(json_error(R"({"method": "lessismore", "selection_layers": 1099511627776})"),
                 "lessismore option 'selection_layers' element 1099511627776 does not fit in a "
                 "32-bit integer");
  EXPECT_REJECTS(json_error(R"({"method": "lessismore", "dense_layers": 3})"),
                 "lessismore: layer 3 would reuse a token set but no selection layer at or above "
                 "dense_layers=3 comes before it (dense 0-2, select 2,14;");
  // The same schedules with a selection layer at or above dense_layers are fine.
  EXPECT_BUILDS(spec_error("tidal:dense_layers=1,selection_layers=1"));
  EXPECT_BUILDS(spec_error("lessismore:dense_layers=3,selection_layers=3,14"));
  EXPECT_BUILDS(spec_error("tidal:dense_layers=2,selection_layers=1,2"));  // 1 is dense
  EXPECT_BUILDS(spec_error("tidal:dense_layers=30,selection_layers=none"));  // all dense
  EXPECT_REJECTS(spec_error("tidal:selection_layers=none"), "tidal: layer 2 would reuse");
}

TEST(SparseOptionRanges, BoundariesOfEachMethod) {
  struct Case {
    std::string spec;  // "method:k=v,..." that must build (min / max) or fail (the fragment)
    std::string fragment;
  };
  const std::string ok;
  const std::string roles = "lycheedecode:roles=" + roles_pattern(30, 3) + ",";
  const std::vector<Case> cases = {
      // streaming: budget > sinks; sinks in [0, 2^31 - 2].
      {"streaming:budget=1,sinks=0", ok},
      {"streaming:budget=2147483647,sinks=2147483646", ok},
      {"streaming:budget=2147483648",
       "streaming option 'budget' = 2147483648 outside [1, 2147483647]"},
      {"streaming:budget=0", "streaming option 'budget' = 0 outside [1, 2147483647]"},
      {"streaming:sinks=-1", "streaming option 'sinks' = -1 outside [0, 2147483646]"},
      {"streaming:dense_layers=30", ok},
      {"streaming:dense_layers=31",
       "streaming option 'dense_layers' = 31 outside [0, 30] (the model has 30 layers)"},
      // quest
      {"quest:budget=1,page_size=1", ok},
      {"quest:budget=65536,page_size=65536", ok},
      {"quest:budget=65537,page_size=65537", "quest option 'page_size' = 65537 outside [1, 65536]"},
      {"quest:page_size=0", "quest option 'page_size' = 0 outside [1, 65536]"},
      {"quest:dense_layers=-1", "quest option 'dense_layers' = -1 outside [0, 30]"},
      {"quest:group=sum", ok},
      {"quest:group=avg", "quest option 'group' = 'avg' is not one of max, sum"},
      // "auto" only where it is the default.
      {"quest:group=auto", "quest option 'group' = 'auto' is not one of max, sum"},
      {"quest:budget=auto", "quest option 'budget' expects an integer, got 'auto'"},
      {"twilight:budget=auto", ok},
      {"lessismore:dense_layers=auto,selection_layers=auto", ok},
      // tidal
      {"tidal:budget=1", ok},
      {"tidal:budget=2147483647", ok},
      {"tidal:budget=2147483648", "tidal option 'budget' = 2147483648 outside [1, 2147483647]"},
      {"tidal:selection_layers=2,29", ok},
      {"tidal:selection_layers=2,30",
       "tidal option 'selection_layers' element 30 outside [0, 29] (the model has 30 layers)"},
      {"tidal:selection_layers=-1,2", "tidal option 'selection_layers' element -1 outside [0, 29]"},
      {"tidal:dense_layers=31,selection_layers=2",
       "tidal option 'dense_layers' = 31 outside [0, 30]"},
      // lessismore
      {"lessismore:recent_ratio=0", ok},
      {"lessismore:recent_ratio=1,sinks=0", ok},
      {"lessismore:recent_ratio=1.0001",
       "lessismore option 'recent_ratio' = 1.0001 outside [0, 1]"},
      {"lessismore:recent_ratio=-0.1", "lessismore option 'recent_ratio' = -0.1 outside [0, 1]"},
      {"lessismore:sinks=-1", "lessismore option 'sinks' = -1 outside [0, 2147483647]"},
      // oracles
      {"oracle-topk:dense_layers=30", ok},
      {"oracle-topk:dense_layers=31", "oracle-topk option 'dense_layers' = 31 outside [0, 30]"},
      {"oracle-topp:p=1", ok},
      {"oracle-topp:p=1e-9", ok},
      {"oracle-topp:p=0", "oracle-topp option 'p' = 0 outside (0, 1]"},
      {"oracle-topp:p=1.5", "oracle-topp option 'p' = 1.5 outside (0, 1]"},
      {"oracle-topp:group=max", "oracle-topp option 'group' = 'max' is not one of union, mean"},
      // twilight
      {"twilight:p=1,eps=1,budget=16", ok},
      {"twilight:p=0", "twilight option 'p' = 0 outside (0, 1]"},
      {"twilight:eps=0", "twilight option 'eps' = 0 outside (0, 1]"},
      {"twilight:budget=0", "twilight option 'budget' = 0 outside [1, 2147483647]"},
      {"twilight:dense_layers=30", ok},
      {"twilight:dense_layers=31", "twilight option 'dense_layers' = 31 outside [0, 30]"},
      {"twilight:keys=int8", "twilight option 'keys' = 'int8' is not one of int4, exact"},
      // blasst
      {"blasst:tile=1,prefill_tile=1,q_block=1", ok},
      {"blasst:tile=65536,prefill_tile=65536,q_block=65536", ok},
      {"blasst:tile=0", "blasst option 'tile' = 0 outside [1, 65536]"},
      {"blasst:tile=65537", "blasst option 'tile' = 65537 outside [1, 65536]"},
      {"blasst:prefill_tile=65537", "blasst option 'prefill_tile' = 65537 outside [1, 65536]"},
      {"blasst:q_block=65537", "blasst option 'q_block' = 65537 outside [1, 65536]"},
      {"blasst:lambda=0", ok},
      {"blasst:lambda=1", ok},
      {"blasst:lambda=1.01", "blasst option 'lambda' = 1.01 outside [0, 1]"},
      {"blasst:a=0,prefill_a=1e300", ok},
      {"blasst:a=-1", "blasst option 'a' = -1 outside [0, inf)"},
      {"blasst:prefill=2", "blasst option 'prefill' = 2 outside [0, 1]"},
      {"blasst:order=random",
       "blasst option 'order' = 'random' is not one of sequential, reverse, sink_recent"},
      {"blasst:length=all", "blasst option 'length' = 'all' is not one of selected, context"},
      // lycheecluster
      {"lycheecluster:min_chunk=1,max_chunk=65536,fixed_chunk=65536", ok},
      {"lycheecluster:max_chunk=65537",
       "lycheecluster option 'max_chunk' = 65537 outside [1, 65536]"},
      {"lycheecluster:min_chunk=0", "lycheecluster option 'min_chunk' = 0 outside [1, 65536]"},
      {"lycheecluster:kmeans_iters=0", ok},
      {"lycheecluster:kmeans_iters=1000", ok},
      {"lycheecluster:kmeans_iters=1001",
       "lycheecluster option 'kmeans_iters' = 1001 outside [0, 1000]"},
      {"lycheecluster:chunks_per_fine=1", ok},
      {"lycheecluster:chunks_per_fine=0.5",
       "lycheecluster option 'chunks_per_fine' = 0.5 outside [1, 65536]"},
      {"lycheecluster:coarse_cover=0",
       "lycheecluster option 'coarse_cover' = 0 outside (0, 2147483647]"},
      {"lycheecluster:buffer=0", "lycheecluster option 'buffer' = 0 outside [1, 2147483647]"},
      {"lycheecluster:seed=-9223372036854775808", ok},
      {"lycheecluster:group=avg", "lycheecluster option 'group' = 'avg' is not one of max, sum"},
      // lycheedecode (inline roles for the 30 x 3 model)
      {roles + "mode=threshold,tau=0", ok},
      {roles + "tau=1", "lycheedecode option 'tau' = 1 outside [0, 1)"},
      {roles + "ratio=1,block=65536,correction_every=65536", ok},
      {roles + "ratio=0", "lycheedecode option 'ratio' = 0 outside (0, 1]"},
      {roles + "block=65537", "lycheedecode option 'block' = 65537 outside [1, 65536]"},
      {roles + "correction_every=65537",
       "lycheedecode option 'correction_every' = 65537 outside [1, 65536]"},
      {roles + "mode=topq",
       "lycheedecode option 'mode' = 'topq' is not one of topk, topp, threshold, ratio"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.spec);
    if (c.fragment.empty())
      EXPECT_BUILDS(spec_error(c.spec));
    else
      EXPECT_REJECTS(spec_error(c.spec), c.fragment);
  }
  // Layer bounds follow the model: 32 layers for Llama-3-8B.
  EXPECT_BUILDS(spec_error("quest:dense_layers=32", kLlama));
  EXPECT_REJECTS(spec_error("quest:dense_layers=33", kLlama),
                 "quest option 'dense_layers' = 33 outside [0, 32] (the model has 32 layers)");
  EXPECT_BUILDS(spec_error("tidal:selection_layers=2,31", kLlama));
  // LycheeDecode's selection weights support head_dim <= 512.
  ModelConfig wide = kSmol;
  wide.head_dim = 1024;
  EXPECT_REJECTS(spec_error(roles + "budget=16", wide),
                 "lycheedecode: head_dim 1024 outside [1, 512]");
}

TEST(SparseOptionRanges, DefaultsOfEveryMethodAreValid) {
  for (const ModelConfig& m : {kSmol, kLlama})
    for (const MethodInfo& info : all_methods()) {
      SCOPED_TRACE(info.name);
      EXPECT_NO_THROW(MethodOptions(info.name, info.options(), {}, m));
      if (info.name != "lycheedecode") {
        EXPECT_BUILDS(spec_error(info.name, m));
      }
    }
}

TEST(SparseOptionRanges, NanInfAndIntegerOverflow) {
  for (const char* s : {"nan", "NaN", "inf", "-inf", "infinity", "1e999", "0.5x", ""})
    EXPECT_THROW(parse_float(s, "x"), Error) << s;
  EXPECT_DOUBLE_EQ(parse_float(" 1e-30 ", "x"), 1e-30);
  EXPECT_EQ(parse_int("9223372036854775807", "x"), INT64_MAX);
  EXPECT_EQ(parse_int("-9223372036854775808", "x"), INT64_MIN);
  for (const char* s : {"9223372036854775808", "-9223372036854775809", "12abc", "1.5", ""})
    EXPECT_THROW(parse_int(s, "x"), Error) << s;
  try {
    parse_int("99999999999999999999", "blasst option 'tile'");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "blasst option 'tile' = 99999999999999999999 is outside the 64-bit "
                           "integer range");
  }
  // Lists: every element an int, never truncated.
  EXPECT_EQ(parse_int_list("2, 2147483647,-2147483648", "x"),
            (std::vector<int>{2, 2147483647, -2147483648}));
  EXPECT_TRUE(parse_int_list("none", "x").empty());
  for (const char* s : {"2,2147483648", "2,-2147483649", "2,4294967298", "2,,3", "2,"})
    EXPECT_THROW(parse_int_list(s, "x"), Error) << s;
  // Through the parsers: NaN / inf from a spec or JSON string, integers past int64 in JSON.
  EXPECT_REJECTS(spec_error("twilight:p=inf"), "twilight option 'p' expects a finite number");
  EXPECT_REJECTS(spec_error("blasst:a=nan"), "blasst option 'a' expects a finite number");
  EXPECT_REJECTS(json_error(R"({"method": "blasst", "lambda": "-inf"})"),
                 "blasst option 'lambda' expects a finite number");
  EXPECT_REJECTS(json_error(R"({"method": "lycheecluster", "seed": 18446744073709551615})"),
                 "lycheecluster option 'seed' = 18446744073709551615 is outside the 64-bit "
                 "integer range");
  EXPECT_REJECTS(json_error(R"({"method": "tidal", "selection_layers": [2, 4294967298]})"),
                 "tidal option 'selection_layers' element 4294967298 does not fit in a 32-bit "
                 "integer");
  EXPECT_REJECTS(json_error(R"({"method": "tidal",
                                "selection_layers": [2, 18446744073709551615]})"),
                 "is outside the 64-bit integer range");
}

TEST(SparseOptionRanges, StacksCheckEveryStage) {
  EXPECT_BUILDS(spec_error("quest+twilight+blasst:budget=2048,p=0.95,a=2,tile=65536"));
  EXPECT_BUILDS(spec_error("blasst:base=quest+twilight,budget=2048,p=0.95,a=2"));
  EXPECT_REJECTS(spec_error("quest+twilight+blasst:tile=288230376151711744"),
                 "blasst option 'tile' = 288230376151711744 outside [1, 65536]");
  EXPECT_REJECTS(spec_error("blasst:base=quest+twilight,p=2"),
                 "twilight option 'p' = 2 outside (0, 1]");
  EXPECT_REJECTS(spec_error("quest+twilight+blasst:page_size=0"),
                 "quest option 'page_size' = 0 outside [1, 65536]");
  EXPECT_REJECTS(spec_error("tidal+blasst:selection_layers=1"), "tidal: layer 2 would reuse");
  EXPECT_REJECTS(spec_error("quest+twilight:dense_layers=31"),
                 "option 'dense_layers' = 31 outside [0, 30]");
  // BLASST is the last stage, once: a blasst inside blasst's base would throw mid-step.
  EXPECT_REJECTS(spec_error("blasst:base=blasst"),
                 "blasst: blasst skips inside attention and must be the last stage");
  EXPECT_REJECTS(spec_error("full+blasst+blasst"), "must be the last stage");
  EXPECT_REJECTS(spec_error("quest+blasst+twilight"), "must be the last stage");
  // Stacks are short: a base, twilight and blasst are 3 stages.
  EXPECT_REJECTS(spec_error("quest+twilight+twilight+twilight+twilight+twilight+twilight+"
                            "twilight+blasst"),
                 "has more than 8 stages");
}

TEST(SparseLocalOnly, FileValuesAreRejectedForRequests) {
  auto reject = [](const std::string& spec) -> std::string {
    try {
      reject_local_only_options(SparseConfig::parse_spec(spec));
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_REJECTS(reject("blasst:config=/etc/passwd"),
                 "sparse option 'config' of blasst: '/etc/passwd' names a file; files are not "
                 "accepted in requests");
  EXPECT_REJECTS(reject("blasst:config=configs/blasst_smollm2_decode_s50.json"), "names a file");
  EXPECT_REJECTS(reject("quest+twilight+blasst:config=a.json,budget=64"), "'config' of blasst");
  EXPECT_REJECTS(reject("lycheedecode:roles=roles.json"), "sparse option 'roles' of lycheedecode");
  EXPECT_REJECTS(reject("lycheedecode:roles=/dev/zero"), "names a file");
  EXPECT_REJECTS(reject("blasst:base=lycheedecode,roles=x"), "'roles' of lycheedecode");  // base
  EXPECT_REJECTS(reject("nosuchmethod"), "unknown sparse method 'nosuchmethod'");
  // Values that name no file are fine in requests.
  for (const char* ok : {"blasst:a=2,tile=32", "blasst:config=", "lycheedecode:roles=auto",
                         "lycheedecode:roles=RRR/SRS/SSR", "quest+twilight+blasst:budget=64",
                         "quest:budget=64", "full"})
    EXPECT_EQ(reject(ok), "") << ok;
  // The operator's own flags still read files (make_method does not call it).
  const std::string path = ::testing::TempDir() + "/spade_blasst_a.json";
  std::ofstream(path) << R"({"a": 12.5, "phase": "decode"})";
  EXPECT_BUILDS(spec_error("blasst:config=" + path));
  EXPECT_NE(reject("blasst:config=" + path), "");
  std::remove(path.c_str());
}

TEST(SparseOptionRanges, KvLayoutIsCheckedWhenTheSessionStarts) {
  // Quest pages are whole KV pages: a mismatch fails at SparseSession construction, before a
  // step (it used to throw inside select()).
  ModelConfig small = cfg(Arch::Llama, 4, 96, 2);
  KVPool kv(KVLayout{small.n_layers, small.n_kv_heads, small.head_dim, 16}, 4);
  KVPool no_minmax(KVLayout{small.n_layers, small.n_kv_heads, small.head_dim, 16, false}, 4);
  auto start = [&](const std::string& spec, KVPool& pool) {
    SparseSession s(make_method(SparseConfig::parse_spec(spec), small), small, pool);
  };
  try {
    start("quest:budget=64,page_size=8", kv);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "quest: page_size 8 is not a multiple of the KV cache page size 16");
  }
  EXPECT_THROW(start("quest+twilight+blasst:budget=64,page_size=24", kv), Error);
  EXPECT_NO_THROW(start("quest:budget=64,page_size=32", kv));
  EXPECT_THROW(start("quest:budget=64", no_minmax), Error);
  EXPECT_NO_THROW(start("tidal:budget=64", no_minmax));
}
