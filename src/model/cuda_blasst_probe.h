// BLASST sparsity on the GPU for `spade calibrate blasst --device cuda`: one CudaModel built
// with BLASST (over full attention, or inside a selector: --sparse X+blasst), whose lambda is changed between runs (CudaModel::set_blasst), and the tile
// counters of its kernels (decode: 16-token warp chunks, seeded running max; prefill: 64 rows
// x 128 keys in the wgmma kernel, 32 rows x 64 keys at head_dim 64). Decode measurements prefill each (sample, length) prefix
// once, densely, and rewind to it for every lambda (the decode steps only write later slots);
// a selector with per-request state (lycheecluster+blasst) prefills a fresh request for every
// measurement instead (no token text: fixed-size chunks).
#pragma once
#if defined(SPADE_HAVE_CUDA)
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "model/cuda_model.h"

namespace spade {

class CudaBlasstProbe {
 public:
  // decode_phase: decode steps after a dense prefill; else prefill chunks with skipping.
  // placement (optional, decode only): BLASST inside a GPU selector's lists (X+blasst,
  // CudaSparse::blasst_sel, e.g. from cuda_sparse_config of "quest+blasst:budget=2048"): the
  // selection kernel's chunks and the selector's dense launches (dense layers, fallback) count,
  // as where the method will run; its lambda options are replaced by each run's.
  CudaBlasstProbe(const ModelWeights& w, int64_t max_tokens, bool decode_phase,
                  const CudaSparse* placement = nullptr);
  ~CudaBlasstProbe();
  // Skipped / visited tiles over every layer and KV head with lambda (>= 0) or lambda = a / L
  // (lambda < 0): decode: `steps` teacher-forced steps feeding toks[L .. L + steps) after the
  // prefix toks[0, L) (kept under `key`); prefill: toks[0, L) in one run. per_layer (optional)
  // receives each layer's ratio.
  double measure(int key, const std::vector<int32_t>& toks, int64_t L, int64_t steps,
                 double lambda, double a, std::vector<double>* per_layer = nullptr);
  const CudaModel& model() const { return *model_; }

 private:
  bool decode_;
  std::unique_ptr<CudaSparse> placement_;  // X+blasst, or null: over full attention
  std::unique_ptr<CudaModel> model_;
  std::map<std::pair<int, int64_t>, PageTable> prefixes_;
};

}  // namespace spade
#endif  // SPADE_HAVE_CUDA
