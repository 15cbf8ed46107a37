#include "model/cpu_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "backend/cpu/ops.h"
#include "backend/cpu/qgemv.h"
#include "dist/communicator.h"
#include "kv/key_rotation.h"

namespace spade {

namespace {

// y[M, N] = x[M, K] W^T (+ bias) with W as stored when the loader kept it so (`q`), else fp32.
void linear(const float* x, const HostTensor& f, const cpu::QuantMatrix& q, const HostTensor& bias,
            float* y, int64_t M, int64_t N, int64_t K) {
  const float* b = bias.numel() ? bias.data() : nullptr;
  if (q)
    cpu::qmatmul(x, q, b, y, M);
  else
    cpu::matmul(x, f.data(), b, y, M, N, K);
}

}  // namespace

CpuModel::CpuModel(const ModelWeights& w, KVPool& kv, dist::Communicator* tp)
    : w_(w), kv_(kv), tp_(tp) {
  const ModelConfig& c = w.config;
  SPADE_CHECK(kv.layout().n_layers == c.n_layers && kv.layout().n_kv_heads == c.n_kv_heads &&
                  kv.layout().head_dim == c.head_dim,
              "KV pool layout does not match the model");
  inv_freq_.resize(size_t(c.head_dim / 2));
  cpu::rope_inv_freq(c, inv_freq_.data());
}

template <typename T>
static T* grow(std::vector<T>& b, int64_t n) {
  if (int64_t(b.size()) < n) b.resize(size_t(n));
  return b.data();
}

void CpuModel::ensure_workspace(int64_t T, int64_t logit_rows) {
  const ModelConfig& c = w_.config;
  grow(x_, T * c.hidden);
  grow(xn_, T * c.hidden);
  grow(q_, T * c.n_heads * c.head_dim);
  grow(k_, T * c.n_kv_heads * c.head_dim);
  grow(v_, T * c.n_kv_heads * c.head_dim);
  grow(att_, T * c.n_heads * c.head_dim);
  grow(tmp_, T * c.hidden);
  grow(gate_, T * c.ffn);
  grow(up_, T * c.ffn);
  grow(pos_, T);
  grow(last_, logit_rows * c.hidden);
  const int64_t n_logits = logits_on_ ? logit_rows * c.vocab : 0;
  if (int64_t(logits_.size()) != n_logits) logits_.resize(size_t(n_logits));
}

void CpuModel::dense_attention(int layer, const PageTable& pt, const float* q, int64_t p0,
                               int64_t T, float* out) {
  const ModelConfig& c = w_.config;
  cpu::attention_dense(kv_, layer, pt, q, p0, T, c.n_heads, 1.f / std::sqrt(float(c.head_dim)),
                       out, scratch_);
}

const std::vector<float>& CpuModel::forward(const std::vector<SeqInput>& batch,
                                            std::vector<int64_t>& row_of) {
  const ModelConfig& c = w_.config;
  const int64_t H = c.hidden, D = c.head_dim, Hq = c.n_heads, Hkv = c.n_kv_heads;
  int64_t T = 0, logit_rows = 0;
  for (const SeqInput& s : batch) {
    SPADE_CHECK(s.n_tokens > 0 && s.pages, "forward: empty sequence input");
    SPADE_CHECK(s.pages->length + s.n_tokens <= c.max_context, "sequence of ",
                s.pages->length + s.n_tokens, " tokens exceeds the model's context of ",
                c.max_context, " tokens");
    T += s.n_tokens;
    logit_rows += s.all_logits ? s.n_tokens : 1;
  }
  // Reserve every sequence's pages before touching anything; undo on failure.
  {
    std::vector<size_t> before;
    try {
      for (const SeqInput& s : batch) {
        before.push_back(s.pages->pages.size());
        kv_.reserve(*s.pages, s.pages->length + s.n_tokens);
      }
    } catch (...) {
      for (size_t i = 0; i < before.size(); ++i) {
        PageTable& pt = *batch[i].pages;
        PageTable extra;
        extra.pages.assign(pt.pages.begin() + long(before[i]), pt.pages.end());
        pt.pages.resize(before[i]);
        kv_.release(extra);
      }
      throw;
    }
  }
  ensure_workspace(T, logit_rows);
  float *x = x_.data(), *xn = xn_.data(), *q = q_.data(), *k = k_.data(), *v = v_.data();
  float *att = att_.data(), *tmp = tmp_.data(), *gate = gate_.data(), *up = up_.data();

  // Token ids and positions, flattened over the batch.
  std::vector<int32_t>& pos = pos_;
  {
    int64_t r = 0;
    for (const SeqInput& s : batch) {
      if (w_.q_tok_embeddings) {
        for (int64_t t = 0; t < s.n_tokens; ++t) {
          SPADE_CHECK(s.tokens[t] >= 0 && s.tokens[t] < c.vocab, "token id ", s.tokens[t],
                      " outside the vocabulary (", c.vocab, " tokens)");
          cpu::dequantize_row(w_.q_tok_embeddings, s.tokens[t], x + (r + t) * H);
        }
      } else {
        cpu::embedding(w_.tok_embeddings.data(), s.tokens, x + r * H, s.n_tokens, H, c.vocab);
      }
      for (int64_t t = 0; t < s.n_tokens; ++t) pos[size_t(r + t)] = int32_t(s.pages->length + t);
      r += s.n_tokens;
    }
  }
  const float eps = c.rms_eps;
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& L = w_.layers[size_t(l)];
    cpu::rmsnorm(x, L.attn_norm.data(), eps, xn, T, H);
    linear(xn, L.wq, L.qwq, L.bq, q, T, Hq * D, H);
    linear(xn, L.wk, L.qwk, L.bk, k, T, Hkv * D, H);
    linear(xn, L.wv, L.qwv, L.bv, v, T, Hkv * D, H);
    if (c.qk_norm) {
      cpu::rmsnorm(q, L.q_norm.data(), eps, q, T * Hq, D);
      cpu::rmsnorm(k, L.k_norm.data(), eps, k, T * Hkv, D);
    }
    cpu::rope(q, pos.data(), inv_freq_.data(), T, Hq, D);
    cpu::rope(k, pos.data(), inv_freq_.data(), T, Hkv, D);
    // fp8 cache: its keys are stored rotated, so the queries turn alike (kv/key_rotation.h).
    if (kv_.keys_rotated()) rotate_key_rows(q, T * Hq, D);
    // fp8 cache with auto scales: a layer's scales come from every K/V row of its first step.
    kv_.calibrate_scales(l, k, v, T);
    int64_t r = 0;
    for (const SeqInput& s : batch) {
      const int64_t p0 = s.pages->length;
      for (int64_t t = 0; t < s.n_tokens; ++t)
        kv_.write(l, *s.pages, p0 + t, k + (r + t) * Hkv * D, v + (r + t) * Hkv * D);
      if (s.attention && !s.dense)
        (*s.attention)(l, *s.pages, q + r * Hq * D, p0, s.n_tokens, att + r * Hq * D);
      else
        dense_attention(l, *s.pages, q + r * Hq * D, p0, s.n_tokens, att + r * Hq * D);
      r += s.n_tokens;
    }
    linear(att, L.wo, L.qwo, {}, tmp, T, H, Hq * D);
    if (tp_) tp_->all_reduce_sum(tmp, T * H);  // the ranks' partial sums
    cpu::add_inplace(x, tmp, T * H);
    cpu::rmsnorm(x, L.ffn_norm.data(), eps, xn, T, H);
    linear(xn, L.w_gate, L.qw_gate, {}, gate, T, c.ffn, H);
    linear(xn, L.w_up, L.qw_up, {}, up, T, c.ffn, H);
    cpu::swiglu(gate, up, gate, T * c.ffn);
    linear(gate, L.w_down, L.qw_down, {}, tmp, T, H, c.ffn);
    if (tp_) tp_->all_reduce_sum(tmp, T * H);
    cpu::add_inplace(x, tmp, T * H);
  }
  // Final norm and LM head only for the rows whose logits are wanted.
  row_of.assign(batch.size(), 0);
  float* last = last_.data();
  int64_t r = 0, lr = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    const SeqInput& s = batch[i];
    row_of[i] = lr;
    if (s.all_logits) {
      std::memcpy(last + lr * H, x + r * H, sizeof(float) * size_t(s.n_tokens * H));
      lr += s.n_tokens;
    } else {
      std::memcpy(last + lr * H, x + (r + s.n_tokens - 1) * H, sizeof(float) * size_t(H));
      lr += 1;
    }
    r += s.n_tokens;
    s.pages->length += s.n_tokens;
  }
  if (!logits_on_) return logits_;  // empty (ensure_workspace)
  cpu::rmsnorm(last, w_.final_norm.data(), eps, last, lr, H);
  // The LM head: lm_head when the model has one, else the (tied) embedding table.
  const bool untied = w_.lm_head.numel() || w_.q_lm_head;
  linear(last, untied ? w_.lm_head : w_.tok_embeddings,
         untied ? w_.q_lm_head : w_.q_tok_embeddings, {}, logits_.data(), lr, c.vocab, H);
  return logits_;
}

}  // namespace spade
