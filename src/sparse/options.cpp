#include "sparse/options.h"

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"

namespace spade::sparse {

namespace {
std::string trim(const std::string& s) {
  size_t a = s.find_first_not_of(" \t\n\r"), b = s.find_last_not_of(" \t\n\r");
  return a == std::string::npos ? std::string() : s.substr(a, b - a + 1);
}
}  // namespace

int64_t parse_int(const std::string& s, const std::string& what) {
  try {
    size_t pos = 0;
    long long v = std::stoll(trim(s), &pos);
    if (pos == trim(s).size()) return v;
  } catch (...) {
  }
  fail(what, " expects an integer, got '", s, "'");
}

double parse_float(const std::string& s, const std::string& what) {
  try {
    size_t pos = 0;
    double v = std::stod(trim(s), &pos);
    if (pos == trim(s).size()) return v;
  } catch (...) {
  }
  fail(what, " expects a number, got '", s, "'");
}

std::vector<int> parse_int_list(const std::string& s, const std::string& what) {
  std::vector<int> out;
  std::string t = trim(s);
  if (t.empty() || t == "none") return out;
  std::stringstream ss(t);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(int(parse_int(item, what)));
  return out;
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
        s += (s.empty() ? "" : ",") + std::to_string(e.get<long long>());
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
  std::ifstream f(path, std::ios::binary);
  SPADE_CHECK(f.good(), "cannot read sparse config file '", path, "'");
  std::stringstream ss;
  ss << f.rdbuf();
  merge_json(ss.str(), "sparse config '" + path + "'");
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
                             const std::map<std::string, std::string>& given)
    : method_(std::move(method)), specs_(std::move(specs)), given_(given) {
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
  // Parse every value now, so a typo fails before the model runs.
  for (const auto& s : specs_) {
    const std::string v = str(s.key);
    if (v == "auto") continue;
    const std::string what = cat(method_, " option '", s.key, "'");
    switch (s.kind) {
      case OptKind::Int: parse_int(v, what); break;
      case OptKind::Float: parse_float(v, what); break;
      case OptKind::IntList: parse_int_list(v, what); break;
      case OptKind::String: break;
    }
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
