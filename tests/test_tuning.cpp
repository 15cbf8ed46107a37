// The tuning knobs (core/tuning.h): every SPADE_* variable parsed once, defaults when unset, a
// clear error naming the variable for a value that does not parse or is out of range.
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "core/error.h"
#include "core/tuning.h"

using namespace spade;

namespace {
Tuning parse(const std::map<std::string, std::string>& env) {
  return parse_tuning([&](const char* n) -> const char* {
    auto it = env.find(n);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}

void expect_error(const std::map<std::string, std::string>& env, const std::string& what) {
  try {
    parse(env);
    FAIL() << "accepted " << env.begin()->first << "=" << env.begin()->second;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
  }
}
}  // namespace

TEST(Tuning, DefaultsWhenUnsetOrEmpty) {
  for (const auto& env : {std::map<std::string, std::string>{},
                          std::map<std::string, std::string>{{"SPADE_PDL", ""}, {"SPADE_GEMV", ""}}}) {
    const Tuning t = parse(env);
    EXPECT_EQ(t.threads, 0);
    EXPECT_FALSE(t.deterministic);
    EXPECT_EQ(t.fused_gemv, -1);
    EXPECT_EQ(t.gemv_max_m, -1);
    EXPECT_TRUE(t.pdl);
    EXPECT_TRUE(t.gemv_rotate);
    EXPECT_TRUE(t.prefill_tma);
    EXPECT_TRUE(t.tma);
    EXPECT_EQ(t.attn_decode, -1);
    EXPECT_EQ(t.attn_prefill, -1);
    EXPECT_TRUE(t.fp8_direct);
    EXPECT_EQ(t.twilight_est_tiles, -1);
    EXPECT_EQ(t.graph_min_uses, -1);
    EXPECT_EQ(t.graph_log, "");
    EXPECT_EQ(t.emulate_cc, 0);
  }
}

TEST(Tuning, EveryVariableReachesItsField) {
  const Tuning t = parse({{"SPADE_THREADS", "3"},
                          {"SPADE_DETERMINISTIC", "1"},
                          {"SPADE_FUSED_GEMV", "2"},
                          {"SPADE_GEMV", "0"},
                          {"SPADE_PDL", "0"},
                          {"SPADE_GEMV_ROTATE", "0"},
                          {"SPADE_PREFILL_TMA", "0"},
                          {"SPADE_TMA", "0"},
                          {"SPADE_ATTN_DECODE", "4"},
                          {"SPADE_ATTN_PREFILL", "0"},
                          {"SPADE_FP8_DIRECT", "0"},
                          {"SPADE_TWL_EST_TPW", "12"},
                          {"SPADE_GRAPH_MIN_USES", "3"},
                          {"SPADE_GRAPH_LOG", "/tmp/keys.log"},
                          {"SPADE_EMULATE_CC", "86"}});
  EXPECT_EQ(t.threads, 3);
  EXPECT_TRUE(t.deterministic);
  EXPECT_EQ(t.fused_gemv, 2);
  EXPECT_EQ(t.gemv_max_m, 0);
  EXPECT_FALSE(t.pdl);
  EXPECT_FALSE(t.gemv_rotate);
  EXPECT_FALSE(t.prefill_tma);
  EXPECT_FALSE(t.tma);
  EXPECT_EQ(t.attn_decode, 4);
  EXPECT_EQ(t.attn_prefill, 0);
  EXPECT_FALSE(t.fp8_direct);
  EXPECT_EQ(t.twilight_est_tiles, 12);
  EXPECT_EQ(t.graph_min_uses, 3);
  EXPECT_EQ(t.graph_log, "/tmp/keys.log");
  EXPECT_EQ(t.emulate_cc, 86);
  EXPECT_FALSE(parse({{"SPADE_DETERMINISTIC", "0"}}).deterministic);
}

TEST(Tuning, BadValuesAreClearErrors) {
  expect_error({{"SPADE_THREADS", "0"}}, "SPADE_THREADS must be an integer in [1, 1024], got '0'");
  expect_error({{"SPADE_THREADS", "4x"}}, "SPADE_THREADS");
  expect_error({{"SPADE_DETERMINISTIC", "yes"}}, "SPADE_DETERMINISTIC must be 0 or 1, got 'yes'");
  expect_error({{"SPADE_FUSED_GEMV", "4"}}, "SPADE_FUSED_GEMV must be an integer in [0, 3]");
  expect_error({{"SPADE_GEMV", "-1"}}, "SPADE_GEMV");
  expect_error({{"SPADE_PDL", "off"}}, "SPADE_PDL must be 0 or 1");
  expect_error({{"SPADE_ATTN_PREFILL", "3"}}, "SPADE_ATTN_PREFILL must be an integer in [0, 2]");
  expect_error({{"SPADE_TWL_EST_TPW", "0"}}, "SPADE_TWL_EST_TPW");
  expect_error({{"SPADE_ATTN_DECODE", " 1"}}, "SPADE_ATTN_DECODE");
  expect_error({{"SPADE_GRAPH_MIN_USES", "0"}}, "SPADE_GRAPH_MIN_USES must be an integer in [1, 64]");
  expect_error({{"SPADE_EMULATE_CC", "90"}}, "SPADE_EMULATE_CC must be an integer in [80, 89]");
  expect_error({{"SPADE_EMULATE_CC", "85"}}, "SPADE_EMULATE_CC must be 80, 86 or 89, got 85");
}
