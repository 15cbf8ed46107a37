// Greedy decoding with llama.cpp on given token ids, for bench/cpu_greedy_compare.py (issue 43):
// prints one line per step, "step token top1_logit second_token second_logit". Built by that
// script against a llama.cpp build tree (libllama.a, libggml*.a); not part of spade's build.
//   llama_greedy MODEL IDS_FILE N THREADS
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <vector>

#include "llama.h"

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: llama_greedy MODEL IDS_FILE N THREADS\n");
    return 2;
  }
  std::vector<llama_token> ids;
  std::ifstream f(argv[2]);
  for (long x; f >> x;) ids.push_back(llama_token(x));
  const int n = std::atoi(argv[3]), threads = std::atoi(argv[4]);
  llama_backend_init();
  llama_model_params mp = llama_model_default_params();
  llama_model* model = llama_model_load_from_file(argv[1], mp);
  if (!model) return 1;
  llama_context_params cp = llama_context_default_params();
  cp.n_ctx = uint32_t(ids.size() + n + 16);
  cp.n_batch = 512;
  cp.n_ubatch = 512;
  cp.n_threads = cp.n_threads_batch = threads;
  llama_context* ctx = llama_init_from_model(model, cp);
  if (!ctx) return 1;
  const int vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
  for (size_t i = 0; i < ids.size(); i += 512) {
    const int cnt = int(std::min<size_t>(512, ids.size() - i));
    if (llama_decode(ctx, llama_batch_get_one(ids.data() + i, cnt)) != 0) return 1;
  }
  for (int step = 0; step < n; ++step) {
    const float* lg = llama_get_logits_ith(ctx, -1);
    int a = 0, b = -1;
    for (int t = 1; t < vocab; ++t)
      if (lg[t] > lg[a]) b = a, a = t;
      else if (b < 0 || lg[t] > lg[b]) b = t;
    std::printf("%d %d %.6f %d %.6f\n", step, a, lg[a], b, lg[b]);
    std::fflush(stdout);
    llama_token tok = a;
    if (llama_decode(ctx, llama_batch_get_one(&tok, 1)) != 0) return 1;
  }
  llama_free(ctx);
  llama_model_free(model);
  return 0;
}
