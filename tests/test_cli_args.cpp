// tools/args.h: the CLI's option parsing by CLI11 (unknown options are errors, short or long;
// the aliases llama.cpp users type), tools/sampling_args.h's ranges and tools/sparse_args.h's
// sparse-method flags.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "../tools/args.h"
#include "../tools/sampling_args.h"
#include "../tools/sparse_args.h"

namespace spade::cli {
namespace {

struct Argv {
  explicit Argv(std::vector<std::string> a) : s(std::move(a)) {
    s.insert(s.begin(), "spade-cmd");
    for (auto& x : s) p.push_back(x.data());
  }
  int argc() { return int(p.size()); }
  char** argv() { return p.data(); }
  std::vector<std::string> s;
  std::vector<char*> p;
};

Args parse(std::vector<std::string> a) {
  Argv v(std::move(a));
  return Args(v.argc(), v.argv(),
              {"--model", "--prompt", "-n", "--max-tokens", "--temperature", "--top-p", "--threads",
               "--top-k", "--min-p", "--repeat-penalty", "--seed"},
              {"--help", "--stats"});
}

std::string error_of(std::vector<std::string> a) {
  try {
    Args x = parse(std::move(a));
    x.no_positionals();
    sampling_from_args(x, 0);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(CliArgs, ShortAliasesOfLongOptions) {
  Args a = parse({"-m", "M.gguf", "-p", "Hi", "-n", "4", "-t", "2", "--temp", "0.5"});
  EXPECT_EQ(a.str("--model"), "M.gguf");
  EXPECT_EQ(a.str("--prompt"), "Hi");
  EXPECT_EQ(a.integer("-n", 0), 4);
  EXPECT_EQ(a.integer("--threads", 0), 2);
  EXPECT_DOUBLE_EQ(a.number("--temperature", 0), 0.5);
  Args b = parse({"--temp=0.25", "--model=x"});
  EXPECT_DOUBLE_EQ(b.number("--temperature", 0), 0.25);
  EXPECT_EQ(b.str("--model"), "x");
  a.no_positionals();
}

TEST(CliArgs, UnknownOptionsAndStrayWordsAreErrors) {
  EXPECT_NE(error_of({"-Z"}).find("unknown option '-Z'"), std::string::npos) << error_of({"-Z"});
  EXPECT_NE(error_of({"-c", "2048"}).find("unknown option '-c'"), std::string::npos);
  EXPECT_NE(error_of({"--ctx"}).find("unknown option '--ctx'"), std::string::npos);
  EXPECT_NE(error_of({"-m", "M", "stray"}).find("unexpected argument 'stray'"), std::string::npos);
  EXPECT_EQ(error_of({"-m", "M", "--", "-5"}).find("unknown option"), std::string::npos);
}

// What the hand-written parser did and CLI11 must keep: negative numbers are values, the last
// of repeated values wins (all() keeps each), `--` ends options, a missing value and a value
// given to a flag are errors naming the option.
TEST(CliArgs, ValuesRepeatsAndEndOfOptions) {
  Args a = parse({"--temperature", "-1", "--seed=7", "--seed", "9", "-n4", "--stats", "--", "-x",
                  "--model"});
  EXPECT_EQ(a.str("--temperature"), "-1");
  EXPECT_EQ(a.integer("--seed", 0), 9);
  EXPECT_EQ(a.all("--seed"), (std::vector<std::string>{"7", "9"}));
  EXPECT_EQ(a.integer("-n", 0), 4);
  EXPECT_TRUE(a.has("--stats"));
  EXPECT_FALSE(a.has("--model"));
  EXPECT_EQ(a.positional(), (std::vector<std::string>{"-x", "--model"}));
  EXPECT_EQ(parse({"-h"}).has("--help"), true);
  EXPECT_EQ(parse({"--prompt", ""}).str("--prompt", "def"), "");
  EXPECT_NE(error_of({"--model"}).find("--model"), std::string::npos) << error_of({"--model"});
  EXPECT_NE(error_of({"--stats=1"}).find("stats"), std::string::npos) << error_of({"--stats=1"});
  EXPECT_NE(error_of({"--ctx=5"}).find("unknown option '--ctx'"), std::string::npos);
  EXPECT_NE(error_of({"--seed", "x"}).find("--seed expects an integer"), std::string::npos);
}

TEST(CliArgs, SamplingRangesAreChecked) {
  EXPECT_NE(error_of({"--top-p", "2"}).find("--top-p must be in (0, 1]"), std::string::npos);
  EXPECT_NE(error_of({"--top-p", "0"}).find("--top-p"), std::string::npos);
  EXPECT_NE(error_of({"--temperature", "-1"}).find("--temperature must be in [0, 100]"),
            std::string::npos);
  EXPECT_NE(error_of({"--temperature", "nan"}).find("--temperature"), std::string::npos);
  EXPECT_NE(error_of({"--top-k", "-3"}).find("--top-k"), std::string::npos);
  EXPECT_NE(error_of({"--min-p", "1.5"}).find("--min-p"), std::string::npos);
  EXPECT_NE(error_of({"--repeat-penalty", "0"}).find("--repeat-penalty"), std::string::npos);
  EXPECT_EQ(error_of({"--top-p", "0.9", "--temperature", "0.7", "--top-k", "40"}), "");
}

// --sparse takes the spec form requests take; --budget and repeated --sparse-opt override it,
// in that order; an unknown method fails before any model loads.
TEST(CliArgs, SparseFlagsParseOnceIntoOneConfig) {
  auto sparse_of = [](std::vector<std::string> a) {
    Argv v(std::move(a));
    Args x(v.argc(), v.argv(), {"--sparse", "--budget", "--sparse-opt", "--sparse-config"}, {});
    return sparse_from_args(x);
  };
  const sparse::SparseConfig c = sparse_of({"--sparse", "quest:budget=64,page_size=16", "--budget",
                                            "32", "--sparse-opt", "page_size=32", "--sparse-opt",
                                            "dense_layers=1"});
  EXPECT_EQ(c.method, "quest");
  EXPECT_EQ(c.options.at("budget"), "32");
  EXPECT_EQ(c.options.at("page_size"), "32");
  EXPECT_EQ(c.options.at("dense_layers"), "1");
  EXPECT_EQ(sparse_of({}).method, "full");
  EXPECT_EQ(sparse_of({"--sparse", "twilight:base=quest,budget=128"}).options.at("base"), "quest");
  EXPECT_THROW(sparse_of({"--sparse", "nope"}), Error);
  EXPECT_THROW(sparse_of({"--budget", "x"}), Error);
}

}  // namespace
}  // namespace spade::cli
