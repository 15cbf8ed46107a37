// SafetensorsModel: one file or a sharded set described by model.safetensors.index.json.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "core/error.h"
#include "core/mmap_file.h"
#include "io/safetensors.h"

namespace spade {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

std::string read_text(const std::string& path) { return read_regular_file(path); }

// Shard names come from a JSON file: accept plain file names only, so an index cannot
// point outside its directory.
void check_shard_name(const std::string& index, const std::string& tensor,
                      const std::string& shard) {
  if (shard.empty() || shard == "." || shard == ".." ||
      shard.find('/') != std::string::npos || shard.find('\\') != std::string::npos ||
      shard.find('\0') != std::string::npos)
    fail(index, ": weight_map entry for '", tensor, "' names an invalid shard file '", shard,
         "'");
}

}  // namespace

std::unique_ptr<SafetensorsModel> SafetensorsModel::open(const std::string& path) {
  auto m = std::make_unique<SafetensorsModel>();
  m->path_ = path;
  std::vector<std::string> files;
  std::vector<std::pair<std::string, std::string>> weight_map;  // tensor, shard
  std::string index_path;

  if (!fs::is_directory(path)) {
    if (!fs::exists(path)) fail("'", path, "' does not exist");
    files.push_back(path);
  } else if (fs::exists(fs::path(path) / "model.safetensors.index.json")) {
    index_path = (fs::path(path) / "model.safetensors.index.json").string();
    json idx;
    try {
      idx = json::parse(read_text(index_path));
    } catch (const json::exception& e) {
      fail(index_path, ": not valid JSON: ", e.what());
    }
    if (!idx.is_object() || !idx.contains("weight_map") || !idx["weight_map"].is_object())
      fail(index_path, ": missing object 'weight_map'");
    std::set<std::string> seen;
    for (auto it = idx["weight_map"].begin(); it != idx["weight_map"].end(); ++it) {
      if (!it.value().is_string())
        fail(index_path, ": weight_map entry for '", it.key(), "' must be a file name");
      std::string shard = it.value().get<std::string>();
      check_shard_name(index_path, it.key(), shard);
      weight_map.emplace_back(it.key(), shard);
      if (seen.insert(shard).second) files.push_back((fs::path(path) / shard).string());
    }
    if (files.empty()) fail(index_path, ": weight_map is empty");
  } else if (fs::exists(fs::path(path) / "model.safetensors")) {
    files.push_back((fs::path(path) / "model.safetensors").string());
  } else {
    fail("'", path, "' has neither model.safetensors nor model.safetensors.index.json");
  }

  for (const std::string& f : files) {
    m->shards_.push_back(SafetensorsFile::open(f));
    size_t si = m->shards_.size() - 1;
    for (const SafetensorsTensor& t : m->shards_.back()->tensors()) {
      auto [it, fresh] = m->index_.emplace(t.name, std::make_pair(si, &t));
      if (!fresh)
        fail("tensor '", t.name, "' appears in both '", m->shards_[it->second.first]->path(),
             "' and '", f, "'");
    }
  }
  // The index must agree with the shards' own headers.
  for (const auto& [tensor, shard] : weight_map) {
    auto it = m->index_.find(tensor);
    std::string want = (fs::path(path) / shard).string();
    if (it == m->index_.end() || m->shards_[it->second.first]->path() != want)
      fail(index_path, ": lists tensor '", tensor, "' in '", shard,
           "', but that shard has no such tensor");
  }
  return m;
}

const SafetensorsTensor* SafetensorsModel::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : it->second.second;
}

const SafetensorsTensor& SafetensorsModel::get(const std::string& name) const {
  const SafetensorsTensor* t = find(name);
  if (!t) fail(path_, ": no tensor named '", name, "'");
  return *t;
}

TensorView SafetensorsModel::view(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) fail(path_, ": no tensor named '", name, "'");
  return shards_[it->second.first]->view(*it->second.second);
}

std::vector<const SafetensorsTensor*> SafetensorsModel::tensors() const {
  std::vector<const SafetensorsTensor*> out;
  out.reserve(index_.size());
  for (const auto& [name, loc] : index_) out.push_back(loc.second);
  return out;
}

}  // namespace spade
