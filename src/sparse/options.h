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
#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "model/config.h"

namespace spade::sparse {

enum class OptKind { Int, Float, IntList, String };

// Upper bound of an Int / IntList option that comes from the model.
enum class ModelBound {
  None,
  Layers,      // value <= n_layers (a count of layers, e.g. dense_layers)
  LayerIndex,  // value < n_layers (a layer number, e.g. selection_layers)
};

// Largest value of budgets and other counts of tokens (budget >= context already means full).
constexpr int64_t kMaxTokenCount = 2147483647;
// Largest tile / block / chunk size in tokens: small enough that tile x head_dim x rows never
// overflows the buffers sized by it.
constexpr int64_t kMaxTile = 65536;

struct OptionSpec {
  std::string key;
  OptKind kind = OptKind::Int;
  std::string def;   // default as text; "auto": the per-model table (model_defaults.h)
  std::string help;  // one line, with the paper reference for the default

  // Valid values, checked by MethodOptions for the given and the default value ("auto" is
  // not checked where it is the default). Int, Float and every element of an IntList: in
  // [lo, hi] ((lo or hi) when open) and within the model's bound; Floats must be finite.
  // String: one of `choices` when it is not empty.
  double lo = -INFINITY, hi = INFINITY;
  bool lo_open = false, hi_open = false;
  ModelBound bound = ModelBound::None;
  std::vector<std::string> choices = {};
  // Values that name files on this machine (true = read from disk). Such values are for the
  // operator only (flags, --sparse-config): reject_local_only_options (registry.h) refuses
  // them in requests. nullptr: no value of the option names a file.
  bool (*local_only)(const std::string& value) = nullptr;

  // Builders: {"tile", OptKind::Int, "64", "..."} -> OptionSpec{...}.range(1, kMaxTile).
  OptionSpec range(double lo, double hi) const;
  OptionSpec open_lo() const;  // (lo, hi]
  OptionSpec open_hi() const;  // [lo, hi)
  OptionSpec upto(ModelBound b) const;
  OptionSpec one_of(std::vector<std::string> values) const;
  // Marks values naming files; the default: every non-empty value.
  OptionSpec names_file(bool (*is_file)(const std::string&) = nullptr) const;
  // "[1, 65536]", "(0, 1]", "[0, 29] (the model has 30 layers)", "one of max, sum".
  std::string valid_text(int n_layers) const;
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
  // Validates `given` against `specs` for `model`: unknown keys, unparsable values and values
  // outside their spec's range (given or default) throw spade::Error naming the method, the
  // option, the value and the valid range.
  MethodOptions(std::string method, std::vector<OptionSpec> specs,
                const std::map<std::string, std::string>& given, const ModelConfig& model);

  bool is_auto(const std::string& key) const { return str(key) == "auto"; }
  bool given(const std::string& key) const { return given_.count(key) > 0; }
  std::string str(const std::string& key) const;
  int64_t integer(const std::string& key) const;
  double number(const std::string& key) const;
  std::vector<int> int_list(const std::string& key) const;
  const std::string& method() const { return method_; }
  const std::vector<OptionSpec>& specs() const { return specs_; }
  const ModelConfig& model() const { return model_; }

 private:
  const OptionSpec& spec(const std::string& key) const;
  void check_value(const OptionSpec& s, const std::string& v) const;
  std::string method_;
  std::vector<OptionSpec> specs_;
  std::map<std::string, std::string> given_;
  ModelConfig model_;
};

// Typed parsing shared by the CLI and MethodOptions; throw spade::Error naming `what`.
// parse_int: a whole int64 (no trailing text); parse_float: finite; parse_int_list: each
// element an int ("none" or empty: no element).
int64_t parse_int(const std::string& s, const std::string& what);
double parse_float(const std::string& s, const std::string& what);
std::vector<int> parse_int_list(const std::string& s, const std::string& what);

}  // namespace spade::sparse
