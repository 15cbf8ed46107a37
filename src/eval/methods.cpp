// expand_methods of src/eval/methods.h.
#include "eval/methods.h"

#include <map>
#include <sstream>

#include "core/error.h"
#include "sparse/registry.h"

namespace spade::eval {

namespace {
// Whether `name` reads a budget. A stacked method (an option "base", e.g. BLASST over full,
// Twilight over quest) reads one only when its base does.
bool method_takes_budget(const std::string& name, const std::map<std::string, std::string>& given) {
  bool budget = false;
  std::string base;
  for (const auto& o : sparse::find_method(name).options()) {
    budget |= o.key == "budget";
    if (o.key == "base") base = given.count("base") ? given.at("base") : o.def;
  }
  if (!budget || base.empty()) return budget;
  const std::string first = base.substr(0, base.find('+'));
  return first != name && method_takes_budget(first, {});
}
}  // namespace

std::vector<MethodRun> expand_methods(const std::string& list, const std::vector<int64_t>& budgets) {
  std::vector<MethodRun> out;
  std::stringstream ss(list);
  std::string spec;
  while (std::getline(ss, spec, ';')) {
    if (spec.empty()) continue;
    const sparse::SparseConfig c = sparse::SparseConfig::parse_spec(spec);
    const bool takes_budget = method_takes_budget(c.method, c.options);
    if (!takes_budget || c.options.count("budget")) {
      MethodRun r{spec, c.method, -1, c};
      // budget=auto (Twilight's max(8192, L/4) base): once, with no budget of its own.
      if (c.options.count("budget") && c.options.at("budget") != "auto")
        r.budget = sparse::parse_int(c.options.at("budget"), spec);
      out.push_back(r);
      continue;
    }
    SPADE_CHECK(!budgets.empty(), "method ", spec, " takes a budget: give --budgets");
    for (int64_t b : budgets) {
      MethodRun r{spec + (spec.find(':') == std::string::npos ? ":" : ",") + "budget=" +
                      std::to_string(b),
                  c.method, b, c};
      r.config.set("budget", std::to_string(b));
      out.push_back(r);
    }
  }
  SPADE_CHECK(!out.empty(), "no method given");
  for (size_t i = 0; i < out.size(); ++i)
    for (size_t j = 0; j < i; ++j)
      SPADE_CHECK(out[i].label != out[j].label, "method ", out[i].label, " is listed twice");
  return out;
}

}  // namespace spade::eval
