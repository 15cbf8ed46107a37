// The real SmolLM2-135M-Instruct checkpoint shared by the model-level CPU tests (fetched to
// models/ by scripts/fetch_model.sh): its path, the weights and tokenizer loaded once per test
// binary, and a whole-file read for the prompt texts.
#pragma once
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include "model/loader.h"
#include "test_util.h"
#include "tokenizer/tokenizer.h"

namespace spade::test {

inline const char* kSmolLM2 = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
inline std::string smollm2_path() { return source_dir() + "/" + kSmolLM2; }

struct SmolLM2 {
  std::unique_ptr<ModelWeights> w;
  std::unique_ptr<Tokenizer> tok;
};
// Loaded on first use (callers check smollm2_path() exists first).
inline SmolLM2& smollm2() {
  static SmolLM2 m = [] {
    SmolLM2 x;
    x.w = load_model(smollm2_path());
    x.tok = Tokenizer::load(smollm2_path());
    return x;
  }();
  return m;
}

inline std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace spade::test
