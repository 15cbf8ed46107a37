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

inline sparse::SparseConfig sparse_from_args(const Args& a) {
  sparse::SparseConfig sc;
  if (a.has("--sparse-config")) sc.merge_json_file(a.str("--sparse-config"));
  if (a.has("--sparse")) {
    const sparse::SparseConfig s = sparse::SparseConfig::parse_spec(a.str("--sparse"));
    sc.method = s.method;
    for (const auto& [k, v] : s.options) sc.options[k] = v;
  }
  if (a.has("--budget")) sc.set("budget", std::to_string(a.integer("--budget", 0)));
  for (const std::string& o : a.all("--sparse-opt")) sc.set_options(o);
  sparse::find_method(sc.method);  // unknown names fail before the model loads
  return sc;
}

}  // namespace spade::cli
