// Configuration of a sparse method: its name plus key=value options. Every parameter of
// docs/METHODS.md is an option with the paper's default; each method declares its options
// (OptionSpec) and reads typed values through MethodOptions, which rejects unknown keys
// and malformed values with a message listing what is valid.
//
// Sources, later ones override earlier ones: a JSON file (--sparse-config), then the
// command line (--sparse NAME, --budget N, --sparse-opt key=value[,key=value...]).
// JSON: {"method": "quest", "budget": 2048, "dense_layers": 2, "recall": true}
//   (options may also sit in an "options" object; arrays become comma lists).
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace spade::sparse {

enum class OptKind { Int, Float, IntList, String };

struct OptionSpec {
  std::string key;
  OptKind kind = OptKind::Int;
  std::string def;   // default as text; "auto": the per-model table (model_defaults.h)
  std::string help;  // one line, with the paper reference for the default
};

struct SparseConfig {
  std::string method = "full";
  std::map<std::string, std::string> options;  // raw text values
  bool measure_recall = false;                 // recall counters against full attention

  // "key=value" or a comma list "k=v,k=v". A fragment without '=' continues the previous
  // value, so "selection_layers=2,12" works inside a list.
  void set_options(const std::string& text);
  void set(const std::string& key, const std::string& value) { options[key] = value; }
  // Merges a JSON object (see the header comment) into this config.
  void merge_json(const std::string& json_text, const std::string& what = "sparse config");
  void merge_json_file(const std::string& path);
  // "name" or "name:k=v,k=v" (used by `spade needle --methods`).
  static SparseConfig parse_spec(const std::string& spec);
  std::string to_string() const;  // "quest budget=2048 ..." for logs
};

class MethodOptions {
 public:
  // Validates `given` against `specs`: unknown keys and unparsable values throw
  // spade::Error naming the method and listing its valid options.
  MethodOptions(std::string method, std::vector<OptionSpec> specs,
                const std::map<std::string, std::string>& given);

  bool is_auto(const std::string& key) const { return str(key) == "auto"; }
  bool given(const std::string& key) const { return given_.count(key) > 0; }
  std::string str(const std::string& key) const;
  int64_t integer(const std::string& key) const;
  double number(const std::string& key) const;
  std::vector<int> int_list(const std::string& key) const;
  const std::string& method() const { return method_; }
  const std::vector<OptionSpec>& specs() const { return specs_; }

 private:
  const OptionSpec& spec(const std::string& key) const;
  std::string method_;
  std::vector<OptionSpec> specs_;
  std::map<std::string, std::string> given_;
};

// Typed parsing shared by the CLI and MethodOptions; throw spade::Error naming `what`.
int64_t parse_int(const std::string& s, const std::string& what);
double parse_float(const std::string& s, const std::string& what);
std::vector<int> parse_int_list(const std::string& s, const std::string& what);

}  // namespace spade::sparse
