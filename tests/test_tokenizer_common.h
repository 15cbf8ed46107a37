// Helpers shared by the tokenizer tests: fixture paths, tokenizers loaded once per process,
// and llama.cpp's .inp/.out vocabulary test format.
#pragma once
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace spade::test {

inline std::string tok_shared(const std::string& rel) {
  return std::string(SPADE_SOURCE_DIR) + "/../shared/fixtures/tokenizers/" + rel;
}
inline std::string tok_fixture(const std::string& rel) {
  return std::string(SPADE_SOURCE_DIR) + "/tests/fixtures/tokenizer/" + rel;
}
inline std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}
inline bool exists(const std::string& path) { return std::ifstream(path).good(); }

// Loads each path once; tests share the instance (Tokenizer is immutable).
inline const Tokenizer& cached_tokenizer(const std::string& path) {
  static std::mutex mu;
  static std::map<std::string, std::unique_ptr<Tokenizer>> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto& t = cache[path];
  if (!t) t = Tokenizer::load(path);
  return *t;
}

struct VocabCase {
  std::string text;
  std::vector<int32_t> ids;
};

// llama.cpp's format: strings separated by "\n__ggml_vocab_test__\n"; one line of ids each.
inline std::vector<VocabCase> read_vocab_cases(const std::string& inp, const std::string& out) {
  std::string text = read_all(inp);
  const std::string delim = "\n__ggml_vocab_test__\n";
  std::vector<std::string> strs;
  size_t pos = 0;
  for (size_t f; (f = text.find(delim, pos)) != std::string::npos; pos = f + delim.size())
    strs.push_back(text.substr(pos, f - pos));
  std::istringstream outs(read_all(out));
  std::vector<VocabCase> cases;
  std::string line;
  for (const auto& s : strs) {
    std::getline(outs, line);
    VocabCase c{s, {}};
    std::istringstream ls(line);
    int32_t id;
    while (ls >> id) c.ids.push_back(id);
    cases.push_back(std::move(c));
  }
  return cases;
}

inline std::string ids_str(const std::vector<int32_t>& v) {
  std::string s;
  for (auto x : v) s += std::to_string(x) + " ";
  return s;
}

}  // namespace spade::test
