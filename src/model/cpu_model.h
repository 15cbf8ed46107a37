// The layer loop on the CPU backend (ARCHITECTURE.md's data flow), for a batch of
// sequences that each bring one or more new tokens (prefill chunks and decode steps mix
// freely). Every sequence's K/V goes to the shared paged pool; attention per sequence is
// dense causal here, or whatever the sequence's AttentionFn chooses (sparse methods).
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "backend/cpu/attention.h"
#include "kv/kv_pool.h"
#include "model/weights.h"

namespace spade {

namespace sparse {
struct MethodState;
}
namespace dist {
class Communicator;
}

// Attention for one sequence and layer: q [T, Hq, D] of tokens at positions [p0, p0+T)
// whose K/V are already in the cache -> out [T, Hq, D].
using AttentionFn = std::function<void(int layer, const PageTable& pt, const float* q, int64_t p0,
                                       int64_t T, float* out)>;

struct SeqInput {
  PageTable* pages = nullptr;    // grows by n_tokens (pages reserved from the pool)
  const int32_t* tokens = nullptr;
  int64_t n_tokens = 0;
  bool all_logits = false;       // logits for every new token, else only the last
  const AttentionFn* attention = nullptr;  // null: dense causal attention
  // CudaModel only: the per-request state of a GPU method that keeps one
  // (CudaModel::new_request_state; LycheeCluster), the same object on every step of the request.
  sparse::MethodState* device_state = nullptr;
  // Dense attention whatever the length: a cache-correction chunk (sparse/cache_correction.h).
  // The CPU model ignores `attention`; CudaModel plans it as a prefill row, never as a sparse
  // decode row, also when it holds one token (correction_every=1, or a chunk split by the
  // scheduler's token budget).
  bool dense = false;
};

class CpuModel {
 public:
  // Tensor parallelism (dist/shard.h): with `tp`, `w` is this rank's shard and `kv` holds its
  // KV heads; the partial o-proj and down-proj outputs are all-reduced over `tp` before each
  // residual add, so every rank ends each layer with the same x (and the same logits). Every
  // rank must call forward with the same batch. Null: one rank.
  CpuModel(const ModelWeights& w, KVPool& kv, dist::Communicator* tp = nullptr);

  const ModelConfig& config() const { return w_.config; }
  KVPool& kv() { return kv_; }

  // Runs the batch. Returns logits rows [rows, vocab]; `row_of[i]` is the first row of
  // sequence i (its last row for !all_logits is the only one). Reserves KV pages first and
  // throws (with nothing written) if the pool cannot hold them.
  const std::vector<float>& forward(const std::vector<SeqInput>& batch,
                                    std::vector<int64_t>& row_of);

  // Off: forward computes no logits (no final norm, no LM head) and returns an empty vector;
  // row_of and the page tables advance as usual. Tensor-parallel followers (dist/tp_runner.h),
  // whose logits nobody reads.
  void set_logits(bool on) { logits_on_ = on; }

  // Default attention: dense causal over the whole cached prefix.
  void dense_attention(int layer, const PageTable& pt, const float* q, int64_t p0, int64_t T,
                       float* out);

 private:
  void ensure_workspace(int64_t T, int64_t logit_rows);

  const ModelWeights& w_;
  KVPool& kv_;
  dist::Communicator* tp_ = nullptr;
  bool logits_on_ = true;
  std::vector<float> inv_freq_;
  // Workspaces (grow-only).
  std::vector<float> x_, xn_, q_, k_, v_, att_, tmp_, gate_, up_, logits_, last_;
  std::vector<int32_t> pos_;
  cpu::AttentionScratch scratch_;
};

}  // namespace spade
