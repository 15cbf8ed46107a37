// Twilight's pruning stage on the GPU (select-then-prune, sparse/methods/twilight.h), run by any
// SelectingMethod after its own selection (selecting.h): the base writes a layer's lists at its
// granularity (Quest: Chunk16 pages; full: every Chunk16 chunk; TidalDecode, LycheeCluster:
// Token lists per KV head; LessIsMore: one Token list per request, copied per KV head here),
// the pruner (backend/cuda/twilight.h) estimates q.k of every listed token from the model's INT4
// key copy (GpuPageHooks::k_int4, written by every KV append), keeps each query head's top-p
// set and writes the union per (request, KV head) as Token lists, and a second SparseAttention
// attends over those.
//
// Layout / bytes (after the base's buffers, in alloc order): the TwilightPruner
// (TwilightPruner::arena_bytes for max_batch * Hkv lists of at most max_slots base tokens:
// estimated logits, kept masks, kept lists at a fixed stride with their counts), the kept
// lists' SparseAttention (SparseAttention::arena_bytes with its default splits) + 4 MiB; for
// shared base lists, their per-KV-head copies: i32 offsets [max_batch * Hkv + 1] and entries
// [max_batch * Hkv * max_slots] + 2 x 256 B; where it prunes whole contexts (full, the base's
// dense layers), the Chunk16 lists of every chunk: i32 [max_batch * Hkv + 1] and
// [max_batch * Hkv * seq_pages_cap * page_size / 16] + 2 x 256 B (max_slots then covers the
// longest context). Reads the INT4 codes
// [L][pages][Hkv][P][D/2] and their u32 scale / zero [L][pages][Hkv][P].
#pragma once
#if defined(SPADE_HAVE_CUDA)
#include <memory>
#include <string>
#include <vector>

#include "backend/cuda/sparse_attention.h"
#include "sparse/gpu/method.h"

namespace spade {

namespace cuda {
class TwilightPruner;
}

// One layer's base lists as the pruner reads them.
struct TwilightBaseLists {
  const int32_t* off = nullptr;  // CSR offsets: [B * Hkv + 1], or [B + 1] when shared
  const int32_t* idx = nullptr;
  cuda::SelGran gran = cuda::SelGran::Token;  // Token or Chunk16
  bool shared = false;                        // one list per request (lists_per_req = 1)
  // The base plan's device page table, page offsets and lengths (SparseAttention::dev_*).
  const int32_t* page_table = nullptr, *page_off = nullptr, *kv_len = nullptr;
};

class TwilightStage {
 public:
  // max_slots: the most base tokens of one list (Chunk16: 16 x its entries; the kernels clip
  // longer lists, so every base bounds its lists by this); shared: the base lists are shared
  // by a request's KV heads (the per-head copies are allocated); full: it also prunes whole
  // contexts (full_lists()).
  static size_t arena_bytes(const GpuMethodContext& ctx, int64_t max_slots, bool shared,
                            bool full);
  // The pruner's list capacity for these arguments (the longest context's chunks when full).
  static int64_t slots(const GpuMethodContext& ctx, int64_t max_slots, bool full);
  TwilightStage(cuda::DeviceArena& A, const GpuMethodContext& ctx, const CudaSparse& sp,
                int64_t max_slots, bool shared, bool full);
  ~TwilightStage();
  // The kept lists' plan: kept_max[b * Hkv + h] bounds list (b, h) (its base tokens).
  void plan(const std::vector<cuda::SparseSeq>& seqs, const std::vector<int>& kept_max,
            void* stream);
  // Prunes the base lists of layer `layer` and attends over the kept tokens: out = att.
  // trace (tests): the kept lists and estimated logits into trace->kept / trace->logits.
  void attend(const TwilightBaseLists& base, int B, int layer, const void* q, const void* kc,
              const void* vc, void* att, float scale, void* stream, const cuda::SelSkip& skip,
              GpuSelectionTrace* trace);
  // Lists of every 16-token chunk of each (request, KV head) context (Chunk16, written on
  // `stream` from kv_len; the constructor's full must be set).
  TwilightBaseLists full_lists(int B, const int32_t* kv_len, void* stream);
  void append_graph_key(std::vector<int>& k) const;
  int64_t max_slots() const { return max_slots_; }

 private:
  void trace_kept(int B, int layer, void* stream, GpuSelectionTrace* trace);

  GpuMethodContext ctx_;
  int64_t max_slots_ = 0;
  std::unique_ptr<cuda::TwilightPruner> pruner_;
  std::unique_ptr<cuda::SparseAttention> kept_;
  int32_t* exp_off_ = nullptr;  // per-KV-head copies of shared base lists
  int32_t* exp_idx_ = nullptr;
  int32_t* full_off_ = nullptr;  // every chunk of each context
  int32_t* full_idx_ = nullptr;
};

// The description of a Twilight stage over a base (describe(): "twilight ... over [base]").
std::string twilight_stage_describe(const CudaSparse& sp, const std::string& base);

}  // namespace spade
#endif  // SPADE_HAVE_CUDA
