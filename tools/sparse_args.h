// The sparse-method flags of `spade generate` and `spade serve`, parsed once into a
// sparse::SparseConfig. Sources in order, later ones win: --sparse-config FILE (JSON), then
// --sparse NAME or NAME:k=v,... (the form requests and `spade eval --methods` take), --budget N,
// --sparse-opt k=v,... (repeatable). Unknown method names fail here, before any model loads;
// options are checked against the model when the method is built.
#pragma once
#include <string>
#include <vector>

#include "args.h"
#include "sparse/options.h"
#include "sparse/registry.h"

namespace spade::cli {

// Every value of a repeatable option (Args keeps only the last one).
inline std::vector<std::string> all_values(int argc, char** argv, const std::string& name) {
  std::vector<std::string> out;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--") break;
    if (a == name && i + 1 < argc) out.push_back(argv[++i]);
    else if (a.rfind(name + "=", 0) == 0) out.push_back(a.substr(name.size() + 1));
  }
  return out;
}

inline sparse::SparseConfig sparse_from_args(const Args& a, int argc, char** argv) {
  sparse::SparseConfig sc;
  if (a.has("--sparse-config")) sc.merge_json_file(a.str("--sparse-config"));
  if (a.has("--sparse")) {
    const sparse::SparseConfig s = sparse::SparseConfig::parse_spec(a.str("--sparse"));
    sc.method = s.method;
    for (const auto& [k, v] : s.options) sc.options[k] = v;
  }
  if (a.has("--budget")) sc.set("budget", std::to_string(a.integer("--budget", 0)));
  for (const std::string& o : all_values(argc, argv, "--sparse-opt")) sc.set_options(o);
  sparse::find_method(sc.method);  // unknown names fail before the model loads
  return sc;
}

}  // namespace spade::cli
