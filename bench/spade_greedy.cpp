// Greedy decoding with spade's CPU model on a prompt, for bench/cpu_greedy_compare.py (issue
// 43): writes the prompt's token ids to IDS_OUT and one line per step, "step token
// top1_logit second_token second_logit", as bench/llama_greedy.cpp does. Built by that script
// against build-cpu/libspade_lib.a.
//   spade_greedy MODEL PROMPT_FILE N THREADS KV_DTYPE CPU_WEIGHTS IDS_OUT
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <vector>

#include "core/thread_pool.h"
#include "kv/kv_pool.h"
#include "model/cpu_model.h"
#include "model/loader.h"
#include "tokenizer/tokenizer.h"

using namespace spade;

int main(int argc, char** argv) {
  if (argc < 8) {
    std::fprintf(stderr, "usage: spade_greedy MODEL PROMPT_FILE N THREADS KV_DTYPE CPU_WEIGHTS IDS_OUT\n");
    return 2;
  }
  std::ifstream pf(argv[2], std::ios::binary);
  std::stringstream ss;
  ss << pf.rdbuf();
  const int n = std::atoi(argv[3]);
  ThreadPool::set_global_threads(std::atoi(argv[4]));
  auto w = load_model(argv[1], parse_cpu_weights(argv[6]));
  auto tok = Tokenizer::load(argv[1]);
  const std::vector<int32_t> prompt = tok->encode(ss.str(), true, true);
  {
    std::ofstream o(argv[7]);
    for (int32_t t : prompt) o << t << "\n";
  }
  const ModelConfig& c = w->config;
  KVLayout lay{c.n_layers, c.n_kv_heads, c.head_dim, 16};
  lay.dtype = parse_kv_dtype(argv[5]);
  KVPool kv(lay, (int64_t(prompt.size()) + n + 15) / 16 + 1);
  CpuModel model(*w, kv);
  PageTable pt;
  std::vector<int64_t> row_of;
  const std::vector<float>* lg = nullptr;
  for (size_t i = 0; i < prompt.size(); i += 1024) {
    const int64_t cnt = std::min<int64_t>(1024, int64_t(prompt.size() - i));
    std::vector<SeqInput> b = {{&pt, prompt.data() + i, cnt, false, nullptr}};
    lg = &model.forward(b, row_of);
  }
  for (int step = 0; step < n; ++step) {
    const float* l = lg->data() + row_of[0] * c.vocab;
    int a = 0, b = -1;
    for (int t = 1; t < c.vocab; ++t)
      if (l[t] > l[a]) b = a, a = t;
      else if (b < 0 || l[t] > l[b]) b = t;
    std::printf("%d %d %.6f %d %.6f\n", step, a, l[a], b, l[b]);
    std::fflush(stdout);
    const int32_t tok = a;
    std::vector<SeqInput> bt = {{&pt, &tok, 1, false, nullptr}};
    lg = &model.forward(bt, row_of);
  }
  return 0;
}
