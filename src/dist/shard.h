// Megatron-style tensor-parallel sharding of a model for rank r of N (issue 39): each rank
// gets Hkv/N KV heads and the Hq/N query heads that read them (GQA groups stay whole), so
// q/k/v (and Qwen2's biases) keep the rank's rows, as do gate/up (column-parallel, ffn/N
// rows); o-proj and down-proj keep the matching columns (row-parallel: each rank's product is
// a partial sum that the ranks all-reduce, cpu_model.h). Norms, embeddings, the final norm and
// the LM head are replicated. The shard's config has the per-rank head counts and ffn, so a
// KV pool built from it holds only the rank's KV heads.
//
// Weights kept as stored (CpuWeights::Native: quantized, f16, bf16) shard too: rows of a
// row-major stored matrix split anywhere; a column split must fall on the type's blocks
// (e.g. 32 elements for Q4_1, 256 for Q4_K), else a spade::Error says to load with
// --cpu-weights f32. Every slice is copied into the shard (ModelWeights::owned), so the
// shard needs nothing of the source but its `storage` (the mapped file, shared) for the
// replicated stored embedding table / LM head.
#pragma once
#include "model/weights.h"

namespace spade::dist {

// Throws spade::Error unless `c` splits over `n_ranks` ranks (heads, KV heads and ffn
// divisible; n_ranks >= 1): "--tp 2: 3 KV heads are not divisible by 2".
void check_shardable(const ModelConfig& c, int n_ranks);

// The shard of rank `rank` of `n_ranks` (n_ranks = 1: a copy of the whole model).
ModelWeights shard_weights(const ModelWeights& w, int rank, int n_ranks);

}  // namespace spade::dist
