// Helpers of the GPU model tests: bf16-rounded random weights (the CPU runs fp32 on the same
// values the GPU holds), random token ids.
#pragma once
#include <random>
#include <vector>

#include "gpu_util.h"
#include "model/weights.h"

namespace spade::test {

inline void round_weights_bf16(ModelWeights& w) {
  auto r = [](HostTensor& t) {
    for (auto& x : t.storage) x = round_bf16(x);
  };
  r(w.tok_embeddings);
  r(w.lm_head);
  r(w.final_norm);
  for (auto& L : w.layers)
    for (HostTensor* t : {&L.attn_norm, &L.wq, &L.wk, &L.wv, &L.wo, &L.bq, &L.bk, &L.bv,
                          &L.q_norm, &L.k_norm, &L.ffn_norm, &L.w_gate, &L.w_up, &L.w_down})
      r(*t);
}

inline std::vector<int32_t> random_tokens(std::mt19937& rng, int n, int vocab) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = int32_t(rng() % uint32_t(vocab));
  return t;
}

}  // namespace spade::test
