// Helpers of the GPU model tests: bf16-rounded random weights (the CPU runs fp32 on the same
// values the GPU holds), random token ids.
#pragma once
#include <random>
#include <string>
#include <vector>

#include "gpu_util.h"
#include "model/config.h"
#include "model/cpu_model.h"
#include "model/cuda_model.h"
#include "model/weights.h"
#include "sparse/options.h"
#include "sparse/session.h"

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

// A small random-weights model: hidden 256, 8 query / 2 KV heads of `D`, FFN 512, vocab 1000
// (Qwen2: q/k/v bias, untied; Qwen3: q/k norm).
inline ModelConfig tiny_config(Arch arch, int D, int n_layers = 3, int max_context = 4096) {
  ModelConfig c;
  c.arch = arch;
  c.n_layers = n_layers;
  c.hidden = 256;
  c.n_heads = 8;
  c.n_kv_heads = 2;
  c.head_dim = D;
  c.ffn = 512;
  c.vocab = 1000;
  c.max_context = max_context;
  c.rope_theta = 10000.f;
  c.qkv_bias = arch == Arch::Qwen2;
  c.qk_norm = arch == Arch::Qwen3;
  c.tie_embeddings = arch != Arch::Qwen2;
  return c;
}

// cuda_sparse_config(spec) must throw spade::Error whose message contains `what`.
inline void expect_cuda_config_error(const std::string& spec, const char* what,
                                     const ModelConfig& c) {
  try {
    cuda_sparse_config(sparse::SparseConfig::parse_spec(spec), c, 16);
    ADD_FAILURE() << spec << ": expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
  }
}

inline std::vector<int32_t> random_tokens(std::mt19937& rng, int n, int vocab) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = int32_t(rng() % uint32_t(vocab));
  return t;
}

// Requests a and b prefilled together on the CPU (through sessions s0 / s1) and on the GPU,
// then `steps` batched decode steps feeding the same random tokens to both; every step's
// logits must agree within `tol` (rel err). Returns the worst step's error.
inline double compare_decode_with_cpu(CpuModel& cpu, sparse::SparseSession& s0,
                                      sparse::SparseSession& s1, CudaModel& gpu,
                                      const std::vector<int32_t>& a,
                                      const std::vector<int32_t>& b, int steps, double tol,
                                      std::mt19937& rng) {
  const int vocab = cpu.config().vocab;
  const int na = int(a.size()), nb = int(b.size());
  PageTable pc[2], pg[2];
  std::vector<int64_t> rc, rg;
  cpu.forward({{&pc[0], a.data(), na, false, &s0.attention()},
               {&pc[1], b.data(), nb, false, &s1.attention()}}, rc);
  gpu.forward({{&pg[0], a.data(), na, false}, {&pg[1], b.data(), nb, false}}, rg);
  double worst = 0;
  for (int s = 0; s < steps; ++s) {
    int32_t ta = int32_t(rng() % uint32_t(vocab)), tb = int32_t(rng() % uint32_t(vocab));
    const auto& lc = cpu.forward({{&pc[0], &ta, 1, false, &s0.attention()},
                                  {&pc[1], &tb, 1, false, &s1.attention()}}, rc);
    const auto& lg = gpu.forward({{&pg[0], &ta, 1, false}, {&pg[1], &tb, 1, false}}, rg);
    const double e = rel_err(lg, lc);
    worst = std::max(worst, e);
    EXPECT_LT(e, tol) << "decode step " << s;
  }
  return worst;
}

}  // namespace spade::test
