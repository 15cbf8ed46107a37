// GpuMethod's LycheeDecode decode layer (hybrid heads; the CPU's LycheeDecodeMethod, mode topk
// with token units). Per decode layer l:
//   - every KV head a retrieval head (layer 0): the dense decode kernel, emitting the
//     group-mean scores when a later layer needs sets;
//   - otherwise one launch of the sparse kernel with the layer's retrieval heads flagged
//     dense (they read their whole context, pooled with the sparse heads into equal work
//     items: LycheeDecode appendix C) and emitting their group-mean scores; the sparse heads
//     read the sets they inherited.
// Then the retrieval heads' top-`budget` tokens by group-mean score (= by the CPU's softmax
// weight of the group-averaged query, a monotone map) replace their heads' rows of the set
// table, and the table is compacted into the CSR lists the next layer reads, on a side stream
// that overlaps the layer's GEMMs (GpuMethod::fork_selection). The sets never leave the GPU.
#if defined(SPADE_HAVE_CUDA)
#include <algorithm>

#include "backend/cuda/attention.h"
#include "backend/cuda/sparse_attention.h"
#include "core/error.h"
#include "sparse/gpu/gpu_method.h"

namespace spade {

void GpuMethod::ld_layer(int layer, const void* q_, const void* kc_, const void* vc_, void* att_,
                         float scale) {
  using cuda::bf16;
  const bf16* q = static_cast<const bf16*>(q_);
  const bf16* kc = static_cast<const bf16*>(kc_);
  const bf16* vc = static_cast<const bf16*>(vc_);
  bf16* att = static_cast<bf16*>(att_);
  cudaStream_t st = static_cast<cudaStream_t>(run_);
  const CudaSparse& sp = sp_;
  const int Hkv = ctx_.cfg.n_kv_heads;
  const int k = int(std::min<int64_t>(sp.budget, ctx_.cfg.max_context));
  const int64_t ld = ctx_.seq_pages_cap * ctx_.page_size;
  const std::vector<uint8_t>& roles = sp.retrieval[size_t(layer)];
  const bool selects = layer + 1 < ctx_.cfg.n_layers &&
                       std::any_of(roles.begin(), roles.end(), [](uint8_t r) { return r != 0; });
  const int pattern = ld_pattern_of_[size_t(layer)];
  // BLASST over LycheeDecode skips only in launches that emit no scores.
  if (pattern < 0) {  // all retrieval heads: dense attention
    const cuda::DecodeScores ds{sel_scores_, ld};
    attn_->run(q, kc, vc, att, scale, st, selects ? cuda::BlasstSkip{} : blasst_skip(layer),
               selects ? &ds : nullptr);
  } else {
    sparse_->run(q, kc, vc, sel_off_, sel_idx_, att, scale, st, pattern,
                 selects ? sel_scores_ : nullptr, ld, selects ? cuda::SelSkip{} : sel_skip(layer));
  }
  if (!selects) return;
  uint32_t heads = 0;
  for (int h = 0; h < Hkv; ++h)
    if (roles[size_t(h)]) heads |= 1u << h;
  // The next layer's sets: off the critical path until its attention (join).
  cudaStream_t ss = static_cast<cudaStream_t>(fork_selection());
  cuda::row_lengths(sparse_->dev_kv_len(), step_B_, Hkv, tidal_rown_, ss, heads);
  select_topk(sel_scores_, tidal_rown_, step_B_ * Hkv, k, tidal_strided_, ss);
  cuda::token_compact_lists(tidal_strided_, sparse_->dev_kv_len(), step_B_, Hkv, k, sel_off_,
                            sel_idx_, ss);
  if (trace) trace_quest(layer), trace_scores(layer);
}

}  // namespace spade
#endif  // SPADE_HAVE_CUDA
