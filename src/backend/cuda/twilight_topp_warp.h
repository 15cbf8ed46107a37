// Twilight's top-p over lists of at most 512 slots, one warp per query head
// (twilight_topp_warp.cu); TwilightPruner::topp takes it where it applies.
#pragma once
#include <cstdint>

#include "backend/cuda/sparse_attention.h"

namespace spade::cuda {

struct ToppWarpArgs {
  const int32_t* base_off;  // [n_lists + 1] base CSR
  const int32_t* base_idx;
  SelGran gran;             // Chunk16: 16 slots per entry; Token: one
  const float* logits;      // [list][G][max_slots]
  float* thr;               // [list][G]
  int32_t* kept;            // [list][max_slots]: kept positions, selection order
  int32_t* kept_cnt;        // [list]
  int G, max_slots;
  double p, eps;
};

// Whether lists of max_slots slots with G query heads per KV head fit the kernel (<= 512
// slots, its shared memory within the device's).
bool topp_warp_applies(int max_slots, int G);
void topp_warp(const ToppWarpArgs& a, int n_lists, cudaStream_t s);

}  // namespace spade::cuda
