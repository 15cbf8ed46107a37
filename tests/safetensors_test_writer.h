// Test helper: builds safetensors images from (name, dtype, shape, bytes) entries.
#pragma once
#include <cstdint>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace spade::test {

struct StEntry {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> data;
};

// Header from `header_json` verbatim (for broken headers), followed by `data`.
inline std::vector<uint8_t> safetensors_raw(const std::string& header_json,
                                            const std::vector<uint8_t>& data) {
  std::vector<uint8_t> out(8);
  uint64_t n = header_json.size();
  std::memcpy(out.data(), &n, 8);
  out.insert(out.end(), header_json.begin(), header_json.end());
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

inline std::vector<uint8_t> safetensors_image(
    const std::vector<StEntry>& tensors, const std::map<std::string, std::string>& meta = {}) {
  nlohmann::json h = nlohmann::json::object();
  if (!meta.empty()) h["__metadata__"] = meta;
  std::vector<uint8_t> data;
  for (const StEntry& t : tensors) {
    uint64_t begin = data.size();
    data.insert(data.end(), t.data.begin(), t.data.end());
    h[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {begin, data.size()}}};
  }
  std::string hs = h.dump();
  hs.resize((hs.size() + 7) / 8 * 8, ' ');  // writers pad the header with spaces
  return safetensors_raw(hs, data);
}

}  // namespace spade::test
