// Tokenizer throughput: encodes a text file in chunks (split at line ends, ~CHUNK bytes
// each, the way documents reach a tokenizer) on one thread and prints one JSON line:
// bytes, tokens, best-of-N seconds, tokens/s, MB/s, and a checksum of the ids so the
// count can be compared with the Hugging Face run (bench/bench_tokenizer_hf.py).
//   bench_tokenizer TOKENIZER_PATH TEXT_FILE [CHUNK=4096] [REPEATS=3]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "tokenizer/tokenizer.h"

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s TOKENIZER_PATH TEXT_FILE [CHUNK] [REPEATS]\n", argv[0]);
    return 2;
  }
  size_t chunk = argc > 3 ? std::strtoul(argv[3], nullptr, 10) : 4096;
  int repeats = argc > 4 ? std::atoi(argv[4]) : 3;
  auto t0 = std::chrono::steady_clock::now();
  auto tok = spade::Tokenizer::load(argv[1]);
  double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::ifstream in(argv[2], std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  std::string text = ss.str();
  std::vector<std::string_view> docs;
  for (size_t pos = 0; pos < text.size();) {
    size_t end = std::min(text.size(), pos + chunk);
    size_t nl = text.find('\n', end);
    end = nl == std::string::npos ? text.size() : nl + 1;
    docs.emplace_back(text.data() + pos, end - pos);
    pos = end;
  }
  double best = 1e30;
  size_t tokens = 0;
  uint64_t sum = 0;
  for (int r = 0; r < repeats; ++r) {
    tokens = 0;
    sum = 0;
    auto s = std::chrono::steady_clock::now();
    for (auto d : docs) {
      auto ids = tok->encode(d, /*add_special=*/false, /*parse_special=*/true);
      tokens += ids.size();
      for (int32_t id : ids) sum = sum * 1000003u + uint64_t(id);
    }
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - s).count());
  }
  std::printf(
      "{\"impl\": \"spade\", \"tokenizer\": \"%s\", \"bytes\": %zu, \"docs\": %zu, \"tokens\": %zu, "
      "\"seconds\": %.4f, \"tokens_per_s\": %.0f, \"mb_per_s\": %.2f, \"load_seconds\": %.3f, "
      "\"checksum\": \"%016llx\"}\n",
      argv[1], text.size(), docs.size(), tokens, best, tokens / best, text.size() / best / 1e6,
      load_s, (unsigned long long)sum);
  return 0;
}
