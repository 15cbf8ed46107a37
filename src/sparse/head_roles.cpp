#include "sparse/head_roles.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "core/mmap_file.h"

namespace spade::sparse {

namespace {

std::vector<std::vector<int>> identity_origin(int layers, int heads) {
  std::vector<std::vector<int>> o(static_cast<size_t>(layers), std::vector<int>(static_cast<size_t>(heads)));
  for (auto& row : o)
    for (int h = 0; h < heads; ++h) row[size_t(h)] = h;
  return o;
}

bool is_pattern(const std::string& s) {
  if (s.empty()) return false;
  for (char c : s)
    if (c != 'R' && c != 'S' && c != 'r' && c != 's' && c != '/') return false;
  return true;
}

struct TableRow {
  Arch arch;
  int n_layers, hidden, n_kv_heads;
  const char* file;
};
// Trained roles shipped in configs/head_roles/ (python/lycheedecode/train_roles.py).
const TableRow kTable[] = {
    {Arch::Llama, 30, 576, 3, "smollm2-135m-instruct.json"},
};

}  // namespace

int HeadRoles::count_retrieval() const {
  return int(std::count(retrieval.begin(), retrieval.end(), uint8_t(1)));
}

int HeadRoles::count_retrieval(int layer) const {
  int n = 0;
  for (int h = 0; h < n_kv_heads; ++h) n += is_retrieval(layer, h);
  return n;
}

bool HeadRoles::identity_order() const {
  for (const auto& row : origin)
    for (size_t h = 0; h < row.size(); ++h)
      if (row[h] != int(h)) return false;
  return true;
}

std::string HeadRoles::pattern() const {
  std::string s;
  for (int l = 0; l < n_layers; ++l) {
    if (l) s += '/';
    for (int h = 0; h < n_kv_heads; ++h) s += is_retrieval(l, h) ? 'R' : 'S';
  }
  return s;
}

std::string HeadRoles::to_json() const {
  std::ostringstream os;
  os << "{\n  \"model\": " << nlohmann::json(model).dump() << ",\n  \"n_layers\": " << n_layers
     << ",\n  \"n_kv_heads\": " << n_kv_heads << ",\n  \"roles\": [\n";
  for (int l = 0; l < n_layers; ++l) {
    os << "    [";
    for (int h = 0; h < n_kv_heads; ++h)
      os << (h ? ", " : "") << (is_retrieval(l, h) ? "\"retrieval\"" : "\"sparse\"");
    os << "]" << (l + 1 < n_layers ? "," : "") << "\n";
  }
  os << "  ]\n}\n";
  return os.str();
}

HeadRoles HeadRoles::all_retrieval(int n_layers, int n_kv_heads, std::string model) {
  HeadRoles r;
  r.model = std::move(model);
  r.source = "all-retrieval";
  r.n_layers = n_layers;
  r.n_kv_heads = n_kv_heads;
  r.retrieval.assign(size_t(n_layers) * size_t(n_kv_heads), 1);
  r.origin = identity_origin(n_layers, n_kv_heads);
  return r;
}

HeadRoles HeadRoles::parse_pattern(const std::string& text) {
  SPADE_CHECK(is_pattern(text), "head roles: '", text,
              "' is not an inline pattern (R/S per KV head, layers separated by '/')");
  HeadRoles r;
  r.source = "inline";
  std::stringstream ss(text);
  std::string layer;
  while (std::getline(ss, layer, '/')) {
    SPADE_CHECK(!layer.empty(), "head roles '", text, "': empty layer");
    if (r.n_layers == 0) r.n_kv_heads = int(layer.size());
    SPADE_CHECK(int(layer.size()) == r.n_kv_heads, "head roles '", text, "': layer ",
                r.n_layers, " has ", layer.size(), " heads, layer 0 has ", r.n_kv_heads);
    for (char c : layer) r.retrieval.push_back(c == 'R' || c == 'r');
    ++r.n_layers;
  }
  r.origin = identity_origin(r.n_layers, r.n_kv_heads);
  r.check();
  return r;
}

HeadRoles HeadRoles::parse_json(const std::string& text, const std::string& what) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    fail(what, ": invalid JSON: ", e.what());
  }
  SPADE_CHECK(j.is_object(), what, ": expected a JSON object");
  auto need = [&](const char* key) -> const nlohmann::json& {
    SPADE_CHECK(j.contains(key), what, ": missing \"", key, "\"");
    return j[key];
  };
  HeadRoles r;
  r.source = what;
  SPADE_CHECK(need("model").is_string() && !j["model"].get<std::string>().empty(), what,
              ": \"model\" must name the model the roles were trained for");
  r.model = j["model"].get<std::string>();
  SPADE_CHECK(need("n_layers").is_number_integer() && need("n_kv_heads").is_number_integer(),
              what, ": \"n_layers\" and \"n_kv_heads\" must be integers");
  r.n_layers = j["n_layers"].get<int>();
  r.n_kv_heads = j["n_kv_heads"].get<int>();
  SPADE_CHECK(r.n_layers > 0 && r.n_kv_heads > 0, what, ": non-positive layer or head count");
  SPADE_CHECK((!j.contains("n_heads") || j["n_heads"].is_number_integer()) &&
                  (!j.contains("hidden") || j["hidden"].is_number_integer()) &&
                  (!j.contains("arch") || j["arch"].is_string()),
              what, ": \"n_heads\" and \"hidden\" must be integers, \"arch\" a string");
  if (j.contains("n_heads")) r.file_n_heads_ = j["n_heads"].get<int>();
  if (j.contains("hidden")) r.file_hidden_ = j["hidden"].get<int>();
  if (j.contains("arch")) r.file_arch_ = j["arch"].get<std::string>();
  const auto& roles = need("roles");
  SPADE_CHECK(roles.is_array() && int(roles.size()) == r.n_layers, what, ": \"roles\" must be ",
              r.n_layers, " layers");
  for (size_t l = 0; l < roles.size(); ++l) {
    const auto& row = roles[l];
    SPADE_CHECK(row.is_array() && int(row.size()) == r.n_kv_heads, what, ": roles of layer ", l,
                " must list ", r.n_kv_heads, " KV heads");
    for (const auto& v : row) {
      SPADE_CHECK(v.is_string(), what, ": layer ", l, ": roles are \"retrieval\" or \"sparse\"");
      const std::string s = v.get<std::string>();
      if (s == "retrieval" || s == "R")
        r.retrieval.push_back(1);
      else if (s == "sparse" || s == "S")
        r.retrieval.push_back(0);
      else
        fail(what, ": layer ", l, ": unknown role '", s, "' (retrieval or sparse)");
    }
  }
  r.origin = identity_origin(r.n_layers, r.n_kv_heads);
  r.check();
  return r;
}

HeadRoles HeadRoles::load(const std::string& path) {
  std::string text;
  try {
    text = read_regular_file(path);  // a FIFO, directory or device: an error, not a hang
  } catch (const Error& e) {
    fail("cannot read head roles file: ", e.what());
  }
  return parse_json(text, "head roles '" + path + "'");
}

void HeadRoles::check() const {
  SPADE_CHECK(n_layers > 0 && n_kv_heads > 0 &&
                  retrieval.size() == size_t(n_layers) * size_t(n_kv_heads) &&
                  origin.size() == size_t(n_layers),
              "head roles (", source, "): inconsistent sizes");
  for (int h = 0; h < n_kv_heads; ++h)
    SPADE_CHECK(is_retrieval(0, h), "head roles (", source, "): layer 0 must be all retrieval",
                " heads (the first token sets come from it), head ", h, " is sparse");
  for (int l = 0; l < n_layers; ++l) {
    std::vector<int> o = origin[size_t(l)];
    SPADE_CHECK(int(o.size()) == n_kv_heads, "head roles: origin of layer ", l, " has ",
                o.size(), " entries");
    std::sort(o.begin(), o.end());
    for (int h = 0; h < n_kv_heads; ++h)
      SPADE_CHECK(o[size_t(h)] == h, "head roles: origin of layer ", l, " is not a permutation");
  }
}

void HeadRoles::check_model(const ModelConfig& cfg) const {
  check();
  const std::string who = model.empty() ? source : cat(source, " (trained for ", model, ")");
  SPADE_CHECK(n_layers == cfg.n_layers && n_kv_heads == cfg.n_kv_heads, "head roles ", who,
              " describe ", n_layers, " layers x ", n_kv_heads, " KV heads, the model has ",
              cfg.n_layers, " x ", cfg.n_kv_heads);
  SPADE_CHECK(!file_n_heads_ || file_n_heads_ == cfg.n_heads, "head roles ", who, " are for ",
              file_n_heads_, " query heads, the model has ", cfg.n_heads);
  SPADE_CHECK(!file_hidden_ || file_hidden_ == cfg.hidden, "head roles ", who,
              " are for hidden size ", file_hidden_, ", the model has ", cfg.hidden);
  SPADE_CHECK(file_arch_.empty() || file_arch_ == arch_name(cfg.arch), "head roles ", who,
              " are for architecture ", file_arch_, ", the model is ", arch_name(cfg.arch));
}

std::string default_head_roles_file(const ModelConfig& cfg) {
  for (const TableRow& r : kTable)
    if (r.arch == cfg.arch && r.n_layers == cfg.n_layers && r.hidden == cfg.hidden &&
        r.n_kv_heads == cfg.n_kv_heads)
      return r.file;
  return "";
}

HeadRoles resolve_head_roles(const std::string& value, const ModelConfig& cfg) {
  HeadRoles r;
  if (value == "auto") {
    const std::string file = default_head_roles_file(cfg);
    SPADE_CHECK(!file.empty(), "lycheedecode: no trained head roles for this model (",
                arch_name(cfg.arch), ", ", cfg.n_layers, " layers, hidden ", cfg.hidden, ", ",
                cfg.n_kv_heads, " KV heads); pass roles=PATH.json or an inline pattern ",
                "(train one with python/lycheedecode/train_roles.py)");
    namespace fs = std::filesystem;
    std::vector<fs::path> dirs = {fs::path("configs/head_roles")};
    std::error_code ec;
    fs::path exe = fs::read_symlink("/proc/self/exe", ec);
    if (!ec)
      for (fs::path d = exe.parent_path(); !d.empty() && d != d.root_path(); d = d.parent_path())
        dirs.push_back(d / "configs/head_roles");
    std::string tried;
    for (const auto& d : dirs) {
      if (fs::exists(d / file, ec)) {
        r = HeadRoles::load((d / file).string());
        r.check_model(cfg);
        return r;
      }
      tried += cat(tried.empty() ? "" : ", ", d.string());
    }
    fail("lycheedecode: head roles file ", file, " not found in ", tried, "; pass roles=PATH");
  }
  r = is_pattern(value) ? HeadRoles::parse_pattern(value) : HeadRoles::load(value);
  r.check_model(cfg);
  return r;
}

HeadRoles reorder_heads(ModelWeights& w, const HeadRoles& roles) {
  const ModelConfig& c = w.config;
  roles.check_model(c);
  SPADE_CHECK(roles.identity_order(), "reorder_heads: roles are already reordered");
  const int Hkv = c.n_kv_heads, G = c.group_size(), D = c.head_dim;
  const int64_t H = c.hidden;
  HeadRoles out = roles;
  for (int l = 0; l < c.n_layers; ++l) {
    std::vector<int> order;  // new index -> original head
    for (int h = 0; h < Hkv; ++h)
      if (roles.is_retrieval(l, h)) order.push_back(h);
    for (int h = 0; h < Hkv; ++h)
      if (!roles.is_retrieval(l, h)) order.push_back(h);
    out.origin[size_t(l)] = order;
    for (int i = 0; i < Hkv; ++i)
      out.retrieval[size_t(l) * size_t(Hkv) + size_t(i)] = roles.is_retrieval(l, order[size_t(i)]);
    LayerWeights& L = w.layers[size_t(l)];
    // Rows: `rows_per_head` consecutive rows of `cols` floats per KV head.
    auto permute_rows = [&](HostTensor& t, int64_t rows_per_head, int64_t cols) {
      if (!t.numel()) return;
      const int64_t block = rows_per_head * cols;
      SPADE_CHECK(t.numel() == block * Hkv, "reorder_heads: unexpected tensor size");
      std::vector<float> src = t.storage;
      for (int i = 0; i < Hkv; ++i)
        std::copy_n(src.data() + order[size_t(i)] * block, block, t.data() + i * block);
    };
    permute_rows(L.wq, int64_t(G) * D, H);
    permute_rows(L.wk, D, H);
    permute_rows(L.wv, D, H);
    permute_rows(L.bq, int64_t(G) * D, 1);
    permute_rows(L.bk, D, 1);
    permute_rows(L.bv, D, 1);
    // wo [hidden, Hq*D]: columns of query-head group i come from group order[i].
    std::vector<float> src = L.wo.storage;
    const int64_t in = int64_t(c.n_heads) * D, gw = int64_t(G) * D;
    for (int64_t r = 0; r < H; ++r)
      for (int i = 0; i < Hkv; ++i)
        std::copy_n(src.data() + r * in + order[size_t(i)] * gw, gw,
                    L.wo.data() + r * in + i * gw);
  }
  out.check();
  return out;
}

}  // namespace spade::sparse
