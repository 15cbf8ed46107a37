#include "sparse/options.h"

#include <cmath>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "core/mmap_file.h"

namespace spade::sparse {

namespace {
std::string trim(const std::string& s) {
  size_t a = s.find_first_not_of(" \t\n\r"), b = s.find_last_not_of(" \t\n\r");
  return a == std::string::npos ? std::string() : s.substr(a, b - a + 1);
}
}  // namespace

int64_t parse_int(const std::string& s, const std::string& what) {
  const std::string t = trim(s);
  try {
    size_t pos = 0;
    long long v = std::stoll(t, &pos);
    if (pos == t.size()) return v;
  } catch (const std::out_of_range&) {
    fail(what, " = ", t, " is outside the 64-bit integer range");
  } catch (...) {
  }
  fail(what, " expects an integer, got '", s, "'");
}

double parse_float(const std::string& s, const std::string& what) {
  const std::string t = trim(s);
  double v = 0;
  bool whole = false;
  try {
    size_t pos = 0;
    v = std::stod(t, &pos);
    whole = pos == t.size();
  } catch (...) {
  }
  SPADE_CHECK(whole, what, " expects a number, got '", s, "'");
  SPADE_CHECK(std::isfinite(v), what, " expects a finite number, got '", s, "'");
  return v;
}

std::vector<int> parse_int_list(const std::string& s, const std::string& what) {
  std::vector<int> out;
  std::string t = trim(s);
  if (t.empty() || t == "none") return out;
  std::stringstream ss(t);
  std::string item;
  while (std::getline(ss, item, ',')) {
    const int64_t v = parse_int(item, what);
    SPADE_CHECK(v >= std::numeric_limits<int>::min() && v <= std::numeric_limits<int>::max(),
                what, " element ", v, " does not fit in a 32-bit integer");
    out.push_back(int(v));
  }
  if (!t.empty() && t.back() == ',') fail(what, " has an empty element in '", s, "'");
  return out;
}

// ---------------------------------------------------------------- OptionSpec

OptionSpec OptionSpec::range(double l, double h) const {
  OptionSpec s = *this;
  s.lo = l;
  s.hi = h;
  return s;
}
OptionSpec OptionSpec::open_lo() const {
  OptionSpec s = *this;
  s.lo_open = true;
  return s;
}
OptionSpec OptionSpec::open_hi() const {
  OptionSpec s = *this;
  s.hi_open = true;
  return s;
}
OptionSpec OptionSpec::upto(ModelBound b) const {
  OptionSpec s = *this;
  s.bound = b;
  return s;
}
OptionSpec OptionSpec::one_of(std::vector<std::string> values) const {
  OptionSpec s = *this;
  s.choices = std::move(values);
  return s;
}
OptionSpec OptionSpec::names_file(bool (*is_file)(const std::string&)) const {
  OptionSpec s = *this;
  s.local_only = is_file ? is_file : [](const std::string& v) { return !trim(v).empty(); };
  return s;
}

namespace {
// The closed upper bound the model adds, or +inf.
double model_hi(ModelBound b, int n_layers) {
  switch (b) {
    case ModelBound::None: return INFINITY;
    case ModelBound::Layers: return n_layers;
    case ModelBound::LayerIndex: return n_layers - 1;
  }
  return INFINITY;
}
std::string bound_text(double x) {
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  if (x == std::floor(x) && std::fabs(x) < 1e15) return std::to_string(int64_t(x));
  return cat(x);
}
}  // namespace

std::string OptionSpec::valid_text(int n_layers) const {
  if (kind == OptKind::String) {
    std::string s;
    for (const auto& c : choices) s += (s.empty() ? "" : ", ") + c;
    return "one of " + s;
  }
  const double mh = model_hi(bound, n_layers);
  const bool by_model = mh <= hi;
  const double h = by_model ? mh : hi;
  std::string s = cat(lo_open || std::isinf(lo) ? "(" : "[", bound_text(lo), ", ", bound_text(h),
                      (hi_open && !by_model) || std::isinf(h) ? ")" : "]");
  if (bound != ModelBound::None) s += cat(" (the model has ", n_layers, " layers)");
  return s;
}

void SparseConfig::set_options(const std::string& text) {
  std::stringstream ss(text);
  std::string item, last_key;
  while (std::getline(ss, item, ',')) {
    item = trim(item);
    if (item.empty()) continue;
    auto eq = item.find('=');
    if (eq == std::string::npos) {
      SPADE_CHECK(!last_key.empty(), "sparse option '", item, "' is not key=value");
      options[last_key] += "," + item;
      continue;
    }
    last_key = trim(item.substr(0, eq));
    SPADE_CHECK(!last_key.empty(), "sparse option '", item, "' has no key");
    options[last_key] = trim(item.substr(eq + 1));
  }
}

void SparseConfig::merge_json(const std::string& text, const std::string& what) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    fail(what, ": invalid JSON: ", e.what());
  }
  SPADE_CHECK(j.is_object(), what, ": expected a JSON object");
  auto value_text = [&](const std::string& key, const nlohmann::json& v) -> std::string {
    if (v.is_string()) return v.get<std::string>();
    if (v.is_number_unsigned()) return std::to_string(v.get<unsigned long long>());
    if (v.is_number_integer()) return std::to_string(v.get<long long>());
    if (v.is_number()) {
      std::ostringstream os;
      os.precision(17);
      os << v.get<double>();
      return os.str();
    }
    if (v.is_boolean()) return v.get<bool>() ? "1" : "0";
    if (v.is_array()) {
      std::string s;
      for (const auto& e : v) {
        SPADE_CHECK(e.is_number_integer(), what, ": option '", key,
                    "' must be a list of integers");
        s += (s.empty() ? "" : ",") + (e.is_number_unsigned()
                                             ? std::to_string(e.get<unsigned long long>())
                                             : std::to_string(e.get<long long>()));
      }
      return s.empty() ? "none" : s;
    }
    fail(what, ": option '", key, "' has an unsupported JSON type");
  };
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& k = it.key();
    if (k == "method") {
      SPADE_CHECK(it->is_string(), what, ": \"method\" must be a string");
      method = it->get<std::string>();
    } else if (k == "recall") {
      SPADE_CHECK(it->is_boolean(), what, ": \"recall\" must be true or false");
      measure_recall = it->get<bool>();
    } else if (k == "options") {
      SPADE_CHECK(it->is_object(), what, ": \"options\" must be an object");
      for (auto o = it->begin(); o != it->end(); ++o) options[o.key()] = value_text(o.key(), *o);
    } else {
      options[k] = value_text(k, *it);
    }
  }
}

void SparseConfig::merge_json_file(const std::string& path) {
  std::string text;
  try {
    text = read_regular_file(path);  // a FIFO, directory or device: an error, not a hang
  } catch (const Error& e) {
    fail("cannot read sparse config file: ", e.what());
  }
  merge_json(text, "sparse config '" + path + "'");
}

SparseConfig SparseConfig::parse_spec(const std::string& spec) {
  SparseConfig c;
  std::string s = trim(spec);
  auto colon = s.find(':');
  c.method = trim(s.substr(0, colon));
  SPADE_CHECK(!c.method.empty(), "empty sparse method spec '", spec, "'");
  if (colon != std::string::npos) c.set_options(s.substr(colon + 1));
  return c;
}

std::string SparseConfig::to_string() const {
  std::string s = method;
  for (const auto& [k, v] : options) s += " " + k + "=" + v;
  return s;
}

MethodOptions::MethodOptions(std::string method, std::vector<OptionSpec> specs,
                             const std::map<std::string, std::string>& given,
                             const ModelConfig& model)
    : method_(std::move(method)), specs_(std::move(specs)), given_(given), model_(model) {
  for (const auto& [k, v] : given_) {
    bool known = false;
    for (const auto& s : specs_) known |= s.key == k;
    if (!known) {
      std::string valid;
      for (const auto& s : specs_) valid += (valid.empty() ? "" : ", ") + s.key;
      fail("sparse method '", method_, "' has no option '", k, "'; valid options: ",
           valid.empty() ? std::string("none") : valid);
    }
  }
  // Parse and range-check every value now, so a bad one fails before the model runs ("auto"
  // only where it is the default: the method resolves it).
  for (const auto& s : specs_) {
    const std::string v = str(s.key);
    if (v != "auto" || s.def != "auto") check_value(s, v);
  }
}

void MethodOptions::check_value(const OptionSpec& s, const std::string& v) const {
  const std::string what = cat(method_, " option '", s.key, "'");
  const double mh = model_hi(s.bound, model_.n_layers);
  auto in_range = [&](double x) {
    return (s.lo_open ? x > s.lo : x >= s.lo) && (s.hi_open ? x < s.hi : x <= s.hi) && x <= mh;
  };
  switch (s.kind) {
    case OptKind::Int: {
      const int64_t x = parse_int(v, what);
      SPADE_CHECK(in_range(double(x)), what, " = ", x, " outside ", s.valid_text(model_.n_layers));
      break;
    }
    case OptKind::Float: {
      const double x = parse_float(v, what);
      SPADE_CHECK(in_range(x), what, " = ", trim(v), " outside ", s.valid_text(model_.n_layers));
      break;
    }
    case OptKind::IntList:
      for (int x : parse_int_list(v, what))
        SPADE_CHECK(in_range(double(x)), what, " element ", x, " outside ",
                    s.valid_text(model_.n_layers));
      break;
    case OptKind::String:
      if (s.choices.empty()) break;
      for (const auto& c : s.choices)
        if (v == c) return;
      fail(what, " = '", v, "' is not ", s.valid_text(model_.n_layers));
  }
}

const OptionSpec& MethodOptions::spec(const std::string& key) const {
  for (const auto& s : specs_)
    if (s.key == key) return s;
  fail("internal: sparse method '", method_, "' reads undeclared option '", key, "'");
}

std::string MethodOptions::str(const std::string& key) const {
  const OptionSpec& s = spec(key);
  auto it = given_.find(key);
  return it == given_.end() ? s.def : it->second;
}

int64_t MethodOptions::integer(const std::string& key) const {
  return parse_int(str(key), cat(method_, " option '", key, "'"));
}
double MethodOptions::number(const std::string& key) const {
  return parse_float(str(key), cat(method_, " option '", key, "'"));
}
std::vector<int> MethodOptions::int_list(const std::string& key) const {
  return parse_int_list(str(key), cat(method_, " option '", key, "'"));
}

}  // namespace spade::sparse
