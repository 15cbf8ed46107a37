#include <algorithm>
#include <cmath>

#include "backend/cpu/attention.h"
#include "core/error.h"
#include "sparse/method.h"

namespace spade::sparse {

const float* StepContext::full_weights() {
  if (has_full_weights()) return weights_.data();
  if (weights_.size() < size_t(Hq) * size_t(L)) weights_.resize(size_t(Hq) * size_t(L));
  cpu::attention_weights_full(*kv, layer, *pt, q, Hq, scale, L, weights_.data(),
                              *attention_scratch);
  weights_layer_ = layer;
  weights_step_ = step;
  return weights_.data();
}

void StepContext::bind(const ModelConfig& cfg, const KVPool& pool, cpu::AttentionScratch* scratch,
                       const char* who) {
  SPADE_CHECK(pool.layout().n_layers == cfg.n_layers && pool.layout().n_kv_heads == cfg.n_kv_heads &&
                  pool.layout().head_dim == cfg.head_dim,
              who, ": KV pool layout does not match the model");
  n_layers = cfg.n_layers;
  Hq = cfg.n_heads;
  Hkv = cfg.n_kv_heads;
  D = cfg.head_dim;
  G = cfg.n_heads / cfg.n_kv_heads;
  scale = 1.f / std::sqrt(float(cfg.head_dim));
  if (shard.Hq_all == 0) shard.Hq_all = Hq;
  if (shard.Hkv_all == 0) shard.Hkv_all = Hkv;
  SPADE_CHECK(shard.q0 >= 0 && shard.kv0 >= 0 && shard.q0 + Hq <= shard.Hq_all &&
                  shard.kv0 + Hkv <= shard.Hkv_all && shard.q0 == shard.kv0 * G,
              who, ": the rank's heads [", shard.q0, ", ", shard.q0 + Hq, ") / [", shard.kv0, ", ",
              shard.kv0 + Hkv, ") do not fit the model's ", shard.Hq_all, " / ", shard.Hkv_all);
  kv = &pool;
  attention_scratch = scratch;
}

void StepContext::reserve(int64_t n) {
  const size_t N = size_t(std::max<int64_t>(1, n));
  weights_.reserve(size_t(Hq) * N);
  scratch.f0.reserve(N);
  scratch.f1.reserve(std::max(N, size_t(2 * D)));
  scratch.i0.reserve(N);
  scratch.i1.reserve(size_t(Hq) * N);
  scratch.i2.reserve(N);
  scratch.mark.reserve(N);
}

}  // namespace spade::sparse
