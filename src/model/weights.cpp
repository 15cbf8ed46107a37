#include "model/weights.h"

namespace spade {

int64_t ModelWeights::parameter_count() const {
  int64_t n = tok_embeddings.numel() + final_norm.numel() + lm_head.numel();
  for (const LayerWeights& l : layers) {
    for (const HostTensor* t : {&l.attn_norm, &l.wq, &l.wk, &l.wv, &l.wo, &l.bq, &l.bk, &l.bv,
                                &l.q_norm, &l.k_norm, &l.ffn_norm, &l.w_gate, &l.w_up,
                                &l.w_down})
      n += t->numel();
  }
  return n;
}

}  // namespace spade
