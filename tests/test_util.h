// Shared helpers for tests: seeded random tensors and a random-weight model.
#pragma once
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "model/weights.h"

namespace spade::test {

inline std::string source_dir() { return SPADE_SOURCE_DIR; }
inline std::string shared_dir() { return std::string(SPADE_SOURCE_DIR) + "/../shared"; }

// The factor of the tests' time limits: 1, or 4 in the ASan + UBSan build run by
// scripts/run_sanitized_tests.sh (SPADE_SANITIZED=1), which runs 2-5x slower; SPADE_TIME_SCALE
// overrides. The same rule as tests/e2e/spade_client.py time_scale().
inline double time_scale() {
  if (const char* v = std::getenv("SPADE_TIME_SCALE"); v && *v) return std::atof(v);
  const char* s = std::getenv("SPADE_SANITIZED");
  return s && std::string(s) == "1" ? 4.0 : 1.0;
}
// `limit` stretched by time_scale().
inline std::chrono::steady_clock::duration scaled(std::chrono::steady_clock::duration limit) {
  return std::chrono::duration_cast<std::chrono::steady_clock::duration>(limit * time_scale());
}

inline void fill_random(float* p, size_t n, std::mt19937& rng, float scale = 1.f) {
  std::normal_distribution<float> d(0.f, scale);
  for (size_t i = 0; i < n; ++i) p[i] = d(rng);
}
inline std::vector<float> random_vec(size_t n, uint32_t seed, float scale = 1.f) {
  std::mt19937 rng(seed);
  std::vector<float> v(n);
  fill_random(v.data(), n, rng, scale);
  return v;
}

inline HostTensor random_tensor(std::initializer_list<int64_t> dims, std::mt19937& rng,
                                float scale, float mean = 0.f) {
  HostTensor t(dims);
  fill_random(t.data(), size_t(t.numel()), rng, scale);
  for (auto& x : t.storage) x += mean;
  return t;
}

// A small random model of the given config (weights scaled so activations stay O(1)).
inline ModelWeights random_model(const ModelConfig& c, uint32_t seed) {
  std::mt19937 rng(seed);
  ModelWeights w;
  w.config = c;
  const int64_t H = c.hidden, D = c.head_dim;
  const float s = 1.f / std::sqrt(float(H));
  w.tok_embeddings = random_tensor({c.vocab, H}, rng, 1.f);
  for (int l = 0; l < c.n_layers; ++l) {
    LayerWeights L;
    L.attn_norm = random_tensor({H}, rng, 0.1f, 1.f);
    L.wq = random_tensor({c.n_heads * D, H}, rng, 2 * s);
    L.wk = random_tensor({c.n_kv_heads * D, H}, rng, 2 * s);
    L.wv = random_tensor({c.n_kv_heads * D, H}, rng, s);
    L.wo = random_tensor({H, c.n_heads * D}, rng, s);
    if (c.qkv_bias) {
      L.bq = random_tensor({c.n_heads * D}, rng, 0.2f);
      L.bk = random_tensor({c.n_kv_heads * D}, rng, 0.2f);
      L.bv = random_tensor({c.n_kv_heads * D}, rng, 0.2f);
    }
    if (c.qk_norm) {
      L.q_norm = random_tensor({D}, rng, 0.1f, 1.f);
      L.k_norm = random_tensor({D}, rng, 0.1f, 1.f);
    }
    L.ffn_norm = random_tensor({H}, rng, 0.1f, 1.f);
    L.w_gate = random_tensor({c.ffn, H}, rng, s);
    L.w_up = random_tensor({c.ffn, H}, rng, s);
    L.w_down = random_tensor({H, c.ffn}, rng, 1.f / std::sqrt(float(c.ffn)));
    w.layers.push_back(std::move(L));
  }
  w.final_norm = random_tensor({H}, rng, 0.1f, 1.f);
  if (!c.tie_embeddings) w.lm_head = random_tensor({c.vocab, H}, rng, s);
  return w;
}

inline ModelConfig tiny_config(Arch arch = Arch::Llama) {
  ModelConfig c;
  c.arch = arch;
  c.n_layers = 2;
  c.hidden = 48;
  c.n_heads = 6;
  c.n_kv_heads = 2;
  c.head_dim = 16;
  c.ffn = 96;
  c.vocab = 101;
  c.max_context = 512;
  c.rope_theta = 10000.f;
  c.qkv_bias = arch == Arch::Qwen2;
  c.qk_norm = arch == Arch::Qwen3;
  c.tie_embeddings = arch != Arch::Qwen2;
  return c;
}

}  // namespace spade::test
