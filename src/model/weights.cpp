#include "model/weights.h"

namespace spade {

int64_t ModelWeights::parameter_count() const {
  int64_t n = tok_embeddings.numel() + final_norm.numel() + lm_head.numel();
  for (const LayerWeights& l : layers) {
    for (const HostTensor* t : {&l.attn_norm, &l.wq, &l.wk, &l.wv, &l.wo, &l.bq, &l.bk, &l.bv,
                                &l.q_norm, &l.k_norm, &l.ffn_norm, &l.w_gate, &l.w_up,
                                &l.w_down})
      n += t->numel();
    for (const cpu::QuantMatrix* q : {&l.qwq, &l.qwk, &l.qwv, &l.qwo, &l.qw_gate, &l.qw_up,
                                      &l.qw_down})
      n += q->rows * q->cols;
  }
  return n + q_tok_embeddings.rows * q_tok_embeddings.cols + q_lm_head.rows * q_lm_head.cols;
}

bool ModelWeights::native() const {
  if (q_tok_embeddings || q_lm_head) return true;
  for (const LayerWeights& l : layers)
    if (l.qwq || l.qwk || l.qwv || l.qwo || l.qw_gate || l.qw_up || l.qw_down) return true;
  return false;
}

}  // namespace spade
