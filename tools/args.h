// Minimal option parser for the CLI: `--name value`, `--name=value`, boolean `--flag`,
// positionals, and `--` ending options. Unknown options are errors, short or long, so a typo
// is never silently ignored: each command declares what it accepts. The short and alternate
// spellings llama.cpp users type (-m, -p, -t, --temp) stand for their long options wherever
// a command declares those.
#pragma once
#include <cctype>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "core/error.h"

namespace spade::cli {

class Args {
 public:
  // `with_value`: options taking a value; `flags`: boolean options.
  Args(int argc, char** argv, std::set<std::string> with_value, std::set<std::string> flags) {
    static const std::map<std::string, std::string> kAliases = {
        {"-m", "--model"}, {"-p", "--prompt"}, {"-t", "--threads"}, {"--temp", "--temperature"},
        {"-c", "--ctx-size"}};
    for (const auto& [alias, name] : kAliases) {
      if (with_value.count(alias) || flags.count(alias)) continue;  // the command's own meaning
      if (with_value.count(name)) with_value.insert(alias), alias_[alias] = name;
      if (flags.count(name)) flags.insert(alias), alias_[alias] = name;
    }
    bool only_pos = false;
    for (int i = 1; i < argc; ++i) {
      std::string a = argv[i];
      // Options start with "--"; single-dash names count only when declared (e.g. "-n").
      const bool declared_short = a.size() >= 2 && a[0] == '-' && a[1] != '-' &&
                                  (flags.count(a) || with_value.count(a));
      // "-x" that is not declared: an unknown option (a negative number stays a positional).
      const bool negative_number = a.size() >= 2 && a[0] == '-' &&
                                   (std::isdigit(static_cast<unsigned char>(a[1])) || a[1] == '.');
      if (!only_pos && a.size() >= 2 && a[0] == '-' && a[1] != '-' && !declared_short &&
          !negative_number)
        fail("unknown option '", a, "' (see --help)");
      if (only_pos || a.size() < 2 || a[0] != '-' || (a[1] != '-' && !declared_short)) {
        positional_.push_back(a);
        continue;
      }
      if (a == "--") {
        only_pos = true;
        continue;
      }
      std::string name = a, value;
      bool has_eq = false;
      if (auto eq = a.find('='); eq != std::string::npos) {
        name = a.substr(0, eq);
        value = a.substr(eq + 1);
        has_eq = true;
      }
      if (auto al = alias_.find(name); al != alias_.end()) name = al->second;
      if (flags.count(name)) {
        SPADE_CHECK(!has_eq, "option ", name, " takes no value");
        values_[name] = "1";
      } else if (with_value.count(name)) {
        if (!has_eq) {
          SPADE_CHECK(i + 1 < argc, "option ", name, " needs a value");
          value = argv[++i];
        }
        values_[name] = value;
      } else {
        fail("unknown option '", name, "' (see --help)");
      }
    }
  }
  bool has(const std::string& n) const { return values_.count(n) > 0; }
  std::string str(const std::string& n, const std::string& def = "") const {
    auto it = values_.find(n);
    return it == values_.end() ? def : it->second;
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
  std::map<std::string, std::string> alias_;  // short / alternate spelling -> option name
  std::map<std::string, std::string> values_;
  std::vector<std::string> positional_;
};

}  // namespace spade::cli
