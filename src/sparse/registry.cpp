#include "sparse/registry.h"

#include <algorithm>
#include <set>

#include "core/error.h"
#include "sparse/methods/full.h"
#include "sparse/methods/lessismore.h"
#include "sparse/methods/lycheecluster.h"
#include "sparse/methods/lycheedecode.h"
#include "sparse/methods/oracle.h"
#include "sparse/methods/quest.h"
#include "sparse/methods/streaming.h"
#include "sparse/methods/tidal.h"
#include "sparse/methods/twilight.h"
#include "sparse/methods/blasst.h"

namespace spade::sparse {

const std::vector<MethodInfo>& all_methods() {
  static const std::vector<MethodInfo> table = {
      {"full", "exact attention over the whole cache", full_options, make_full},
      {"streaming", "StreamingLLM: sink tokens + recent window", streaming_options,
       make_streaming},
      {"quest", "Quest: top pages by the key min/max bound", quest_options, make_quest},
      {"tidal", "TidalDecode: full-attention selection layers, set reused by later layers",
       tidal_options, make_tidal},
      {"lessismore", "LessIsMore: cross-head unified set + recency window (Algorithm 1)",
       lessismore_options, make_lessismore},
      {"lycheecluster", "LycheeCluster: structure-aware chunks, coarse/fine cluster index, bound search",
       lycheecluster_options, make_lycheecluster},
      {"lycheedecode", "LycheeDecode: retrieval heads select sets that sparse heads of later layers reuse",
       lycheedecode_options, make_lycheedecode},
      {"oracle-topk", "true top-K of the full attention (recall upper bound)",
       oracle_topk_options, make_oracle_topk},
      {"oracle-topp", "smallest true top set reaching mass p", oracle_topp_options,
       make_oracle_topp},
      {"twilight", "Twilight: top-p pruning (INT4 key estimate) of a base selection",
       twilight_options, make_twilight},
      {"blasst", "BLASST: skip key tiles below the running max (inside any selection)",
       blasst_options, make_blasst},
  };
  return table;
}

std::string method_names() {
  std::string s;
  for (const auto& m : all_methods()) s += (s.empty() ? "" : ", ") + m.name;
  return s;
}

const MethodInfo& find_method(const std::string& name) {
  if (const size_t plus = name.rfind('+'); plus != std::string::npos) {
    for (size_t b = 0, e; b <= name.size(); b = e + 1) {
      e = std::min(name.find('+', b), name.size());
      SPADE_CHECK(e > b, "sparse stack '", name, "' has an empty stage");
      find_method(name.substr(b, e - b));
    }
    return find_method(name.substr(plus + 1));
  }
  for (const auto& m : all_methods())
    if (m.name == name) return m;
  fail("unknown sparse method '", name, "'; valid methods: ", method_names());
}

std::shared_ptr<const SparseMethod> make_method(const SparseConfig& cfg, const ModelConfig& model) {
  // A stack "base+modifier[+modifier]" (e.g. quest+twilight, quest+twilight+blasst).
  if (cfg.method.find('+') != std::string::npos) return make_stack(cfg.method, cfg.options, model);
  const MethodInfo& info = find_method(cfg.method);
  MethodOptions opts(info.name, info.options(), cfg.options, model);
  return info.make(opts, model);
}

void reject_local_only_options(const SparseConfig& cfg) {
  std::vector<std::string> todo = split_stack(cfg.method);
  if (auto b = cfg.options.find("base"); b != cfg.options.end())
    for (const auto& s : split_stack(b->second)) todo.push_back(s);
  std::set<std::string> seen;
  while (!todo.empty()) {
    const std::string name = todo.back();
    todo.pop_back();
    if (!seen.insert(name).second) continue;
    for (const auto& spec : find_method(name).options()) {
      if (spec.key == "base" && !cfg.options.count("base"))  // the default base's stages too
        for (const auto& s : split_stack(spec.def)) todo.push_back(s);
      auto it = cfg.options.find(spec.key);
      if (it == cfg.options.end() || !spec.local_only || !spec.local_only(it->second)) continue;
      fail("sparse option '", spec.key, "' of ", name, ": '", it->second, "' names a file; "
           "files are not accepted in requests (set them with the server's --sparse-opt / "
           "--sparse-config)");
    }
  }
}

std::string methods_help() {
  std::string s;
  for (const auto& m : all_methods()) {
    s += cat("  ", m.name, ": ", m.summary, "\n");
    for (const auto& o : m.options()) s += cat("      ", o.key, "=", o.def, "  ", o.help, "\n");
  }
  return s;
}

}  // namespace spade::sparse
