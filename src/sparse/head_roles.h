// Head roles of LycheeDecode (docs/lycheedecode.md): per (layer, KV head) a *retrieval* head
// (attends to every cached token and selects the token set of the same head index in the
// next layer) or a *sparse* head (attends only to the set it inherits and passes it on).
// Layer 0 is all retrieval heads. Trained by python/lycheedecode/train_roles.py.
//
// File (configs/head_roles/*.json):
//   {"model": "SmolLM2-135M-Instruct",             the model it was trained for (required)
//    "arch": "llama", "n_layers": 30, "n_heads": 9, "n_kv_heads": 3, "hidden": 576,
//    "roles": [["retrieval","retrieval","retrieval"], ["sparse","retrieval","sparse"], ...],
//    ...}                                           other keys (training record) are ignored
// n_layers and n_kv_heads are required and checked against the model; n_heads, hidden and
// arch are checked when present. "R"/"S" are accepted for the role names.
//
// Inline form (option value, tests and quick experiments): one string of R/S per layer,
// layers separated by '/', e.g. "RRR/SRS/SSS".
//
// Head reordering (paper appendix F): `origin[l][i]` is the original index of the KV head
// stored at index i of layer l. Token sets follow original indices (a set flows from head h
// of layer l to head h of layer l+1 in the original numbering), so a model whose heads were
// permuted by reorder_heads() computes exactly what the original computes.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/weights.h"

namespace spade::sparse {

struct HeadRoles {
  std::string model;                     // name of the model the roles were trained for
  std::string source;                    // file it was read from ("inline", ...)
  int n_layers = 0, n_kv_heads = 0;
  std::vector<uint8_t> retrieval;        // [layer][kv_head] 1 = retrieval, 0 = sparse
  std::vector<std::vector<int>> origin;  // [layer][kv_head] original head index (identity)

  bool is_retrieval(int layer, int head) const {
    return retrieval[size_t(layer) * size_t(n_kv_heads) + size_t(head)] != 0;
  }
  int count_retrieval() const;            // over every layer, layer 0 included
  int count_retrieval(int layer) const;
  bool identity_order() const;
  std::string pattern() const;            // inline form "RRR/SRS/..."
  std::string to_json() const;            // the file form (roles + shape + model)

  // Every head of every layer a retrieval head (== full attention).
  static HeadRoles all_retrieval(int n_layers, int n_kv_heads, std::string model = "");
  // Inline form "RRR/SRS/..." (see the header comment).
  static HeadRoles parse_pattern(const std::string& text);
  static HeadRoles parse_json(const std::string& text, const std::string& what);
  static HeadRoles load(const std::string& path);
  // Throws spade::Error unless the roles fit `cfg` (layer and head counts, and the optional
  // shape fields of the file) and layer 0 is all retrieval.
  void check_model(const ModelConfig& cfg) const;
  void check() const;  // internal consistency (sizes, layer 0, origin permutations)

 private:
  int file_n_heads_ = 0, file_hidden_ = 0;
  std::string file_arch_;
};

// Resolves the `roles` option: "auto" (the file of the per-model table below, searched in
// ./configs/head_roles and next to the executable's ../configs/head_roles), an inline
// pattern, or a JSON path. Checks the result against `cfg`.
HeadRoles resolve_head_roles(const std::string& value, const ModelConfig& cfg);
// File name (under configs/head_roles/) of the trained roles for `cfg`, "" if none.
std::string default_head_roles_file(const ModelConfig& cfg);

// Paper appendix F: permute each layer's KV heads (and their G query heads) so that the
// retrieval heads come first, in original order, then the sparse heads. Rewrites the rows
// of wq/wk/wv (+ biases) and the columns of wo, and returns the roles in the new order with
// `origin` filled. Outputs are unchanged (tests/test_lycheedecode.cpp proves it).
HeadRoles reorder_heads(ModelWeights& w, const HeadRoles& roles);

}  // namespace spade::sparse
