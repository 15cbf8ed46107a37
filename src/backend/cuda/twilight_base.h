// Twilight's base lists on the GPU (twilight_base.cu): the per-(request, KV head) CSR lists the
// pruner (twilight.h TwilightPruner) reads, for bases whose own lists are not in that form.
// Both build from the device copy of the step's context lengths, so a decode step needs no
// host work between the base's selection and the pruner.
#pragma once
#include <cstdint>

#include "backend/cuda/cuda_common.h"

namespace spade::cuda {

// Twilight over full attention: list b * Hkv + h = every 16-token chunk of request b's
// context, 0 .. ceil(kv_len[b] / 16) - 1 (SelGran::Chunk16), CSR off[B * Hkv + 1] / idx
// (idx holds sum_b Hkv * ceil(kv_len[b] / 16) entries).
void twilight_full_lists(const int32_t* kv_len, int B, int Hkv, int32_t* off, int32_t* idx,
                         cudaStream_t s);
// Lists shared by a request's KV heads (lists_per_req = 1: CSR src_off[B + 1] / src_idx,
// LessIsMore) -> one copy per KV head: list b * Hkv + h = list b (CSR off[B * Hkv + 1] / idx;
// idx holds Hkv x the source's entries). Entries are copied as they are (any granularity).
void twilight_expand_lists(const int32_t* src_off, const int32_t* src_idx, int B, int Hkv,
                           int32_t* off, int32_t* idx, cudaStream_t s);

}  // namespace spade::cuda
