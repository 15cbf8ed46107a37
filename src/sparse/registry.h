// The table of sparse methods: name -> options and factory. Adding a method = one file
// pair in src/sparse/methods/ and one row in registry.cpp (docs/sparse.md).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "model/config.h"
#include "sparse/method.h"
#include "sparse/options.h"

namespace spade::sparse {

struct MethodInfo {
  std::string name;
  std::string summary;
  std::vector<OptionSpec> (*options)();
  std::unique_ptr<SparseMethod> (*make)(const MethodOptions&, const ModelConfig&);
};

const std::vector<MethodInfo>& all_methods();
// Throws spade::Error listing the valid names when `name` is unknown. For a stack "a+b+c"
// every stage is checked and the outermost stage's entry is returned (its options include
// the ones it forwards to its base).
const MethodInfo& find_method(const std::string& name);
std::string method_names();  // "full, streaming, ..."
// Builds the method of `cfg` for `model`; unknown methods / options are errors.
std::shared_ptr<const SparseMethod> make_method(const SparseConfig& cfg, const ModelConfig& model);
// Throws spade::Error when an option of `cfg` has a value that names a file (OptionSpec::
// local_only: blasst config=, lycheedecode roles=PATH): such values are for the operator
// (command-line flags, --sparse-config), never for a request, which must not make the server
// read files of its choosing. Checks every stage of the method or stack and of its base
// (given or default); unknown methods throw as make_method does. Call it before make_method.
void reject_local_only_options(const SparseConfig& cfg);
// Every method with its options and defaults, for --help.
std::string methods_help();

}  // namespace spade::sparse
