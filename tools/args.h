// The CLI's option parsing, by CLI11 (Debian libcli11-dev, header-only): `--name value`,
// `--name=value`, `-n 4` / `-n4`, boolean `--flag`, positionals, and `--` ending options.
// Unknown options are errors, short or long, so a typo is never silently ignored: each command
// declares what it accepts. The short and alternate spellings llama.cpp users type (-m, -p, -t,
// -c, --temp, -h) stand for their long options wherever a command declares those. Each
// command prints its own --help text (tools/cmd_*.cpp), so CLI11's generated help is off.
// Values are read as typed and checked by the command (integer(), number(), the range checks of
// sampling_args.h), so every error names the option.
#pragma once
#include <map>
#include <set>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "core/error.h"

namespace spade::cli {

class Args {
 public:
  // `with_value`: options taking a value; `flags`: boolean options. Names are spelled as typed:
  // "--model", or a one-letter short option such as "-n".
  Args(int argc, char** argv, std::set<std::string> with_value, std::set<std::string> flags) {
    static const std::map<std::string, std::string> kAliases = {
        {"-m", "--model"}, {"-p", "--prompt"},  {"-t", "--threads"}, {"--temp", "--temperature"},
        {"-c", "--ctx-size"}, {"-h", "--help"}};
    std::map<std::string, std::string> spelling;  // option name -> CLI11 name list ("-m,--model")
    for (const auto& n : with_value) spelling[n] = n;
    for (const auto& n : flags) spelling[n] = n;
    for (const auto& [alias, name] : kAliases) {
      if (spelling.count(alias) || !spelling.count(name)) continue;  // the command's own meaning
      spelling[name] = alias + "," + spelling[name];
    }
    CLI::App app;
    app.set_help_flag();  // --help is a flag like any other: the command prints its own text
    app.allow_extras();   // unknown options are reported below, in our words
    std::vector<std::pair<std::string, CLI::Option*>> opts;
    for (const auto& n : with_value) {
      CLI::Option* o = app.add_option(spelling[n]);
      // Every occurrence is kept (str() reads the last one, all() every one).
      o->type_name("VALUE")->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
      opts.emplace_back(n, o);
    }
    for (const auto& n : flags) opts.emplace_back(n, app.add_flag(spelling[n])->disable_flag_override());
    app.add_option("args", positional_);
    try {
      app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
      fail("option ", e.what(), " (see --help)");
    }
    for (const std::string& x : app.remaining()) {
      if (x == "--") continue;  // CLI11 lists the end-of-options mark among the extras
      fail("unknown option '", x.substr(0, x.find('=')), "' (see --help)");
    }
    for (const auto& [n, o] : opts) {
      if (o->count() == 0) continue;
      if (flags.count(n)) values_[n] = {"1"};
      else values_[n] = o->results();
    }
  }
  bool has(const std::string& n) const { return values_.count(n) > 0; }
  // The option's value (the last one when given several times), or `def`.
  std::string str(const std::string& n, const std::string& def = "") const {
    auto it = values_.find(n);
    return it == values_.end() || it->second.empty() ? def : it->second.back();
  }
  // Every value of a repeatable option, in command-line order.
  std::vector<std::string> all(const std::string& n) const {
    auto it = values_.find(n);
    return it == values_.end() ? std::vector<std::string>{} : it->second;
  }
  long long integer(const std::string& n, long long def) const {
    if (!has(n)) return def;
    try {
      size_t pos = 0;
      long long v = std::stoll(str(n), &pos);
      SPADE_CHECK(pos == str(n).size(), "");
      return v;
    } catch (...) {
      fail("option ", n, " expects an integer, got '", str(n), "'");
    }
  }
  double number(const std::string& n, double def) const {
    if (!has(n)) return def;
    try {
      size_t pos = 0;
      double v = std::stod(str(n), &pos);
      SPADE_CHECK(pos == str(n).size(), "");
      return v;
    } catch (...) {
      fail("option ", n, " expects a number, got '", str(n), "'");
    }
  }
  const std::vector<std::string>& positional() const { return positional_; }
  // Commands that take no positional arguments: a stray word is an error, not ignored.
  void no_positionals() const {
    SPADE_CHECK(positional_.empty(), "unexpected argument '",
                positional_.empty() ? "" : positional_.front(), "' (see --help)");
  }

 private:
  std::map<std::string, std::vector<std::string>> values_;
  std::vector<std::string> positional_;
};

}  // namespace spade::cli
