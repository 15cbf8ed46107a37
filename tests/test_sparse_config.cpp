// Sparse configuration: key=value lists, JSON files, precedence, per-model defaults.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>

#include "sparse/layer_schedule.h"
#include "sparse/model_defaults.h"
#include "sparse/registry.h"
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
